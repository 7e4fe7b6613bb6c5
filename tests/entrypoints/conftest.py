"""A real ``manylora serve`` on 127.0.0.1 (uvicorn on a free port, in a thread) over a tiny
checkpoint with a tokenizer and chat template, and PEFT adapters under a ``--lora-root``."""

from __future__ import annotations

import contextlib

import openai
import pytest

from manylora.entrypoints.openai.launcher import ServerThread, create_server, serve_parser
from manylora.testing import make_checkpoint, make_peft_adapter

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)
# the offline LLM's arguments, mirrored by the server's flags below
ENGINE = dict(device="cpu", dtype="float32", max_loras=4, max_lora_rank=8, block_size=4,
              max_model_len=128)
BASE = "tiny-base"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def engine_flags(**overrides) -> list[str]:
    flags = []
    for key, value in {**ENGINE, **overrides}.items():
        flags += [f"--{key.replace('_', '-')}", str(value)]
    return flags


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


@contextlib.contextmanager
def running_server(base_dir, *extra: str, lora_modules=(), **engine_overrides):
    """``manylora serve --model base_dir ...`` on a free loopback port; yields
    ``(server, url)``; stops the server and the engine afterwards."""
    argv = ["--model", str(base_dir), "--served-model-name", BASE, *engine_flags(
        **engine_overrides), *extra]
    if lora_modules:
        argv += ["--lora-modules", *lora_modules]
    server = create_server(serve_parser().parse_args(argv))
    try:
        with ServerThread(server.app) as http:
            yield server, http.url
    finally:
        server.shutdown()


@pytest.fixture(scope="module")
def served(base_dir, adapters, lora_root):
    """A server with four adapters from start-up and run-time updates under lora_root."""
    modules = [f"{name}={adapters[name]}" for name in ("ad0", "ad1", "ad2", "ad3")]
    with running_server(base_dir, "--enable-lora-runtime-updates", "--lora-root",
                        str(lora_root), lora_modules=modules) as (server, url):
        yield server, url


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=f"{served[1]}/v1", api_key="unused", max_retries=0)
