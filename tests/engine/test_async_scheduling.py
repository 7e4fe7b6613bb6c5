"""Async scheduling: step n+1 is planned and launched before step n's tokens reach the host.

References: the same engine with ``async_scheduling=False`` (itself checked token for token
against transformers + peft in test_peft_equivalence.py and test_prefix_caching.py), on a
workload that preempts, chunks prefills, queues adapters for slots, hits the prefix cache
and mixes greedy, seeded, stop-token, one-token and logprob requests; a fresh engine for a
request id reused while a step of its predecessor is in flight; a run without the request
aborted mid-flight. Every test ends with the block accounting.
"""

from __future__ import annotations

import pytest
import torch

from manylora import LLM, LoRARequest, SamplingParams
from manylora.testing import compare_greedy, hf_greedy_reference, make_checkpoint, make_peft_adapter
from manylora.worker.step_inputs import StepBuffers

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)
ENGINE = dict(max_lora_rank=8, block_size=4, max_model_len=128, device="cpu", dtype="float32",
              skip_tokenizer_init=True, max_loras=2)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("async") / "base", "llama", seed=0, **TINY)


@pytest.fixture(scope="module")
def adapters(base_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("async-loras")
    targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
    return [LoRARequest(f"a{i}", i, str(make_peft_adapter(
        base_dir, root / f"a{i}", r=(2, 4, 8)[i - 1], target_modules=targets, seed=i)))
        for i in (1, 2, 3)]


@pytest.fixture
def gathered(monkeypatch):
    """Counts the decode token ids steps took from the previous step's samples."""
    count = [0]
    upload = StepBuffers.upload

    def spy(self, inputs, max_loras, prev_sampled=None):
        count[0] += inputs.layout.num_prev
        return upload(self, inputs, max_loras, prev_sampled)

    monkeypatch.setattr(StepBuffers, "upload", spy)
    return count


def _workload(adapters, vocab):
    prompts, params, loras = [], [], []
    stops = list(range(0, vocab, 3))          # about one token in three ends the request
    for i in range(12):
        prompts.append({"prompt_token_ids": [1 + (7 * i + 5 * j) % (vocab - 1)
                                             for j in range(5 + 3 * i)]})
        kind = i % 6
        if kind == 0:
            p = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True, logprobs=3)
        elif kind == 1:
            p = SamplingParams(temperature=0.9, top_k=20, seed=100 + i, max_tokens=9,
                               ignore_eos=True)
        elif kind == 2:
            p = SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=stops,
                               min_tokens=2)
        elif kind == 3:
            p = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        elif kind == 4:
            p = SamplingParams(temperature=0.7, top_p=0.9, seed=7 * i, max_tokens=10,
                               stop_token_ids=stops, logprobs=2)
        else:
            p = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
        prompts[-1]["prompt_token_ids"][:6] = [3, 1, 4, 1, 5, 9]     # a shared prefix
        params.append(p)
        loras.append([None, *adapters][i % 4])
    return prompts, params, loras


def _run(base_dir, adapters, async_scheduling):
    llm = LLM(str(base_dir), **ENGINE, num_kv_blocks=20, max_num_batched_tokens=24,
              async_scheduling=async_scheduling)
    vocab = llm.llm_engine.engine_core.model_config.vocab_size
    prompts, params, loras = _workload(adapters, vocab)
    runs = [llm.generate(prompts, params, loras, use_tqdm=False) for _ in range(2)]
    stats = llm.llm_engine.kv_cache_stats()
    assert stats.used_blocks == 0
    assert stats.used_blocks + stats.cached_blocks + stats.free_blocks == stats.num_blocks
    sched = llm.llm_engine.engine_core.scheduler
    assert not sched.requests
    return runs, stats


def _same(a, b):
    assert a.outputs[0].token_ids == b.outputs[0].token_ids, a.request_id
    assert a.outputs[0].finish_reason == b.outputs[0].finish_reason
    assert a.outputs[0].stop_reason == b.outputs[0].stop_reason
    la, lb = a.outputs[0].logprobs, b.outputs[0].logprobs
    assert (la is None) == (lb is None)
    for x, y in zip(la or [], lb or []):
        assert x.keys() == y.keys()
        for tok in x:
            assert abs(x[tok].logprob - y[tok].logprob) < 1e-4


def test_outputs_are_identical_with_async_scheduling_on_and_off(base_dir, adapters,
                                                                  gathered):
    (on_runs, on_stats) = _run(base_dir, adapters, True)
    assert gathered[0] > 0, "decode tokens came from the previous step's samples"
    took = gathered[0]
    (off_runs, off_stats) = _run(base_dir, adapters, False)
    assert gathered[0] == took, "without async scheduling every token is on the host"
    for on, off in zip(on_runs, off_runs):
        for a, b in zip(on, off):
            _same(a, b)
    reasons = {o.outputs[0].finish_reason for o in on_runs[0]}
    assert reasons == {"stop", "length"}
    for stats in (on_stats, off_stats):
        assert stats.preemptions > 0 and stats.prefix_hits > 0


def test_greedy_outputs_match_peft_with_async_scheduling(base_dir, adapters):
    llm = LLM(str(base_dir), **ENGINE, num_kv_blocks=40, max_num_batched_tokens=24)
    assert llm.llm_engine.engine_core.async_scheduling
    prompts = [[5 + i, 17, 3 * i + 1, 40, 2] * (1 + i) for i in range(6)]
    loras = [None, *adapters, adapters[0], None]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, loras,
                        use_tqdm=False)
    refs = hf_greedy_reference(base_dir, {a.lora_name: a.lora_path for a in adapters},
                               prompts, [a.lora_name if a else None for a in loras], 8)
    for out, ref in zip(outs, refs):
        ok, where = compare_greedy(out.outputs[0].token_ids, ref)
        assert ok, where


def _drain(engine, rid):
    while True:
        for out in engine.step():
            if out.request_id == rid and out.finished:
                return out


def test_a_request_id_reused_while_its_last_step_is_in_flight(base_dir):
    """A request that stops at step n was also planned into step n+1 (launched before its
    stop was known); a new request with the same id, added at once, gets none of that
    step's token and its own output equals a fresh engine's. (Another request keeps the
    core busy: an idle core reads the step in flight at once.)"""
    llm = LLM(str(base_dir), **ENGINE, num_kv_blocks=64, enable_lora=False)
    engine = llm.llm_engine
    vocab = engine.engine_core.model_config.vocab_size
    stop_all = SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=list(range(vocab)),
                              min_tokens=3)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engine.add_request("busy", {"prompt_token_ids": [1, 2]},
                       SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    engine.add_request("r", {"prompt_token_ids": [7, 8, 9, 10]}, stop_all)
    first = _drain(engine, "r")
    assert first.outputs[0].finish_reason == "stop" and len(first.outputs[0].token_ids) == 3
    assert engine.engine_core._in_flight is not None, "the stopped request's next step runs"
    engine.add_request("r", {"prompt_token_ids": [20, 21, 22]}, greedy)
    second = _drain(engine, "r")
    fresh = LLM(str(base_dir), **ENGINE, num_kv_blocks=64, enable_lora=False,
                async_scheduling=False)
    (want,) = fresh.generate({"prompt_token_ids": [20, 21, 22]}, greedy, use_tqdm=False)
    assert second.outputs[0].token_ids == want.outputs[0].token_ids
    assert second.prompt_token_ids == [20, 21, 22]
    engine.abort_request("busy")
    assert not engine.engine_core.has_unfinished_requests()
    assert engine.kv_cache_stats().used_blocks == 0


def test_abort_while_a_step_is_in_flight_leaves_the_others_alone(base_dir):
    llm = LLM(str(base_dir), **ENGINE, num_kv_blocks=64, enable_lora=False)
    engine = llm.llm_engine
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = {f"q{i}": [3 + i, 9, 27, 81 % 50 + i] for i in range(3)}
    for rid, ids in prompts.items():
        engine.add_request(rid, {"prompt_token_ids": ids}, greedy)
    for _ in range(3):
        engine.step()
    assert engine.engine_core._in_flight is not None
    engine.abort_request("q1")
    done = {o.request_id: o for o in engine.generate_all()}
    assert set(done) == {"q0", "q2"}
    ref = LLM(str(base_dir), **ENGINE, num_kv_blocks=64, enable_lora=False,
              async_scheduling=False)
    for rid in ("q0", "q2"):
        (want,) = ref.generate({"prompt_token_ids": prompts[rid]}, greedy, use_tqdm=False)
        assert done[rid].outputs[0].token_ids == want.outputs[0].token_ids
    assert not engine.engine_core.has_unfinished_requests()   # idle: nothing in flight
    assert engine.kv_cache_stats().used_blocks == 0


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_session_turns_prefill_the_same_with_async_scheduling(base_dir, adapters,
                                                              async_scheduling):
    """A session keeps the KV a synchronous step leaves (all but its last token) even when
    the step in flight computed that token, so every turn prefills the same tokens and
    equals a cold run of its whole history."""
    a2 = adapters[1]
    llm = LLM(str(base_dir), **ENGINE, num_kv_blocks=128, async_scheduling=async_scheduling)
    cold = LLM(str(base_dir), **ENGINE, num_kv_blocks=128, enable_prefix_caching=False,
               async_scheduling=False)
    eng = llm.llm_engine
    vocab = eng.engine_core.model_config.vocab_size
    # every turn ends on a stop token (not at max_tokens), so the next step was planned
    greedy = SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=list(range(vocab)),
                            min_tokens=4)
    history: list[int] = []
    for i, turn in enumerate([[11, 12, 13, 14, 15, 16, 17], [40, 41], [50, 51, 52]]):
        before = eng.kv_cache_stats()
        (out,) = llm.generate({"prompt_token_ids": turn}, greedy, a2, use_tqdm=False,
                              session_id="chat")
        after = eng.kv_cache_stats()
        prefilled = ((after.prefix_queries - before.prefix_queries)
                     - (after.prefix_hits - before.prefix_hits))
        assert prefilled == len(turn) + (1 if i else 0), i
        (ref,) = cold.generate({"prompt_token_ids": history + turn}, greedy, a2,
                               use_tqdm=False)
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids, i
        assert out.outputs[0].finish_reason == "stop"
        history = history + turn + out.outputs[0].token_ids
    assert llm.end_session("chat")
    assert eng.kv_cache_stats().used_blocks == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_with_async_scheduling_equal_synchronous(base_dir, adapters):
    """On a GPU: decode graphs replay on ids gathered on the device from the previous
    step's samples (the copy to the host on a side stream); outputs equal the synchronous
    engine's."""
    outs = []
    for on in (True, False):
        llm = LLM(str(base_dir), **{**ENGINE, "device": "cuda"}, num_kv_blocks=40,
                  max_num_batched_tokens=24, async_scheduling=on)
        vocab = llm.llm_engine.engine_core.model_config.vocab_size
        prompts, params, loras = _workload(adapters, vocab)
        outs.append(llm.generate(prompts, params, loras, use_tqdm=False))
        assert llm.llm_engine.kv_cache_stats().used_blocks == 0
        llm.llm_engine.shutdown()
    for a, b in zip(*outs):
        _same(a, b)
