"""Tool calling through a real ``manylora serve`` (``--enable-auto-tool-choice
--tool-call-parser hermes``) with the clients people use: the official ``openai`` client,
LangChain (``langchain-openai``) and LiteLLM, all on loopback, nothing else reached.

Named and required choices need the grammar path (task 19D: ``manylora.structured``),
``response_format`` (LangChain's json_schema and json_mode, LiteLLM's) its server side, and
LiteLLM's ``presence_penalty`` penalties on the server (task 19F); those tests skip until
their part is in the tree. The
tiny model's weights are random, so what is checked is what must hold whatever it writes:
arguments that validate against the tool's schema, parsed objects of the asked type."""

from __future__ import annotations

import importlib.util
import json
import os

import httpx
import openai
import pytest
from server_helpers import BASE, running_server

from manylora.entrypoints.openai.errors import OpenAIError
from manylora.entrypoints.openai.protocol import ChatCompletionRequest

jsonschema = pytest.importorskip("jsonschema")


def _chat_check_passes(**fields) -> bool:
    try:
        ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], **fields).check()
    except OpenAIError:
        return False
    return True


needs_grammar = pytest.mark.skipif(importlib.util.find_spec("manylora.structured") is None,
                                   reason="needs the grammar path (task 19D, branch structured)")
needs_penalties = pytest.mark.skipif(not _chat_check_passes(presence_penalty=0.5),
                                     reason="needs penalties on the server (task 19F)")
needs_response_format = pytest.mark.skipif(
    not _chat_check_passes(response_format={"type": "json_object"}),
    reason="needs response_format on the server (task 19D)")

# small closed schemas: whatever a random model picks under the grammar ends soon
FORECAST = {"type": "object", "properties": {
    "unit": {"type": "string", "enum": ["c", "f"]},
    "days": {"type": "integer", "enum": [1, 2, 3]}},
    "required": ["unit", "days"], "additionalProperties": False}
ALERT = {"type": "object", "properties": {"severe": {"type": "boolean"}},
         "required": ["severe"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "forecast", "description": "Forecast.",
                                           "parameters": FORECAST}},
         {"type": "function", "function": {"name": "alert", "parameters": ALERT}}]
SCHEMAS = {"forecast": FORECAST, "alert": ALERT}
USER = [{"role": "user", "content": "Weather in Oslo?"}]
HISTORY = USER + [
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "forecast", "arguments": '{"unit": "c", "days": 2}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "cold"}]
MAX_TOKENS = 96


@pytest.fixture(scope="module")
def tool_server(base_dir):
    with running_server(base_dir, "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                        max_model_len=256) as (server, url):
        yield url


@pytest.fixture(scope="module")
def no_whitespace(base_dir):
    """``logit_bias`` pushing down every whitespace-only token: a random model under a JSON
    grammar otherwise wanders in the whitespace JSON allows (a trained one does not) until
    ``max_tokens``. The grammar still decides what may come; this only steers the pick."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base_dir)
    return {str(i): -100 for i in range(len(tok))
            if tok.decode([i]) and not tok.decode([i]).strip()}


@pytest.fixture(scope="module")
def close_objects(base_dir, no_whitespace):
    """``no_whitespace`` and a push towards ``}``: under ``json_object`` (any object) a
    random model would otherwise write a key string that never ends (any text is allowed
    in it); this steers it to close objects where the grammar lets it."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base_dir)
    [close] = tok.encode("}", add_special_tokens=False)
    return {**no_whitespace, str(close): 20}


@pytest.fixture
def oai(tool_server):
    return openai.OpenAI(base_url=f"{tool_server}/v1", api_key="unused", max_retries=0)


def _streamed(oai, **kwargs):
    """Content, calls ``[(id, name, arguments)]`` and finish reason of a streamed choice."""
    content, calls, reason = "", {}, None
    for chunk in oai.chat.completions.create(stream=True, **kwargs):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for piece in choice.delta.tool_calls or []:
            call = calls.setdefault(piece.index, [piece.id, piece.function.name, ""])
            call[2] += piece.function.arguments or ""
        reason = choice.finish_reason or reason
    return content or None, [tuple(calls[i]) for i in sorted(calls)], reason


def _calls(oai, stream, **kwargs):
    if stream:
        return _streamed(oai, **kwargs)
    choice = oai.chat.completions.create(**kwargs).choices[0]
    calls = [(c.id, c.function.name, c.function.arguments)
             for c in choice.message.tool_calls or []]
    return choice.message.content, calls, choice.finish_reason


# ------------------------------------------------------------------------ openai client


@pytest.mark.parametrize("stream", [False, True])
def test_auto_choice_with_a_parser_answers_streamed_and_not(oai, stream):
    content, calls, reason = _calls(oai, stream, model=BASE, messages=USER, tools=TOOLS,
                                    tool_choice="auto", max_tokens=16, temperature=0)
    # the random model writes no <tool_call>: its text is the content, as without tools
    plain = oai.chat.completions.create(model=BASE, messages=USER, max_tokens=16,
                                        temperature=0).choices[0]
    assert (content, calls, reason) == (plain.message.content, [], plain.finish_reason)


def test_tool_history_is_accepted_and_rendered(oai, tool_server):
    resp = oai.chat.completions.create(model=BASE, messages=HISTORY, tools=TOOLS,
                                       tool_choice="none", max_tokens=4)
    assert resp.choices[0].message.tool_calls is None
    # the history reaches the prompt: more tokens than the same turn without it
    short = oai.chat.completions.create(model=BASE, messages=USER, max_tokens=4)
    assert resp.usage.prompt_tokens > short.usage.prompt_tokens
    assert httpx.post(f"{tool_server}/v1/chat/completions", json={
        "model": BASE, "messages": HISTORY + [{"role": "developer", "content": "be brief"}],
        "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0]"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0]"),
    ({"messages": [{"role": "developer"}]}, "messages[0]"),
    ({"messages": [{"role": "developer", "content": {"text": "x"}}]}, "messages[0].content"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "function": {
        "name": "f", "arguments": "{not json"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "tool", "function": {
        "name": "f", "arguments": "{}"}}]}]}, "messages[0].tool_calls[0].type"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {
        "name": "f", "arguments": "{}"}}]}]}, "messages[0].tool_calls[0].id"),
    ({"messages": USER, "tools": [{"type": "function"}]}, "tools[0].function"),
    ({"messages": USER, "tools": [{"type": "function", "function": {"name": 3}}]},
     "tools[0].function.name"),
    ({"messages": USER, "tools": [{"function": {"name": "f", "parameters": []}}]},
     "tools[0].function.parameters"),
    ({"messages": USER, "tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"messages": USER, "tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"messages": USER, "tool_choice": "required"}, "tool_choice"),
    ({"messages": USER, "tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
])
def test_malformed_tool_shapes_are_400_naming_the_field(tool_server, body, param):
    r = httpx.post(f"{tool_server}/v1/chat/completions", json={"model": BASE, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith(param), r.text


@needs_grammar
@needs_penalties
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_named_choice_arguments_validate_against_the_schema(oai, no_whitespace, stream, seed):
    content, calls, reason = _calls(
        oai, stream, model=BASE, messages=USER, tools=TOOLS, max_tokens=MAX_TOKENS,
        tool_choice={"type": "function", "function": {"name": "forecast"}}, seed=seed,
        logit_bias=no_whitespace)
    assert content is None and reason == "stop"
    [(call_id, name, arguments)] = calls
    assert name == "forecast" and call_id.startswith("chatcmpl-tool-")
    jsonschema.validate(json.loads(arguments), FORECAST)


@needs_grammar
@needs_penalties
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_required_choice_calls_validate_against_their_tools(oai, no_whitespace, stream, seed):
    _, calls, reason = _calls(oai, stream, model=BASE, messages=USER, tools=TOOLS,
                              tool_choice="required", max_tokens=MAX_TOKENS, seed=seed,
                              logit_bias=no_whitespace)
    assert calls and reason == "tool_calls"
    for _, name, arguments in calls:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@needs_grammar
@needs_penalties
def test_returned_tool_calls_round_trip_in_the_history(oai, no_whitespace):
    first = oai.chat.completions.create(
        model=BASE, messages=USER, tools=TOOLS, max_tokens=MAX_TOKENS,
        tool_choice={"type": "function", "function": {"name": "alert"}},
        logit_bias=no_whitespace)
    message = first.choices[0].message
    history = USER + [message.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": c.id, "content": "none"} for c in message.tool_calls]
    second = oai.chat.completions.create(model=BASE, messages=history, tools=TOOLS,
                                         tool_choice="none", max_tokens=4)
    assert second.choices[0].message.content is not None


# --------------------------------------------------------------------------- LangChain


def _chat_model(url: str, logit_bias: dict[str, int]):
    langchain_openai = pytest.importorskip("langchain_openai")
    bias = logit_bias if _chat_check_passes(logit_bias={"1": 1.0}) else None
    return langchain_openai.ChatOpenAI(base_url=f"{url}/v1", api_key="unused", model=BASE,
                                       max_tokens=MAX_TOKENS, max_retries=0, temperature=1.0,
                                       logit_bias=bias)


@pytest.fixture
def chat_model(tool_server, no_whitespace):
    return _chat_model(tool_server, no_whitespace)


def _forecast_model():
    from typing import Literal

    from pydantic import BaseModel, ConfigDict

    class Forecast(BaseModel):
        """A forecast request."""

        model_config = ConfigDict(extra="forbid")
        unit: Literal["c", "f"]
        days: Literal[1, 2, 3]

    return Forecast


@needs_grammar
@pytest.mark.parametrize("method", [
    pytest.param("json_schema", marks=needs_response_format), "function_calling"])
def test_langchain_with_structured_output_returns_parsed_objects(chat_model, method):
    forecast = _forecast_model()
    result = chat_model.with_structured_output(forecast, method=method).invoke(
        "Weather in Oslo?")
    assert isinstance(result, forecast)


@needs_response_format
def test_langchain_with_structured_output_json_mode_returns_a_dict(tool_server, close_objects):
    result = _chat_model(tool_server, close_objects).with_structured_output(
        method="json_mode").invoke("Reply in JSON: the weather in Oslo.")
    assert isinstance(result, dict)


@needs_grammar
@pytest.mark.parametrize("tool_choice", ["required", "Forecast", "any"])
def test_langchain_bind_tools_returns_parsed_tool_calls(chat_model, tool_choice):
    forecast = _forecast_model()
    message = chat_model.bind_tools([forecast], tool_choice=tool_choice).invoke(
        "Weather in Oslo?")
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call["name"] == "Forecast"
        forecast(**call["args"])                 # the arguments parse into the model


def test_langchain_bind_tools_auto_answers(chat_model):
    message = chat_model.bind_tools([_forecast_model()], tool_choice="auto").invoke("hi")
    assert message.tool_calls == [] and isinstance(message.content, str)


# ----------------------------------------------------------------------------- LiteLLM


@pytest.fixture
def litellm():
    os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"      # no fetch of the cost map
    os.environ.setdefault("LITELLM_TELEMETRY", "False")
    litellm = pytest.importorskip("litellm")
    litellm.telemetry = False
    return litellm


def _litellm(litellm, url, **kwargs):
    return litellm.completion(model=f"openai/{BASE}", api_base=f"{url}/v1", api_key="unused",
                              messages=USER, max_tokens=MAX_TOKENS, num_retries=0, **kwargs)


def test_litellm_tools_auto(litellm, tool_server):
    resp = _litellm(litellm, tool_server, tools=TOOLS, tool_choice="auto")
    assert resp.choices[0].message.tool_calls is None
    assert isinstance(resp.choices[0].message.content, str)


@needs_grammar
@needs_penalties
def test_litellm_tools_required(litellm, tool_server, no_whitespace):
    resp = _litellm(litellm, tool_server, tools=TOOLS, tool_choice="required",
                    logit_bias=no_whitespace)
    calls = resp.choices[0].message.tool_calls
    assert calls and resp.choices[0].finish_reason == "tool_calls"
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@needs_response_format
def test_litellm_response_format(litellm, tool_server, no_whitespace, close_objects):
    resp = _litellm(litellm, tool_server, logit_bias=no_whitespace, response_format={
        "type": "json_schema", "json_schema": {"name": "forecast", "schema": FORECAST}})
    jsonschema.validate(json.loads(resp.choices[0].message.content), FORECAST)
    resp = _litellm(litellm, tool_server, logit_bias=close_objects,
                    response_format={"type": "json_object"})
    assert isinstance(json.loads(resp.choices[0].message.content), dict)


@needs_penalties
def test_litellm_presence_penalty(litellm, tool_server):
    resp = _litellm(litellm, tool_server, presence_penalty=0.5, frequency_penalty=0.2)
    assert isinstance(resp.choices[0].message.content, str)


def test_tokenize_renders_tools_as_the_chat_route(tool_server):
    with_tools = httpx.post(f"{tool_server}/tokenize", json={
        "model": BASE, "messages": HISTORY, "tools": TOOLS}).json()
    chat = httpx.post(f"{tool_server}/v1/chat/completions", json={
        "model": BASE, "messages": HISTORY, "tools": TOOLS, "tool_choice": "none",
        "max_tokens": 1}).json()
    assert with_tools["count"] == chat["usage"]["prompt_tokens"]


# ------------------------------------------------------------------ Responses API tools

FLAT_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]


@needs_grammar
@needs_penalties
@pytest.mark.parametrize("tool_choice", [{"type": "function", "name": "forecast"}, "required"])
def test_responses_forced_choice_returns_a_function_call_that_round_trips(
        oai, no_whitespace, tool_choice):
    first = oai.responses.create(model=BASE, input="Weather in Oslo?", tools=FLAT_TOOLS,
                                 tool_choice=tool_choice, max_output_tokens=MAX_TOKENS,
                                 temperature=0, extra_body={"logit_bias": no_whitespace},
                                 store=False)
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and first.status == "completed"
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    # the calls and their results sent back render as the chat route's tool messages
    replay = [{"role": "user", "content": "Weather in Oslo?"}] + [
        {"type": "function_call", "call_id": c.call_id, "name": c.name,
         "arguments": c.arguments} for c in calls] + [
        {"type": "function_call_output", "call_id": c.call_id, "output": "cold"}
        for c in calls]
    second = oai.responses.create(model=BASE, input=replay, tools=FLAT_TOOLS,
                                  tool_choice="none", max_output_tokens=4, store=False)
    assert [item.type for item in second.output] == ["message"]
    history = USER + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": c.call_id, "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}} for c in calls]}] + [
        {"role": "tool", "tool_call_id": c.call_id, "content": "cold"} for c in calls]
    chat = oai.chat.completions.create(model=BASE, messages=history, tools=TOOLS,
                                       tool_choice="none", max_tokens=1)
    without_result = oai.chat.completions.create(model=BASE, messages=history[:-len(calls)],
                                                 tools=TOOLS, tool_choice="none", max_tokens=1)
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.usage.input_tokens > without_result.usage.prompt_tokens


@needs_grammar
@needs_penalties
def test_responses_streamed_function_call_events_come_in_order(oai, no_whitespace):
    events = list(oai.responses.create(
        model=BASE, input="Weather in Oslo?", tools=FLAT_TOOLS, stream=True,
        tool_choice={"type": "function", "name": "alert"}, max_output_tokens=MAX_TOKENS,
        temperature=0, extra_body={"logit_bias": no_whitespace}, store=False))
    kinds = [e.type for e in events]
    deltas = kinds.count("response.function_call_arguments.delta")
    assert deltas >= 1
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     *["response.function_call_arguments.delta"] * deltas,
                     "response.function_call_arguments.done", "response.output_item.done",
                     "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    added, done, final = events[2].item, events[-2].item, events[-1].response
    assert (added.type, added.name, added.status) == ("function_call", "alert", "in_progress")
    arguments = "".join(e.delta for e in events if e.type.endswith("arguments.delta"))
    assert events[-3].arguments == done.arguments == arguments
    jsonschema.validate(json.loads(arguments), ALERT)
    assert final.output[0].call_id == done.call_id == added.call_id
    assert final.output[0].arguments == arguments


@pytest.mark.parametrize("body, param, named", [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type", "web_search"),
    ({"tools": FLAT_TOOLS + [{"type": "file_search", "vector_store_ids": []}]},
     "tools[2].type", "file_search"),
    ({"tools": FLAT_TOOLS, "tool_choice": {"type": "function", "name": "nowcast"}},
     "tool_choice", "nowcast"),
    ({"tools": FLAT_TOOLS, "tool_choice": {"type": "web_search_preview"}},
     "tool_choice", "web_search_preview"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools[0]", "name"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{x"}]},
     "input", "JSON"),
])
def test_responses_bad_tools_are_400_naming_them(tool_server, body, param, named):
    r = httpx.post(f"{tool_server}/v1/responses",
                   json={"model": BASE, "input": "Weather?", **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"].startswith(param) and named in error["message"], r.text


@pytest.mark.parametrize("stream", [False, True])
def test_responses_auto_choice_answers_as_the_chat_route(oai, stream):
    kwargs = dict(model=BASE, input="Weather in Oslo?", tools=FLAT_TOOLS, tool_choice="auto",
                  max_output_tokens=16, temperature=0, store=False)
    if stream:
        events = list(oai.responses.create(stream=True, **kwargs))
        reply = events[-1].response
    else:
        reply = oai.responses.create(**kwargs)
    chat = oai.chat.completions.create(model=BASE, messages=USER, tools=TOOLS,
                                       tool_choice="auto", max_tokens=16, temperature=0)
    # the random model writes no <tool_call>: one message item with the chat route's text
    assert [item.type for item in reply.output] == ["message"]
    assert reply.output_text == chat.choices[0].message.content


@needs_grammar
@needs_penalties
def test_responses_stored_calls_continue_with_previous_response_id(oai, no_whitespace):
    first = oai.responses.create(model=BASE, input="Weather in Oslo?", tools=FLAT_TOOLS,
                                 tool_choice={"type": "function", "name": "alert"},
                                 max_output_tokens=MAX_TOKENS, temperature=0,
                                 extra_body={"logit_bias": no_whitespace})
    [call] = first.output
    result = [{"type": "function_call_output", "call_id": call.call_id, "output": "none"}]
    second = oai.responses.create(model=BASE, previous_response_id=first.id, input=result,
                                  tools=FLAT_TOOLS, tool_choice="none", max_output_tokens=2)
    replayed = oai.responses.create(model=BASE, input=[
        {"role": "user", "content": "Weather in Oslo?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name,
         "arguments": call.arguments}, *result],
        tools=FLAT_TOOLS, tool_choice="none", max_output_tokens=2, store=False)
    assert second.usage.input_tokens == replayed.usage.input_tokens


@needs_grammar
@needs_penalties
@pytest.mark.parametrize("stream", [False, True])
def test_responses_max_tool_calls_keeps_the_first_calls(oai, no_whitespace, stream):
    def calls(**extra):
        kwargs = dict(model=BASE, input="Weather in Oslo?", tools=FLAT_TOOLS,
                      tool_choice="required", max_output_tokens=MAX_TOKENS, store=False,
                      extra_body={"logit_bias": no_whitespace, "seed": 4}, **extra)
        reply = (list(oai.responses.create(stream=True, **kwargs))[-1].response if stream
                 else oai.responses.create(**kwargs))
        return [(c.name, c.arguments) for c in reply.output if c.type == "function_call"]
    everything = calls()        # seed 4: the tiny random model writes two calls
    assert len(everything) >= 2 and calls(max_tool_calls=1) == everything[:1]
