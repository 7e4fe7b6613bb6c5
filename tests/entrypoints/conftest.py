"""A real ``manylora serve`` on 127.0.0.1 (uvicorn on a free port, in a thread) over a tiny
checkpoint with a tokenizer and chat template, and PEFT adapters under a ``--lora-root``."""

from __future__ import annotations

import openai
import pytest
from server_helpers import TARGETS, TINY, running_server

from manylora.testing import make_checkpoint, make_peft_adapter


@pytest.fixture(scope="session")
def server_root(tmp_path_factory):
    return tmp_path_factory.mktemp("server")


@pytest.fixture(scope="session")
def base_dir(server_root):
    return make_checkpoint(server_root / "base", "llama", seed=0, **TINY)


@pytest.fixture(scope="session")
def lora_root(server_root):
    root = server_root / "loras"
    root.mkdir()
    return root


@pytest.fixture(scope="session")
def adapters(base_dir, lora_root):
    """Eight adapters of ranks 2..8 over different targets, by name."""
    return {f"ad{i}": make_peft_adapter(base_dir, lora_root / f"ad{i}", r=2 + i % 4 * 2,
                                        target_modules=TARGETS[: 2 + i % 6], seed=10 + i)
            for i in range(8)}


@pytest.fixture(scope="module")
def served(base_dir, adapters, lora_root):
    """A server with four adapters from start-up and run-time updates under lora_root, its
    engine core in a process of its own (as ``manylora serve`` runs it)."""
    modules = [f"{name}={adapters[name]}" for name in ("ad0", "ad1", "ad2", "ad3")]
    with running_server(base_dir, "--enable-lora-runtime-updates", "--lora-root",
                        str(lora_root), lora_modules=modules,
                        engine_process=True) as (server, url):
        yield server, url


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=f"{served[1]}/v1", api_key="unused", max_retries=0)
