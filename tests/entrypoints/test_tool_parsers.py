"""The tool call parsers against hand-written model outputs of each format: the calls and
content expected are written out here, and the streamed extraction, fed the text split at
every point (and token by token), concatenates to the non-streamed result."""

from __future__ import annotations

import json

import pytest

from manylora.entrypoints.openai.tool_parsers import (
    TOOL_PARSERS,
    RequiredToolCallsParser,
    ToolParser,
    get_tool_parser,
)

WEATHER = {"city": "Paris", "unit": "celsius"}
TIME = {"tz": "Europe/Paris"}
NESTED = {"q": "a } and { and \"quoted\" and \\ back", "list": [1, {"x": [2]}]}


def _hermes(name, args, key="arguments"):
    return f'<tool_call>\n{json.dumps({"name": name, key: args})}\n</tool_call>'


# (parser, model output, expected content, expected [(name, arguments dict)])
CASES = [
    # hermes
    ("hermes", _hermes("get_weather", WEATHER), None, [("get_weather", WEATHER)]),
    ("hermes", _hermes("get_weather", WEATHER) + "\n" + _hermes("get_time", TIME), None,
     [("get_weather", WEATHER), ("get_time", TIME)]),
    ("hermes", "Let me look that up.\n" + _hermes("search", NESTED),
     "Let me look that up.\n", [("search", NESTED)]),
    ("hermes", "\n\n" + _hermes("get_time", TIME) + "\n", None, [("get_time", TIME)]),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1}}', None, [("f", {"a": 1})]),
    ("hermes", "Just an answer, no tools <tool.", "Just an answer, no tools <tool.", []),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1,}}</tool_call>',
     '<tool_call>{"name": "f", "arguments": {"a": 1,}}</tool_call>', []),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1}',
     '<tool_call>{"name": "f", "arguments": {"a": 1}', []),
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>',
     '<tool_call>{"arguments": {}}</tool_call>', []),
    ("hermes", _hermes("ok", {}) + '<tool_call>{"name": 3}</tool_call>',
     '<tool_call>{"name": 3}</tool_call>', [("ok", {})]),
    # llama3_json
    ("llama3_json", json.dumps({"name": "get_weather", "parameters": WEATHER}), None,
     [("get_weather", WEATHER)]),
    ("llama3_json", "<|python_tag|>" + json.dumps({"name": "get_weather",
                                                    "parameters": WEATHER}), None,
     [("get_weather", WEATHER)]),
    ("llama3_json", json.dumps({"name": "a", "parameters": WEATHER}) + "; "
     + json.dumps({"name": "b", "arguments": NESTED}), None,
     [("a", WEATHER), ("b", NESTED)]),
    ("llama3_json", "I will check.<|python_tag|>" + json.dumps(
        {"name": "get_time", "parameters": TIME}), "I will check.", [("get_time", TIME)]),
    ("llama3_json", 'The JSON {"name": "x", "parameters": {}} is an example.',
     'The JSON {"name": "x", "parameters": {}} is an example.', []),
    ("llama3_json", '{"name": "f", "parameters": {"a": }}', '{"name": "f", "parameters": {"a": }}',
     []),
    ("llama3_json", '{"name": "f", "parameters": {"a": 1}', '{"name": "f", "parameters": {"a": 1}',
     []),
    ("llama3_json", '{"key": "plain JSON answer"}', '{"key": "plain JSON answer"}', []),
    # mistral
    ("mistral", "[TOOL_CALLS]" + json.dumps([{"name": "get_weather", "arguments": WEATHER}]),
     None, [("get_weather", WEATHER)]),
    ("mistral", "Checking. [TOOL_CALLS] " + json.dumps(
        [{"name": "a", "arguments": WEATHER}, {"name": "b", "arguments": NESTED}]),
     "Checking. ", [("a", WEATHER), ("b", NESTED)]),
    ("mistral", "[TOOL_CALLS]get_weather[ARGS]" + json.dumps(WEATHER) + "[TOOL_CALLS]get_time"
     + json.dumps(TIME), None, [("get_weather", WEATHER), ("get_time", TIME)]),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}',
     '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}', []),
    ("mistral", '[TOOL_CALLS][{"name": "f"}]', '[TOOL_CALLS][{"name": "f"}]', []),
    ("mistral", "[TOOLS are fine] in text", "[TOOLS are fine] in text", []),
]


def _parser(name: str) -> ToolParser:
    return RequiredToolCallsParser() if name == "required" else get_tool_parser(name)


def _streamed(parser: ToolParser, pieces: list[str]) -> tuple[str | None, list, list]:
    """Content, calls ``(id, name, arguments)`` and the raw pieces of a streamed run."""
    stream = parser.streaming()
    deltas = [d for p in pieces for d in stream.feed(p)] + stream.finish()
    content = "".join(d.content for d in deltas if d.content is not None) or None
    calls: dict[int, list] = {}
    order = []
    for delta in deltas:
        for piece in delta.tool_calls:
            order.append(piece)
            if piece.index not in calls:
                calls[piece.index] = [piece.id, piece.function.name, ""]
            calls[piece.index][2] += piece.function.arguments or ""
    return content, [calls[i] for i in sorted(calls)], order


def _expected(calls):
    return [(name, args) for name, args in calls]


@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_non_streamed_extraction(name, text, content, calls):
    result = _parser(name).extract_tool_calls(text)
    assert result.content == content
    assert [(c.function.name, json.loads(c.function.arguments))
            for c in result.tool_calls] == _expected(calls)
    assert result.tools_called == bool(calls)
    for call in result.tool_calls:
        assert call.type == "function"
        if name == "mistral":
            assert len(call.id) == 9 and call.id.isalnum()
        else:
            assert call.id.startswith("chatcmpl-tool-")
    assert len({c.id for c in result.tool_calls}) == len(calls)


@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_streamed_equals_non_streamed_at_every_split(name, text, content, calls):
    parser = _parser(name)
    whole = parser.extract_tool_calls(text)
    want = (whole.content, [(c.function.name, c.function.arguments) for c in whole.tool_calls])
    splits = [[text[:i], text[i:]] for i in range(len(text) + 1)]
    splits.append(list(text))                               # one character per delta
    splits.append([text[i:i + 3] for i in range(0, len(text), 3)])
    for pieces in splits:
        got_content, got_calls, order = _streamed(parser, pieces)
        assert (got_content, [(n, a) for _, n, a in got_calls]) == want, pieces
        # OpenAI's streamed shape: a call's first piece has id, type and name; later ones
        # only argument fragments of the same index
        seen = set()
        for piece in order:
            first = piece.index not in seen
            seen.add(piece.index)
            assert (piece.id is not None) == first and (piece.type is not None) == first
            assert (piece.function.name is not None) == first


def test_required_choice_output_is_read_as_calls():
    text = json.dumps([{"name": "get_weather", "parameters": WEATHER},
                       {"name": "get_time", "parameters": TIME}])
    result = RequiredToolCallsParser().extract_tool_calls(text)
    assert result.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in result.tool_calls] \
        == [("get_weather", WEATHER), ("get_time", TIME)]
    for i in range(len(text) + 1):
        content, calls, _ = _streamed(RequiredToolCallsParser(), [text[:i], text[i:]])
        assert content is None and [(n, json.loads(a)) for _, n, a in calls] == [
            ("get_weather", WEATHER), ("get_time", TIME)]
    # cut off by max_tokens: the unfinished object is content (the array's punctuation is
    # not), the finished calls stay calls
    cut = text[:20]
    assert RequiredToolCallsParser().extract_tool_calls(cut).content == cut[1:]
    cut = text[:len(text) - 10]
    result = RequiredToolCallsParser().extract_tool_calls(cut)
    assert [c.function.name for c in result.tool_calls] == ["get_weather"]
    assert result.content == cut[cut.index('{"name": "get_time"'):]


def test_streamed_call_is_reported_when_its_region_closes():
    stream = get_tool_parser("hermes").streaming()
    assert [d.content for d in stream.feed("Hi <tool")] == ["Hi "]
    assert stream.feed('_call>{"name": "f", "arguments": {"a"') == []
    assert stream.feed(": 1}}") == []                 # the closing tag may still come
    deltas = stream.feed("</tool_call>")
    assert [(p.index, p.function.name, p.function.arguments)
            for d in deltas for p in d.tool_calls] == [(0, "f", ""), (0, None, '{"a": 1}')]
    assert stream.tools_called and stream.finish() == []


def test_parser_registry_names_and_unknown_name():
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json", "mistral"}
    with pytest.raises(ValueError, match="hermes, llama3_json, mistral"):
        get_tool_parser("nope")
