"""``SamplingParams.logprobs`` through the whole engine, against transformers (+ peft).

The reference runs the same checkpoint with transformers on the prompt followed by the tokens
the engine generated (teacher forcing, one forward) and takes ``log_softmax`` of its logits
at every generated position: the raw distribution, as vLLM v1's default
``logprobs_mode="raw_logprobs"``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from manylora import LLM, LoRARequest, SamplingParams
from manylora.engine.outputs import CompletionOutput, Logprob
from manylora.sampling_params import MAX_LOGPROBS

PROMPTS = ["The quick brown fox", "SELECT name FROM users WHERE", "Hello", "def add(a, b):",
           "Once upon a time, in a small village by the sea,"]
TOL = 1e-4


@pytest.fixture(scope="module")
def llm(demo_set):
    return LLM(str(demo_set.base_dir), device="cpu", dtype="float32", max_loras=2,
               max_lora_rank=32, num_kv_blocks=128, block_size=4)


@pytest.fixture(scope="module")
def hf_models(demo_set):
    """name -> transformers model: ``None`` the base, ``"sql"`` base + the sql adapter."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    def load():
        return AutoModelForCausalLM.from_pretrained(
            str(demo_set.base_dir), dtype=torch.float32, attn_implementation="eager").eval()

    sql = PeftModel.from_pretrained(load(), str(demo_set.adapters["sql"])).eval()
    return {None: load(), "sql": sql}


def _sql(demo_set):
    return LoRARequest("sql", 1, str(demo_set.adapters["sql"]))


@torch.no_grad()
def _reference(model, prompt_ids: list[int], generated: list[int]) -> torch.Tensor:
    """``[len(generated), V]`` float32 log-probabilities of each generated position."""
    ids = torch.tensor([prompt_ids + generated[:-1]])
    logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0].float()
    return logits[len(prompt_ids) - 1:].log_softmax(dim=-1)


def _ref_rank_bounds(ref: torch.Tensor, value: float) -> tuple[int, int]:
    """The ranks ``value`` may have given the reference row, forgiving differences < TOL."""
    return 1 + int((ref > value + TOL).sum()), 1 + int((ref > value - TOL).sum())


def _assert_matches_reference(out, model, n: int, tokenizer) -> None:
    comp: CompletionOutput = out.outputs[0]
    assert comp.logprobs is not None and len(comp.logprobs) == len(comp.token_ids) > 0
    ref_all = _reference(model, out.prompt_token_ids, comp.token_ids)
    total = 0.0
    for pos, (token, entries) in enumerate(zip(comp.token_ids, comp.logprobs)):
        ref = ref_all[pos]
        assert next(iter(entries)) == token, "the sampled token comes first"
        assert all(isinstance(lp, Logprob) for lp in entries.values())
        sampled = entries[token]
        assert sampled.logprob == pytest.approx(float(ref[token]), abs=TOL)
        lo, hi = _ref_rank_bounds(ref, float(ref[token]))
        assert lo <= sampled.rank <= hi
        # The top n: the reference's top n (where its n-th and n+1-th values are apart).
        top_values, top_ids = ref.topk(min(n + 1, ref.shape[0]))
        in_top = token in top_ids[:n].tolist()
        assert len(entries) == (n if in_top else n + 1)
        top = sorted(entries.items(), key=lambda kv: -kv[1].logprob)[:n]
        np.testing.assert_allclose([lp.logprob for _, lp in top], top_values[:n].numpy(),
                                   atol=TOL)
        if n < ref.shape[0] and n and float(top_values[n - 1] - top_values[n]) > TOL:
            assert {t for t, _ in top} == set(top_ids[:n].tolist())
        for tid, lp in entries.items():
            lo, hi = _ref_rank_bounds(ref, float(ref[tid]))
            assert lo <= lp.rank <= hi
            assert lp.logprob == pytest.approx(float(ref[tid]), abs=TOL)
            assert lp.decoded_token == tokenizer.convert_tokens_to_string(
                [tokenizer.convert_ids_to_tokens(tid)])
        total += sampled.logprob
    assert comp.cumulative_logprob == pytest.approx(total, rel=1e-12, abs=1e-12)


def test_greedy_logprobs_match_transformers(llm, hf_models):
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for out in outs:
        _assert_matches_reference(out, hf_models[None], 5, llm.get_tokenizer())
        for token, entries in zip(out.outputs[0].token_ids, out.outputs[0].logprobs):
            assert entries[token].rank == 1, "greedy picks a most likely token"


def test_logprobs_zero_is_the_sampled_token_alone(llm, hf_models):
    five = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=6,
                                                   ignore_eos=True, logprobs=5),
                        use_tqdm=False)[0].outputs[0]
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=6,
                                                  ignore_eos=True, logprobs=0),
                       use_tqdm=False)[0]
    zero = out.outputs[0]
    assert zero.token_ids == five.token_ids
    assert [list(d) for d in zero.logprobs] == [[t] for t in zero.token_ids]
    assert [d[t] for d, t in zip(zero.logprobs, zero.token_ids)] == \
        [d[t] for d, t in zip(five.logprobs, five.token_ids)]
    _assert_matches_reference(out, hf_models[None], 0, llm.get_tokenizer())


@pytest.mark.parametrize("params", [
    dict(temperature=0.5, top_k=5),
    dict(temperature=1.5, top_p=0.8),
    dict(temperature=1.0, min_p=0.05),
])
def test_logprobs_are_raw_whatever_the_sampling(llm, hf_models, params):
    """Sampled with temperature and filters, the values stay the raw model's."""
    sp = SamplingParams(max_tokens=8, ignore_eos=True, seed=7, logprobs=3, **params)
    out = llm.generate(PROMPTS[1], sp, use_tqdm=False)[0]
    _assert_matches_reference(out, hf_models[None], 3, llm.get_tokenizer())


def test_no_logprobs_by_default(llm):
    comp = llm.generate(PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=3),
                        use_tqdm=False)[0].outputs[0]
    assert comp.logprobs is None and comp.cumulative_logprob is None


@pytest.mark.parametrize("bad", [-1, MAX_LOGPROBS + 1, 2.5, "3", True])
def test_invalid_logprobs_raise(bad):
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=bad)


def test_valid_logprobs_values():
    assert SamplingParams().logprobs is None
    assert SamplingParams(logprobs=0).logprobs == 0
    assert SamplingParams(logprobs=MAX_LOGPROBS).logprobs == MAX_LOGPROBS
    p = SamplingParams(logprobs=np.int64(4))
    assert p.logprobs == 4 and type(p.logprobs) is int


def test_mixed_batch(llm, demo_set, hf_models):
    """Rows with and without logprobs, different N, base and LoRA rows, in one batch."""
    counts = [None, 0, 5, MAX_LOGPROBS, None, 2]
    adapters = [None, None, "sql", None, "sql", None]
    prompts = PROMPTS + ["Numbers: 0 1 2"]
    params = [SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True, logprobs=c)
              for c in counts]
    loras = [_sql(demo_set) if a else None for a in adapters]
    outs = llm.generate(prompts, params, loras, use_tqdm=False)
    plain = llm.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=7,
                                                  ignore_eos=True)] * len(prompts), loras,
                         use_tqdm=False)
    tok = llm.get_tokenizer()
    for out, ref_out, n, adapter in zip(outs, plain, counts, adapters):
        comp = out.outputs[0]
        assert comp.token_ids == ref_out.outputs[0].token_ids, "logprobs change no token"
        if n is None:
            assert comp.logprobs is None and comp.cumulative_logprob is None
        else:
            _assert_matches_reference(out, hf_models[adapter], n, tok)


def test_logprobs_survive_preemption(demo_set, hf_models):
    """Requests re-prefilled after preemption keep one logprobs dict per token."""
    llm = LLM(str(demo_set.base_dir), device="cpu", dtype="float32", block_size=4,
              num_kv_blocks=16, max_num_seqs=4)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    outs = llm.generate(PROMPTS[:4], params, use_tqdm=False)
    assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0
    for out in outs:
        _assert_matches_reference(out, hf_models[None], 2, llm.get_tokenizer())


def test_step_outputs_grow_and_are_snapshots(llm):
    engine = llm.llm_engine
    rid = engine.add_request(None, PROMPTS[0], SamplingParams(
        temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=1))
    seen = []
    while engine.has_unfinished_requests():
        seen.extend(o for o in engine.step() if o.request_id == rid)
    lengths = [len(o.outputs[0].logprobs) for o in seen]
    assert lengths == [1, 2, 3, 4]
    for o in seen:
        comp = o.outputs[0]
        assert len(comp.logprobs) == len(comp.token_ids)
        assert comp.cumulative_logprob == pytest.approx(
            sum(d[t].logprob for d, t in zip(comp.logprobs, comp.token_ids)))


def test_without_tokenizer_decoded_token_is_none(demo_set):
    llm = LLM(str(demo_set.base_dir), device="cpu", dtype="float32", skip_tokenizer_init=True,
              num_kv_blocks=32)
    comp = llm.generate({"prompt_token_ids": [0, 5, 6, 7]}, SamplingParams(
        temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=2),
        use_tqdm=False)[0].outputs[0]
    assert len(comp.logprobs) == 3
    assert all(lp.decoded_token is None for d in comp.logprobs for lp in d.values())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_decode_matches_eager(demo_set):
    """Decode steps replayed from CUDA graphs give the eager path's log-probabilities."""
    params = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=n)
              for n in (None, 0, 4, MAX_LOGPROBS, 3)]
    results = []
    for eager in (False, True):
        llm = LLM(str(demo_set.base_dir), device="cuda", dtype="float32", max_num_seqs=8,
                  num_kv_blocks=128, block_size=16, enforce_eager=eager)
        if not eager:
            assert llm.llm_engine.engine_core.executor.runner.graphs is not None
        results.append(llm.generate(PROMPTS, params, use_tqdm=False))
        del llm
        torch.cuda.empty_cache()
    for graph_out, eager_out in zip(*results):
        g, e = graph_out.outputs[0], eager_out.outputs[0]
        assert g.token_ids == e.token_ids
        if e.logprobs is None:
            assert g.logprobs is None
            continue
        for dg, de in zip(g.logprobs, e.logprobs):
            assert list(dg) == list(de)
            for tid in de:
                assert dg[tid].logprob == pytest.approx(de[tid].logprob, abs=1e-4)
                assert dg[tid].rank == de[tid].rank
