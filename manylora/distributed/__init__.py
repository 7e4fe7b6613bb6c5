"""Tensor parallelism: process groups, collectives, worker processes."""
