"""vLLM's request extras and server flags through ``manylora serve`` (the official
``openai`` client on loopback), each against an independent reference: the checkpoint's
Hugging Face tokenizer for prompt ids, the offline ``LLM`` for outputs.

``truncate_prompt_tokens`` / ``truncation_side``, ``add_special_tokens``,
``return_token_ids`` (streamed and not), chat ``echo``, ``request_id``,
``--generation-config`` (a folder's ``generation_config.json`` as defaults, vLLM's
precedence) and ``--max-logprobs``.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from server_helpers import BASE, ENGINE, running_server

from manylora import LLM, SamplingParams
from manylora.entrypoints.openai.generation_config import generation_defaults
from manylora.entrypoints.openai.launcher import create_server
from manylora.entrypoints.openai.serve_args import serve_parser

PROMPT = "The quick brown fox jumps over the lazy dog"
GREEDY = {"temperature": 0.0, "max_tokens": 5}
EXTRA = {"ignore_eos": True}


@pytest.fixture(scope="module")
def server(base_dir):
    with running_server(base_dir) as (srv, url):
        yield srv, url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server[1]}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline(base_dir):
    llm = LLM(str(base_dir), **ENGINE)

    def run(ids, **params):
        sp = SamplingParams(**{"temperature": 0.0, "max_tokens": 5, "ignore_eos": True,
                               **params})
        return llm.generate({"prompt_token_ids": ids}, sp, use_tqdm=False)[0].outputs[0]

    return llm.get_tokenizer(), run


@pytest.mark.parametrize("side", [None, "left", "right"])
def test_truncate_prompt_tokens_keeps_the_last_or_first_k(client, offline, side):
    tok, run = offline
    ids = tok(PROMPT).input_ids
    extra = {**EXTRA, "truncate_prompt_tokens": 4, "return_token_ids": True}
    if side is not None:
        extra["truncation_side"] = side
    answer = client.completions.create(model=BASE, prompt=PROMPT, extra_body=extra, **GREEDY)
    kept = ids[:4] if side == "right" else ids[-4:]
    choice = answer.choices[0]
    assert answer.usage.prompt_tokens == 4
    assert choice.model_extra["prompt_token_ids"] == kept
    assert choice.model_extra["token_ids"] == run(kept).token_ids


def test_truncate_prompt_tokens_bounds_and_chat(client, offline):
    tok, _ = offline
    ids = tok(PROMPT).input_ids
    same = client.completions.create(model=BASE, prompt=PROMPT, **GREEDY,
                                     extra_body={**EXTRA, "truncate_prompt_tokens": -1})
    assert same.usage.prompt_tokens == len(ids)        # -1: the context length
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=BASE, prompt=PROMPT, **GREEDY,
                                  extra_body={"truncate_prompt_tokens": 10_000})
    assert info.value.body["param"] == "truncate_prompt_tokens"
    chat = client.chat.completions.create(
        model=BASE, messages=[{"role": "user", "content": PROMPT}], **GREEDY,
        extra_body={**EXTRA, "truncate_prompt_tokens": 3})
    assert chat.usage.prompt_tokens == 3


def test_add_special_tokens(client, offline):
    tok, _ = offline
    without = client.completions.create(model=BASE, prompt=PROMPT, **GREEDY,
                                        extra_body={**EXTRA, "add_special_tokens": False,
                                                    "return_token_ids": True})
    assert without.choices[0].model_extra["prompt_token_ids"] == tok(
        PROMPT, add_special_tokens=False).input_ids
    messages = [{"role": "user", "content": "Hi"}]
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    for flag, ids in [(False, tok(rendered, add_special_tokens=False).input_ids),
                      (True, tok(rendered, add_special_tokens=True).input_ids)]:
        chat = client.chat.completions.create(
            model=BASE, messages=messages, **GREEDY,
            extra_body={**EXTRA, "add_special_tokens": flag, "return_token_ids": True})
        assert chat.model_extra["prompt_token_ids"] == ids
    assert ids[0] == tok.bos_token_id and ids[1] == tok.bos_token_id   # template BOS + added


def _events(text: str) -> list[dict]:
    return [json.loads(e.removeprefix("data: ")) for e in text.split("\n\n")
            if e.startswith("data: {")]


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_return_token_ids_streamed_and_not(server, offline, route):
    tok, run = offline
    if route == "completions":
        body = {"prompt": PROMPT}
        ids = tok(PROMPT).input_ids
    else:
        messages = [{"role": "user", "content": "Hello"}]
        body = {"messages": messages}
        ids = tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                  add_special_tokens=False).input_ids
    body.update(model=BASE, n=2, return_token_ids=True, **GREEDY, **EXTRA)
    expected = run(ids).token_ids
    plain = httpx.post(f"{server[1]}/v1/{route}", json=body, timeout=60).json()
    for choice in plain["choices"]:
        assert choice["token_ids"] == expected
    if route == "completions":
        assert [c["prompt_token_ids"] for c in plain["choices"]] == [ids, ids]
    else:
        assert plain["prompt_token_ids"] == ids
    chunks = _events(httpx.post(f"{server[1]}/v1/{route}", json={**body, "stream": True},
                                timeout=60).text)
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert [t for c in mine for t in c.get("token_ids") or []] == expected
        if route == "completions":
            assert mine[0]["prompt_token_ids"] == ids
            assert all("prompt_token_ids" not in c for c in mine[1:])
    if route != "completions":
        assert chunks[0]["prompt_token_ids"] == ids
        assert all("prompt_token_ids" not in c for c in chunks[1:])
    without = httpx.post(f"{server[1]}/v1/{route}", json={**body, "return_token_ids": False},
                         timeout=60).json()
    assert "token_ids" not in without["choices"][0]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_echo_prepends_the_last_assistant_message(client, stream):
    history = [{"role": "user", "content": "Name a colour"},
               {"role": "assistant", "content": "Blue, and"}]

    def ask(**extra):
        reply = client.chat.completions.create(model=BASE, messages=history, stream=stream,
                                               **GREEDY, extra_body={**EXTRA, **extra})
        if not stream:
            return reply.choices[0].message.content
        return "".join(c.choices[0].delta.content or "" for c in reply)

    assert ask(echo=True) == "Blue, and" + ask()
    user_last = client.chat.completions.create(
        model=BASE, messages=history[:1], **GREEDY, extra_body={**EXTRA, "echo": True})
    plain = client.chat.completions.create(model=BASE, messages=history[:1], **GREEDY,
                                           extra_body=EXTRA)
    assert user_last.choices[0].message.content == plain.choices[0].message.content


def test_request_id_names_the_response_and_may_repeat(client):
    def ask(_):
        return client.completions.create(model=BASE, prompt=PROMPT, **GREEDY,
                                         extra_body={"request_id": "job-7"})

    with ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(ask, range(3)))
    assert [a.id for a in answers] == ["cmpl-job-7"] * 3
    chat = client.chat.completions.create(model=BASE, messages=[{"role": "user",
                                                                 "content": "x"}],
                                          **GREEDY, extra_body={"request_id": "job-8"})
    assert chat.id == "chatcmpl-job-8"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=BASE, prompt="x", extra_body={"request_id": "a\nb"})
    assert info.value.body["param"] == "request_id"


def test_generation_config_defaults_and_precedence(base_dir, offline, tmp_path):
    tok, run = offline
    folder = tmp_path / "gen"
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps(
        {"repetition_penalty": 1.7, "max_new_tokens": 4, "temperature": 0.5, "top_k": 7}))
    assert generation_defaults(str(folder), str(base_dir)) == {
        "repetition_penalty": 1.7, "max_tokens": 4, "temperature": 0.5, "top_k": 7}
    assert generation_defaults("vllm", str(folder)) == {}
    assert generation_defaults("auto", str(folder)) == generation_defaults(str(folder), "x")
    ids = tok(PROMPT).input_ids
    with running_server(base_dir, "--generation-config", str(folder)) as (_, url):
        c = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        # temperature from the request, repetition penalty from the file, max_tokens capped
        answer = c.completions.create(model=BASE, prompt=PROMPT, temperature=0.0,
                                      max_tokens=10, extra_body={**EXTRA,
                                                                 "return_token_ids": True})
        got = answer.choices[0].model_extra["token_ids"]
        assert got == run(ids, repetition_penalty=1.7, max_tokens=4).token_ids
        assert got != run(ids, max_tokens=4).token_ids
        # the request's own repetition_penalty wins over the file's
        plain = c.completions.create(model=BASE, prompt=PROMPT, temperature=0.0,
                                     extra_body={**EXTRA, "repetition_penalty": 1.0,
                                                 "return_token_ids": True})
        assert plain.choices[0].model_extra["token_ids"] == run(ids, max_tokens=4).token_ids
    with running_server(base_dir, "--generation-config", "vllm",
                        "--override-generation-config", '{"max_new_tokens": 2}') as (_, url):
        c = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        assert c.completions.create(model=BASE, prompt=PROMPT, extra_body=EXTRA
                                    ).usage.completion_tokens == 2


@pytest.mark.parametrize("flags", [["--generation-config", "/no/such/dir"],
                                   ["--override-generation-config", "[1]"],
                                   ["--override-generation-config", '{"temperature": -1}'],
                                   ["--max-logprobs", "21"]])
def test_bad_generation_flags_fail_at_start(base_dir, flags):
    args = serve_parser().parse_args(["--model", str(base_dir), "--device", "cpu", *flags])
    with pytest.raises(ValueError, match=flags[0].removeprefix("--override")):
        create_server(args)


def test_max_logprobs_bounds_requests(base_dir):
    with running_server(base_dir, "--max-logprobs", "2") as (_, url):
        c = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        assert c.completions.create(model=BASE, prompt="x", max_tokens=1, logprobs=2
                                    ).choices[0].logprobs is not None
        with pytest.raises(openai.BadRequestError) as info:
            c.completions.create(model=BASE, prompt="x", max_tokens=1, logprobs=3)
        assert info.value.body["param"] == "logprobs"
        with pytest.raises(openai.BadRequestError) as info:
            c.chat.completions.create(model=BASE, messages=[{"role": "user", "content": "x"}],
                                      max_tokens=1, logprobs=True, top_logprobs=3)
        assert info.value.body["param"] == "top_logprobs"
