"""``AsyncLLM`` and adapters read off the engine's thread: ``add_lora`` answers when the
read ends while streams keep going, and a bad adapter raises its error (naming the
problem) in its own requests' streams only; with the core in this process and in its own.

A slow read is made by wrapping the loader threads' format reader so that it waits on a
``threading.Event`` the test sets (the core in this process only): nothing here depends on
timing.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
from safetensors.torch import load_file, save_file

from manylora import EngineArgs, LoRARequest, SamplingParams
from manylora.engine.async_llm import AsyncLLM
from manylora.lora import reader as reader_module
from manylora.lora.adapter import LoRAAdapterError
from manylora.testing import make_checkpoint, make_peft_adapter

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)
ENGINE = dict(max_lora_rank=8, block_size=4, max_model_len=128, device="cpu", dtype="float32",
              max_loras=2)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("async-reads")


@pytest.fixture(scope="module")
def base_dir(root):
    return make_checkpoint(root / "base", "llama", seed=0, **TINY)


@pytest.fixture(scope="module")
def good_dir(base_dir, root):
    return make_peft_adapter(base_dir, root / "good", r=4, target_modules=["q_proj", "v_proj"],
                             seed=1)


@pytest.fixture(scope="module")
def nan_dir(good_dir, root):
    bad = root / "nan"
    bad.mkdir()
    for f in good_dir.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    tensors = load_file(bad / "adapter_model.safetensors")
    key = next(k for k in sorted(tensors) if "lora_A" in k)
    tensors[key] = tensors[key].clone()
    tensors[key][1, 2] = float("inf")
    save_file(tensors, bad / "adapter_model.safetensors")
    return bad


def make_engine(base_dir, monkeypatch, own_process: bool) -> AsyncLLM:
    with monkeypatch.context() as mp:
        mp.setenv("MANYLORA_ENABLE_MULTIPROCESSING", "1" if own_process else "0")
        return AsyncLLM.from_engine_args(EngineArgs(model=str(base_dir), **ENGINE))


async def _tokens(async_llm, prompt, params, rid, lora=None) -> list[int]:
    last = None
    async for out in async_llm.generate(prompt, params, rid, lora):
        last = out
    return last.outputs[0].token_ids


@pytest.mark.parametrize("own_process", [False, True], ids=["in_process", "own_process"])
def test_bad_adapter_raises_in_its_streams_only(base_dir, good_dir, nan_dir, monkeypatch,
                                                own_process):
    engine = make_engine(base_dir, monkeypatch, own_process)
    bad = LoRARequest("broken", 7, str(nan_dir))
    good = LoRARequest("good", 8, str(good_dir))

    async def main():
        results = await asyncio.gather(
            _tokens(engine, "The quick brown fox", GREEDY, "base"),
            _tokens(engine, "Once upon a time", GREEDY, "bad-1", bad),
            _tokens(engine, "Low-rank adaptation", GREEDY, "good", good),
            _tokens(engine, "SELECT name", GREEDY, "bad-2", bad),
            return_exceptions=True)
        with pytest.raises(LoRAAdapterError, match=r"'broken-again'.*NaN or Inf in lora_A"):
            await engine.add_lora(LoRARequest("broken-again", 9, str(nan_dir)))
        await engine.add_lora(LoRARequest("good-again", 10, str(good_dir)))
        # a request after it all: the snapshot published before its last output is newer
        await _tokens(engine, "A last one", GREEDY, "last")
        return results

    try:
        base, bad1, good_out, bad2 = asyncio.run(main())
        for error in (bad1, bad2):
            assert isinstance(error, LoRAAdapterError), error
            assert "'broken'" in str(error) and "NaN or Inf in lora_A" in str(error)
        assert len(base) == 8 and len(good_out) == 8
        snapshot = engine.snapshot()    # (the engine's thread alone talks to the core)
        assert snapshot.lora.host_load_failures == 2
        assert snapshot.kv.used_blocks == 0
    finally:
        engine.shutdown()


def test_streams_run_while_add_lora_reads(base_dir, good_dir, monkeypatch):
    gate = threading.Event()
    original = reader_module.load_adapter_dir

    def slow(request, path, target):
        assert gate.wait(60), "the test never released the read"
        return original(request, path, target)

    monkeypatch.setattr(reader_module, "load_adapter_dir", slow)
    engine = make_engine(base_dir, monkeypatch, own_process=False)

    async def main():
        loading = asyncio.ensure_future(engine.add_lora(LoRARequest("good", 3, str(good_dir))))
        seen = 0
        stream = engine.generate("The quick brown fox", LONG, "base")
        async for _ in stream:
            seen += 1
            if seen == 6:
                break
        await stream.aclose()
        assert not loading.done()          # the read waits on the gate; the stream went on
        gate.set()
        await loading
        lora = LoRARequest("good", 3, str(good_dir))
        return await _tokens(engine, "Once upon a time", GREEDY, "after", lora)

    try:
        assert len(asyncio.run(main())) == 8
        stats = engine.snapshot().lora
        assert stats.host_misses == 1 and stats.adapter_waits == 0
    finally:
        engine.shutdown()
