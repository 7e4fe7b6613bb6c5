"""``SamplingParams.prompt_logprobs`` through the whole engine, against transformers (+ peft).

The reference runs the same checkpoint (float32) with transformers, with the adapter through
peft, on the prompt (teacher forcing, one forward) and takes ``log_softmax`` of the logits at
every prompt position but the last: entry ``j`` is ``log p(x_j | x_<j)``. Checked with base
and adapter rows in one batch, a prefix cached by an earlier request, chunked prefill (a
small token budget), preemption, and async scheduling on and off.
"""

from __future__ import annotations

import pytest
import torch

from manylora import LLM, LoRARequest, SamplingParams
from manylora.engine.outputs import Logprob
from manylora.sampling_params import RequestOutputKind

TOL = 1e-4
PROMPTS = ["The quick brown fox jumps over the lazy dog and then",
           "SELECT name FROM users WHERE id = 4 AND",
           "Once upon a time, in a small village by the sea, there lived",
           "def add(a, b):\n    return"]
ENGINE = dict(device="cpu", dtype="float32", max_loras=2, max_lora_rank=32, block_size=4)


@pytest.fixture(scope="module")
def hf_models(demo_set):
    """name -> transformers model: ``None`` the base, ``"sql"`` base + the sql adapter."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    def load():
        return AutoModelForCausalLM.from_pretrained(
            str(demo_set.base_dir), dtype=torch.float32, attn_implementation="eager").eval()

    return {None: load(), "sql": PeftModel.from_pretrained(
        load(), str(demo_set.adapters["sql"])).eval()}


def _sql(demo_set):
    return LoRARequest("sql", 1, str(demo_set.adapters["sql"]))


@torch.no_grad()
def _reference(model, prompt_ids: list[int]) -> torch.Tensor:
    """``[P - 1, V]``: row ``j - 1`` is ``log_softmax`` of the logits predicting ``x_j``."""
    ids = torch.tensor([prompt_ids])
    logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0].float()
    return logits[:-1].log_softmax(dim=-1)


def assert_prompt_logprobs(out, model, n: int, tokenizer=None) -> None:
    """``out.prompt_logprobs`` equals the reference: None first, the prompt token first in
    each dict with its log-probability and rank, then the top ``n``."""
    ids = out.prompt_token_ids
    plp = out.prompt_logprobs
    assert plp is not None and len(plp) == len(ids) and plp[0] is None
    ref = _reference(model, ids)
    for j in range(1, len(ids)):
        entries, row, token = plp[j], ref[j - 1], ids[j]
        assert next(iter(entries)) == token, "the prompt token comes first"
        assert all(isinstance(v, Logprob) for v in entries.values())
        value = entries[token].logprob
        assert value == pytest.approx(float(row[token]), abs=TOL)
        assert 1 + int((row > value + TOL).sum()) <= entries[token].rank \
            <= 1 + int((row > value - TOL).sum())
        top_values, top_ids = row.topk(n)
        in_top = token in top_ids.tolist()
        assert len(entries) in ((n,) if in_top else (n, n + 1))
        for tid, lp in entries.items():
            assert lp.logprob == pytest.approx(float(row[tid]), abs=TOL)
            if tokenizer is not None:
                assert lp.decoded_token == tokenizer.convert_tokens_to_string(
                    [tokenizer.convert_ids_to_tokens(tid)])
        got_top = sorted((lp.logprob for t, lp in entries.items()
                          if t != token or in_top), reverse=True)[:n]
        torch.testing.assert_close(torch.tensor(got_top), top_values, atol=TOL, rtol=0)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_prompt_logprobs_mixed_batch_match_peft(demo_set, hf_models, async_scheduling):
    """Base and adapter rows in one batch, chunked prefill (budget 8 tokens)."""
    llm = LLM(str(demo_set.base_dir), **ENGINE, num_kv_blocks=128,
              max_num_batched_tokens=8, async_scheduling=async_scheduling)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True,
                            prompt_logprobs=3)
    sql = _sql(demo_set)
    loras = [None, sql, None, sql]
    outs = llm.generate(PROMPTS, params, lora_request=loras, use_tqdm=False)
    tok = llm.get_tokenizer()
    for out, lora in zip(outs, loras):
        assert_prompt_logprobs(out, hf_models[None if lora is None else "sql"], 3, tok)
        assert len(out.outputs[0].token_ids) == 3
    plain = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=3,
                                                    ignore_eos=True), use_tqdm=False)[0]
    assert plain.prompt_logprobs is None
    assert plain.outputs[0].token_ids == outs[0].outputs[0].token_ids


def test_prompt_logprobs_zero_and_one_token_prompt(demo_set, hf_models):
    llm = LLM(str(demo_set.base_dir), **ENGINE, num_kv_blocks=64)
    tok = llm.get_tokenizer()
    out = llm.generate(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=2,
                                                  prompt_logprobs=0), use_tqdm=False)[0]
    assert_prompt_logprobs(out, hf_models[None], 0, tok)
    assert all(len(d) == 1 for d in out.prompt_logprobs[1:])
    one = llm.generate({"prompt_token_ids": [5]}, SamplingParams(max_tokens=1,
                                                                 prompt_logprobs=2),
                       use_tqdm=False)[0]
    assert one.prompt_logprobs == [None]


def test_cached_prefix_is_recomputed_for_prompt_logprobs(demo_set, hf_models):
    """An earlier request caches the prefix; the next one still gets every entry."""
    llm = LLM(str(demo_set.base_dir), **ENGINE, num_kv_blocks=128)
    sql = _sql(demo_set)
    prefix = PROMPTS[2]
    greedy = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    llm.generate(prefix + " a fisherman", greedy, lora_request=sql, use_tqdm=False)
    stats = llm.llm_engine.engine_core.scheduler.kv.stats
    hits = stats.prefix_hits
    out = llm.generate(prefix + " a baker", SamplingParams(
        temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=4),
        lora_request=sql, use_tqdm=False)[0]
    assert stats.prefix_hits == hits, "the prompt was computed, not taken from the cache"
    assert_prompt_logprobs(out, hf_models["sql"], 4)
    again = llm.generate(prefix + " a baker", greedy, lora_request=sql, use_tqdm=False)[0]
    assert stats.prefix_hits > hits, "a request without prompt_logprobs still hits"
    assert again.outputs[0].token_ids == out.outputs[0].token_ids


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_prompt_logprobs_survive_preemption(demo_set, hf_models, async_scheduling):
    """Preempted requests re-prefill; each prompt position is reported exactly once."""
    llm = LLM(str(demo_set.base_dir), device="cpu", dtype="float32", block_size=4,
              num_kv_blocks=20, max_num_seqs=4, max_num_batched_tokens=16,
              async_scheduling=async_scheduling)
    params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True,
                            prompt_logprobs=2, output_kind=RequestOutputKind.DELTA)
    engine = llm.llm_engine
    ids = [engine.add_request(None, p, params) for p in PROMPTS]
    got: dict[str, list] = {rid: [] for rid in ids}
    finals = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.prompt_logprobs is not None:
                got[o.request_id].append(o.prompt_logprobs)
            if o.finished:
                finals[o.request_id] = o
    assert engine.engine_core.scheduler.num_preemptions > 0
    for rid in ids:
        assert len(got[rid]) == 1, "a DELTA request gets its prompt entries once"
        out = finals[rid]
        out.prompt_logprobs = got[rid][0]
        assert_prompt_logprobs(out, hf_models[None], 2)


def test_prompt_logprobs_validation():
    for bad in (-1, 21, 1.5, "3", True):
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)
    assert SamplingParams(prompt_logprobs=20).prompt_logprobs == 20


def test_prompt_logprobs_in_padded_piece_steps_in_process(demo_set, hf_models, monkeypatch):
    """Steps padded to piece buckets (run eagerly on the CPU): prompt rows index the padded
    hidden states; the core in this process (no IPC)."""
    monkeypatch.setenv("MANYLORA_ENABLE_MULTIPROCESSING", "0")
    llm = LLM(str(demo_set.base_dir), **ENGINE, num_kv_blocks=128, max_num_batched_tokens=16,
              piecewise_cuda_graph_sizes=(8, 16))
    sql = _sql(demo_set)
    loras = [sql, None, sql, None]
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=2,
                                                prompt_logprobs=1),
                        lora_request=loras, use_tqdm=False)
    for out, lora in zip(outs, loras):
        assert_prompt_logprobs(out, hf_models[None if lora is None else "sql"], 1)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, tol", [("float32", 1e-3), ("bfloat16", 5e-2)])
def test_prompt_logprobs_on_cuda_with_graphs(demo_set, hf_models, dtype, tol):
    """On a GPU, with decode and piecewise CUDA graphs and async scheduling (the defaults):
    prompt log-probabilities of base and adapter rows vs transformers + peft (float32
    reference; bf16 within its rounding)."""
    llm = LLM(str(demo_set.base_dir), device="cuda", dtype=dtype, max_loras=2,
              max_lora_rank=32, max_num_batched_tokens=32)
    sql = _sql(demo_set)
    loras = [None, sql, None, sql]
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=4,
                                                prompt_logprobs=2),
                        lora_request=loras, use_tqdm=False)
    for out, lora in zip(outs, loras):
        ref = _reference(hf_models[None if lora is None else "sql"], out.prompt_token_ids)
        plp = out.prompt_logprobs
        assert plp[0] is None and len(plp) == len(out.prompt_token_ids)
        for j, token in enumerate(out.prompt_token_ids[1:], start=1):
            assert plp[j][token].logprob == pytest.approx(float(ref[j - 1, token]), abs=tol)
