"""``echo`` + ``logprobs``, ``max_tokens: 0`` and ``prompt_logprobs`` on a real
``manylora serve``, through the official ``openai`` client and httpx, streamed and not.

Reference: transformers (+ peft for an adapter) on the same checkpoint in float32, teacher
forced on the prompt: ``log_softmax`` of the logits at position ``j - 1`` gives prompt token
``j``'s log-probability.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch
from server_helpers import BASE

TOL = 1e-4
PROMPT = "The quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def tokenizer(base_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(base_dir))


@pytest.fixture(scope="module")
def reference(base_dir, adapters):
    """``(model name, prompt ids) -> [P - 1, V]`` teacher-forced log-probabilities."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    models = {}

    def model(name):
        if name not in models:
            m = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32).eval()
            if name != BASE:
                m = PeftModel.from_pretrained(m, str(adapters[name])).eval()
            models[name] = m
        return models[name]

    @torch.no_grad()
    def run(name, ids):
        x = torch.tensor([ids])
        return model(name)(input_ids=x).logits[0, :-1].float().log_softmax(-1)

    return run


def _piece(tokenizer, tid):
    return tokenizer.convert_tokens_to_string([tokenizer.convert_ids_to_tokens(tid)])


def _check_prompt_part(lp, ids, ref, tokenizer, num_top):
    """The legacy logprobs' first ``len(ids)`` entries are the prompt's."""
    p = len(ids)
    assert lp.tokens[:p] == [_piece(tokenizer, t) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for j in range(1, p):
        assert lp.token_logprobs[j] == pytest.approx(float(ref[j - 1, ids[j]]), abs=TOL)
        top = lp.top_logprobs[j]
        assert _piece(tokenizer, ids[j]) in top
        best = ref[j - 1].topk(num_top).values
        assert max(top.values()) == pytest.approx(float(best[0]), abs=TOL)
    offsets = [0]
    for t in lp.tokens[:-1]:
        offsets.append(offsets[-1] + len(t))
    assert lp.text_offset == offsets


@pytest.mark.parametrize("model", [BASE, "ad0"])
def test_echo_logprobs_like_lm_eval(client, tokenizer, reference, model):
    """lm-eval's loglikelihood request: token-id prompt, max_tokens 1, logprobs 1, echo."""
    ids = tokenizer(PROMPT).input_ids
    res = client.completions.create(model=model, prompt=[ids], max_tokens=1, logprobs=1,
                                    echo=True, temperature=0)
    choice = res.choices[0]
    assert choice.text.startswith(tokenizer.decode(ids))
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) + 1
    ref = reference(model, ids)
    _check_prompt_part(lp, ids, ref, tokenizer, 1)
    assert lp.token_logprobs[-1] is not None and lp.top_logprobs[-1]
    assert res.usage.completion_tokens == 1


@pytest.mark.parametrize("model", [BASE, "ad1"])
def test_max_tokens_zero_with_echo_returns_the_prompt(client, tokenizer, reference, model):
    ids = tokenizer(PROMPT).input_ids
    res = client.completions.create(model=model, prompt=PROMPT, max_tokens=0, logprobs=3,
                                    echo=True)
    choice = res.choices[0]
    assert choice.text == PROMPT
    assert len(choice.logprobs.tokens) == len(ids)
    _check_prompt_part(choice.logprobs, ids, reference(model, ids), tokenizer, 3)
    assert res.usage.completion_tokens == 0
    plain = client.completions.create(model=model, prompt=PROMPT, max_tokens=0, echo=True)
    assert plain.choices[0].text == PROMPT and plain.choices[0].logprobs is None


def test_max_tokens_zero_without_echo_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=BASE, prompt=PROMPT, max_tokens=0)
    assert e.value.body["param"] == "max_tokens"


@pytest.mark.parametrize("max_tokens", [0, 4])
def test_streamed_echo_leads_with_the_prompt(served, tokenizer, reference, max_tokens):
    ids = tokenizer(PROMPT).input_ids
    body = {"model": BASE, "prompt": PROMPT, "max_tokens": max_tokens, "logprobs": 2,
            "echo": True, "stream": True, "temperature": 0, "ignore_eos": True}
    chunks = []
    with httpx.stream("POST", f"{served[1]}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    first = chunks[0]["choices"][0]
    assert first["text"].startswith(PROMPT)
    lp = first["logprobs"]
    tokens = [t for c in chunks for t in (c["choices"][0]["logprobs"] or {}).get("tokens", [])]
    assert len(tokens) == len(ids) + max_tokens
    ref = reference(BASE, ids)
    assert lp["token_logprobs"][0] is None
    for j in range(1, len(ids)):
        assert lp["token_logprobs"][j] == pytest.approx(float(ref[j - 1, ids[j]]), abs=TOL)
    offsets = [o for c in chunks for o in (c["choices"][0]["logprobs"] or {})
               .get("text_offset", [])]
    assert offsets == sorted(offsets) and offsets[0] == 0
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert text.startswith(PROMPT) and (max_tokens or text == PROMPT)


def test_prompt_logprobs_completions_and_chat(client, tokenizer, reference):
    ids = tokenizer(PROMPT).input_ids
    res = client.completions.create(model="ad2", prompt=PROMPT, max_tokens=2,
                                    extra_body={"prompt_logprobs": 2})
    plp = res.choices[0].model_extra["prompt_logprobs"]
    ref = reference("ad2", ids)
    assert len(plp) == len(ids) and plp[0] is None
    for j in range(1, len(ids)):
        entry = plp[j][str(ids[j])]
        assert entry["logprob"] == pytest.approx(float(ref[j - 1, ids[j]]), abs=TOL)
        assert entry["decoded_token"] == _piece(tokenizer, ids[j])
        assert len(plp[j]) in (2, 3)
    chat = client.chat.completions.create(
        model=BASE, messages=[{"role": "user", "content": "Hello there"}], max_tokens=2,
        extra_body={"prompt_logprobs": 0})
    plp = chat.model_extra["prompt_logprobs"]
    assert plp[0] is None and all(len(d) == 1 for d in plp[1:])
    chat_ids = [int(next(iter(d))) for d in plp[1:]]
    ref = reference(BASE, [0] + chat_ids)   # the entries' own ids: the templated prompt
    for j, tid in enumerate(chat_ids[1:], start=2):
        assert plp[j][str(tid)]["logprob"] == pytest.approx(float(ref[j - 1, tid]), abs=TOL)


@pytest.mark.parametrize("body, param", [
    ({"prompt_logprobs": 2, "stream": True}, "prompt_logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": [[-2040, 7415, 351272644670352, -393, 3954828175]], "echo": True},
     "prompt"),
    ({"prompt": [[1, 2, 10**9]], "echo": True, "logprobs": 1, "max_tokens": 0}, "prompt"),
    ({"prompt": [5, -3], "echo": False}, "prompt"),
])
def test_bad_prompt_logprob_requests_are_400s(served, body, param):
    r = httpx.post(f"{served[1]}/v1/completions",
                   json={"model": BASE, "prompt": "hi", **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


@pytest.mark.parametrize("stream", [False, True])
def test_chat_echo_prepends_the_final_assistant_message(client, stream):
    """vLLM's chat ``echo``: with ``continue_final_message`` the reply continues the last
    (assistant) message, which leads the content; a last user message is not echoed."""
    messages = [{"role": "user", "content": "Name a colour."},
                {"role": "assistant", "content": "My favourite colour is"}]
    kw = dict(model=BASE, messages=messages, max_tokens=3, temperature=0,
              extra_body={"echo": True, "continue_final_message": True,
                          "add_generation_prompt": False})
    plain = client.chat.completions.create(
        model=BASE, messages=messages, max_tokens=3, temperature=0,
        extra_body={"continue_final_message": True, "add_generation_prompt": False})
    if stream:
        parts = [c.choices[0].delta.content or ""
                 for c in client.chat.completions.create(stream=True, **kw) if c.choices]
        content = "".join(parts)
        assert parts[1] == messages[-1]["content"], "the echo comes in a chunk of its own"
    else:
        content = client.chat.completions.create(**kw).choices[0].message.content
    assert content == messages[-1]["content"] + plain.choices[0].message.content
    user_last = client.chat.completions.create(
        model=BASE, messages=messages[:1], max_tokens=3, temperature=0,
        extra_body={"echo": True})
    again = client.chat.completions.create(model=BASE, messages=messages[:1], max_tokens=3,
                                           temperature=0)
    assert user_last.choices[0].message.content == again.choices[0].message.content


def test_streamed_echo_with_the_openai_client(client, tokenizer, reference):
    ids = tokenizer(PROMPT).input_ids
    chunks = list(client.completions.create(model="ad0", prompt=[ids], max_tokens=2,
                                            logprobs=1, echo=True, temperature=0,
                                            stream=True))
    first = chunks[0].choices[0]
    assert first.text.startswith(tokenizer.decode(ids))
    ref = reference("ad0", ids)
    lp = first.logprobs
    assert lp.token_logprobs[0] is None
    np_ref = [float(ref[j - 1, ids[j]]) for j in range(1, len(ids))]
    assert lp.token_logprobs[1:len(ids)] == pytest.approx(np_ref, abs=TOL)
