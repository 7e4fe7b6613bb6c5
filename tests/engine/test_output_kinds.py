"""The front over the core's deltas: ``SamplingParams.output_kind`` (vLLM's
``RequestOutputKind``) and the split of stop rules between the core (EOS, stop token ids,
length) and the front (stop strings).

References: the text is checked against the tokenizer's own ``decode`` of the token ids;
the token ids of the three kinds against each other and, for stop strings, against a run
without them (the same greedy sequence, cut).
"""

from __future__ import annotations

import dataclasses

import pytest

from manylora import LLM, LoRARequest, SamplingParams
from manylora.sampling_params import RequestOutputKind

PROMPTS = ["The quick brown fox", "SELECT name FROM users WHERE", "Hello", "def add(a, b):"]
KINDS = list(RequestOutputKind)


@pytest.fixture(scope="module")
def llm(demo_set):
    return LLM(str(demo_set.base_dir), device="cpu", max_loras=2, max_lora_rank=32,
               num_kv_blocks=128, block_size=4)


def _run(engine, params, loras) -> dict[str, list]:
    """Every output of every request, in step order, keyed by request id."""
    ids = [engine.add_request(None, p, params, lora) for p, lora in zip(PROMPTS, loras)]
    seen: dict[str, list] = {rid: [] for rid in ids}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out)
    return seen


def _merged(outs: list, kind: RequestOutputKind) -> tuple[list[int], str, list | None]:
    """The final token ids, text and logprobs a caller of ``kind`` ends up with."""
    if kind is not RequestOutputKind.DELTA:
        last = outs[-1].outputs[0]
        return last.token_ids, last.text, last.logprobs
    tokens, text, lps = [], "", []
    for out in outs:
        tokens += out.outputs[0].token_ids
        text += out.outputs[0].text
        lps += out.outputs[0].logprobs or []
    return tokens, text, lps


def test_every_kind_ends_with_the_same_output(llm, demo_set):
    sql = LoRARequest("sql", 1, str(demo_set.adapters["sql"]))
    loras = [None, sql, None, sql]
    base = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True, logprobs=2)
    runs = {kind: _run(llm.llm_engine, dataclasses.replace(base, output_kind=kind), loras)
            for kind in KINDS}
    tok = llm.get_tokenizer()
    ref = runs[RequestOutputKind.CUMULATIVE]
    for kind, run in runs.items():
        for rid_ref, rid in zip(ref, run):
            outs = run[rid]
            assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
            if kind is RequestOutputKind.FINAL_ONLY:
                assert len(outs) == 1
            else:
                assert len(outs) == 9                 # one per generated token
            tokens, text, lps = _merged(outs, kind)
            ref_tokens, _, ref_lps = _merged(ref[rid_ref], RequestOutputKind.CUMULATIVE)
            assert tokens == ref_tokens and len(tokens) == 9
            assert text == tok.decode(tokens, skip_special_tokens=True)
            assert [list(d) for d in lps] == [list(d) for d in ref_lps]
            final = outs[-1].outputs[0]
            assert final.finish_reason == "length"
            assert final.cumulative_logprob == pytest.approx(
                sum(d[t].logprob for d, t in zip(lps, tokens)))


def test_delta_outputs_carry_only_the_new_token(llm):
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    run = _run(llm.llm_engine, params, [None] * len(PROMPTS))
    for outs in run.values():
        assert [len(o.outputs[0].token_ids) for o in outs] == [1] * 5


@pytest.mark.parametrize("kind", KINDS)
def test_stop_string_found_by_the_front_ends_the_request_in_the_core(llm, kind):
    engine = llm.llm_engine
    free = llm.generate(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=24,
                                                   ignore_eos=True), use_tqdm=False)[0]
    text = free.outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert stop.strip(), text
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop],
                            output_kind=kind)
    rid = engine.add_request(None, PROMPTS[1], params)
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(o for o in engine.step() if o.request_id == rid)
    tokens, got, _ = _merged(outs, kind)
    assert got == text[:text.index(stop)]
    assert outs[-1].outputs[0].finish_reason == "stop"
    assert outs[-1].outputs[0].stop_reason == stop
    # the core ran the request no further than the token that completed the stop string
    assert tokens == free.outputs[0].token_ids[:len(tokens)]
    assert len(tokens) < 24
    assert engine.kv_cache_stats().used_blocks == 0


def test_session_turn_ended_by_a_stop_string_keeps_its_history(llm):
    engine = llm.llm_engine
    first = llm.generate(PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=16,
                                                    ignore_eos=True), use_tqdm=False)[0]
    text = first.outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop=[stop])
    (turn,) = llm.generate(PROMPTS[2], params, use_tqdm=False, session_id="s")
    assert turn.outputs[0].finish_reason == "stop"
    tok = llm.get_tokenizer()
    follow = tok(" and").input_ids
    (nxt,) = llm.generate({"prompt_token_ids": follow}, params, use_tqdm=False,
                          session_id="s")
    # the next turn starts from the whole first turn: its prompt and every token it sampled
    assert nxt.prompt_token_ids == turn.prompt_token_ids + turn.outputs[0].token_ids + follow
    assert llm.end_session("s")
    assert engine.kv_cache_stats().used_blocks == 0


def test_output_kind_must_be_a_request_output_kind():
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind="delta")


def test_delta_outputs_never_carry_part_of_a_stop_string(llm):
    engine = llm.llm_engine
    free = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=24,
                                                   ignore_eos=True), use_tqdm=False)[0]
    text = free.outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert len(stop.strip()) == 3, text
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop],
                            output_kind=RequestOutputKind.DELTA)
    rid = engine.add_request(None, PROMPTS[0], params)
    sent = ""
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id != rid:
                continue
            sent += out.outputs[0].text
            if not out.finished:
                # what was sent so far never reaches into the stop string's first character
                assert len(sent) <= text.index(stop)
    assert sent == text[:text.index(stop)]


def test_requests_submitted_in_one_message_reach_the_core_together(llm):
    engine = llm.llm_engine
    core = engine.engine_core
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    with engine.one_message():
        ids = [engine.submit_request(None, p, params) for p in PROMPTS]
        with pytest.raises(ValueError, match="integers"):          # checked on its own
            engine.submit_request(None, {"prompt_token_ids": ["x"]}, params)
        engine.abort_request(ids[1])                    # never sent: dropped
        assert not core.scheduler.requests              # held until the block ends
    assert set(core.scheduler.requests) == {ids[0], ids[2], ids[3]}
    assert engine.wait_added([ids[0], ids[2], ids[3]]) == dict.fromkeys(
        [ids[0], ids[2], ids[3]])
    finished = {o.request_id for o in engine.generate_all()}
    assert finished == {ids[0], ids[2], ids[3]}
    assert engine.take_added() == []            # no answer left over
