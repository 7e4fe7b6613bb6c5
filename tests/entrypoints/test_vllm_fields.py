"""Every field of vLLM's two request bodies through a real ``manylora serve`` (httpx on
loopback): each declared field either changes what reaches the engine (prompt, sampling
parameters, adapter) or the response, or is refused with a 400 naming it; ``inert`` fields
(which vLLM declares without effect on generation) change nothing; unknown fields are
accepted and logged as ignored; OpenAI fields whose value would change the output are
refused. The table swept is ``vllm_fields.FIELDS``: a field added to a request body without
a rule, or a rule without a probe here, fails this file.
"""

from __future__ import annotations

import json
import logging

import httpx
import pytest
from server_helpers import BASE, running_server

from manylora.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from manylora.entrypoints.openai.vllm_fields import FIELDS, REFUSED_OPENAI_FIELDS

# Fields other tasks of issue 19 own (prompt log-probabilities, structured output, tools):
# declared by them, not swept here.
OTHER_TASKS = {"prompt_logprobs", "response_format", "structured_outputs", "guided_json",
               "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
               "guided_whitespace_pattern", "bad_words", "tools", "tool_choice",
               "parallel_tool_calls"}

# A chat template that shows what vLLM passes it (documents, reasoning_effort), so that
# those fields change the prompt; sent by every chat request of the sweep.
TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}"
            "{% if documents %}[{{ documents | length }} docs]{% endif %}"
            "{% if reasoning_effort %}[effort {{ reasoning_effort }}]{% endif %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
OTHER_TEMPLATE = "{% for m in messages %}{{ m.content }}|{% endfor %}"
ASSISTANT_LAST = [{"role": "user", "content": "Say yes"},
                  {"role": "assistant", "content": "Sure, yes"}]

# field -> (what the probe adds, what its baseline adds: the companions the field needs)
SHARED = {
    "model": ({"model": "ad0"}, {}),
    "frequency_penalty": ({"frequency_penalty": 1.0}, {}),
    "presence_penalty": ({"presence_penalty": 1.0}, {}),
    "repetition_penalty": ({"repetition_penalty": 1.5}, {}),
    "logit_bias": ({"logit_bias": {"5": 10}}, {}),
    "max_tokens": ({"max_tokens": 2}, {}),
    "n": ({"n": 2}, {}), "seed": ({"seed": 5}, {}), "stop": ({"stop": ["zz"]}, {}),
    "stream": ({"stream": True}, {}),
    "stream_options": ({"stream": True, "stream_options": {"include_usage": True}},
                       {"stream": True}),
    "temperature": ({"temperature": 0.5}, {}), "top_p": ({"top_p": 0.5}, {}),
    "user": ({"user": "someone"}, {}),
    "use_beam_search": ({"use_beam_search": True}, {}),
    "length_penalty": ({"length_penalty": 2.0}, {}),
    "watermarking": ({"watermarking": True}, {}),
    "top_k": ({"top_k": 5}, {}), "min_p": ({"min_p": 0.1}, {}),
    "stop_token_ids": ({"stop_token_ids": [5]}, {}),
    "include_stop_str_in_output": ({"include_stop_str_in_output": True}, {}),
    "ignore_eos": ({"ignore_eos": False}, {}), "min_tokens": ({"min_tokens": 1}, {}),
    "skip_special_tokens": ({"skip_special_tokens": False}, {}),
    "spaces_between_special_tokens": ({"spaces_between_special_tokens": False}, {}),
    "truncate_prompt_tokens": ({"truncate_prompt_tokens": 2}, {}),
    "truncation_side": ({"truncate_prompt_tokens": 2, "truncation_side": "right"},
                        {"truncate_prompt_tokens": 2}),
    "allowed_token_ids": ({"allowed_token_ids": [5, 6]}, {}),
    "logprob_token_ids": ({"logprob_token_ids": [5]}, {}),
    "priority": ({"priority": 1}, {}), "request_id": ({"request_id": "my-request"}, {}),
    "session_id": ({"session_id": "s1"}, {}),
    "return_token_ids": ({"return_token_ids": True}, {}),
    "routed_experts_prompt_start": ({"routed_experts_prompt_start": 1}, {}),
    "return_token_offsets": ({"return_token_offsets": True}, {}),
    "return_mm_kwargs": ({"return_mm_kwargs": False}, {}),
    "cache_salt": ({"cache_salt": "a-salt"}, {}),
    "kv_transfer_params": ({"kv_transfer_params": {"a": 1}}, {}),
    "ec_transfer_params": ({"ec_transfer_params": {"a": 1}}, {}),
    "vllm_xargs": ({"vllm_xargs": {"a": 1}}, {}),
    "repetition_detection": ({"repetition_detection": {"max_pattern_size": 2}}, {}),
    "thinking_token_budget": ({"thinking_token_budget": 10}, {}),
    "stream_interval": ({"stream_interval": 4}, {}),
}
PROBES = {
    "completion": {
        **SHARED, "prompt": ({"prompt": "Another prompt"}, {}), "echo": ({"echo": True}, {}),
        "logprobs": ({"logprobs": 2}, {}), "best_of": ({"best_of": 2}, {}),
        "suffix": ({"suffix": "end"}, {}),
        "return_tokens_as_token_ids": ({"logprobs": 1, "return_tokens_as_token_ids": True},
                                       {"logprobs": 1}),
        "prompt_embeds": ({"prompt_embeds": "AAAA"}, {}),
        "add_special_tokens": ({"add_special_tokens": False}, {}),
    },
    "chat": {
        **SHARED, "messages": ({"messages": [{"role": "user", "content": "Other"}]}, {}),
        "echo": ({"echo": True, "messages": ASSISTANT_LAST}, {"messages": ASSISTANT_LAST}),
        "logprobs": ({"logprobs": True}, {}),
        "top_logprobs": ({"logprobs": True, "top_logprobs": 2}, {"logprobs": True}),
        "max_completion_tokens": ({"max_completion_tokens": 2}, {}),
        "reasoning_effort": ({"reasoning_effort": "low"}, {}),
        "return_tokens_as_token_ids": (
            {"logprobs": True, "return_tokens_as_token_ids": True}, {"logprobs": True}),
        "add_special_tokens": ({"add_special_tokens": True}, {}),
        "return_prompt_text": ({"return_prompt_text": True}, {}),
        "include_reasoning": ({"include_reasoning": False}, {}),
        "add_generation_prompt": ({"add_generation_prompt": False}, {}),
        "continue_final_message": (
            {"continue_final_message": True, "add_generation_prompt": False,
             "messages": ASSISTANT_LAST},
            {"add_generation_prompt": False, "messages": ASSISTANT_LAST}),
        "documents": ({"documents": [{"title": "t", "text": "x"}]}, {}),
        "chat_template": ({"chat_template": OTHER_TEMPLATE}, {}),
        "chat_template_kwargs": ({"chat_template_kwargs": {"reasoning_effort": "max"}}, {}),
        "media_io_kwargs": ({"media_io_kwargs": {"image": {}}}, {}),
        "mm_processor_kwargs": ({"mm_processor_kwargs": {"a": 1}}, {}),
    },
}
ROUTES = {"completion": ("completions", CompletionRequest, {"prompt": "The quick brown"}),
          "chat": ("chat/completions", ChatCompletionRequest,
                   {"messages": [{"role": "user", "content": "Hello there"}],
                    "chat_template": TEMPLATE})}
BASELINE = {"model": BASE, "max_tokens": 3, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(base_dir, adapters):
    """A server trusting request chat templates, whose engine records what it is sent."""
    with running_server(base_dir, "--trust-request-chat-template",
                        lora_modules=[f"ad0={adapters['ad0']}"]) as (srv, url):
        calls: list = []
        generate = srv.engine.generate

        async def recording(prompt, params, request_id=None, lora_request=None,
                            client_group=None):
            calls.append((prompt, params, None if lora_request is None
                          else lora_request.lora_name))
            async for out in generate(prompt, params, request_id=request_id,
                                      lora_request=lora_request, client_group=client_group):
                yield out

        srv.engine.generate = recording
        yield url, calls


def _post(server, route: str, body: dict) -> tuple[int, object, list]:
    url, calls = server
    path = ROUTES[route][0]
    start = len(calls)
    r = httpx.post(f"{url}/v1/{path}", json=body, timeout=60)
    if r.status_code != 200:
        return r.status_code, r.json(), calls[start:]
    if body.get("stream"):
        events = [json.loads(e) if e != "[DONE]" else e for e in
                  (line.removeprefix("data: ") for line in r.text.split("\n\n") if line)]
        return 200, [_scrub(e) for e in events], calls[start:]
    return 200, _scrub(r.json()), calls[start:]


def _scrub(body):
    """The response without what differs between any two requests (id, created)."""
    if isinstance(body, dict):
        return {k: v for k, v in body.items() if k not in ("id", "created")}
    return body


def test_every_declared_field_has_a_rule_and_a_probe():
    for route, (_, model, _) in ROUTES.items():
        declared = set(model.model_fields) - OTHER_TASKS
        ruled = {name for name, rule in FIELDS.items() if route in rule.routes}
        assert declared == ruled, (route, declared ^ ruled)
        assert set(PROBES[route]) == ruled, (route, set(PROBES[route]) ^ ruled)


@pytest.mark.parametrize("route, name", [(route, name) for route in ROUTES
                                         for name in PROBES[route]])
def test_field_is_honoured_refused_or_inert(server, route, name):
    probe, companions = PROBES[route][name]
    base = {**BASELINE, **ROUTES[route][2], **companions}
    status, body, sent = _post(server, route, {**base, **probe})
    rule = FIELDS[name]
    if rule.status == "refused":
        assert status == 400 and body["error"]["param"] == name, body
        assert not sent                  # nothing reached the engine
        return
    assert status == 200, body
    _, ref_body, ref_sent = _post(server, route, base)
    if rule.status == "inert":
        assert (sent, body) == (ref_sent, ref_body)
    elif name == "request_id":
        url, _ = server
        prefix = "cmpl" if route == "completion" else "chatcmpl"
        r = httpx.post(f"{url}/v1/{ROUTES[route][0]}", json={**base, **probe}, timeout=60)
        assert r.json()["id"] == f"{prefix}-my-request"
    else:
        assert (sent, body) != (ref_sent, ref_body), f"{name} changed nothing"


@pytest.mark.parametrize("name, value", [
    ("functions", [{"name": "f", "parameters": {}}]), ("function_call", "auto"),
    ("audio", {"voice": "alloy", "format": "wav"}), ("modalities", ["text", "audio"]),
    ("web_search_options", {}),
])
def test_openai_fields_that_would_change_the_output_are_refused(server, name, value):
    assert name in REFUSED_OPENAI_FIELDS
    status, body, sent = _post(server, "chat", {**BASELINE, **ROUTES["chat"][2], name: value})
    assert status == 400 and body["error"]["param"] == name and not sent, body


def test_unknown_and_ignorable_openai_fields_are_accepted_and_logged(server, caplog):
    base = {**BASELINE, **ROUTES["chat"][2]}
    ignored = {"store": True, "metadata": {"k": "v"}, "service_tier": "auto",
               "prediction": {"type": "content", "content": "x"}, "modalities": ["text"],
               "verbosity": "low", "no_such_field": 1}
    _, ref_body, ref_sent = _post(server, "chat", base)
    with caplog.at_level(logging.WARNING, logger="manylora.entrypoints.openai.vllm_fields"):
        status, body, sent = _post(server, "chat", {**base, **ignored})
    assert status == 200 and (sent, body) == (ref_sent, ref_body)
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert "present in the request but ignored" in logged
    for name in ignored.keys() - {"modalities"}:
        assert name in logged


def test_request_chat_template_refused_without_trust(base_dir):
    with running_server(base_dir) as (_, url):
        for field, value in [("chat_template", OTHER_TEMPLATE),
                             ("chat_template_kwargs", {"chat_template": OTHER_TEMPLATE})]:
            r = httpx.post(f"{url}/v1/chat/completions", json={
                **BASELINE, "messages": [{"role": "user", "content": "x"}], field: value},
                timeout=60)
            assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
            assert "--trust-request-chat-template" in r.json()["error"]["message"]


def test_trusted_request_template_from_either_field_renders_the_prompt(server):
    messages = [{"role": "user", "content": "Hello there"}]
    for extra in ({"chat_template": OTHER_TEMPLATE},
                  {"chat_template_kwargs": {"chat_template": OTHER_TEMPLATE}}):
        status, body, sent = _post(server, "chat", {**BASELINE, "messages": messages, **extra})
        assert status == 200, body
        assert [prompt["prompt"] for prompt, _, _ in sent] == ["Hello there|"]


def test_truncate_prompt_semantics():
    from manylora.entrypoints.openai.errors import OpenAIError
    from manylora.entrypoints.openai.vllm_fields import truncate_prompt
    ids = list(range(10))
    assert truncate_prompt(ids, None, None, 8) == ids
    assert truncate_prompt(ids, 3, None, 64) == [7, 8, 9]
    assert truncate_prompt(ids, 3, "left", 64) == [7, 8, 9]
    assert truncate_prompt(ids, 3, "right", 64) == [0, 1, 2]
    assert truncate_prompt(ids, 20, None, 64) == ids
    assert truncate_prompt(ids, -1, None, 4) == [6, 7, 8, 9]
    for bad in (65, 0):                   # past the context; no prompt left
        with pytest.raises(OpenAIError) as info:
            truncate_prompt(ids, bad, None, 64)
        assert info.value.param == "truncate_prompt_tokens"


def test_response_ids_keep_engine_ids_unique():
    from manylora.entrypoints.openai.vllm_fields import response_ids
    rid, engine = response_ids("cmpl", None)
    assert rid == engine and rid.startswith("cmpl-") and len(rid) == 37
    first, second = response_ids("cmpl", "job"), response_ids("cmpl", "job")
    assert first[0] == second[0] == "cmpl-job"
    assert first[1] != second[1] and first[1].startswith("cmpl-job-")


def test_published_schema_of_refused_fields_admits_only_unset_values():
    schema = ChatCompletionRequest.model_json_schema()
    assert schema["additionalProperties"] is True
    for name, rule in FIELDS.items():
        if rule.status != "refused" or name not in schema["properties"] or name == "best_of":
            continue
        options = schema["properties"][name]["anyOf"]
        assert {"type": "null"} in options and rule.why in schema["properties"][name][
            "description"]
        assert all("const" in o or o.get("maxItems") == 0 or o.get("maxProperties") == 0
                   or o == {"type": "null"} for o in options), (name, options)
