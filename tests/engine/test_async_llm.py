"""``AsyncLLM``: the step loop on its own thread, per-request streams, abort, adapters
removed after their requests, overload, and a failed step.

Reference: the offline ``LLM`` on the same checkpoint and adapters (itself checked against
transformers + peft in test_peft_equivalence.py). Every test ends with no request left and
every KV block free or cached.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from manylora import LLM, EngineArgs, LoRARequest, SamplingParams
from manylora.engine.async_llm import AsyncLLM, EngineDeadError, EngineOverloadedError
from manylora.engine.protocol import EngineCoreOutputs
from manylora.testing import make_checkpoint, make_peft_adapter

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)
ENGINE = dict(max_lora_rank=8, block_size=4, max_model_len=128, device="cpu", dtype="float32",
              max_loras=2)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = ["The quick brown fox", "SELECT name FROM users", "Low-rank adaptation",
           "A large language model", "def add(a, b):"]


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("async") / "base", "llama", seed=0, **TINY)


@pytest.fixture(scope="module")
def loras(base_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("async-loras")
    targets = ["q_proj", "v_proj", "o_proj"]
    return [LoRARequest(f"a{i}", i, str(make_peft_adapter(
        base_dir, root / f"a{i}", r=2 + 2 * i, target_modules=targets, seed=i)))
        for i in (1, 2, 3)]


@pytest.fixture
def engine(base_dir):
    async_llm = AsyncLLM.from_engine_args(EngineArgs(model=str(base_dir), **ENGINE))
    yield async_llm
    async_llm.shutdown()


def _assert_idle(async_llm: AsyncLLM) -> None:
    eng = async_llm.engine
    assert not eng.has_unfinished_requests()
    kv = eng.kv_cache_stats()
    assert kv.used_blocks == 0
    assert kv.used_blocks + kv.cached_blocks + kv.free_blocks == kv.num_blocks


async def _collect(async_llm, prompt, params, rid, lora):
    outs = [o async for o in async_llm.generate(prompt, params, rid, lora)]
    return outs


def test_concurrent_streams_equal_offline_llm(base_dir, loras, engine):
    adapters = [None, *loras, loras[0]]
    offline = LLM(str(base_dir), **ENGINE).generate(PROMPTS, GREEDY, adapters, use_tqdm=False)

    async def main():
        return await asyncio.gather(*(
            _collect(engine, p, GREEDY, f"r{i}", lora)
            for i, (p, lora) in enumerate(zip(PROMPTS, adapters))))

    streams = asyncio.run(main())
    for outs, ref in zip(streams, offline):
        # one output per generated token, cumulative, the last one finished
        assert [len(o.outputs[0].token_ids) for o in outs] == list(range(1, 9))
        assert [o.finished for o in outs] == [False] * 7 + [True]
        assert outs[-1].outputs[0].token_ids == ref.outputs[0].token_ids
        assert outs[-1].outputs[0].text == ref.outputs[0].text
    _assert_idle(engine)


def test_closing_a_stream_aborts_and_frees_its_blocks(engine, loras):
    long = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)

    async def main():
        gen = engine.generate("The quick brown fox", long, "quit", loras[0])
        got = [await gen.__anext__() for _ in range(3)]
        await gen.aclose()
        # the other request is unaffected
        rest = await _collect(engine, "Low-rank", GREEDY, "stay", loras[1])
        return got, rest

    got, rest = asyncio.run(main())
    assert len(got[-1].outputs[0].token_ids) == 3 and not got[-1].finished
    assert rest[-1].finished and len(rest[-1].outputs[0].token_ids) == 8
    _wait_idle(engine)
    assert engine.engine.engine_core.lora_manager._refs == {}


def _wait_idle(async_llm: AsyncLLM) -> None:
    """Wait (up to a minute: a loaded machine may take a while) for the loop to finish every
    request, e.g. to carry out an abort, then check the engine is idle."""
    deadline = time.monotonic() + 60
    while async_llm.engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.01)
    _assert_idle(async_llm)


def test_cancelled_task_aborts_its_request(engine):
    long = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)

    async def main():
        seen = asyncio.Event()

        async def consume():
            async for _ in engine.generate("The quick brown fox", long, "cancel-me"):
                seen.set()

        task = asyncio.create_task(consume())
        await seen.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    _wait_idle(engine)


def test_bad_request_raises_and_others_keep_going(engine):
    async def main():
        good = asyncio.create_task(_collect(engine, "The quick", GREEDY, "good", None))
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await _collect(engine, {"prompt_token_ids": [10**6]}, GREEDY, "bad", None)
        with pytest.raises(ValueError, match="already in use"):
            await asyncio.gather(_collect(engine, "x", GREEDY, "dup", None),
                                 _collect(engine, "y", GREEDY, "dup", None))
        return await good

    outs = asyncio.run(main())
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 8
    _wait_idle(engine)


def test_remove_lora_lets_running_requests_finish(engine, loras):
    long = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)

    async def main():
        gen = engine.generate("SELECT name", long, "using-a1", loras[0])
        first = await gen.__anext__()
        await engine.remove_lora(loras[0].lora_int_id)
        rest = [o async for o in gen]
        return first, rest

    first, rest = asyncio.run(main())
    assert rest[-1].finished and rest[-1].outputs[0].finish_reason == "length"
    assert len(rest[-1].outputs[0].token_ids) == 30
    _wait_idle(engine)
    manager = engine.engine.engine_core.lora_manager
    assert not manager.is_ready(loras[0].lora_int_id)
    assert loras[0].lora_int_id not in manager._known
    # a bare id for the removed adapter is now unknown; a path loads it again
    async def again():
        with pytest.raises(ValueError, match="not cached"):
            await _collect(engine, "x", GREEDY, "bare", LoRARequest("a1", 1))
        return await _collect(engine, "SELECT name", GREEDY, "reload", loras[0])

    assert asyncio.run(again())[-1].finished


def test_waiting_queue_bound(base_dir):
    async_llm = AsyncLLM.from_engine_args(
        EngineArgs(model=str(base_dir), **{**ENGINE, "max_num_seqs": 1}),
        max_waiting_requests=2)
    long = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    # After the step that gives q0 its first token the loop steps no further until the
    # overload is checked, so q0 cannot finish (and q1 start) first however slowly this
    # thread runs.
    core = async_llm.engine.engine_core
    step, release, produced = core.step, threading.Event(), []

    def held_step():
        if produced and not release.is_set():
            time.sleep(0.01)
            return EngineCoreOutputs()
        out = step()
        if out.outputs:
            produced.append(1)
        return out

    core.step = held_step
    try:
        async def main():
            gens = [async_llm.generate("The quick", long, f"q{i}") for i in range(3)]
            await gens[0].__anext__()        # q0 runs; q1 and q2 wait (max_num_seqs=1)
            firsts = [asyncio.ensure_future(g.__anext__()) for g in gens[1:]]
            while async_llm.snapshot().num_waiting < 2:
                await asyncio.sleep(0.01)
            with pytest.raises(EngineOverloadedError, match="max_waiting_requests=2"):
                await _collect(async_llm, "The quick", GREEDY, "q3", None)
            release.set()
            for f in firsts:
                f.cancel()
            await asyncio.gather(*firsts, return_exceptions=True)
            for g in gens:
                await g.aclose()

        asyncio.run(main())
        _wait_idle(async_llm)
    finally:
        async_llm.shutdown()


def test_a_failed_step_ends_every_stream(base_dir, monkeypatch):
    """The streams end with the error, then the engine is shut down and the ``on_dead``
    callbacks run once (one registered after the death at once); ``shutdown`` after it is
    harmless."""
    async_llm = AsyncLLM.from_engine_args(EngineArgs(model=str(base_dir), **ENGINE))
    core = async_llm.engine.engine_core
    shut, dead, later = [], [], []
    monkeypatch.setattr(core, "shutdown", lambda: shut.append(1))
    async_llm.on_dead(lambda error: dead.append((error, list(shut))))

    def broken_step():
        raise RuntimeError("device lost")

    monkeypatch.setattr(core, "step", broken_step)

    async def main():
        with pytest.raises(EngineDeadError, match="device lost"):
            await _collect(async_llm, "The quick", GREEDY, "doomed", None)
        with pytest.raises(EngineDeadError):
            await _collect(async_llm, "The quick", GREEDY, "after", None)

    asyncio.run(main())
    assert not async_llm.is_running and async_llm.errored
    async_llm._thread.join(60)
    assert len(dead) == 1
    error, shut_before = dead[0]
    assert isinstance(error, RuntimeError) and "device lost" in str(error)
    assert shut_before == [1]              # the engine was stopped before the callback
    async_llm.on_dead(later.append)
    assert later == [error]
    async_llm.shutdown()
    assert shut == [1] and len(dead) == 1


@pytest.mark.gpu
def test_cuda_async_streams_match_peft(base_dir, loras):
    """On CUDA (decode steps replayed as CUDA graphs captured on the main thread, run on
    the engine thread; adapter copies on the side stream), concurrent streams agree with
    transformers + peft."""
    from manylora.testing import compare_greedy, hf_greedy_reference

    async_llm = AsyncLLM.from_engine_args(EngineArgs(
        model=str(base_dir), **{**ENGINE, "device": "cuda", "max_num_seqs": 8}))
    adapters = [None, *loras, loras[0]]
    tok = async_llm.tokenizer
    prompts = [tok(p).input_ids for p in PROMPTS]
    try:
        async def main():
            return await asyncio.gather(*(
                _collect(async_llm, {"prompt_token_ids": p}, GREEDY, f"c{i}", lora)
                for i, (p, lora) in enumerate(zip(prompts, adapters))))

        streams = asyncio.run(main())
    finally:
        async_llm.shutdown()
    refs = hf_greedy_reference(base_dir, {lo.lora_name: lo.lora_path for lo in loras},
                               prompts, [lo.lora_name if lo else None for lo in adapters],
                               GREEDY.max_tokens)
    for outs, ref in zip(streams, refs):
        ok, where = compare_greedy(outs[-1].outputs[0].token_ids, ref)
        assert ok, where
