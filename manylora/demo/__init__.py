"""The demo on a real model: SmolLM2-135M-Instruct (a GGUF file from PyPI), four LoRA
adapters trained on checkable tasks, and those tasks' data."""
