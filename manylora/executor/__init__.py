"""Executors: what the engine core calls to run steps on the model (one process, or
tensor parallelism over several)."""
