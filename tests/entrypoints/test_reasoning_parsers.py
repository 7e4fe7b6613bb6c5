"""``--reasoning-parser``: vLLM's ``deepseek_r1`` and ``qwen3`` rules on whole outputs
(expected splits written out from vLLM's parsers), the same splits from every way of
streaming the text, and the chat route's order (reasoning first, tool calls read from the
content only), driven by the scripted engine of ``test_serving_tools``."""

from __future__ import annotations

import json

import pytest
from test_serving_tools import AUTO, TOOLS, USER, Engine, _assemble, _run

from manylora.entrypoints.openai.reasoning_parsers import (
    REASONING_PARSERS,
    get_reasoning_parser,
)

PROMPT = "<user>hi<assistant>"          # a template that leaves the thinking to the model
OPEN_PROMPT = "<user>hi<assistant><think>\n"      # one that opens it in the prompt
NO_THINKING = {"enable_thinking": False}

# (parser, output, prompt, chat_template_kwargs) -> (reasoning_content, content)
CASES = [
    ("deepseek_r1", "<think>abc</think>xyz", PROMPT, None, ("abc", "xyz")),
    ("deepseek_r1", "abc</think>xyz", PROMPT, None, ("abc", "xyz")),        # no <think>
    ("deepseek_r1", "abc</think>", PROMPT, None, ("abc", None)),
    ("deepseek_r1", "</think>xyz", PROMPT, None, (None, "xyz")),
    ("deepseek_r1", "abc def", PROMPT, None, ("abc def", None)),            # cut short
    ("deepseek_r1", "<think>abc", PROMPT, None, ("abc", None)),
    ("deepseek_r1", "a<b</thin</think>x<think>y</think>", PROMPT, None,
     ("a<b</thin", "x<think>y</think>")),
    ("qwen3", "<think>abc</think>xyz", PROMPT, None, ("abc", "xyz")),
    ("qwen3", "\n<think>\nabc\n</think>\n\nxyz", PROMPT, None, ("\nabc\n", "\n\n\nxyz")),
    ("qwen3", "xyz", PROMPT, None, (None, "xyz")),                          # no thinking
    ("qwen3", "<think>abc", PROMPT, None, ("abc", None)),                   # cut short
    ("qwen3", "abc</think>xyz", PROMPT, None, (None, "abc</think>xyz")),    # no <think>
    ("qwen3", "<think>abc</think>xyz", PROMPT, NO_THINKING,
     (None, "<think>abc</think>xyz")),
    ("qwen3", "abc</think>xyz", OPEN_PROMPT, None, ("abc", "xyz")),
    ("qwen3", "abc</think>xyz", OPEN_PROMPT, NO_THINKING, (None, "abc</think>xyz")),
    ("qwen3", "abc", "<think>old</think><assistant>", None, (None, "abc")),
]


def test_registry_names_and_unknown_name():
    assert sorted(REASONING_PARSERS) == ["deepseek_r1", "qwen3"]
    with pytest.raises(ValueError, match="deepseek_r1, qwen3"):
        get_reasoning_parser("granite")


@pytest.mark.parametrize("name,text,prompt,kwargs,expected", CASES)
def test_whole_output_split(name, text, prompt, kwargs, expected):
    assert get_reasoning_parser(name).split(text, prompt, kwargs) == expected


def _streamed(name, pieces, prompt, kwargs):
    stream = get_reasoning_parser(name).stream(prompt, kwargs)
    reasoning = content = ""
    for i, piece in enumerate(pieces):
        r, c = stream.feed(piece, finished=i == len(pieces) - 1)
        reasoning, content = reasoning + r, content + c
    return reasoning or None, content or None


@pytest.mark.parametrize("name,text,prompt,kwargs,expected", CASES)
def test_every_streamed_split_adds_up_to_the_whole(name, text, prompt, kwargs, expected):
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            pieces = [text[:i], text[i:j], text[j:]]
            assert _streamed(name, pieces, prompt, kwargs) == expected, pieces
    assert _streamed(name, list(text), prompt, kwargs) == expected
    assert _streamed(name, [*text, ""], prompt, kwargs) == expected   # a bare final piece


def test_reasoning_is_sent_before_the_end_marker_arrives():
    """A stream sends reasoning as it comes, holding back only a possible marker's start."""
    stream = get_reasoning_parser("deepseek_r1").stream(PROMPT, None)
    assert stream.feed("step one</th") == ("step one", "")
    assert stream.feed("ink>ans") == ("", "ans")
    assert stream.feed("wer", finished=True) == ("", "wer")


THOUGHT = "<think>need the weather</think>"


@pytest.mark.parametrize("stream", [False, True])
def test_chat_splits_reasoning_then_parses_tools_in_the_content(stream):
    body = dict(messages=USER, tools=TOOLS, stream=stream)
    text = THOUGHT + '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    result = _run(Engine(text), body, reasoning_parser="deepseek_r1", **AUTO)
    if stream:
        reasoning = "".join(c["choices"][0]["delta"].get("reasoning_content") or ""
                            for c in result)
        content, calls, reason = _assemble(result)
        names = [name for _, name, _ in calls]
    else:
        message = result["choices"][0]["message"]
        reasoning, content = message["reasoning_content"], message["content"]
        names = [c["function"]["name"] for c in message["tool_calls"]]
        reason = result["choices"][0]["finish_reason"]
    assert (reasoning, content, names, reason) == ("need the weather", None, ["get_time"],
                                                   "tool_calls")


@pytest.mark.parametrize("stream", [False, True])
def test_include_reasoning_false_drops_the_reasoning(stream):
    result = _run(Engine(THOUGHT + "sunny"), dict(messages=USER, stream=stream,
                                                  include_reasoning=False),
                  reasoning_parser="deepseek_r1")
    if stream:
        assert not any("reasoning_content" in c["choices"][0]["delta"]
                       for c in result if c["choices"])
        assert "".join(c["choices"][0]["delta"].get("content") or ""
                       for c in result if c["choices"]) == "sunny"
    else:
        message = result["choices"][0]["message"]
        assert "reasoning_content" not in message and message["content"] == "sunny"


def test_constrained_output_is_not_split():
    """An output constrained from its first token (a named tool) has no thinking."""
    engine = Engine('{"city": "Paris"}')
    choice = {"type": "function", "function": {"name": "get_weather"}}
    result = _run(engine, dict(messages=USER, tools=TOOLS, tool_choice=choice),
                  reasoning_parser="deepseek_r1")
    message = result["choices"][0]["message"]
    assert "reasoning_content" not in message
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}


def test_chat_refuses_an_unknown_parser():
    with pytest.raises(ValueError, match="unknown reasoning parser 'nope'"):
        _run(Engine("x"), dict(messages=USER), reasoning_parser="nope")
