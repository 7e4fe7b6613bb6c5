"""``lora_load_timeout``: an adapter read that does not end within its bound fails alone
(``LoRALoadTimeoutError`` in its own requests and in ``add_lora``) while every other stream
runs to its end, and the loader threads stuck in it are replaced, so later adapters load.

The stuck read is the loader threads' format reader waiting on a ``threading.Event`` that
the test sets only at its end (the core in this process): the bound, not the test, ends
it, and no assertion depends on how fast the machine is.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from manylora import EngineArgs, LoRARequest, SamplingParams
from manylora.engine.async_llm import AsyncLLM
from manylora.lora import reader as reader_module
from manylora.lora.adapter import LoRALoadTimeoutError
from manylora.testing import make_checkpoint, make_peft_adapter

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)
ENGINE = dict(max_lora_rank=8, block_size=4, max_model_len=128, device="cpu", dtype="float32",
              max_loras=2, lora_load_timeout=0.5)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("load-timeout")


@pytest.fixture(scope="module")
def base_dir(root):
    return make_checkpoint(root / "base", "llama", seed=0, **TINY)


@pytest.fixture(scope="module")
def good_dir(base_dir, root):
    return make_peft_adapter(base_dir, root / "good", r=4, target_modules=["q_proj", "v_proj"],
                             seed=1)


async def _tokens(async_llm, prompt, params, rid, lora=None) -> list[int]:
    last = None
    async for out in async_llm.generate(prompt, params, rid, lora):
        last = out
    return last.outputs[0].token_ids


def test_stuck_read_fails_alone_within_its_bound(base_dir, good_dir, monkeypatch):
    gate = threading.Event()
    original = reader_module.load_adapter_dir

    def reader(request, path, target):
        if request.lora_name.startswith("stuck"):
            gate.wait()                     # a read that never ends on its own
        return original(request, path, target)

    monkeypatch.setattr(reader_module, "load_adapter_dir", reader)
    with monkeypatch.context() as mp:
        mp.setenv("MANYLORA_ENABLE_MULTIPROCESSING", "0")
        engine = AsyncLLM.from_engine_args(EngineArgs(model=str(base_dir), **ENGINE))

    async def main():
        results = await asyncio.gather(
            _tokens(engine, "The quick brown fox", LONG, "base"),
            engine.add_lora(LoRARequest("stuck-load", 5, str(good_dir))),
            _tokens(engine, "Once upon a time", GREEDY, "stuck-req",
                    LoRARequest("stuck-req", 6, str(good_dir))),
            return_exceptions=True)
        # both loader threads were stuck: their replacements read the next adapter
        await engine.add_lora(LoRARequest("good", 7, str(good_dir)))
        out = await _tokens(engine, "Low-rank adaptation", GREEDY, "good",
                            LoRARequest("good", 7, str(good_dir)))
        return results, out

    try:
        (base, load_error, req_error), good_out = asyncio.run(main())
        assert len(base) == 40 and len(good_out) == 8
        for error, name in ((load_error, "stuck-load"), (req_error, "stuck-req")):
            assert isinstance(error, LoRALoadTimeoutError), error
            assert f"adapter '{name}'" in str(error) and "0.5 s" in str(error)
        stats = engine.snapshot().lora
        assert stats.host_load_failures == 2
        assert stats.stuck_loader_threads == 2 and stats.pending_loads == 0
    finally:
        gate.set()
        engine.shutdown()


def test_a_slow_pin_outlives_the_bound(base_dir, good_dir, monkeypatch):
    """The pin (a page-locked allocation, which can wait behind the engine's driver calls
    on a busy GPU) is not the store's fault: a read whose allocation takes three bounds
    still loads, and its adapter's tokens are those of the same files read normally."""
    entered, gate = threading.Event(), threading.Event()
    original = reader_module.pinned_bytes

    def slow_alloc(nbytes):
        if not gate.is_set():
            entered.set()
            gate.wait()
        return original(nbytes)

    monkeypatch.setattr(reader_module, "pinned_bytes", slow_alloc)
    with monkeypatch.context() as mp:
        mp.setenv("MANYLORA_ENABLE_MULTIPROCESSING", "0")
        engine = AsyncLLM.from_engine_args(EngineArgs(model=str(base_dir), **ENGINE))

    async def main():
        slow = asyncio.ensure_future(_tokens(engine, "Once upon a time", GREEDY, "slow",
                                             LoRARequest("slow-pin", 8, str(good_dir))))
        while not entered.is_set():
            await asyncio.sleep(0.01)
        await asyncio.sleep(3 * ENGINE["lora_load_timeout"])
        gate.set()
        slow_out = await slow
        again = await _tokens(engine, "Once upon a time", GREEDY, "again",
                              LoRARequest("again", 9, str(good_dir)))
        return slow_out, again

    try:
        slow_out, again = asyncio.run(main())
        assert len(slow_out) == 8 and slow_out == again
        assert engine.snapshot().lora.host_load_failures == 0
    finally:
        gate.set()
        engine.shutdown()
