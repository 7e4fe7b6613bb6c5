"""Structured output through a real server with the official ``openai`` client:
``response_format`` json_schema (``chat.completions.parse`` with a pydantic model) and
json_object, vLLM's ``structured_outputs``, on chat and completions, streamed and not; every
JSON output validated with ``jsonschema``; invalid schemas, regexes and grammars, and vLLM's
removed ``guided_*`` fields, are 400s naming the field, found before the request is queued."""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from server_helpers import BASE, TINY, running_server

from manylora.testing import make_checkpoint
from manylora.testing.structured import names_an_empty_constraint

SCHEMA = {"type": "object",
          "properties": {"city": {"type": "string", "pattern": "^[a-z]{2,6}$"},
                         "rank": {"type": "integer", "minimum": 1, "maximum": 99},
                         "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                  "minItems": 1, "maxItems": 3}},
          "required": ["city", "rank", "tags"], "additionalProperties": False}
MESSAGES = [{"role": "user", "content": "Give me a city as JSON."}]


class City(BaseModel):
    city: str = Field(pattern="^[a-z]{2,6}$")
    rank: int = Field(ge=1, le=99)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    base = make_checkpoint(tmp_path_factory.mktemp("so-server") / "base", "llama", seed=2,
                           **{**TINY, "max_position_embeddings": 512})
    with running_server(base, max_model_len=512, block_size=8) as (served, url):
        yield (openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0),
               httpx.Client(base_url=url, timeout=120), str(base), served)


def _loads(text: str):
    return json.loads(text, strict=False)    # xgrammar's bounded strings: see the engine test


def test_chat_parse_with_a_pydantic_model(server):
    client = server[0]
    for seed in (0, 1):
        completion = client.chat.completions.parse(
            model=BASE, messages=MESSAGES, response_format=City, seed=seed, max_tokens=200)
        parsed = completion.choices[0].message.parsed
        assert isinstance(parsed, City) and completion.choices[0].finish_reason == "stop"
        assert re.fullmatch("[a-z]{2,6}", parsed.city) and 1 <= parsed.rank <= 99


@pytest.mark.parametrize("stream", [False, True])
def test_chat_json_schema_and_json_object(server, stream):
    client = server[0]
    fmt = {"type": "json_schema",
           "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
    for seed in (3, 4):
        text, finish = _chat(client, fmt, seed, stream)
        assert finish == "stop", text
        jsonschema.validate(_loads(text), SCHEMA)
    text, finish = _chat(client, {"type": "json_object"}, 5, stream)
    if finish == "stop":                 # whitespace is free: it may run to the length cap
        assert isinstance(_loads(text), dict)
    else:
        assert finish == "length" and text.lstrip().startswith("{")


def _chat(client, fmt, seed, stream):
    kwargs = dict(model=BASE, messages=MESSAGES, response_format=fmt, seed=seed,
                  max_tokens=200)
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        return choice.message.content, choice.finish_reason
    text, finish = "", None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return text, finish


@pytest.mark.parametrize("stream", [False, True])
def test_completions_structured_outputs_and_response_format(server, stream):
    client = server[0]
    cases = [({"structured_outputs": {"choice": ["red", "green", "blue"]}},
              lambda t: t in ("red", "green", "blue")),
             ({"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}},
              lambda t: re.fullmatch("[0-9]{3}-[a-z]{2}", t)),
             ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
              lambda t: jsonschema.validate(_loads(t), SCHEMA) is None),
             ({"response_format": {"type": "json_schema",
                                   "json_schema": {"name": "c", "schema": SCHEMA}}},
              lambda t: jsonschema.validate(_loads(t), SCHEMA) is None)]
    for body, ok in cases:
        kwargs = dict(model=BASE, prompt="Answer:", max_tokens=200, seed=7, extra_body=body)
        if stream:
            text = "".join(c.choices[0].text for c in
                           client.completions.create(stream=True, **kwargs) if c.choices)
        else:
            text = client.completions.create(**kwargs).choices[0].text
        assert ok(text), (body, text)


@pytest.mark.parametrize("route, body, param", [
    ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    ("/v1/completions", {"prompt": "x", "response_format": {
        "type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "(a"}},
     "structured_outputs"),
    ("/v1/chat/completions", {"messages": MESSAGES,
                              "structured_outputs": {"grammar": "root ::= undefined"}},
     "structured_outputs"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["b"]}},
     "structured_outputs"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"json": "{not json"}},
     "structured_outputs"),
    ("/v1/chat/completions", {"messages": MESSAGES, "guided_json": SCHEMA}, "guided_json"),
    ("/v1/completions", {"prompt": "x", "guided_choice": ["a"]}, "guided_choice"),
    ("/v1/completions", {"prompt": "x", "response_format": {"type": "json_object"},
                         "structured_outputs": {"regex": "a"}}, "structured_outputs"),
    # options alone need a response_format to give the kind
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"disable_any_whitespace": True}},
     "structured_outputs"),
    ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {"type": "yaml"}},
     "response_format.type"),
])
def test_invalid_constraints_are_400s_naming_the_field(server, route, body, param):
    http = server[1]
    r = http.post(route, json={"model": BASE, "max_tokens": 5, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()     # the front's check, not the core's
    # the server keeps serving
    ok = http.post("/v1/completions", json={"model": BASE, "prompt": "x", "max_tokens": 2})
    assert ok.status_code == 200, ok.text


def test_bad_words(server):
    from transformers import AutoTokenizer

    http, tok = server[1], AutoTokenizer.from_pretrained(server[2])
    # lower-case words (a regex, so the tokens are text), greedy: the ban must change them
    body = {"model": BASE, "prompt": "Answer:", "max_tokens": 12, "temperature": 0,
            "logprobs": 0, "return_tokens_as_token_ids": True,
            "structured_outputs": {"regex": "[a-z]{1,6}( [a-z]{1,6}){0,20}"}}

    def token_ids(**extra):
        r = http.post("/v1/completions", json={**body, **extra})
        assert r.status_code == 200, r.text
        return [int(t.split(":")[1]) for t in r.json()["choices"][0]["logprobs"]["tokens"]]

    plain = token_ids()
    # a generated token that is a word of its own: the word encodes back to it (with or
    # without its leading space)
    position, word = next(
        (i, tok.decode([t]).strip()) for i, t in enumerate(plain)
        if tok.decode([t]).strip() and [t] in (
            tok.encode(tok.decode([t]).strip(), add_special_tokens=False),
            tok.encode(" " + tok.decode([t]).strip(), add_special_tokens=False)))
    banned = token_ids(bad_words=[word])
    assert banned[:position] == plain[:position] and banned[position] != plain[position]
    assert plain[position] not in banned
    for route, extra in (("/v1/completions", {"prompt": "x"}),
                         ("/v1/chat/completions", {"messages": MESSAGES})):
        r = http.post(route, json={"model": BASE, "bad_words": [""], **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == "bad_words", r.text


_BIG_ENUM = {"type": "string", "enum": [f"{i:06d}" * 20 for i in range(1200)]}   # 150 KB
_TOOL = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"x": {"type": "string"}}}}}


@pytest.mark.parametrize("route, body, param, bound", [
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "a" * (2**17 + 1)}},
     "structured_outputs", "--max-structured-output-spec-bytes"),
    ("/v1/chat/completions", {"messages": MESSAGES, "structured_outputs": {
        "grammar": 'root ::= "' + "a" * 2**17 + '"'}},
     "structured_outputs", "--max-structured-output-spec-bytes"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {
        "choice": [f"{i:04d}" * 30 for i in range(1200)]}},
     "structured_outputs", "--max-structured-output-spec-bytes"),
    ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": _BIG_ENUM}}},
     "response_format", "--max-structured-output-spec-bytes"),
    ("/v1/responses", {"input": "x", "text": {"format": {
        "type": "json_schema", "name": "x", "schema": _BIG_ENUM}}},
     "text", "--max-structured-output-spec-bytes"),
    ("/v1/chat/completions", {"messages": MESSAGES, "tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": f"f{i}", "parameters": {
            "type": "object", "properties": {"x": {"enum": [f"{i:05d}" * 40] * 1}}}}}
        for i in range(120)] + [
        {"type": "function", "function": {"name": "big", "parameters": {
            "type": "object", "properties": {"x": _BIG_ENUM}}}}]},
     "tools", "--max-structured-output-spec-bytes"),
    ("/v1/chat/completions", {"messages": MESSAGES, "tools": [
        {"type": "function", "function": {**_TOOL["function"], "name": f"f{i}"}}
        for i in range(129)], "tool_choice": "none"}, "tools", "--max-tools"),
    ("/v1/completions", {"prompt": "x", "bad_words": ["a"] * 4097}, "bad_words",
     "--max-bad-words"),
    ("/v1/chat/completions", {"messages": MESSAGES, "bad_words": ["a" * 2**16] * 3},
     "bad_words", "--max-structured-output-spec-bytes"),
])
def test_bounds_are_400s_naming_the_field_and_flag(server, route, body, param, bound):
    http = server[1]
    r = http.post(route, json={"model": BASE, "max_tokens": 5, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and bound in error["message"], error
    ok = http.post("/v1/completions", json={"model": BASE, "prompt": "x", "max_tokens": 2})
    assert ok.status_code == 200, ok.text


_REF = {"$ref": "#"}
_MUTUAL = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
           "$ref": "#/$defs/a"}


def _engine_killers(tok):
    """Bodies whose output constraints admit no token (each took the engine down once)."""
    a = tok.encode("a", add_special_tokens=False)[0]
    completions = [
        {"prompt": "x", "structured_outputs": {"json": _REF}},
        {"prompt": "x", "structured_outputs": {"json": _MUTUAL}},
        {"prompt": "x", "structured_outputs": {"regex": "[^\\s\\S]"}},
        {"prompt": "x", "structured_outputs": {"grammar": "root ::= [^\\x00-\\U0010FFFF]"}},
        {"prompt": "x", "structured_outputs": {"choice": ["a"]}, "allowed_token_ids": [a + 1]},
        {"prompt": "x", "structured_outputs": {"choice": ["a"]}, "bad_words": ["a"]},
        {"prompt": "x", "structured_outputs": {"json_object": True}, "allowed_token_ids": [a]},
    ]
    chat = {"messages": MESSAGES, "response_format": {
        "type": "json_schema", "json_schema": {"name": "loop", "schema": _REF}}}
    responses = {"input": "x", "text": {"format": {"type": "json_schema", "name": "loop",
                                                   "schema": _REF}}}
    return ([("/v1/completions", b) for b in completions]
            + [("/v1/chat/completions", chat), ("/v1/responses", responses)])


def test_constraints_that_admit_no_token_fail_alone(server):
    """Each body gets an error of its own (a 400, or an error event on its stream) while
    another client's stream goes on to its full length, equal to the same stream alone;
    /health stays 200 and the server serves again."""
    import threading

    from transformers import AutoTokenizer

    http, tok = server[1], AutoTokenizer.from_pretrained(server[2])
    long = {"model": BASE, "prompt": "Once upon a time", "max_tokens": 300, "temperature": 0,
            "ignore_eos": True, "stream": True}

    def stream_text() -> tuple[str, str | None]:
        text, reason = [], None
        with httpx.Client(base_url=str(http.base_url), timeout=300) as c, \
                c.stream("POST", "/v1/completions", json=long) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    choice = json.loads(line[6:])["choices"][0]
                    text.append(choice["text"])
                    reason = choice["finish_reason"] or reason
        return "".join(text), reason

    alone = stream_text()
    assert alone[1] == "length"
    result = {}
    other = threading.Thread(target=lambda: result.update(out=stream_text()))
    other.start()
    try:
        for route, body in _engine_killers(tok):
            for stream in (False, True):
                r = http.post(route, json={"model": BASE, "max_tokens": 8, "stream": stream,
                                           **body})
                if r.status_code == 200:       # a stream that began: its error event
                    assert stream and '"error"' in r.text, (route, body, r.text)
                else:
                    assert r.status_code == 400, (route, body, r.text)
                    assert names_an_empty_constraint(r.json()["error"]["message"]), r.text
                assert http.get("/health").status_code == 200
    finally:
        other.join(timeout=600)
    assert result["out"] == alone
    ok = http.post("/v1/completions", json={"model": BASE, "prompt": "x", "max_tokens": 2})
    assert ok.status_code == 200, ok.text


def test_max_bad_words_while_another_stream_runs(server):
    # a request with the most bad_words allowed streams alongside another client's stream:
    # the other stream's chunks arrive between the first and the last chunk of the
    # bad_words one, and no always-banned token (a one-token word) is generated
    from transformers import AutoTokenizer

    http, tok = server[1], AutoTokenizer.from_pretrained(server[2])
    singles = [w for w in (tok.decode([t]).strip() for t in range(3, tok.vocab_size))
               if w.isalpha() and len(tok.encode(w, add_special_tokens=False)) == 1][:2000]
    words = singles + [f"w{i}" for i in range(4096 - len(singles))]
    banned = {tok.encode(w, add_special_tokens=False)[0] for w in singles}
    events: list[str] = []
    long_started = threading.Event()

    def stream(name, body):
        with http.stream("POST", "/v1/completions", json={
                "model": BASE, "stream": True, "temperature": 0, "ignore_eos": True,
                "logprobs": 0, "return_tokens_as_token_ids": True, **body}) as r:
            assert r.status_code == 200
            tokens = []
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    choice = json.loads(line[6:])["choices"][0]
                    tokens += [int(t.split(":")[1]) for t in choice["logprobs"]["tokens"]]
                    events.append(name)
                    long_started.set()
            return tokens

    with ThreadPoolExecutor(2) as pool:
        other = pool.submit(stream, "other", {"prompt": "Hi", "max_tokens": 480})
        assert long_started.wait(120)
        tokens = pool.submit(stream, "bad", {"prompt": "Answer:", "max_tokens": 24,
                                             "bad_words": words}).result(120)
        assert len(other.result(120)) == 480
    first, last = events.index("bad"), len(events) - 1 - events[::-1].index("bad")
    assert "other" in events[first:last]
    assert len(tokens) == 24 and not banned & set(tokens)


def test_min_tokens_does_not_outlive_the_grammar(server):
    body = {"model": BASE, "prompt": "Hi", "max_tokens": 8, "min_tokens": 5,
            "structured_outputs": {"choice": ["a"]}}
    for temperature in (0, 1):
        r = server[1].post("/v1/completions", json={**body, "temperature": temperature})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert (choice["text"], choice["finish_reason"]) == ("a", "stop")


def _gate_compiles(monkeypatch, spec: str) -> tuple[threading.Event, threading.Event]:
    """The engine's compiles of ``spec`` (its core runs in this process) wait for the first
    event; the second is set when such a compile starts."""
    from manylora.structured import compiler as compiler_module

    gate, started = threading.Event(), threading.Event()
    compile_one = compiler_module.compile_grammar

    def gated(compiler, key):
        if key[1] == spec:
            started.set()
            gate.wait()
        return compile_one(compiler, key)

    monkeypatch.setattr(compiler_module, "compile_grammar", gated)
    return gate, started


def _long_stream(http, events: list[str], first: threading.Event) -> int:
    """Stream 480 greedy tokens; append "other" to ``events`` per chunk; their count."""
    with http.stream("POST", "/v1/completions", json={
            "model": BASE, "prompt": "Hi", "max_tokens": 480, "temperature": 0,
            "ignore_eos": True, "stream": True}) as r:
        assert r.status_code == 200
        chunks = 0
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunks += 1
                events.append("other")
                first.set()
        return chunks


def test_a_compile_past_its_time_limit_fails_only_its_request(server, monkeypatch):
    # the grammar's compile never ends (held on an event) and the engine's limit is 1 s:
    # that request gets a 400 naming the limit while another client's stream goes on
    http, served = server[1], server[3]
    compiler = served.engine.engine.engine_core.structured.compiler
    gate, _ = _gate_compiles(monkeypatch, "[0-9]{7}")
    monkeypatch.setattr(compiler, "compile_seconds", 1.0)
    events: list[str] = []
    first = threading.Event()
    try:
        with ThreadPoolExecutor(1) as pool:
            other = pool.submit(_long_stream, http, events, first)
            assert first.wait(120)
            events.append("submitted")
            r = http.post("/v1/completions", json={
                "model": BASE, "prompt": "x", "max_tokens": 5,
                "structured_outputs": {"regex": "[0-9]{7}"}})
            events.append("answered")
            assert r.status_code == 400, r.text
            message = r.json()["error"]["message"]
            assert message.startswith("structured_outputs.regex: the grammar did not compile "
                                      "within 1 s (--max-grammar-compile-seconds)"), message
            assert http.get("/health").status_code == 200
            assert other.result(120) > 0
    finally:
        gate.set()
    assert "other" in events[events.index("submitted"):events.index("answered")]


def test_a_client_leaving_drops_its_compile(server, monkeypatch):
    http, served = server[1], server[3]
    compiler = served.engine.engine.engine_core.structured.compiler
    gate, started = _gate_compiles(monkeypatch, "[0-9]{8}")
    key = ("regex", "[0-9]{8}", True)
    body = json.dumps({"model": BASE, "prompt": "x", "max_tokens": 5, "stream": True,
                       "structured_outputs": {"regex": "[0-9]{8}"}}).encode()
    url = httpx.URL(str(http.base_url))
    try:
        with socket.create_connection((url.host, url.port), timeout=120) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                         b"Content-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            assert started.wait(120) and compiler.cached(key)
        # the client left: the request is aborted, the compile nobody waits for dropped
        deadline = time.monotonic() + 120
        while compiler.cached(key):
            assert time.monotonic() < deadline, "the compile was not dropped"
            time.sleep(0.01)
    finally:
        gate.set()
    ok = http.post("/v1/completions", json={"model": BASE, "prompt": "x", "max_tokens": 3,
                                            "structured_outputs": {"regex": "[0-9]{8}"}})
    assert ok.status_code == 200 and re.fullmatch("[0-9]{3,8}", ok.json()["choices"][0]["text"])
