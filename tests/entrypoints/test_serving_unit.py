"""Unit tests of the OpenAI serving layer without a server or a model: request validation,
log-probability formatting, SSE framing, and the endpoints driven by a fake engine (canned
outputs of the kind each request asks for) to check response shapes and clean-up."""

from __future__ import annotations

import asyncio
import gc
import json

import pytest
from pydantic import ValidationError

from manylora.engine.async_llm import EngineDeadError, EngineOverloadedError
from manylora.engine.outputs import CompletionOutput, Logprob, RequestOutput
from manylora.entrypoints.openai.errors import OpenAIError, not_found, to_openai_error
from manylora.entrypoints.openai.logprobs import chat_logprobs, completion_logprobs
from manylora.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    CompletionRequest,
    DeltaMessage,
    StreamOptions,
)
from manylora.entrypoints.openai.request_sampling import (
    check_context_length,
    child_sampling_params,
    make_sampling_params,
)
from manylora.entrypoints.openai.serving_chat import OpenAIServingChat
from manylora.entrypoints.openai.serving_completion import OpenAIServingCompletion
from manylora.entrypoints.openai.sse import (
    SSE_DONE,
    chunk_event,
    sse_event,
    usage_info,
)
from manylora.entrypoints.openai.streams import (
    MergedStream,
)
from manylora.sampling_params import RequestOutputKind


def _status(fn, *args, **kwargs) -> OpenAIError:
    with pytest.raises(OpenAIError) as info:
        fn(*args, **kwargs)
    return info.value


def _events(stream_text: list[str]) -> list:
    out = []
    for event in stream_text:
        assert event.startswith("data: ") and event.endswith("\n\n")
        body = event[len("data: "):-2]
        out.append(body if body == "[DONE]" else json.loads(body))
    return out


# ------------------------------------------------------------------------ protocol


def test_completion_request_parses_prompt_forms_and_ignores_unknown_fields():
    assert CompletionRequest(prompt="hi", foo=1).prompt == "hi"
    assert CompletionRequest(prompt=["a", "b"]).prompt == ["a", "b"]
    assert CompletionRequest(prompt=[1, 2, 3]).prompt == [1, 2, 3]
    assert CompletionRequest(prompt=[[1], [2, 3]]).prompt == [[1], [2, 3]]
    req = CompletionRequest(prompt="x")
    assert (req.max_tokens, req.temperature, req.n, req.echo) == (16, None, 1, False)
    with pytest.raises(ValidationError):
        CompletionRequest(prompt={"a": 1})


@pytest.mark.parametrize("fields, param", [
    ({"n": 0}, "n"), ({"n": 129}, "n"), ({"best_of": 2}, "best_of"),
    ({"suffix": ""}, "suffix"), ({"logprobs": 21}, "logprobs"), ({"logprobs": -1}, "logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"), ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": []}, "prompt"), ({"prompt": ""}, "prompt"), ({"prompt": [[1], []]}, "prompt"),
    ({"seed": 2**63}, "seed"), ({"seed": -(2**63) - 1}, "seed"),
])
def test_completion_request_check_rejects(fields, param):
    req = CompletionRequest(**{"prompt": "x", **fields})
    error = _status(req.check)
    assert error.status == 400 and error.param == param


def test_completion_request_check_accepts_supported_values():
    CompletionRequest(prompt="x", n=3, best_of=3, logprobs=20, presence_penalty=0,
                      logit_bias={}, stream=True, stream_options={"include_usage": True},
                      seed=-(2**63)).check()
    CompletionRequest(prompt="x", n=2, seed=2**63 - 1).check()


@pytest.mark.parametrize("fields, param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    ({"tools": [{"function": {"name": "f"}}, {"function": {"name": "f"}}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ({"tools": [{"function": {"name": "f"}}], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"continue_final_message": True}, "continue_final_message"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
])
def test_chat_request_check_rejects(fields, param):
    req = ChatCompletionRequest(**{"messages": [{"role": "user", "content": "x"}], **fields})
    error = _status(req.check)
    assert error.status == 400 and error.param == param


def test_chat_request_messages_and_max_tokens():
    req = ChatCompletionRequest(messages=[
        {"role": "system", "content": "s"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text",
                                                                     "text": "b"}]},
        {"role": "assistant", "content": None}], max_tokens=5, tools=[],
        response_format={"type": "text"}, unknown="ignored")
    req.check()
    assert [m.to_template() for m in req.messages] == [
        {"role": "system", "content": "s"}, {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": ""}]
    assert req.max_tokens_param() == (5, "max_tokens")
    req.max_completion_tokens = 7
    assert req.max_tokens_param() == (7, "max_completion_tokens")
    with pytest.raises(ValidationError):
        ChatCompletionRequest(messages=[{"role": "robot", "content": "x"}])


def test_delta_message_leaves_out_unset_fields():
    assert DeltaMessage(role="assistant", content="").model_dump() == {
        "role": "assistant", "content": ""}
    assert DeltaMessage(content="x").model_dump() == {"content": "x"}
    assert DeltaMessage().model_dump() == {}


# ------------------------------------------------------------------------ logprobs


def _lp(entries: list[tuple[int, float, str | None]]) -> dict[int, Logprob]:
    ranked = sorted((-v for _, v, _ in entries))
    return {tid: Logprob(v, 1 + ranked.index(-v), text) for tid, v, text in entries}


def test_completion_logprobs_top_map_offsets_and_floor():
    # token 5 sampled but not among the top 2; token 7 sampled and the most likely
    steps = [_lp([(5, -3.0, "ab"), (1, -0.5, "x"), (2, -1.0, "y")]),
             _lp([(7, -0.1, "c"), (8, float("-inf"), "d")])]
    out = completion_logprobs([5, 7], steps, num_top=2, initial_offset=10)
    assert out.tokens == ["ab", "c"]
    assert out.token_logprobs == [-3.0, -0.1]
    assert out.top_logprobs == [{"ab": -3.0, "x": -0.5, "y": -1.0},
                                {"c": -0.1, "d": -9999.0}]
    assert out.text_offset == [10, 12]
    zero = completion_logprobs([5], [_lp([(5, -3.0, "ab")])], num_top=0)
    assert zero.top_logprobs == [{"ab": -3.0}]
    no_tok = completion_logprobs([5], [_lp([(5, -3.0, None)])], num_top=0)
    assert no_tok.tokens == ["token_id:5"]
    as_ids = completion_logprobs([5, 7], steps, num_top=1, as_token_ids=True)
    assert as_ids.tokens == ["token_id:5", "token_id:7"]
    assert as_ids.top_logprobs[0] == {"token_id:5": -3.0, "token_id:1": -0.5}
    assert as_ids.text_offset == [0, 2]


def test_chat_logprobs_top_list_holds_only_the_most_likely():
    steps = [_lp([(5, -3.0, "é"), (1, -0.5, "x"), (2, -1.0, "y")]),      # sampled not in top
             _lp([(2, -1.0, "y"), (1, -0.5, "x")])]                      # sampled in top 2
    out = chat_logprobs([5, 2], steps, num_top=2).model_dump()["content"]
    assert out[0]["token"] == "é" and out[0]["bytes"] == list("é".encode())
    assert [t["token"] for t in out[0]["top_logprobs"]] == ["x", "y"]
    assert [t["token"] for t in out[1]["top_logprobs"]] == ["x", "y"]
    assert out[1]["logprob"] == -1.0
    assert chat_logprobs([5], steps[:1], num_top=0).content[0].top_logprobs == []
    as_ids = chat_logprobs([5], steps[:1], num_top=1, as_token_ids=True).content[0]
    assert as_ids.token == "token_id:5" and as_ids.top_logprobs[0].token == "token_id:1"


# ------------------------------------------------------------------------ SSE and helpers


def test_sse_framing_and_usage_modes():
    assert SSE_DONE == "data: [DONE]\n\n"
    assert sse_event({"a": "é"}) == 'data: {"a":"é"}\n\n'
    chunk = ChatCompletionStreamResponse(id="c", created=1, model="m", choices=[
        ChatCompletionStreamChoice(index=0, delta=DeltaMessage(content="x"))])
    usage = usage_info(3, 4)
    plain, = _events([chunk_event(chunk, None, usage)])
    assert "usage" not in plain
    assert plain["choices"][0] == {"index": 0, "delta": {"content": "x"}, "logprobs": None,
                                   "finish_reason": None, "stop_reason": None}
    with_null, = _events([chunk_event(chunk, StreamOptions(include_usage=True), usage)])
    assert with_null["usage"] is None
    continuous, = _events([chunk_event(
        chunk, StreamOptions(include_usage=True, continuous_usage_stats=True), usage)])
    assert continuous["usage"] == {"prompt_tokens": 3, "completion_tokens": 4,
                                   "total_tokens": 7}


def test_check_context_length():
    assert check_context_length(10, None, 100) == 90
    assert check_context_length(10, 90, 100) == 90
    error = _status(check_context_length, 100, None, 100)
    assert (error.status, error.code, error.param) == (413, "context_length_exceeded", "prompt")
    assert "100" in error.message
    error = _status(check_context_length, 10, 91, 100, max_tokens_param="max_completion_tokens")
    assert (error.status, error.param) == (400, "max_completion_tokens")
    assert "100" in error.message and "101" in error.message
    assert _status(check_context_length, 10, 0, 100).param == "max_tokens"


def test_sampling_params_errors_and_child_seeds():
    error = _status(make_sampling_params, top_p=2.0)
    assert (error.status, error.param) == (400, "top_p")
    params = make_sampling_params(seed=7, max_tokens=3)
    assert [p.seed for p in child_sampling_params(params, 3)] == [7, 8, 9]
    # seed + i wraps as a signed 64-bit addition: every child seed stays a torch seed
    top = make_sampling_params(seed=2**63 - 2)
    assert [p.seed for p in child_sampling_params(top, 3)] == [2**63 - 2, 2**63 - 1, -(2**63)]
    assert [p.max_tokens for p in child_sampling_params(params, 3)] == [3, 3, 3]
    unseeded = make_sampling_params()
    assert child_sampling_params(unseeded, 2) == [unseeded, unseeded]


def test_to_openai_error():
    assert to_openai_error(ValueError("bad")).status == 400
    assert to_openai_error(EngineOverloadedError("full")).status == 503
    assert to_openai_error(EngineDeadError("dead")).status == 503
    assert to_openai_error(FileNotFoundError("x")).status == 404
    error = not_found("no", param="model")
    assert to_openai_error(error) is error
    assert to_openai_error(RuntimeError("bug")) is None


# ------------------------------------------------------------------------ fake engine


class FakeTokenizer:
    """Characters as token ids (``ord``), BOS 1; a trivial chat template."""

    chat_template = "fake"

    def __call__(self, text, add_special_tokens=True):
        class Enc:
            input_ids = ([1] if add_special_tokens else []) + [ord(c) for c in text]
        return Enc()

    def decode(self, ids):
        return "".join(chr(i) for i in ids if i > 1)

    def apply_chat_template(self, messages, tokenize, add_generation_prompt,
                            continue_final_message, chat_template, **kwargs):
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


class FakeEngine:
    """Yields each request the cumulative outputs of ``script`` (a list of output texts, one
    per step, one token per character), then finishes with ``length``."""

    def __init__(self, script, max_model_len=64, fail=None, die_after=None):
        self.tokenizer = FakeTokenizer()
        self.max_model_len = max_model_len
        self.script = script
        self.fail = fail
        self.die_after = die_after
        self.running: set[str] = set()
        self.aborted: list[str] = []
        self.seen_params = []
        self.groups: dict[str, str | None] = {}

    async def generate(self, prompt, sampling_params, request_id=None, lora_request=None,
                       client_group=None):
        if self.fail is not None:
            raise self.fail
        self.seen_params.append(sampling_params)
        self.groups[request_id] = client_group
        self.running.add(request_id)
        kind = sampling_params.output_kind
        try:
            sent = ""
            for step, text in enumerate(self.script):
                await asyncio.sleep(0)
                if self.die_after is not None and step == self.die_after:
                    raise EngineDeadError("the engine stopped")
                last = step == len(self.script) - 1
                if kind is RequestOutputKind.FINAL_ONLY and not last:
                    continue
                if kind is RequestOutputKind.DELTA:        # the script holds whole texts
                    text, sent = text[len(sent):], text
                ids = [ord(c) for c in text]
                logprobs = None
                if sampling_params.logprobs is not None:
                    logprobs = [{t: Logprob(-1.0, 1, chr(t))} for t in ids]
                out = CompletionOutput(0, text, ids, "length" if last else None,
                                       logprobs=logprobs)
                yield RequestOutput(request_id, prompt.get("prompt"),
                                    prompt["prompt_token_ids"], [out], last)
                if last:
                    self.running.discard(request_id)
        finally:
            self.running.discard(request_id)

    def abort(self, request_ids):
        self.aborted.extend([request_ids] if isinstance(request_ids, str) else request_ids)


class FakeModels:
    base_model_name = "base"

    def resolve(self, name):
        if name != "base":
            raise not_found(f"The model `{name}` does not exist.", param="model")
        return None


async def _drain(stream) -> list:
    return _events([event async for event in stream])


def test_completion_non_streaming_shape_and_usage():
    async def run():
        engine = FakeEngine(["a", "ab", "abc"])
        serving = OpenAIServingCompletion(engine, FakeModels())
        resp = await serving.create_completion(CompletionRequest(
            model="base", prompt=["hi", "yo!"], n=2, seed=5, echo=True))
        return engine, resp.model_dump(mode="json")

    engine, resp = asyncio.run(run())
    assert resp["object"] == "text_completion" and resp["id"].startswith("cmpl-")
    assert [c["index"] for c in resp["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in resp["choices"]] == ["hiabc", "hiabc", "yo!abc", "yo!abc"]
    assert resp["choices"][0]["finish_reason"] == "length"
    assert resp["usage"] == {"prompt_tokens": 3 + 4, "completion_tokens": 12,
                             "total_tokens": 19}
    assert [p.seed for p in engine.seen_params] == [5, 6, 5, 6]
    assert [p.max_tokens for p in engine.seen_params] == [16] * 4


def test_completion_streaming_sends_deltas_and_reports_usage():
    async def run():
        engine = FakeEngine(["x", "xy", "xyz", "xyzw"])
        serving = OpenAIServingCompletion(engine, FakeModels())
        stream = await serving.create_completion(CompletionRequest(
            model="base", prompt="p", stream=True, stop=["abc"], logprobs=0,
            stream_options={"include_usage": True}))
        return [p.output_kind for p in engine.seen_params], await _drain(stream)

    engine_kinds, events = asyncio.run(run())
    assert events[-1] == "[DONE]"
    chunks, usage = events[:-2], events[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 4
    assert all(c["usage"] is None for c in chunks)
    assert [c["choices"][0]["text"] for c in chunks] == list("xyzw")
    assert engine_kinds == [RequestOutputKind.DELTA]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]] == list("xyzw")
    offsets = [o for c in chunks for o in c["choices"][0]["logprobs"]["text_offset"]]
    assert offsets == [0, 1, 2, 3]


def test_chat_streaming_shape():
    async def run():
        engine = FakeEngine(["he", "hey"])
        serving = OpenAIServingChat(engine, FakeModels())
        stream = await serving.create_chat_completion(ChatCompletionRequest(
            model="base", messages=[{"role": "user", "content": "hi"}], n=2, stream=True))
        return engine, await _drain(stream)

    engine, events = asyncio.run(run())
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" and "usage" not in c for c in chunks)
    firsts = chunks[:2]
    assert [c["choices"][0]["delta"] for c in firsts] == [
        {"role": "assistant", "content": ""}] * 2
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks[2:] if c["choices"][0]["index"] == index]
        assert "".join(c["delta"].get("content", "") for c in mine) == "hey"
        assert mine[-1]["finish_reason"] == "length"
    # the chat prompt was tokenized without special tokens, max_tokens up to the context
    prompt_len = len("<user>hi<assistant>")
    assert engine.seen_params[0].max_tokens == 64 - prompt_len


def test_chat_non_streaming_logprobs():
    async def run():
        serving = OpenAIServingChat(FakeEngine(["o", "ok"]), FakeModels())
        return (await serving.create_chat_completion(ChatCompletionRequest(
            model="base", messages=[{"role": "user", "content": "hi"}], logprobs=True,
            max_completion_tokens=4))).model_dump(mode="json")

    resp = asyncio.run(run())
    choice = resp["choices"][0]
    assert resp["object"] == "chat.completion"
    assert choice["message"] == {"role": "assistant", "content": "ok"}
    assert [t["token"] for t in choice["logprobs"]["content"]] == ["o", "k"]
    assert choice["logprobs"]["content"][0]["top_logprobs"] == []


@pytest.mark.parametrize("fail, status", [
    (ValueError("bad adapter"), 400), (EngineOverloadedError("full"), 503),
    (EngineDeadError("dead"), 503)])
def test_engine_rejection_raises_before_streaming(fail, status):
    async def run():
        serving = OpenAIServingCompletion(FakeEngine(["a"], fail=fail), FakeModels())
        await serving.create_completion(CompletionRequest(model="base", prompt="p",
                                                          stream=True))

    with pytest.raises(OpenAIError) as info:
        asyncio.run(run())
    assert info.value.status == status


def test_request_errors_before_the_engine():
    async def run(req, max_model_len=64):
        engine = FakeEngine(["a"], max_model_len=max_model_len)
        try:
            await OpenAIServingCompletion(engine, FakeModels()).create_completion(req)
        except OpenAIError as e:
            assert not engine.seen_params
            return e
        raise AssertionError("no error")

    assert asyncio.run(run(CompletionRequest(model="nope", prompt="p"))).status == 404
    error = asyncio.run(run(CompletionRequest(model="base", prompt="p" * 70)))
    assert (error.status, error.code) == (413, "context_length_exceeded")
    error = asyncio.run(run(CompletionRequest(model="base", prompt="p", max_tokens=64)))
    assert (error.status, error.param) == (400, "max_tokens")
    error = asyncio.run(run(CompletionRequest(model="base", prompt=[[1], []])))
    assert (error.status, error.param) == (400, "prompt")


def test_error_after_streaming_began_is_an_event():
    async def run():
        engine = FakeEngine(["a", "ab", "abc"], die_after=1)
        serving = OpenAIServingCompletion(engine, FakeModels())
        stream = await serving.create_completion(CompletionRequest(model="base", prompt="p",
                                                                   stream=True))
        return await _drain(stream)

    events = asyncio.run(run())
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == 503


def test_disconnect_aborts_unfinished_children():
    async def run():
        engine = FakeEngine([c * (i + 1) for i, c in enumerate("abcdefgh")])
        serving = OpenAIServingChat(engine, FakeModels())
        req = ChatCompletionRequest(model="base", messages=[{"role": "user", "content": "x"}],
                                    n=3, stream=True)
        stream = await serving.create_chat_completion(req)
        async for _ in stream:
            break
        await stream.aclose()
        closed = (set(engine.aborted), set(engine.running))
        # a stream dropped before it ran still aborts its requests
        engine.aborted.clear()
        stream = await serving.create_chat_completion(req)
        del stream
        gc.collect()
        await asyncio.sleep(0.01)
        return closed, (set(engine.aborted), set(engine.running))

    (aborted, running), (aborted2, running2) = asyncio.run(run())
    assert len(aborted) == 3 and not running
    assert len(aborted2) == 3 and not running2


def test_merged_stream_keeps_each_child_in_order():
    async def child(name, n):
        for i in range(n):
            await asyncio.sleep(0)
            out = CompletionOutput(0, f"{name}{i}", [i], "stop" if i == n - 1 else None)
            yield RequestOutput(name, None, [1], [out], i == n - 1)

    async def run():
        engine = FakeEngine([])
        merged = MergedStream(engine, ["a", "b"], [child("a", 3), child("b", 2)])
        await merged.prime()
        got = [(i, o.outputs[0].text) async for i, o in merged]
        await merged.aclose()
        return got, engine.aborted

    got, aborted = asyncio.run(run())
    assert [t for i, t in got if i == 0] == ["a0", "a1", "a2"]
    assert [t for i, t in got if i == 1] == ["b0", "b1"]
    assert aborted == []


def test_children_of_one_http_request_share_one_client_group():
    """The scheduler's fair sharing counts an HTTP request's prompts x n children as one
    client group: the response's id, distinct between requests."""
    async def run():
        engine = FakeEngine(["a"])
        completions = OpenAIServingCompletion(engine, FakeModels())
        chat = OpenAIServingChat(engine, FakeModels())
        ids = []
        for _ in range(2):
            resp = await completions.create_completion(CompletionRequest(
                model="base", prompt=["hi", "yo!"], n=2))
            ids.append(resp.id)
        resp = await chat.create_chat_completion(ChatCompletionRequest(
            model="base", messages=[{"role": "user", "content": "hi"}], n=3))
        ids.append(resp.id)
        return engine.groups, ids

    groups, ids = asyncio.run(run())
    assert len(groups) == 4 + 4 + 3 and len(set(ids)) == 3
    for response_id, count in zip(ids, (4, 4, 3)):
        children = [rid for rid, group in groups.items() if group == response_id]
        assert len(children) == count
        assert all(rid.startswith(response_id + "-") for rid in children)
