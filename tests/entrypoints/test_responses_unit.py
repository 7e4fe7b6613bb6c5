"""Unit tests of ``/v1/responses``' serving layer without a server or a model: the request's
400s naming each refused field, the event sequence of a stream (and of one the engine ends
with an error), aborts on close, the stored-response bounds and ``previous_response_id``'s
conversation, ``text.format`` as the engine's output constraint, ``truncation: auto``.
Driven by test_serving_unit's fake engine (characters as tokens, a trivial template)."""

from __future__ import annotations

import asyncio
import json

import pytest
from pydantic import ValidationError
from test_serving_unit import FakeEngine, FakeModels

from manylora.entrypoints.openai.errors import OpenAIError
from manylora.entrypoints.openai.protocol_responses import ResponsesRequest, ResponsesResponse
from manylora.entrypoints.openai.responses_store import ResponseStore
from manylora.entrypoints.openai.serving_chat import OpenAIServingChat
from manylora.entrypoints.openai.serving_responses import OpenAIServingResponses
from manylora.sampling_params import RequestOutputKind


def _serving(script=("a", "ab", "abc"), **engine_kwargs) -> tuple:
    engine = FakeEngine(list(script), **engine_kwargs)
    models = FakeModels()
    return engine, OpenAIServingResponses(engine, models, OpenAIServingChat(engine, models))


def _request(**fields) -> ResponsesRequest:
    return ResponsesRequest(**{"model": "base", "input": "hi", **fields})


def _parse(events: list[str]) -> list[dict]:
    out = []
    for event in events:
        head, data = event.split("\n", 1)
        assert head.startswith("event: ") and data.startswith("data: ") and data.endswith("\n\n")
        body = json.loads(data[len("data: "):])
        assert body["type"] == head[len("event: "):]
        out.append(body)
    return out


async def _create(serving, request):
    try:
        return await serving.create_response(request)
    except OpenAIError as e:
        return e


@pytest.mark.parametrize("fields, param", [
    ({"input": []}, "input"), ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_tool_calls": 0}, "max_tool_calls"), ({"top_logprobs": 21}, "top_logprobs"),
    ({"include": ["file_search_call.results"]}, "include"),
    ({"stream_options": {"include_obfuscation": False}}, "stream_options"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "name": "f"}, {"type": "function", "name": "f"}]},
     "tools"),
    ({"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "allowed_tools"}},
     "tool_choice"),
    ({"tools": [{"type": "function", "name": "f"}], "tool_choice": "required",
      "text": {"format": {"type": "json_object"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "name": "f"}], "include": [
        "message.output_text.logprobs"]}, "include"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "name": "f"}}, "tool_choice"),
    ({"reasoning": {"effort": "high"}}, "reasoning"), ({"background": True}, "background"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"), ({"conversation": "conv_1"}, "conversation"),
    ({"context_management": [{"type": "compaction"}]}, "context_management"),
    ({"service_tier": "flex"}, "service_tier"),
    ({"prompt_cache_retention": "24h"}, "prompt_cache_retention"),
    ({"priority": 1}, "priority"), ({"seed": 2**63}, "seed"),
    ({"previous_response_id": "resp_x", "store": False}, "previous_response_id"),
])
def test_check_refuses_with_the_field_named(fields, param):
    with pytest.raises(OpenAIError) as info:
        _request(**fields).check()
    assert (info.value.status, info.value.param) == (400, param)


@pytest.mark.parametrize("fields, param", [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"metadata": {"k" * 65: "v"}}, "metadata"), ({"metadata": {"k": "v" * 513}}, "metadata"),
    ({"text": {"format": {"type": "json_schema", "name": "a b", "schema": {}}}}, "text"),
    ({"text": {"format": {"type": "grammar"}}}, "text"), ({"truncation": "yes"}, "truncation"),
    ({"stream": "yes"}, "stream"), ({"user": "\ud800"}, "user"),
])
def test_validation_refuses_what_the_schema_does(fields, param):
    with pytest.raises(ValidationError) as info:
        _request(**fields)
    assert info.value.errors()[0]["loc"][0] == param


def test_accepted_fields_parse_and_check():
    request = _request(
        input=[{"role": "developer", "content": "Be brief."},
               {"type": "message", "role": "user",
                "content": [{"type": "input_text", "text": "a"}, {"type": "input_text",
                                                                   "text": "b"}]},
               {"id": "msg_1", "type": "message", "role": "assistant", "status": "completed",
                "content": [{"type": "output_text", "text": "c", "annotations": []}]}],
        tool_choice="none", tools=[], reasoning={"effort": None}, include=[
            "message.output_text.logprobs"], top_logprobs=2, service_tier="auto",
        metadata={"k": "v"}, text={"format": {"type": "json_schema", "name": "s",
                                               "schema": {"type": "object"}, "strict": True},
                                    "verbosity": "low"})
    request.check()
    assert [m.text() for m in request.input] == ["Be brief.", "a\nb", "c"]
    assert request.text.format.schema_ == {"type": "object"}
    assert request.wants_logprobs()


def test_non_streamed_response_echoes_settings_and_counts_tokens():
    engine, serving = _serving()
    response = asyncio.run(_create(serving, _request(
        instructions="sys", temperature=0.5, max_output_tokens=3, metadata={"a": "b"},
        user="u")))
    assert isinstance(response, ResponsesResponse)
    prompt = "<system>sys<user>hi<assistant>"
    assert engine.seen_params[0].output_kind is RequestOutputKind.FINAL_ONLY
    assert (response.status, response.incomplete_details.reason) == ("incomplete",
                                                                     "max_output_tokens")
    assert response.output[0].content[0].text == "abc"
    assert response.output[0].status == "incomplete"
    assert (response.usage.input_tokens, response.usage.output_tokens,
            response.usage.total_tokens) == (len(prompt), 3, len(prompt) + 3)
    assert (response.temperature, response.max_output_tokens, response.metadata,
            response.user, response.instructions) == (0.5, 3, {"a": "b"}, "u", "sys")
    assert response.id.startswith("resp_") and response.output[0].id.startswith("msg_")


def test_stream_event_sequence():
    engine, serving = _serving()

    async def run():
        stream = await serving.create_response(_request(stream=True, include=[
            "message.output_text.logprobs"], top_logprobs=0))
        return _parse([e async for e in stream])

    events = asyncio.run(run())
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert engine.seen_params[0].output_kind is RequestOutputKind.DELTA
    assert [e["delta"] for e in events if e["type"].endswith(".delta")] == ["a", "b", "c"]
    assert [lp["token"] for e in events[4:7] for lp in e["logprobs"]] == ["a", "b", "c"]
    assert events[7]["text"] == "abc"
    assert events[0]["response"]["status"] == "in_progress" and not events[0]["response"][
        "output"]
    final = events[-1]["response"]
    assert final["output"][0]["content"][0]["text"] == "abc"
    assert final["usage"]["output_tokens"] == 3
    assert serving.retrieve(final["id"]).output[0].content[0].text == "abc"


def test_engine_error_after_the_stream_began_sends_error_then_failed():
    engine, serving = _serving(die_after=1)

    async def run():
        stream = await serving.create_response(_request(stream=True))
        return _parse([e async for e in stream])

    events = asyncio.run(run())
    assert [e["type"] for e in events][-3:] == ["response.output_text.delta", "error",
                                                "response.failed"]
    assert events[-2]["code"] == "503"
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "503"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert not engine.running


def test_closing_a_stream_aborts_its_request():
    engine, serving = _serving([c * (i + 1) for i, c in enumerate("abcdefgh")])

    async def run():
        stream = await serving.create_response(_request(stream=True))
        async for _ in stream:
            break
        await stream.aclose()

    asyncio.run(run())
    assert len(engine.aborted) == 1 and not engine.running


def test_previous_response_id_continues_the_stored_conversation():
    engine, serving = _serving()
    first = asyncio.run(_create(serving, _request(instructions="sys")))
    second = asyncio.run(_create(serving, _request(input="more", previous_response_id=first.id,
                                                   instructions="new")))
    assert isinstance(second, ResponsesResponse)
    # the earlier instructions are not carried over; the earlier reply is
    expected = "<system>new<user>hi<assistant>abc<user>more<assistant>"
    assert second.usage.input_tokens == len(expected)
    assert second.previous_response_id == first.id
    unknown = asyncio.run(_create(serving, _request(previous_response_id="resp_nope")))
    assert (unknown.status, unknown.param) == (404, "previous_response_id")
    unstored = asyncio.run(_create(serving, _request(store=False)))
    assert unstored.store is False
    with pytest.raises(OpenAIError) as info:
        serving.retrieve(unstored.id)
    assert (info.value.status, info.value.param) == (404, "response_id")


def test_store_bounds_drop_the_least_recently_used():
    def response(i):
        return ResponsesResponse(id=f"resp_{i}", created_at=0, status="completed", model="m")

    store = ResponseStore(max_responses=2, max_chars=10)
    store.put(response(0), [{"role": "user", "content": "aaa"}])
    store.put(response(1), [{"role": "user", "content": "bbb"}])
    assert store.get("resp_0") is not None                # 0 is now the most recent
    store.put(response(2), [{"role": "user", "content": "ccc"}])
    assert store.get("resp_1") is None and len(store) == 2
    store.put(response(3), [{"role": "user", "content": "d" * 8}])   # 3 + 8 > 10 chars
    assert store.get("resp_0") is None and store.get("resp_2") is None
    store.put(response(4), [{"role": "user", "content": "e" * 11}])  # alone over the bound
    assert store.get("resp_4") is None and store.get("resp_3") is not None
    with pytest.raises(ValueError):
        ResponseStore(max_responses=0)


def test_text_format_becomes_the_output_constraint_and_a_refusal_names_text():
    engine, serving = _serving()
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    asyncio.run(_create(serving, _request(text={"format": {
        "type": "json_schema", "name": "s", "schema": schema}})))
    asyncio.run(_create(serving, _request(text={"format": {"type": "json_object"}})))
    json_params, object_params = (p.structured_outputs for p in engine.seen_params)
    assert json.loads(json_params.json) == schema and json_params.disable_any_whitespace
    assert object_params.json_object is True
    engine.fail = ValueError("structured_outputs is not supported by this engine yet")
    error = asyncio.run(_create(serving, _request(text={"format": {"type": "json_object"}})))
    assert (error.status, error.param) == (400, "text")


def test_truncation_auto_drops_the_oldest_tokens():
    engine, serving = _serving(max_model_len=64)
    long_input = "x" * 40                 # 57 tokens with the template's, 67 with the output
    refused = asyncio.run(_create(serving, _request(input=long_input, max_output_tokens=10)))
    assert (refused.status, refused.param) == (400, "max_output_tokens")
    response = asyncio.run(_create(serving, _request(input=long_input, max_output_tokens=10,
                                                     truncation="auto")))
    assert response.usage.input_tokens == 54 and response.truncation == "auto"
