"""The published contract and the edge agree (issue 28, finding 10): each body the server
refuses for what a JSON schema can state is refused by its published ``openapi.json`` too
(checked with the ``jsonschema`` package, not our code); a request with two
``Authorization`` headers is refused; an unknown field, ignored, is still held to the
NaN and Unicode rules; ``--allow-credentials`` never echoes an arbitrary or ``null``
origin."""

from __future__ import annotations

import json

import httpx
import pytest
from jsonschema import Draft202012Validator
from server_helpers import BASE, engine_flags, running_server

from manylora.entrypoints.openai.launcher import create_server
from manylora.entrypoints.openai.serve_args import serve_parser

KEY = "edge-key"
AUTH = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}


@pytest.fixture(scope="module")
def served(base_dir, adapters, lora_root):
    with running_server(base_dir, "--api-key", KEY, "--enable-lora-runtime-updates",
                        "--lora-root", str(lora_root),
                        lora_modules=[f"ad1={adapters['ad1']}"]) as (_, url):
        doc = httpx.get(f"{url}/openapi.json").json()
        yield url, doc


def _body_validator(doc: dict, path: str) -> Draft202012Validator:
    schema = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    return Draft202012Validator({**schema, "components": doc["components"]})


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
REFUSED = [
    ("/v1/chat/completions", {"model": BASE, "messages": []}, "messages"),
    ("/v1/chat/completions", {"model": BASE, "messages": [{"role": "user", "content": "hi"}],
                              "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/completions", {"model": BASE, "prompt": "hi", "logprobs": 21}, "logprobs"),
    ("/tokenize", {"model": BASE, "messages": []}, "messages"),
    ("/v1/load_lora_adapter", {"lora_name": "", "lora_path": "ad0"}, "lora_name"),
    ("/v1/unload_lora_adapter", {"lora_name": ""}, "lora_name"),
    ("/v1/responses", {"model": BASE, "input": "hi", "top_logprobs": 21}, "top_logprobs"),
    ("/v1/responses", {"model": BASE, "input": "hi",
                       "context_management": [{"type": "compaction"}]}, "context_management"),
    ("/v1/responses", {"model": BASE, "input": []}, "input"),
    ("/v1/responses", {"model": BASE, "input": "hi", "background": True}, "background"),
    ("/v1/responses", {"model": BASE, "input": "hi", "service_tier": "flex"}, "service_tier"),
    # what a bounded strict Schemathesis run (400 not expected of valid data) found
    ("/v1/chat/completions", {"model": BASE, "messages": [{"role": "tool", "content": "4"}]},
     "messages[0]"),
    # /tokenize's body is a text or messages: the 400 names the text's missing prompt first
    ("/tokenize", {"model": BASE, "messages": [{"role": "tool", "content": "4"}]}, "prompt"),
    ("/v1/chat/completions", {"model": BASE, "messages": [
        {"role": "user", "content": "hi", "tool_call_id": "c1"}]}, "messages[0]"),
    ("/v1/chat/completions", {"model": BASE, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
    ("/v1/completions", {"model": BASE, "prompt": ""}, "prompt"),
    ("/v1/completions", {"model": BASE, "prompt": ["hi", ""]}, "prompt"),
    ("/v1/completions", {"model": BASE, "prompt": [[1], []]}, "prompt"),
    ("/v1/completions", {"model": BASE, "prompt": "hi", "truncate_prompt_tokens": 0},
     "truncate_prompt_tokens"),
    ("/v1/completions", {"model": BASE, "prompt": "hi", "seed": 2**63}, "seed"),
    ("/v1/responses", {"model": BASE, "input": "hi", "seed": 2**63}, "seed"),
    ("/v1/completions", {"model": BASE, "prompt": "hi", "allowed_token_ids": []},
     "allowed_token_ids"),
    ("/v1/completions", {"model": BASE, "prompt": "hi", "stream_options": {}},
     "stream_options"),
    ("/v1/completions", {"model": BASE, "prompt": "hi", "top_p": 0}, "top_p"),
    ("/v1/completions", {"model": BASE, "prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/chat/completions", {"model": BASE, "messages": [{"role": "user", "content": "hi"}],
                              "max_tokens": 0, "max_completion_tokens": 1}, "max_tokens"),
    ("/v1/chat/completions", {"model": BASE, "messages": [{"role": "user", "content": "hi"}],
                              "top_logprobs": 1}, "top_logprobs"),
    ("/v1/chat/completions", {"model": BASE, "messages": [{"role": "user", "content": "hi"}],
                              "tool_choice": "required"}, "tool_choice"),
    # this server runs without --enable-auto-tool-choice: tools need a tool_choice but auto
    ("/v1/chat/completions", {"model": BASE, "messages": [{"role": "user", "content": "hi"}],
                              "tools": [TOOL]}, "tool_choice"),
    ("/v1/chat/completions", {"model": BASE, "messages": [{"role": "user", "content": "hi"}],
                              "tools": [TOOL], "tool_choice": "auto"}, "tool_choice"),
    ("/tokenize", {"model": BASE, "messages": [{"role": "user", "content": "hi"}],
                   "continue_final_message": True}, "continue_final_message"),
    ("/v1/responses", {"model": BASE, "input": "hi",
                       "include": ["reasoning.encrypted_content"]}, "include"),
    ("/v1/responses", {"model": BASE, "input": "hi", "reasoning": {"effort": "high"}},
     "reasoning"),
    ("/v1/completions", {"model": BASE, "prompt": "hi", "structured_outputs": {}},
     "structured_outputs"),
    ("/v1/completions", {"model": BASE, "prompt": "hi",
                         "structured_outputs": {"regex": "a", "choice": ["a"]}},
     "structured_outputs"),
    ("/v1/completions", {"model": BASE, "prompt": "hi", "structured_outputs": {"regex": ""}},
     "structured_outputs"),
    # this server runs without --trust-request-chat-template
    ("/v1/chat/completions", {"model": BASE, "messages": [{"role": "user", "content": "hi"}],
                              "chat_template": "{{ 1 }}"}, "chat_template"),
    ("/v1/chat/completions", {"model": BASE, "messages": [{"role": "user", "content": "hi"}],
                              "chat_template_kwargs": {"chat_template": "{{ 1 }}"}},
     "chat_template_kwargs"),
]
ACCEPTED = [
    ("/v1/chat/completions", {"model": BASE, "messages": [{"role": "user", "content": "hi"}],
                              "max_tokens": 1, "logprobs": True, "top_logprobs": 2}),
    ("/v1/completions", {"model": BASE, "prompt": "hi", "max_tokens": 1, "logprobs": 20}),
    ("/tokenize", {"model": BASE, "messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/responses", {"model": BASE, "input": "hi", "max_output_tokens": 1,
                       "top_logprobs": 20, "context_management": [], "background": False}),
    # the largest seed with n choices (child i seeded seed + i, wrapped), whole numbers
    # written as 2.0 (JSON Schema's integer), an assistant message without content
    ("/v1/completions", {"model": BASE, "prompt": "hi", "max_tokens": 1, "n": 2,
                         "seed": 2**63 - 1}),
    ("/v1/completions", {"model": BASE, "prompt": [[1.0, 2.0]], "max_tokens": 1.0,
                         "truncate_prompt_tokens": -1}),
    ("/v1/completions", {"model": BASE, "prompt": "hi", "max_tokens": 0, "echo": True}),
    ("/v1/chat/completions", {"model": BASE, "max_tokens": 1, "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": None},
        {"role": "user", "content": [{"type": "text", "text": "more"}]}]}),
    ("/v1/responses", {"model": BASE, "input": "hi", "max_output_tokens": 1,
                       "seed": -(2**63), "reasoning": {"effort": "none"}}),
    ("/v1/chat/completions", {"model": BASE, "messages": [{"role": "user", "content": "hi"}],
                              "max_tokens": 1, "tools": [TOOL], "tool_choice": "none",
                              "chat_template_kwargs": {"enable_thinking": False}}),
    ("/v1/completions", {"model": BASE, "prompt": "hi", "max_tokens": 1,
                         "structured_outputs": {"choice": ["a", "b"], "json_object": False}}),
]


@pytest.mark.parametrize("path, body, field", REFUSED)
def test_bodies_the_server_refuses_the_document_refuses(served, path, body, field):
    url, doc = served
    errors = list(_body_validator(doc, path).iter_errors(body))
    assert errors, f"openapi.json admits {body}"
    r = httpx.post(f"{url}{path}", json=body, headers=AUTH, timeout=60)
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == field


@pytest.mark.parametrize("path, body", ACCEPTED)
def test_bodies_the_document_admits_the_server_serves(served, path, body):
    url, doc = served
    assert not list(_body_validator(doc, path).iter_errors(body))
    r = httpx.post(f"{url}{path}", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text


def test_auto_tool_choice_is_published_where_the_server_serves_it(base_dir):
    body = {"model": BASE, "max_tokens": 1, "tools": [TOOL],
            "messages": [{"role": "user", "content": "hi"}]}
    with running_server(base_dir, "--enable-auto-tool-choice", "--tool-call-parser",
                        "hermes") as (_, url):
        doc = httpx.get(f"{url}/openapi.json").json()
        for choice in ({}, {"tool_choice": "auto"}):
            assert not list(_body_validator(doc, "/v1/chat/completions").iter_errors(
                {**body, **choice}))
            r = httpx.post(f"{url}/v1/chat/completions", json={**body, **choice}, timeout=60)
            assert r.status_code == 200, r.text


def test_two_authorization_headers_are_refused(served):
    url, _ = served
    for pair in ([f"Bearer {KEY}", "Bearer wrong"], ["Bearer wrong", f"Bearer {KEY}"],
                 [f"Bearer {KEY}", f"Bearer {KEY}"]):
        headers = [("Authorization", value) for value in pair]
        r = httpx.get(f"{url}/v1/models", headers=headers)
        assert r.status_code == 401, r.text
        assert "2 Authorization headers" in r.json()["error"]["message"]
    assert httpx.get(f"{url}/v1/models", headers=AUTH).status_code == 200


@pytest.mark.parametrize("raw, param", [
    ('{"model": "%s", "prompt": "hi", "max_tokens": 1, "extra": NaN}', "extra"),
    ('{"model": "%s", "prompt": "hi", "max_tokens": 1, "extra": {"a": [Infinity]}}', "extra"),
    ('{"model": "%s", "prompt": "hi", "max_tokens": 1, "extra": ["ok", "\\ud800"]}', "extra"),
    ('{"model": "%s", "prompt": "hi", "max_tokens": 1, "extra": {"\\udfff": 1}}', "extra"),
    ('{"model": "%s", "prompt": "hi", "max_tokens": 1, "\\ud800": 1}', "'\\ud800'"),
])
def test_unknown_fields_are_held_to_the_nan_and_unicode_rules(served, raw, param):
    url, _ = served
    r = httpx.post(f"{url}/v1/completions", content=raw % BASE, headers=AUTH, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param
    assert "unknown field" in error["message"]


def test_nested_unknown_field_is_named_and_valid_ones_are_ignored(served):
    url, _ = served
    body = json.dumps({"model": BASE, "max_tokens": 1, "messages": [
        {"role": "user", "content": "hi", "note": float("-inf")}]})
    r = httpx.post(f"{url}/v1/chat/completions", content=body, headers=AUTH, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].note", r.text
    ok = json.dumps({"model": BASE, "prompt": "hi", "max_tokens": 1,
                     "extra": {"a": [1.5, "é", None]}})
    r = httpx.post(f"{url}/v1/completions", content=ok, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("origins", [[], ["*"], ["https://good.example", "null"]])
def test_credentials_with_any_or_null_origin_are_refused_at_start(base_dir, origins):
    argv = ["--model", str(base_dir), *engine_flags(), "--allow-credentials"]
    if origins:
        argv += ["--allowed-origins", *origins]
    with pytest.raises(ValueError, match="--allow-credentials with --allowed-origins .*CORS"):
        create_server(serve_parser().parse_args(argv))


def test_credentials_are_allowed_for_listed_origins_only(base_dir):
    with running_server(base_dir, "--allow-credentials", "--allowed-origins",
                        "https://good.example") as (_, url):
        for origin, allowed in [("https://good.example", True), ("https://evil.example", False),
                                ("null", False)]:
            r = httpx.options(f"{url}/v1/completions", headers={
                "Origin": origin, "Access-Control-Request-Method": "POST"})
            assert (r.headers.get("access-control-allow-origin") == origin) is allowed
            r = httpx.get(f"{url}/v1/models", headers={"Origin": origin, "Cookie": "s=1"})
            assert r.status_code == 200
            assert (r.headers.get("access-control-allow-origin") == origin) is allowed
            if allowed:
                assert r.headers["access-control-allow-credentials"] == "true"
            else:
                assert "access-control-allow-origin" not in r.headers
