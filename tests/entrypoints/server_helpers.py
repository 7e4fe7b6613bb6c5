"""What the server tests share: the tiny model's shape, the engine arguments mirrored by
the server's flags, and ``running_server`` (a real ``manylora serve`` on 127.0.0.1, uvicorn
on a free port in a thread). A module of its own, not conftest.py: test modules import it
by name, and another test directory has a conftest.py too."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest

from manylora.engine.protocol import EngineCoreOutputs
from manylora.entrypoints.openai.launcher import ServerThread, create_server
from manylora.entrypoints.openai.serve_args import serve_parser

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


@contextlib.contextmanager
def running_server(base_dir, *extra: str, lora_modules=(), engine_process: bool = False,
                   **engine_overrides):
    """``manylora serve --model base_dir ...`` on a free loopback port; yields
    ``(server, url)``; stops the server and the engine afterwards. ``engine_process``: the
    engine core in a process of its own, as ``manylora serve`` runs it (else in this one,
    where a test can look inside it)."""
    argv = ["--model", str(base_dir), "--served-model-name", BASE, *engine_flags(
        **engine_overrides), *extra]
    if lora_modules:
        argv += ["--lora-modules", *lora_modules]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MANYLORA_ENABLE_MULTIPROCESSING", "1" if engine_process else "0")
        server = create_server(serve_parser().parse_args(argv))
    try:
        with ServerThread(server.app, limits=server.limits) as http:
            yield server, http.url
    finally:
        server.shutdown()


def hold_steps(engine, after: int = 1) -> threading.Event:
    """Let ``engine`` (an ``EngineCore`` in the test's process) run ``after`` real steps,
    then only idle ones (10 ms, no progress, the loop still takes commands such as aborts)
    until the returned event is set. A request that is running then cannot finish on its
    own, however slowly the test runs: what a test checks while it holds does not race the
    engine."""
    step, release, taken = engine.step, threading.Event(), []

    def held_step():
        if len(taken) >= after and not release.is_set():
            time.sleep(0.01)
            return EngineCoreOutputs()
        taken.append(1)
        return step()

    engine.step = held_step
    return release
