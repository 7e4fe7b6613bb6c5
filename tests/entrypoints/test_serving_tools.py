"""Tool calling in the chat endpoint, driven by a fake engine that writes a scripted output:
which mode a request gets, the output constraint sent to the engine (vLLM's schemas,
written out here), the message and finish reason built from the output, and the streamed
pieces (OpenAI's shape) that add up to the non-streamed message."""

from __future__ import annotations

import asyncio
import json

import pytest

from manylora.engine.outputs import CompletionOutput, RequestOutput
from manylora.entrypoints.openai.errors import OpenAIError
from manylora.entrypoints.openai.protocol import ChatCompletionRequest
from manylora.entrypoints.openai.serving_chat import OpenAIServingChat
from manylora.sampling_params import RequestOutputKind

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}},
           "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time"}}]
USER = [{"role": "user", "content": "hi"}]


class Tokenizer:
    """Characters as token ids; records the ``tools`` each render got."""

    chat_template = "fake"

    def __init__(self):
        self.tools_seen = []

    def __call__(self, text, add_special_tokens=True):
        class Enc:
            input_ids = [ord(c) for c in text]
        return Enc()

    def apply_chat_template(self, messages, tokenize, add_generation_prompt,
                            continue_final_message, chat_template, tools=None, **kwargs):
        self.tools_seen.append(tools)
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


class Engine:
    """Writes ``text`` in pieces of ``step`` characters, then finishes with ``reason``."""

    def __init__(self, text, reason="stop", step=3):
        self.tokenizer = Tokenizer()
        self.max_model_len = 4096
        self.text, self.reason, self.step = text, reason, step
        self.params = []

    async def generate(self, prompt, sampling_params, request_id=None, lora_request=None,
                       client_group=None):
        self.params.append(sampling_params)
        pieces = [self.text[i:i + self.step] for i in range(0, len(self.text), self.step)]
        delta = sampling_params.output_kind is RequestOutputKind.DELTA
        for i, piece in enumerate(pieces):
            await asyncio.sleep(0)
            last = i == len(pieces) - 1
            if not delta and not last:
                continue
            text = piece if delta else self.text
            out = CompletionOutput(0, text, [ord(c) for c in text],
                                   self.reason if last else None)
            yield RequestOutput(request_id, None, prompt["prompt_token_ids"], [out], last)

    def abort(self, request_ids):
        pass


class Models:
    base_model_name = "base"

    def resolve(self, name):
        return None


def _run(engine, body, **serving):
    async def go():
        chat = OpenAIServingChat(engine, Models(), **serving)
        result = await chat.create_chat_completion(ChatCompletionRequest(**body))
        if body.get("stream"):
            events = [e async for e in result]
            return [json.loads(e[6:]) for e in events if e != "data: [DONE]\n\n"]
        return result.model_dump(mode="json")
    return asyncio.run(go())


def _assemble(chunks):
    """Content, calls ``[id, name, arguments]`` and finish reason of a streamed choice;
    checks OpenAI's piece shape on the way."""
    content, calls, reason = "", {}, None
    for chunk in chunks:
        choice = chunk["choices"][0]
        delta = choice["delta"]
        content += delta.get("content") or ""
        indexes = [p["index"] for p in delta.get("tool_calls", [])]
        assert len(indexes) == len(set(indexes))          # one piece per call per chunk
        for piece in delta.get("tool_calls", []):
            first = piece["index"] not in calls
            assert ("id" in piece) == first and ("type" in piece) == first
            assert ("name" in piece["function"]) == first
            if first:
                calls[piece["index"]] = [piece["id"], piece["function"]["name"], ""]
            calls[piece["index"]][2] += piece["function"].get("arguments", "")
        reason = choice["finish_reason"] or reason
    return content or None, [calls[i] for i in sorted(calls)], reason


HERMES_OUT = ('Let me check.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
              '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
AUTO = dict(enable_auto_tool_choice=True, tool_call_parser="hermes")


@pytest.mark.parametrize("stream", [False, True])
def test_auto_choice_parses_calls_streamed_and_not(stream):
    engine = Engine(HERMES_OUT)
    result = _run(engine, dict(messages=USER, tools=TOOLS, stream=stream), **AUTO)
    if stream:
        content, calls, reason = _assemble(result)
    else:
        message = result["choices"][0]["message"]
        content, reason = message["content"], result["choices"][0]["finish_reason"]
        calls = [[c["id"], c["function"]["name"], c["function"]["arguments"]]
                 for c in message["tool_calls"]]
        assert all(c["type"] == "function" for c in message["tool_calls"])
    assert content == "Let me check."
    assert [(n, json.loads(a)) for _, n, a in calls] == [("get_weather", {"city": "Paris"}),
                                                         ("get_time", {})]
    assert all(i.startswith("chatcmpl-tool-") for i, _, _ in calls)
    assert reason == "tool_calls"
    params = engine.params[0]
    assert params.structured_outputs is None
    assert params.skip_special_tokens is False          # the tags may be special tokens
    assert engine.tokenizer.tools_seen[0] == TOOLS[:1] + [
        {"type": "function", "function": {"name": "get_time"}}]


@pytest.mark.parametrize("stream", [False, True])
def test_auto_choice_without_parallel_calls_keeps_the_first(stream):
    result = _run(Engine(HERMES_OUT), dict(messages=USER, tools=TOOLS, stream=stream,
                                           parallel_tool_calls=False), **AUTO)
    if stream:
        _, calls, _ = _assemble(result)
        names = [n for _, n, _ in calls]
    else:
        names = [c["function"]["name"] for c in result["choices"][0]["message"]["tool_calls"]]
    assert names == ["get_weather"]


def test_auto_choice_without_a_call_is_text():
    result = _run(Engine("Paris is sunny.", reason="length"),
                  dict(messages=USER, tools=TOOLS, tool_choice="auto"), **AUTO)
    choice = result["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "Paris is sunny."}
    assert choice["finish_reason"] == "length"


@pytest.mark.parametrize("choice", [None, "auto"])
def test_auto_choice_needs_the_server_flags(choice):
    with pytest.raises(OpenAIError) as info:
        _run(Engine("x"), dict(messages=USER, tools=TOOLS, tool_choice=choice))
    assert info.value.status == 400 and info.value.param == "tool_choice"
    assert "--enable-auto-tool-choice" in info.value.message


def test_flags_are_checked_when_the_endpoint_is_built():
    with pytest.raises(ValueError, match="unknown tool call parser"):
        OpenAIServingChat(Engine("x"), Models(), tool_call_parser="nope")
    with pytest.raises(ValueError, match="--tool-call-parser"):
        OpenAIServingChat(Engine("x"), Models(), enable_auto_tool_choice=True)


def test_none_choice_renders_tools_and_returns_text():
    engine = Engine('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    result = _run(engine, dict(messages=USER, tools=TOOLS, tool_choice="none"), **AUTO)
    assert result["choices"][0]["message"]["content"] == engine.text
    assert "tool_calls" not in result["choices"][0]["message"]
    assert engine.tokenizer.tools_seen[0] is not None
    assert engine.params[0].structured_outputs is None


REQUIRED_OUT = json.dumps([{"name": "get_weather", "parameters": {"city": "Oslo"}},
                           {"name": "get_time", "parameters": {}}])


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("parallel", [True, False])
def test_required_choice_constrains_the_output_to_vllms_array(stream, parallel):
    engine = Engine(REQUIRED_OUT)
    result = _run(engine, dict(messages=USER, tools=TOOLS, tool_choice="required",
                               stream=stream, parallel_tool_calls=parallel))
    want = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": [
        {"properties": {"name": {"type": "string", "enum": ["get_weather"]},
                        "parameters": WEATHER}, "required": ["name", "parameters"]},
        {"properties": {"name": {"type": "string", "enum": ["get_time"]},
                        "parameters": {"type": "object", "properties": {}}},
         "required": ["name", "parameters"]}]}}
    if not parallel:
        want["maxItems"] = 1
    assert json.loads(engine.params[0].structured_outputs.json) == want
    if stream:
        content, calls, reason = _assemble(result)
    else:
        message = result["choices"][0]["message"]
        content, reason = message["content"], result["choices"][0]["finish_reason"]
        calls = [[c["id"], c["function"]["name"], c["function"]["arguments"]]
                 for c in message["tool_calls"]]
    assert content is None and reason == "tool_calls"
    # (the fake engine ignores the grammar: without parallel calls the second is dropped)
    want_calls = [("get_weather", {"city": "Oslo"}), ("get_time", {})]
    assert [(n, json.loads(a)) for _, n, a in calls] == want_calls[:None if parallel else 1]


def test_required_choice_cut_by_length_keeps_length():
    result = _run(Engine(REQUIRED_OUT[:30], reason="length"),
                  dict(messages=USER, tools=TOOLS, tool_choice="required"))
    choice = result["choices"][0]
    assert choice["finish_reason"] == "length" and "tool_calls" not in choice["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_named_choice_streams_the_arguments_as_generated(stream):
    args = '{"city": "Lima"}'
    engine = Engine(args, step=2)
    result = _run(engine, dict(messages=USER, tools=TOOLS, stream=stream, tool_choice={
        "type": "function", "function": {"name": "get_weather"}}))
    assert json.loads(engine.params[0].structured_outputs.json) == WEATHER
    if stream:
        content, calls, reason = _assemble(result)
        pieces = [p for c in result for p in c["choices"][0]["delta"].get("tool_calls", [])]
        assert len(pieces) == len(args) // 2          # one fragment per engine output
    else:
        message = result["choices"][0]["message"]
        content, reason = message["content"], result["choices"][0]["finish_reason"]
        calls = [[c["id"], c["function"]["name"], c["function"]["arguments"]]
                 for c in message["tool_calls"]]
    assert content is None and reason == "stop"
    assert [(n, a) for _, n, a in calls] == [("get_weather", args)]
    assert calls[0][0].startswith("chatcmpl-tool-")


@pytest.mark.parametrize("body, param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools"),
])
def test_tool_choice_errors_name_the_field(body, param):
    with pytest.raises(OpenAIError) as info:
        _run(Engine("x"), dict(messages=USER, **body), **AUTO)
    assert info.value.status == 400 and info.value.param == param


# ------------------------------------------------- the schemas under a real grammar engine


def _grammar_walks(schema, seeds, max_tokens=400):
    """Texts a random walk over the tiny tokenizer writes under xgrammar's constraint for
    ``schema`` (each step a uniformly random allowed token): what any model could write."""
    import random

    xgr = pytest.importorskip("xgrammar")
    from manylora.testing import make_tokenizer

    tok = make_tokenizer()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(schema),
                                                             any_whitespace=False)
    texts = []
    for seed in seeds:
        rng, matcher = random.Random(seed), xgr.GrammarMatcher(compiled)
        bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
        ids = []
        while not matcher.is_terminated() and len(ids) < max_tokens:
            matcher.fill_next_token_bitmask(bitmask)
            words = bitmask[0].tolist()
            allowed = [i for i in range(info.vocab_size) if (words[i // 32] >> (i % 32)) & 1]
            ids.append(rng.choice(allowed))
            assert matcher.accept_token(ids[-1])
        assert matcher.is_terminated()
        texts.append(tok.decode([i for i in ids if i != tok.eos_token_id]))
    return texts


FORECAST = {"type": "object", "properties": {
    "unit": {"type": "string", "enum": ["c", "f"]},
    "days": {"type": "integer", "enum": [1, 2, 3]}},
    "required": ["unit", "days"], "additionalProperties": False}
CLOSED_TOOLS = [{"type": "function", "function": {"name": "forecast", "parameters": FORECAST}},
                {"type": "function", "function": {"name": "alert"}}]


@pytest.mark.parametrize("parallel", [True, False])
def test_required_schema_under_xgrammar_gives_valid_calls(parallel):
    jsonschema = pytest.importorskip("jsonschema")
    engine = Engine("")
    _run(engine, dict(messages=USER, tools=CLOSED_TOOLS, tool_choice="required",
                      parallel_tool_calls=parallel))
    schema = json.loads(engine.params[0].structured_outputs.json)
    counts = set()
    for text in _grammar_walks(schema, range(12)):
        engine = Engine(text)
        result = _run(engine, dict(messages=USER, tools=CLOSED_TOOLS, tool_choice="required",
                                   parallel_tool_calls=parallel))
        choice = result["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        calls = choice["message"]["tool_calls"]
        counts.add(len(calls))
        for call in calls:
            params = FORECAST if call["function"]["name"] == "forecast" else {"type": "object"}
            jsonschema.validate(json.loads(call["function"]["arguments"]), params)
    assert counts == {1} if not parallel else max(counts) >= 1


def test_named_schema_under_xgrammar_gives_valid_arguments():
    jsonschema = pytest.importorskip("jsonschema")
    named = {"type": "function", "function": {"name": "forecast"}}
    engine = Engine("")
    _run(engine, dict(messages=USER, tools=CLOSED_TOOLS, tool_choice=named))
    for text in _grammar_walks(json.loads(engine.params[0].structured_outputs.json), range(8)):
        result = _run(Engine(text), dict(messages=USER, tools=CLOSED_TOOLS, tool_choice=named))
        [call] = result["choices"][0]["message"]["tool_calls"]
        jsonschema.validate(json.loads(call["function"]["arguments"]), FORECAST)
