"""Issue 18's request-side findings against a real ``manylora serve`` on loopback: names and
text that cannot be encoded, lax types, the choices bound and obviously too long prompts
are each a 400 (or the context's 413) in OpenAI's shape naming the field, nothing is
registered, and the server keeps answering everyone (``/v1/models`` stays 200)."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
from server_helpers import BASE, running_server
from transformers import AutoTokenizer

from manylora.entrypoints.openai.launcher import create_server
from manylora.entrypoints.openai.serve_args import serve_parser

CHAT = [{"role": "user", "content": "hi"}]


def _post(url: str, body: dict) -> httpx.Response:
    """POST ``body`` as JSON with ASCII escapes, so that lone surrogates travel as the
    ``\\ud800`` escapes a hostile client sends (legal JSON, no valid UTF-8 behind it)."""
    return httpx.post(url, content=json.dumps(body), timeout=60,
                      headers={"content-type": "application/json"})


def _error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and error["type"]
    if param is not None:
        assert error["param"] == param, error
    return error


class CountingTokenizer:
    """Delegates to the server's tokenizer, counting encode calls and their threads."""

    def __init__(self, inner):
        self.inner = inner
        self.calls = 0
        self.threads: set[str] = set()

    def __call__(self, text, **kwargs):
        self.calls += 1
        self.threads.add(threading.current_thread().name)
        return self.inner(text, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.fixture
def counting(served):
    prompts = served[0].app.state.prompt_tokenizer
    inner = prompts.tokenizer
    prompts.tokenizer = CountingTokenizer(inner)
    yield prompts.tokenizer
    prompts.tokenizer = inner


@pytest.mark.parametrize("bad", ["\ud800", "x\udfff", "a\x00b", "line\nbreak", "\x1b[31m",
                                 "del\x7f", "\x85", "rlo\u202e", "n" * 600])
def test_issue18_bad_names_are_400_and_nothing_is_registered(served, bad):
    url = served[1]
    before = httpx.get(f"{url}/v1/models").json()
    _error(_post(f"{url}/v1/load_lora_adapter", {"lora_name": bad, "lora_path": "ad6"}),
           400, "lora_name")
    _error(_post(f"{url}/v1/unload_lora_adapter", {"lora_name": bad}), 400, "lora_name")
    _error(_post(f"{url}/v1/completions", {"model": bad, "prompt": "hi", "max_tokens": 2}),
           400, "model")
    _error(_post(f"{url}/v1/chat/completions", {"model": bad, "messages": CHAT}), 400,
           "model")
    _error(_post(f"{url}/v1/completions", {"model": BASE, "prompt": "hi", "max_tokens": 2,
                                           "user": bad}), 400, "user")
    _error(_post(f"{url}/v1/chat/completions", {"model": BASE, "messages": [
        {"role": "user", "content": "hi", "name": bad}]}), 400, "messages[0].name")
    after = httpx.get(f"{url}/v1/models")
    assert after.status_code == 200 and after.json() == before
    assert httpx.get(f"{url}/metrics").status_code == 200
    assert httpx.get(f"{url}/health").status_code == 200


def test_issue18_model_path_with_control_characters_is_400(served):
    url = served[1]
    _error(httpx.get(f"{url}/v1/models/a%1Bb"), 400, "model_id")
    _error(httpx.get(f"{url}/v1/models/a%00b"), 400, "model_id")
    _error(httpx.get(f"{url}/v1/models/nope"), 404)
    assert httpx.get(f"{url}/v1/models/{BASE}").json()["id"] == BASE


@pytest.mark.parametrize("path, body, param", [
    ("completions", {"prompt": "ok \ud800", "echo": True}, "prompt"),
    ("completions", {"prompt": ["ok", "\udc00"]}, "prompt"),
    ("completions", {"prompt": "ok", "stop": ["\ud83d"]}, "stop"),
    ("chat/completions", {"messages": [{"role": "user", "content": "a\ud800"}]},
     "messages[0].content"),
    ("chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "\udfff"}]}]}, "messages[0].content"),
    ("chat/completions", {"messages": CHAT, "chat_template_kwargs": {"\ud800": 1}},
     "chat_template_kwargs"),
])
def test_issue18_text_that_cannot_encode_is_400(served, path, body, param):
    r = _post(f"{served[1]}/v1/{path}", {"model": BASE, "max_tokens": 2, **body})
    assert "surrogate" in _error(r, 400, param)["message"]


@pytest.mark.parametrize("path, body, param", [
    ("completions", {"stream": "yes"}, "stream"),
    ("completions", {"prompt": [True]}, "prompt"),
    ("completions", {"prompt": [[1, True]]}, "prompt"),
    ("completions", {"n": True}, "n"),
    ("completions", {"min_tokens": 0.5}, "min_tokens"),
    ("completions", {"max_tokens": 5.5}, "max_tokens"),
    ("completions", {"echo": 1}, "echo"),
    ("completions", {"logprobs": "2"}, "logprobs"),
    ("completions", {"temperature": True}, "temperature"),
    ("chat/completions", {"messages": CHAT, "stream": "true"}, "stream"),
    ("chat/completions", {"messages": CHAT, "logprobs": 1}, "logprobs"),
    ("chat/completions", {"messages": CHAT, "max_completion_tokens": 3.5},
     "max_completion_tokens"),
    ("chat/completions", {"messages": CHAT, "top_logprobs": False}, "top_logprobs"),
    ("load_lora_adapter", {"lora_name": 7, "lora_path": "ad6"}, "lora_name"),
    ("unload_lora_adapter", {"lora_name": "ad0", "lora_int_id": "1"}, "lora_int_id"),
])
def test_issue18_lax_types_are_400(served, path, body, param):
    if path.endswith("completions"):
        body = {"model": BASE, "prompt": "hi", "max_tokens": 2, **body}
    _error(_post(f"{served[1]}/v1/{path}", body), 400, param)


def test_integer_numbers_stay_valid(served):
    r = _post(f"{served[1]}/v1/completions", {"model": BASE, "prompt": "hi", "max_tokens": 2,
                                              "temperature": 1, "top_p": 1, "seed": 3})
    assert r.status_code == 200, r.text


def test_whole_number_floats_are_integers(served):
    # the JSON text says 2.0 (httpx writes Python floats so): the integer 2, as JSON Schema
    # and vLLM read it
    url = served[1]
    r = _post(f"{url}/v1/completions", {"model": BASE, "prompt": [5.0, 6.0], "n": 2.0,
                                        "max_tokens": 2.0, "seed": 3.0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert len(body["choices"]) == 2 and body["usage"]["completion_tokens"] == 4
    assert body["usage"]["prompt_tokens"] == 2
    r = _post(f"{url}/detokenize", {"model": BASE, "tokens": [5.0, 6]})
    assert r.status_code == 200 and r.json() == _post(
        f"{url}/detokenize", {"model": BASE, "tokens": [5, 6]}).json()


def test_issue18_choices_bound_answers_before_tokenizing(served, counting):
    url = f"{served[1]}/v1/completions"
    many = {"model": BASE, "prompt": ["ab"] * 150_000, "max_tokens": 2}
    assert 600_000 < len(json.dumps(many)) < 1_000_000      # the 750 KB request
    error = _error(_post(url, many), 400, "prompt")
    assert "150000" in error["message"] and "--max-choices-per-request" in error["message"]
    error = _error(_post(url, {"model": BASE, "prompt": ["ab"] * 300, "n": 4,
                               "max_tokens": 2}), 400, "n")
    assert "1200" in error["message"]
    assert counting.calls == 0
    ok = _post(url, {"model": BASE, "prompt": ["ab"] * 8, "n": 2, "max_tokens": 2})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 16


def test_issue18_huge_text_is_refused_without_tokenizing(served, counting):
    url = served[1]
    huge = "x" * 1_000_000
    error = _error(_post(f"{url}/v1/completions", {"model": BASE, "prompt": huge,
                                                   "max_tokens": 2}), 413, "prompt")
    assert error["code"] == "context_length_exceeded" and "at least" in error["message"]
    _error(_post(f"{url}/v1/chat/completions", {"model": BASE, "messages": [
        {"role": "user", "content": huge}]}), 413, "messages")
    assert counting.calls == 0


def test_prompts_are_tokenized_off_the_event_loop(served, counting, base_dir):
    text = "the quick brown fox jumps over the lazy dog. " * 2
    r = _post(f"{served[1]}/v1/completions", {"model": BASE, "prompt": [text, "hello"],
                                              "max_tokens": 2, "echo": True})
    assert r.status_code == 200, r.text
    reference = AutoTokenizer.from_pretrained(base_dir)
    expected = len(reference(text).input_ids) + len(reference("hello").input_ids)
    assert r.json()["usage"]["prompt_tokens"] == expected
    assert r.json()["choices"][0]["text"].startswith(text)
    assert counting.calls == 2
    assert counting.threads and all(t.startswith("manylora-tokenize") for t in counting.threads)


def test_choices_flag_sets_the_bound(base_dir):
    with running_server(base_dir, "--max-choices-per-request", "3") as (_, url):
        _error(_post(f"{url}/v1/completions", {"model": BASE, "prompt": ["a", "b"], "n": 2,
                                               "max_tokens": 1}), 400, "n")
        ok = _post(f"{url}/v1/completions", {"model": BASE, "prompt": ["a", "b", "c"],
                                             "max_tokens": 1})
        assert ok.status_code == 200 and len(ok.json()["choices"]) == 3



@pytest.mark.parametrize("flags, match", [
    (["--max-choices-per-request", "0"], "--max-choices-per-request"),
    (["--served-model-name", "tiny\nbase"], "--served-model-name .*control character"),
    (["--lora-modules", "ad\udcff=/nowhere"], "--lora-modules .*surrogate"),  # argv bytes
    (["--lora-modules", '{"name": "a", "path": "/x", "base_model_name": "b\\u0007"}'],
     "--lora-modules .*control character"),
])
def test_bad_server_flags_are_refused_before_the_engine_starts(base_dir, flags, match):
    args = serve_parser().parse_args(["--model", str(base_dir), *flags])
    with pytest.raises(ValueError, match=match) as info:
        create_server(args)
    str(info.value).encode("utf-8")


@pytest.mark.parametrize("prompt", [[-2040, 7, 3], [7, 351272644670352], [[5], [-1]]])
def test_echo_of_token_ids_outside_the_vocabulary_is_400(served, prompt):
    r = _post(f"{served[1]}/v1/completions", {"model": BASE, "prompt": prompt, "echo": True,
                                              "max_tokens": 2})
    assert "vocabulary" in _error(r, 400)["message"]
    ok = _post(f"{served[1]}/v1/completions", {"model": BASE, "prompt": [5, 6], "echo": True,
                                               "max_tokens": 2})
    assert ok.status_code == 200, ok.text
