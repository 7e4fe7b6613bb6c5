"""Output constraints that leave no token: the request ends with an error of its own, the
rest of the batch is untouched and the engine keeps serving; a finished grammar ends its
request under ``min_tokens`` too. On a tiny random checkpoint, async scheduling on and off.

References: the plain rows of a batch equal transformers' greedy decoding of the same
weights; which rows allow no token is checked against a float64 torch reference; grammar
outputs against ``re.fullmatch``.
"""

from __future__ import annotations

import re

import pytest
import torch

from manylora import LLM, SamplingParams
from manylora.sample.sampler import Sampler, flag_empty_rows
from manylora.structured_params import StructuredOutputsParams
from manylora.testing import make_checkpoint
from manylora.testing.structured import names_an_empty_constraint

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512)
ENGINE = dict(block_size=8, max_model_len=512, device="cpu", dtype="float32", max_num_seqs=16)
MUTUAL = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
          "$ref": "#/$defs/a"}


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("notoken") / "base", "llama", seed=5,
                           **TINY)


@pytest.fixture(scope="module", params=[True, False], ids=["async", "sync"])
def llm(request, base_dir):
    return LLM(str(base_dir), async_scheduling=request.param, **ENGINE)


@pytest.fixture(scope="module")
def tok(base_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(base_dir))


@torch.no_grad()
def _hf_greedy(base_dir, tok, prompt: str, max_tokens: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32).eval()
    ids = tok(prompt).input_ids
    out = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False,
                         min_new_tokens=max_tokens)
    return out[0, len(ids):].tolist()


def _so(**kw) -> StructuredOutputsParams:
    return StructuredOutputsParams(**kw)


def _bad_params(tok) -> dict[str, SamplingParams]:
    a = tok.encode("a", add_special_tokens=False)
    brace = tok.encode("{", add_special_tokens=False)
    assert len(a) == 1 and len(brace) == 1
    cases = {
        "self $ref": dict(structured_outputs=_so(json={"$ref": "#"})),
        "mutual $refs": dict(structured_outputs=_so(json=MUTUAL)),
        "empty regex": dict(structured_outputs=_so(regex="[^\\s\\S]")),
        "empty grammar": dict(structured_outputs=_so(grammar="root ::= [^\\x00-\\U0010FFFF]")),
        "choice + allowed_token_ids": dict(structured_outputs=_so(choice=["a"]),
                                           allowed_token_ids=[a[0] + 1]),
        "choice + bad_words": dict(structured_outputs=_so(choice=["a"]), bad_words=["a"]),
        "json_object + allowed_token_ids": dict(structured_outputs=_so(json_object=True),
                                                allowed_token_ids=a),
        # "{" is allowed first, then nothing: the dead end is found while sampling
        "dead end after one token": dict(structured_outputs=_so(json_object=True),
                                         allowed_token_ids=brace),
    }
    return {name: SamplingParams(temperature=t, max_tokens=16, seed=3, **kw)
            for name, kw in cases.items() for t in (0.0, 1.0)}


def test_constraints_that_allow_no_token_end_only_their_request(llm, base_dir, tok):
    bad = _bad_params(tok)
    plain = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = ["The weather today", "Once upon a time"]
    expected = [_hf_greedy(base_dir, tok, p, 24) for p in prompts]
    outs = llm.generate(prompts + ["Reply:"] * len(bad), [plain, plain, *bad.values()],
                        use_tqdm=False)
    for out, want in zip(outs[:2], expected):
        assert out.outputs[0].finish_reason == "length"
        assert list(out.outputs[0].token_ids) == want
    for (name, params), out in zip(bad.items(), outs[2:]):
        c = out.outputs[0]
        assert c.finish_reason == "error", (name, c.text)
        assert isinstance(out.error, ValueError), name
        message = str(out.error)
        assert names_an_empty_constraint(message) and "structured_outputs" in message, message
        if params.allowed_token_ids is not None:
            assert "allowed_token_ids" in message, message
        if params.bad_words:
            assert "bad_words" in message, message
        if name == "dead end after one token":
            assert c.text == "{" and "after the 1 generated" in message, (c.text, message)
        else:
            assert c.token_ids == [], message
            assert "no token" not in message or "after the 0 generated" in message, message
    # the engine goes on serving
    again = llm.generate(prompts[:1], plain, use_tqdm=False)[0].outputs[0]
    assert list(again.token_ids) == expected[0]


def test_bad_words_with_allowed_token_ids_leave_no_token_without_a_grammar(llm, tok):
    a = tok.encode("a", add_special_tokens=False)
    params = SamplingParams(temperature=0.0, max_tokens=4, allowed_token_ids=a,
                            bad_words=["a"])
    out = llm.generate(["x"], params, use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "error" and out.outputs[0].token_ids == []
    assert "allowed_token_ids and bad_words" in str(out.error)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_never_outlives_a_grammar(llm, temperature):
    # the grammar admits one string: it ends the request though min_tokens asks for more
    choice = SamplingParams(temperature=temperature, seed=1, max_tokens=8, min_tokens=5,
                            structured_outputs=_so(choice=["a"]))
    # the grammar allows more: the stop tokens wait for min_tokens
    more = SamplingParams(temperature=temperature, seed=2, max_tokens=40, min_tokens=6,
                          structured_outputs=_so(regex="a+"))
    outs = llm.generate(["Hi", "Hi"], [choice, more], use_tqdm=False)
    first, second = outs[0].outputs[0], outs[1].outputs[0]
    assert first.text == "a" and first.finish_reason == "stop"
    assert re.fullmatch("a+", second.text), second.text
    assert len(second.token_ids) >= 6, second.token_ids


def test_flag_empty_rows_against_a_reference():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g, dtype=torch.float64)
    masks = torch.rand(6, 50, generator=g) < 0.5
    masks[1] = False                      # nothing allowed
    masks[3] = False
    masks[4] = False
    masks[4, 17] = True                   # one token allowed
    masked = logits.masked_fill(~masks, float("-inf")).float()
    empty_ref = ~masks.any(dim=1)
    sampler = Sampler()
    for temperature in (0.0, 1.0):
        t = torch.full((6,), temperature)
        tokens = sampler(masked, t, torch.zeros(6, dtype=torch.int64), torch.ones(6),
                         torch.zeros(6), {})
        flagged = flag_empty_rows(tokens, masked)
        assert torch.equal(flagged < 0, empty_ref)
        assert torch.equal(torch.where(flagged < 0, -1 - flagged, flagged), tokens)
        assert int(tokens[4]) == 17
        ok = ~empty_ref
        assert masks[ok].gather(1, tokens[ok].unsqueeze(1)).all()


def test_a_request_whose_output_cannot_be_processed_fails_alone(llm, base_dir, tok):
    """A delta the front cannot apply (here its detokenizer raises) ends that request with
    the error; the other request's output equals transformers' greedy, and the engine
    serves on."""
    engine = llm.llm_engine
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    good = engine.add_request(None, "The weather today", plain)
    bad = engine.add_request(None, "Once upon a time", plain)

    def broken(token):
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "a broken tokenizer")

    engine.output_processor.states[bad].detokenizer.append = broken
    finished = {o.request_id: o for o in engine.generate_all()}
    assert finished[bad].outputs[0].finish_reason == "error"
    assert isinstance(finished[bad].error, UnicodeDecodeError)
    assert list(finished[good].outputs[0].token_ids) == _hf_greedy(base_dir, tok,
                                                                  "The weather today", 12)
    assert not engine.has_unfinished_requests()
    again = llm.generate(["Once upon a time"], plain, use_tqdm=False)[0].outputs[0]
    assert list(again.token_ids) == _hf_greedy(base_dir, tok, "Once upon a time", 12)


@pytest.mark.gpu
@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_cuda_graphs_constraints_that_allow_no_token(base_dir, tok, async_scheduling):
    """On CUDA with decode graphs, bf16: the rows whose masks allow no token end with their
    errors (the marked copy to the host), the plain rows equal their solo outputs, and the
    engine serves on."""
    llm = LLM(str(base_dir), device="cuda", dtype="bfloat16", max_num_seqs=32, block_size=16,
              max_model_len=512, async_scheduling=async_scheduling)
    assert llm.llm_engine.engine_core.executor.runner.graphs is not None
    bad = _bad_params(tok)
    plain = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = ["The weather today", "Once upon a time"]
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, plain, use_tqdm=False)]
    outs = llm.generate(prompts + ["Reply:"] * len(bad), [plain, plain, *bad.values()],
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[:2]] == alone
    for name, out in zip(bad, outs[2:]):
        assert out.outputs[0].finish_reason == "error", name
        assert names_an_empty_constraint(str(out.error)), name
    again = llm.generate(prompts, plain, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == alone
    llm.llm_engine.shutdown()
