"""``manylora serve`` driven by the official ``openai`` client: completions and chat,
streamed and not, several adapters and the base at once, logprobs, n, stop strings, and
adapters loaded, used, unloaded and re-loaded while other streams run.

Reference: the offline ``LLM`` with the same engine arguments, checkpoint and adapters
(itself checked token for token against transformers + peft in test_peft_equivalence.py).
"""

from __future__ import annotations

import math
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from server_helpers import BASE, ENGINE

from manylora import LLM, LoRARequest, SamplingParams
from manylora.testing import make_peft_adapter

PROMPTS = [("The quick brown fox", "ad0"), ("SELECT name FROM users", "ad1"),
           ("Low-rank adaptation adds", None), ("A large language model", "ad2"),
           ("def add(a, b):", "ad3"), ("The quick brown fox", None)]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def offline(base_dir, adapters):
    """The offline engine with the server's arguments and the same adapter ids."""
    llm = LLM(str(base_dir), **ENGINE)
    ids = {name: i + 1 for i, name in enumerate(("ad0", "ad1", "ad2", "ad3"))}

    def run(prompts, names, params):
        loras = [None if n is None else LoRARequest(n, ids.get(n, 50), str(adapters[n]))
                 for n in names]
        return llm.generate(prompts, params, loras, use_tqdm=False)

    return llm, run


def _greedy(**kw):
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, **kw)


def _token_ids(logprobs_tokens):
    return [int(t.removeprefix("token_id:")) for t in logprobs_tokens]


def test_models_lists_base_and_adapters_with_parent(client, base_dir):
    models = {m.id: m for m in client.models.list().data}
    assert set(models) >= {BASE, "ad0", "ad1", "ad2", "ad3"}
    assert models[BASE].parent is None and models[BASE].root == str(base_dir)
    for name in ("ad0", "ad1", "ad2", "ad3"):
        assert models[name].parent == BASE
    assert client.models.retrieve("ad1").parent == BASE
    assert client.models.retrieve(BASE).id == BASE
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


def test_completions_across_adapters_at_once_equal_offline(client, offline):
    _, run = offline
    refs = run([p for p, _ in PROMPTS], [n for _, n in PROMPTS], _greedy())

    def ask(item):
        prompt, name = item
        return client.completions.create(
            model=name or BASE, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0,
            logprobs=0, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        answers = list(pool.map(ask, PROMPTS))
    for answer, ref, (_, name) in zip(answers, refs, PROMPTS):
        choice = answer.choices[0]
        assert answer.model == (name or BASE)
        assert choice.text == ref.outputs[0].text
        assert _token_ids(choice.logprobs.tokens) == ref.outputs[0].token_ids
        assert choice.finish_reason == "length"
        assert answer.usage.prompt_tokens == len(ref.prompt_token_ids)
        assert answer.usage.completion_tokens == MAX_TOKENS
        assert answer.usage.total_tokens == len(ref.prompt_token_ids) + MAX_TOKENS


def test_streamed_completions_equal_offline_with_usage(client, offline):
    _, run = offline
    refs = run([p for p, _ in PROMPTS], [n for _, n in PROMPTS], _greedy())

    def ask(item):
        prompt, name = item
        chunks = list(client.completions.create(
            model=name or BASE, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0,
            stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True}))
        return chunks

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        streams = list(pool.map(ask, PROMPTS))
    for chunks, ref in zip(streams, refs):
        body, last = chunks[:-1], chunks[-1]
        assert "".join(c.choices[0].text for c in body) == ref.outputs[0].text
        assert [c.choices[0].finish_reason for c in body][-1] == "length"
        assert all(c.choices[0].finish_reason is None for c in body[:-1])
        assert all(c.usage is None for c in body)
        assert last.choices == []
        assert last.usage.prompt_tokens == len(ref.prompt_token_ids)
        assert last.usage.completion_tokens == MAX_TOKENS


def _chat_prompt(llm, messages):
    tok = llm.get_tokenizer()
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return {"prompt_token_ids": tok(text, add_special_tokens=False).input_ids}


@pytest.mark.parametrize("stream", [False, True])
def test_chat_equals_offline_on_the_chat_template(client, offline, stream):
    llm, run = offline
    conversations = [
        ([{"role": "system", "content": "You write SQL."},
          {"role": "user", "content": "All users, please."}], "ad1"),
        ([{"role": "user", "content": [{"type": "text", "text": "Say hello."}]}], None),
        ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
          {"role": "user", "content": "Tell me more"}], "ad3")]
    refs = run([_chat_prompt(llm, [{**m, "content": m["content"] if isinstance(
        m["content"], str) else m["content"][0]["text"]} for m in msgs])
        for msgs, _ in conversations], [n for _, n in conversations], _greedy())

    def ask(item):
        messages, name = item
        reply = client.chat.completions.create(
            model=name or BASE, messages=messages, max_tokens=MAX_TOKENS, temperature=0.0,
            stream=stream, extra_body={"ignore_eos": True})
        if not stream:
            return reply.choices[0].message.content, reply.choices[0].finish_reason
        chunks = list(reply)
        assert chunks[0].choices[0].delta.role == "assistant"
        return ("".join(c.choices[0].delta.content or "" for c in chunks),
                chunks[-1].choices[0].finish_reason)

    with ThreadPoolExecutor(len(conversations)) as pool:
        answers = list(pool.map(ask, conversations))
    for (text, finish), ref in zip(answers, refs):
        assert text == ref.outputs[0].text
        assert finish == "length"


def test_logprobs_equal_offline(client, offline):
    _, run = offline
    ref = run(["SELECT name FROM users"], ["ad1"], _greedy(logprobs=3))[0].outputs[0]
    answer = client.completions.create(
        model="ad1", prompt="SELECT name FROM users", max_tokens=MAX_TOKENS, temperature=0.0,
        logprobs=3, extra_body={"ignore_eos": True})
    lp = answer.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == MAX_TOKENS
    for position, (value, top, ref_pos) in enumerate(zip(lp.token_logprobs, lp.top_logprobs,
                                                         ref.logprobs)):
        sampled = ref_pos[ref.token_ids[position]]
        assert math.isclose(value, sampled.logprob, rel_tol=1e-5, abs_tol=1e-5)
        assert len(top) >= 3
        best = max(ref_pos.values(), key=lambda x: x.logprob)
        assert math.isclose(max(top.values()), best.logprob, rel_tol=1e-5, abs_tol=1e-5)
    chat = client.chat.completions.create(
        model="ad1", messages=[{"role": "user", "content": "hello"}], max_tokens=4,
        temperature=0.0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.logprob <= 0
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob <= entry.top_logprobs[0].logprob + 1e-6


def test_n_seed_and_stop(client, offline):
    answer = client.completions.create(model="ad0", prompt="The quick brown fox",
                                       max_tokens=MAX_TOKENS, temperature=0.0, n=3,
                                       extra_body={"ignore_eos": True})
    assert sorted(c.index for c in answer.choices) == [0, 1, 2]
    assert len({c.text for c in answer.choices}) == 1       # greedy: all the same
    assert answer.usage.completion_tokens == 3 * MAX_TOKENS
    a, b = (client.completions.create(model=BASE, prompt="The quick", max_tokens=MAX_TOKENS,
                                      temperature=1.0, seed=7, n=2) for _ in range(2))
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    _, run = offline
    full = run(["The quick brown fox"], ["ad0"], _greedy())[0].outputs[0].text
    stop = full[3:6]
    cut = client.completions.create(model="ad0", prompt="The quick brown fox",
                                    max_tokens=MAX_TOKENS, temperature=0.0, stop=[stop],
                                    extra_body={"ignore_eos": True})
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == full[:full.index(stop)]
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="ad0", prompt="The quick brown fox", max_tokens=MAX_TOKENS, temperature=0.0,
        stop=[stop], stream=True, extra_body={"ignore_eos": True}))
    assert streamed == cut.choices[0].text


def test_load_use_unload_reload_while_streams_run(served, client, offline, adapters):
    _, run = offline
    ref_ad5 = run(["def add(a, b):"], ["ad5"], _greedy())[0].outputs[0].text
    long = dict(max_tokens=60, temperature=0.0, extra_body={"ignore_eos": True})
    results: dict[str, str] = {}

    def background(name):
        stream = client.completions.create(model=name, prompt="The quick", stream=True, **long)
        results[name] = "".join(c.choices[0].text for c in stream if c.choices)

    threads = [threading.Thread(target=background, args=(n,)) for n in ("ad0", BASE)]
    for t in threads:
        t.start()
    http = httpx.Client(base_url=served[1])
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "ad5",
                                                 "lora_path": str(adapters["ad5"])})
    assert r.status_code == 200, r.text
    assert "ad5" in {m.id for m in client.models.list().data}
    first = client.completions.create(model="ad5", prompt="def add(a, b):",
                                      max_tokens=MAX_TOKENS, temperature=0.0,
                                      extra_body={"ignore_eos": True})
    assert first.choices[0].text == ref_ad5
    # unload while a request of it is in flight: that request finishes with it
    stream = client.completions.create(model="ad5", prompt="def add(a, b):", stream=True,
                                       **long)
    got = [next(stream)]
    r = http.post("/v1/unload_lora_adapter", json={"lora_name": "ad5"})
    assert r.status_code == 200, r.text
    got += list(stream)
    assert got[-1].choices[0].finish_reason == "length"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="ad5", prompt="x", max_tokens=2)
    assert "ad5" not in {m.id for m in client.models.list().data}
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "ad5", "lora_path": "ad5"})
    assert r.status_code == 200, r.text                   # relative to --lora-root
    again = client.completions.create(model="ad5", prompt="def add(a, b):",
                                      max_tokens=MAX_TOKENS, temperature=0.0,
                                      extra_body={"ignore_eos": True})
    assert again.choices[0].text == ref_ad5
    for t in threads:
        t.join(60)
    assert set(results) == {"ad0", BASE}
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "ad5"}).status_code == 200


def test_models_show_an_activated_adapters_invocation(client, served, base_dir, lora_root,
                                                      offline):
    """An aLoRA adapter loaded at run time is listed with its ``alora_invocation_tokens``
    (plain adapters and the base model with none), and serves as the offline engine does."""
    invocation = [17, 40, 33]
    path = make_peft_adapter(base_dir, lora_root / "activated", r=4, seed=60,
                             target_modules=["q_proj", "v_proj"],
                             alora_invocation_tokens=invocation)
    http = httpx.Client(base_url=served[1])
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "activated",
                                                 "lora_path": str(path)})
    assert r.status_code == 200, r.text
    try:
        models = {m["id"]: m for m in http.get("/v1/models").json()["data"]}
        assert models["activated"]["alora_invocation_tokens"] == invocation
        assert models["ad0"]["alora_invocation_tokens"] is None
        assert models[BASE]["alora_invocation_tokens"] is None
        prompt = [5, 9, 12] + invocation + [61, 8]
        got = client.completions.create(model="activated", prompt=prompt,
                                        max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0,
                                        extra_body={"ignore_eos": True,
                                                    "return_tokens_as_token_ids": True})
        llm, _ = offline
        ref = llm.generate([{"prompt_token_ids": prompt}], _greedy(),
                           LoRARequest("activated", 60, str(path)), use_tqdm=False)
        assert _token_ids(got.choices[0].logprobs.tokens) == ref[0].outputs[0].token_ids
    finally:
        http.post("/v1/unload_lora_adapter", json={"lora_name": "activated"})
