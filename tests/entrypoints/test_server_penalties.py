"""The penalties, ``logit_bias`` and ``allowed_token_ids`` through ``manylora serve`` (the
official ``openai`` client on loopback): the server passes them to the engine unchanged.

Reference: the offline ``LLM`` with the same engine arguments and the same
``SamplingParams`` (whose penalties tests/engine/test_penalties.py compares to a torch
reference on the same logits). Bad values are 400s whose ``param`` names the field.
"""

from __future__ import annotations

import httpx
import openai
import pytest
from server_helpers import BASE, ENGINE, running_server

from manylora import LLM, LoRARequest, SamplingParams

PROMPT = "The quick brown fox jumps over"
MAX_TOKENS = 12
PENALTIES = dict(presence_penalty=1.5, frequency_penalty=1.0, repetition_penalty=1.8)


@pytest.fixture(scope="module")
def server(base_dir, adapters):
    with running_server(base_dir, lora_modules=[f"ad0={adapters['ad0']}"]) as (srv, url):
        yield srv, url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server[1]}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline(base_dir, adapters):
    llm = LLM(str(base_dir), **ENGINE)

    def run(prompt, name, **params):
        lora = None if name is None else LoRARequest(name, 1, str(adapters[name]))
        sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, **params)
        return llm.generate([prompt], sp, [lora], use_tqdm=False)[0].outputs[0].token_ids

    return llm, run


def _ids(choice) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in choice.logprobs.tokens]


def _complete(client, model, **fields):
    extra = {"ignore_eos": True, "return_tokens_as_token_ids": True}
    extra.update({k: fields.pop(k) for k in ("repetition_penalty", "allowed_token_ids")
                  if k in fields})
    fields.setdefault("temperature", 0.0)
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                     logprobs=0, extra_body=extra, **fields)


@pytest.mark.parametrize("model", [BASE, "ad0"])
def test_penalties_change_greedy_output_as_offline(client, offline, model):
    _, run = offline
    name = None if model == BASE else model
    plain, penalized = run(PROMPT, name), run(PROMPT, name, **PENALTIES)
    assert plain != penalized            # the penalties matter on this prompt
    answer = _complete(client, model, **PENALTIES)
    assert _ids(answer.choices[0]) == penalized


def test_each_penalty_alone_equals_offline(client, offline):
    _, run = offline
    for name, value in PENALTIES.items():
        assert _ids(_complete(client, BASE, **{name: value}).choices[0]) == run(
            PROMPT, None, **{name: value}), name


def test_logit_bias_forces_a_token_in_completions_and_chat(client):
    forced = 42
    answer = _complete(client, BASE, logit_bias={str(forced): 100})
    assert _ids(answer.choices[0]) == [forced] * MAX_TOKENS
    chat = client.chat.completions.create(
        model="ad0", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
        temperature=0.0, logprobs=True, logit_bias={str(forced): 100},
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    assert [t.token for t in chat.choices[0].logprobs.content] == [f"token_id:{forced}"] * 5


def test_allowed_token_ids_restrict_sampled_output(client, offline):
    _, run = offline
    allowed = [7, 11, 300]
    answer = _complete(client, BASE, temperature=1.0, seed=3, allowed_token_ids=allowed)
    ids = _ids(answer.choices[0])
    assert len(ids) == MAX_TOKENS and set(ids) <= set(allowed)
    assert _ids(_complete(client, BASE, allowed_token_ids=allowed).choices[0]) == run(
        PROMPT, None, allowed_token_ids=allowed)


@pytest.mark.parametrize("field, value", [
    ("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0),
    ("repetition_penalty", -1.0), ("logit_bias", {"5": 101}), ("logit_bias", {"abc": 1}),
    ("logit_bias", {"10000000": 1}), ("logit_bias", {"-1": 1}),
    ("allowed_token_ids", []), ("allowed_token_ids", [3, 10000000]),
    ("allowed_token_ids", [-4]),
])
@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_bad_values_are_400_naming_the_field(server, field, value, route):
    body = {"model": BASE, "max_tokens": 2, field: value}
    body.update({"prompt": "x"} if route == "completions"
                else {"messages": [{"role": "user", "content": "x"}]})
    r = httpx.post(f"{server[1]}/v1/{route}", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field, r.text
