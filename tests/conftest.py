"""Shared fixtures: one tiny base checkpoint and its PEFT adapters, written once per session."""

from __future__ import annotations

import os

import torch

# Without a GPU, Triton kernels run through Triton's interpreter on CPU tensors; the variable
# must be set before any kernel module is imported (Triton reads it when a kernel is defined).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The engine core runs in this process unless a test asks for its own process (the
# `engine_process` fixture): most tests look inside the core (scheduler, runner, adapter
# cache), and a spawned core would cost each engine a second interpreter start.
os.environ.setdefault("MANYLORA_ENABLE_MULTIPROCESSING", "0")

import pytest  # noqa: E402

from manylora.testing import make_demo_set  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def demo_set(tmp_path_factory):
    """A llama base with four adapters of different ranks and targets (``make_demo_set``)."""
    return make_demo_set(tmp_path_factory.mktemp("demo"))
