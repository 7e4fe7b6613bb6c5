"""Shared fixtures: one tiny base checkpoint and its PEFT adapters, written once per session."""

from __future__ import annotations

import pytest
import torch

from manylora.testing import make_demo_set


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
