"""Structured output through the engine (xgrammar), on a tiny random checkpoint.

References, independent of the engine's grammar path:
- every json_schema output validates against its schema with the ``jsonschema`` package;
  regex outputs match with ``re.fullmatch``, choices are one of the choices, json_object
  outputs parse as objects;
- a greedy constrained request equals transformers' greedy decoding of the same weights with
  the grammar's mask (an xgrammar matcher of its own, bits unpacked in torch) applied to each
  step's logits;
- requests without a grammar come out of a mixed batch exactly as they do alone (greedy);
with async scheduling on and off.
"""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest
import torch

from manylora import LLM, SamplingParams
from manylora.sampling_params import RequestOutputKind
from manylora.structured_params import StructuredOutputsParams
from manylora.testing import make_checkpoint

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512)
ENGINE = dict(block_size=8, max_model_len=512, device="cpu", dtype="float32", max_num_seqs=16)

SCHEMAS = [
    {"type": "object",
     "properties": {"name": {"type": "string", "maxLength": 8},
                    "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"]},
    {"type": "object",
     "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 4},
                             "minItems": 1, "maxItems": 3},
                    "level": {"enum": ["low", "mid", "high"]}},
     "required": ["tags", "level"]},
    {"type": "object",
     "properties": {"point": {"type": "object",
                              "properties": {"x": {"type": "integer", "minimum": -50,
                                                   "maximum": 50},
                                             "y": {"type": "integer", "minimum": -50,
                                                   "maximum": 50}},
                              "required": ["x", "y"]},
                    "ok": {"type": "boolean"}},
     "required": ["point", "ok"]},
    {"type": "object",
     "properties": {"id": {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 999},
                                     {"type": "string", "pattern": "^[a-f]{2,4}$"}]}},
     "required": ["id"]},
    {"type": "object",
     "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
                    "n": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                     "maximum": 9},
                          "minItems": 2, "maxItems": 4}},
     "required": ["code", "n"]},
]
SEEDS = (0, 1, 2)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("so") / "base", "llama", seed=5, **TINY)


@pytest.fixture(scope="module", params=[True, False], ids=["async", "sync"])
def llm(request, base_dir):
    return LLM(str(base_dir), async_scheduling=request.param, **ENGINE)


def _loads(text: str):
    """JSON text → value. ``strict=False``: xgrammar 0.2.8's length-bounded strings
    (``maxLength``) admit raw control characters, which strict JSON refuses; a random model
    picks them."""
    return json.loads(text, strict=False)


def _so(seed: int | None = None, **kw) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_tokens=200, seed=seed,
                          structured_outputs=StructuredOutputsParams(**kw))


def test_json_schema_outputs_validate(llm):
    params, schemas = [], []
    for schema in SCHEMAS:
        for seed in SEEDS:
            params.append(_so(seed, json=schema, disable_any_whitespace=True))
            schemas.append(schema)
    outs = llm.generate(["Reply in JSON:"] * len(params), params, use_tqdm=False)
    for out, schema in zip(outs, schemas):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (c.text, schema)
        jsonschema.validate(_loads(c.text), schema)


def test_any_whitespace_json_and_json_object(llm):
    outs = llm.generate(["a", "b", "c", "d"],
                        [_so(json=SCHEMAS[0]), _so(json=SCHEMAS[2]),
                         _so(json_object=True), _so(json_object=True, seed=3)],
                        use_tqdm=False)
    for out, schema in zip(outs[:2], (SCHEMAS[0], SCHEMAS[2])):
        if out.outputs[0].finish_reason == "stop":     # whitespace is free: it may run long
            jsonschema.validate(_loads(out.outputs[0].text), schema)
        else:
            assert out.outputs[0].finish_reason == "length"
    for out in outs[2:]:
        if out.outputs[0].finish_reason == "stop":
            assert isinstance(_loads(out.outputs[0].text), dict)


def test_regex_choice_grammar(llm):
    regex = r"(cat|dog)-[0-9]{2,3}"
    choices = ["yes", "no", "maybe \"so\""]
    ebnf = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'
    params = ([_so(regex=regex, seed=s) for s in SEEDS]
              + [_so(choice=choices, seed=s) for s in SEEDS]
              + [_so(grammar=ebnf, seed=s) for s in SEEDS])
    for p in params:
        p.max_tokens = 400
    outs = llm.generate(["x"] * len(params), params, use_tqdm=False)
    texts = [o.outputs[0].text for o in outs]
    assert all(o.outputs[0].finish_reason == "stop" for o in outs), texts
    for t in texts[:3]:
        assert re.fullmatch(regex, t), t
    for t in texts[3:6]:
        assert t in choices, t
    for t in texts[6:]:
        assert re.fullmatch(r"\((?:[1-9][0-9]?)(?:\+[1-9][0-9]?)*\)", t), t


@pytest.fixture(scope="module")
def hf(base_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    return model, AutoTokenizer.from_pretrained(str(base_dir))


@torch.no_grad()
def _hf_constrained_greedy(hf, prompt_ids, schema, max_tokens):
    import xgrammar as xgr

    model, tok = hf
    vocab = model.config.vocab_size
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(schema),
                                                              any_whitespace=False)
    matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=[tok.eos_token_id])
    words = xgr.allocate_token_bitmask(1, vocab)
    out: list[int] = []
    for _ in range(max_tokens):
        logits = model(torch.tensor([prompt_ids + out])).logits[0, -1].double()
        matcher.fill_next_token_bitmask(words)
        bits = (words[0, :, None].long() >> torch.arange(32)) & 1
        allowed = bits.flatten()[:vocab].bool()
        token = int(logits.masked_fill(~allowed, float("-inf")).argmax())
        out.append(token)
        assert matcher.accept_token(token)
        if matcher.is_terminated():
            break
    return out


def test_greedy_constrained_matches_transformers_and_unconstrained_rows_unchanged(llm, hf):
    _check_mixed_batch(llm, hf)


def test_mixed_batch_padded_to_piece_buckets(base_dir, hf):
    """Steps padded to token buckets (the piecewise CUDA-graph layout, run eagerly on the
    CPU): the sampled rows and their masks line up as in unpadded steps."""
    llm = LLM(str(base_dir), piecewise_cuda_graph_sizes=[8, 32], **ENGINE)
    _check_mixed_batch(llm, hf)


def _check_mixed_batch(llm, hf):
    tok = hf[1]
    prompts = ["The weather today", "Reply in JSON:", "one two three", "Once upon a time",
               "JSON please", "hello", "numbers: 1 2 3", "a b c"]
    plain = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, plain, use_tqdm=False)]
    schema = SCHEMAS[2]
    constrained = SamplingParams(temperature=0.0, max_tokens=120, structured_outputs=(
        StructuredOutputsParams(json=schema, disable_any_whitespace=True)))
    params = [constrained if i % 3 == 1 else plain for i in range(len(prompts))]
    mixed = llm.generate(prompts, params, use_tqdm=False)
    for i, out in enumerate(mixed):
        if i % 3 == 1:
            expected = _hf_constrained_greedy(hf, tok(prompts[i]).input_ids, schema, 120)
            assert list(out.outputs[0].token_ids) == expected
            jsonschema.validate(_loads(out.outputs[0].text), schema)
        else:
            assert list(out.outputs[0].token_ids) == list(alone[i])


def test_bad_grammar_ends_only_its_request(llm):
    bad = _so(regex="(unclosed")
    good = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outs = llm.generate(["x", "y"], [bad, good], use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error"
    assert "structured_outputs.regex" in str(outs[0].error)
    assert len(outs[1].outputs[0].token_ids) == 4
    assert llm.llm_engine.engine_core.structured.num_held == 0


def test_without_tokenizer_refused(base_dir):
    llm = LLM(str(base_dir), skip_tokenizer_init=True, **ENGINE)
    with pytest.raises(ValueError, match="skip_tokenizer_init"):
        llm.generate({"prompt_token_ids": [1, 2, 3]}, _so(regex="a+"), use_tqdm=False)


def test_preemption_keeps_the_matcher(base_dir):
    # 10 blocks of 8 tokens for 4 requests of up to ~60 tokens: requests are preempted and
    # recomputed mid-object; their matchers carry on
    llm = LLM(str(base_dir), num_kv_blocks=12, **ENGINE)
    params = [_so(s, json=SCHEMAS[4], disable_any_whitespace=True) for s in range(4)]
    outs = llm.generate(["Reply in JSON with many words:"] * 4, params, use_tqdm=False)
    assert llm.llm_engine.engine_core.kv_cache_stats().preemptions > 0
    for out in outs:
        assert out.outputs[0].finish_reason == "stop"
        jsonschema.validate(_loads(out.outputs[0].text), SCHEMAS[4])


def _gate_compiles(monkeypatch, spec: str) -> tuple[threading.Event, threading.Event]:
    """Compiles of ``spec`` wait for the first event (set it to let them go on), and set
    the second when they end; other specs compile as usual."""
    from manylora.structured import compiler as compiler_module

    gate, ended = threading.Event(), threading.Event()
    compile_one = compiler_module.compile_grammar

    def gated(compiler, key):
        if key[1] != spec:
            return compile_one(compiler, key)
        gate.wait()
        try:
            return compile_one(compiler, key)
        finally:
            ended.set()

    monkeypatch.setattr(compiler_module, "compile_grammar", gated)
    return gate, ended


def test_abort_while_compiling(base_dir, monkeypatch):
    # the abort drops the compile: its key leaves the cache, and the result of the compile
    # under way is not kept when it ends
    gate, ended = _gate_compiles(monkeypatch, "[a-z]{3}")
    llm = LLM(str(base_dir), **ENGINE)
    core = llm.llm_engine.engine_core
    compiler = core.structured.compiler
    engine = llm.llm_engine
    engine.add_request("held", "x", _so(regex="[a-z]{3}"))
    engine.add_request("plain", "y", SamplingParams(max_tokens=3, ignore_eos=True))
    while not any(o.finished for o in engine.step()):
        pass                               # "plain" finishes while "held" compiles
    assert core.structured.is_held("held") and "held" not in core.scheduler.requests
    assert compiler.cached(("regex", "[a-z]{3}", True))
    engine.abort_request(["held"])
    assert not compiler.cached(("regex", "[a-z]{3}", True))
    gate.set()
    assert ended.wait(60)
    assert not core.structured.is_held("held") and not core.has_unfinished_requests()
    assert not compiler.cached(("regex", "[a-z]{3}", True)) and compiler.cached_bytes == 0


def test_compile_time_limit_ends_only_its_request(base_dir, monkeypatch):
    # a compile that does not end within max_grammar_compile_seconds ends its request with
    # an error naming the field and the flag; the plain request in the same engine keeps
    # generating meanwhile and comes out as it does alone
    gate, ended = _gate_compiles(monkeypatch, "[a-z]{4}")
    llm = LLM(str(base_dir), max_grammar_compile_seconds=1.0, **ENGINE)
    engine = llm.llm_engine
    plain = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True,
                           output_kind=RequestOutputKind.CUMULATIVE)
    alone = llm.generate(["y"], plain, use_tqdm=False)[0].outputs[0].token_ids
    engine.add_request("slow", "x", _so(regex="[a-z]{4}"))
    engine.add_request("plain", "y", plain)
    plain_tokens_before_error, error, outputs = None, None, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out
            if out.request_id == "slow" and out.finished:
                error = out
                plain_tokens_before_error = len(outputs.get("plain").outputs[0].token_ids
                                                if "plain" in outputs else ())
    gate.set()
    assert error.outputs[0].finish_reason == "error"
    assert "structured_outputs.regex" in str(error.error)
    assert "--max-grammar-compile-seconds" in str(error.error)
    assert plain_tokens_before_error > 0                 # it ran while "slow" waited
    assert list(outputs["plain"].outputs[0].token_ids) == list(alone)
    assert ended.wait(60)
    compiler = engine.engine_core.structured.compiler
    # the failure is kept (the same spec does not take another thread), the result is not
    assert compiler.cached_bytes == len("[a-z]{4}")


def test_engine_process(base_dir, monkeypatch):
    # the core in its own process: StructuredOutputsParams and the compile error over IPC
    monkeypatch.setenv("MANYLORA_ENABLE_MULTIPROCESSING", "1")
    llm = LLM(str(base_dir), **ENGINE)
    try:
        outs = llm.generate(["x", "y"], [_so(1, choice=["alpha", "beta gamma"]),
                                         _so(regex="(")], use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    assert outs[0].outputs[0].text in ("alpha", "beta gamma")
    assert outs[1].outputs[0].finish_reason == "error"
    assert "structured_outputs.regex" in str(outs[1].error)


@pytest.mark.gpu
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_cuda_graphs_structured_and_plain_rows(base_dir, async_scheduling):
    """On CUDA with decode graphs (sampling runs outside them): constrained rows validate,
    unconstrained rows equal their solo outputs, and the eager engine agrees token for
    token on the greedy constrained row."""
    prompts = [f"prompt {i}" for i in range(12)]
    plain = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    greedy_so = SamplingParams(temperature=0.0, max_tokens=120, structured_outputs=(
        StructuredOutputsParams(json=SCHEMAS[2], disable_any_whitespace=True)))
    params = [greedy_so if i % 4 == 0 else
              _so(i, json=SCHEMAS[i % 5], disable_any_whitespace=True) if i % 4 == 1 else plain
              for i in range(len(prompts))]
    results = []
    for eager in (False, True):
        llm = LLM(str(base_dir), device="cuda", dtype="float32", max_num_seqs=16,
                  block_size=16, max_model_len=512, enforce_eager=eager,
                  async_scheduling=async_scheduling)
        if not eager:
            assert llm.llm_engine.engine_core.executor.runner.graphs is not None
        alone = llm.generate(prompts, plain, use_tqdm=False)
        mixed = llm.generate(prompts, params, use_tqdm=False)
        for i, out in enumerate(mixed):
            text = out.outputs[0].text
            if i % 4 in (0, 1):
                assert out.outputs[0].finish_reason == "stop", text
                schema = SCHEMAS[2] if i % 4 == 0 else SCHEMAS[i % 5]
                jsonschema.validate(_loads(text), schema)
            else:
                assert out.outputs[0].token_ids == alone[i].outputs[0].token_ids
        results.append([mixed[i].outputs[0].token_ids for i in range(0, len(prompts), 4)])
        llm.llm_engine.shutdown()
    assert results[0] == results[1]


def test_tensor_parallel(base_dir):
    """Two ranks (gloo on the CPU): rank 0 masks and samples; the constrained row validates
    and the plain row equals the one-rank engine's."""
    plain = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    constrained = _so(0, json=SCHEMAS[2], disable_any_whitespace=True)
    llm = LLM(str(base_dir), tensor_parallel_size=2, **ENGINE)
    try:
        outs = llm.generate(["Reply in JSON:", "hello"], [constrained, plain], use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    assert outs[0].outputs[0].finish_reason == "stop"
    jsonschema.validate(_loads(outs[0].outputs[0].text), SCHEMAS[2])
    one = LLM(str(base_dir), **ENGINE).generate(["hello"], plain, use_tqdm=False)[0]
    assert outs[1].outputs[0].token_ids == one.outputs[0].token_ids
