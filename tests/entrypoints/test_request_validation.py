"""The edge rules of request bodies without a server: strict types on every field of every
request model (as OpenAI's API validates them), valid Unicode everywhere, client-chosen
names, and the 400 the server makes of pydantic's errors."""

from __future__ import annotations

import math
import re
import types
import typing

import pytest
from pydantic import ValidationError

from manylora.entrypoints.openai.api_server import (
    LoadLoRAAdapterRequest,
    UnloadLoRAAdapterRequest,
)
from manylora.entrypoints.openai.errors import OpenAIError
from manylora.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    StreamOptions,
)
from manylora.entrypoints.openai.protocol_responses import ResponsesRequest
from manylora.entrypoints.openai.validation import (
    MAX_NAME_CHARS,
    NAME_PATTERN,
    check_name,
    first_unencodable,
    validation_error,
)

CHAT = {"messages": [{"role": "user", "content": "hi"}]}
BASE_BODY = {CompletionRequest: {"prompt": "hi"}, ChatCompletionRequest: CHAT,
             LoadLoRAAdapterRequest: {"lora_name": "a", "lora_path": "p"},
             UnloadLoRAAdapterRequest: {"lora_name": "a"}, StreamOptions: {},
             ResponsesRequest: {"input": "hi"}}


def _fails(model, body: dict) -> OpenAIError:
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    return validation_error([{**e, "loc": ("body", *e["loc"])} for e in info.value.errors()])


def _kinds(annotation) -> set[type]:
    """The scalar types a field's annotation admits at its top level."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is typing.Annotated:
        return _kinds(args[0])
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return set().union(*(_kinds(a) for a in args))
    return {annotation} if annotation in (bool, int, float, str) else set()


def _admitted(value, kinds: set[type]) -> bool:
    """Whether JSON Schema's types take ``value`` for a field of these types: exact types,
    an integer for a number, a whole number (``5.0``) for an integer; never NaN or an
    infinity, never bytes."""
    if type(value) is float:
        return math.isfinite(value) and (float in kinds
                                         or (int in kinds and value.is_integer()))
    if type(value) is int:
        return bool({int, float} & kinds)
    return type(value) in kinds


# what a lax parser would coerce, for every declared scalar type
LAX = [True, False, 0, 1, 5.0, 0.0, 2.5, math.nan, math.inf, -math.inf, "yes", "true", "5",
       "1.0", b"x"]


@pytest.mark.parametrize("model", list(BASE_BODY))
def test_every_scalar_field_refuses_lax_coercions(model):
    swept = 0
    for name, field in model.model_fields.items():
        kinds = _kinds(field.annotation)
        if not kinds:
            continue
        for value in LAX:
            if _admitted(value, kinds):
                continue
            error = _fails(model, {**BASE_BODY[model], name: value})
            assert error.status == 400 and error.param == name, (name, value)
            swept += 1
    assert swept >= 10


@pytest.mark.parametrize("body, param", [
    ({"prompt": [True]}, "prompt"),
    ({"prompt": [[1, True]]}, "prompt"),
    ({"prompt": [1.0, 2.5]}, "prompt"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": "x", "n": True}, "n"),
    ({"prompt": "x", "min_tokens": 0.5}, "min_tokens"),
    ({"prompt": "x", "max_tokens": 5.5}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 5.0, "stream": 1.0}, "stream"),
    ({"prompt": "x", "stop_token_ids": [2, False]}, "stop_token_ids[1]"),
    ({"prompt": "x", "logit_bias": {"5": "1"}}, "logit_bias.5"),
    ({"prompt": "x", "stream": True, "stream_options": {"include_usage": "yes"}},
     "stream_options.include_usage"),
    ({"prompt": "x", "temperature": math.nan}, "temperature"),
])
def test_issue18_lax_completion_types_are_400(body, param):
    error = _fails(CompletionRequest, body)
    assert (error.status, error.param) == (400, param)
    assert error.message.startswith(f"{param}: ")


def test_whole_numbers_are_the_integers_they_equal():
    # JSON Schema's integer (and vLLM's lax models) take 5.0 for 5, at any depth and in any
    # member of a union; a fraction stays a 400
    req = CompletionRequest.model_validate({"prompt": [[1.0, 2], [3.0]], "max_tokens": 5.0,
                                            "seed": -4.0, "n": 1.0, "temperature": 1.0})
    assert req.prompt == [[1, 2], [3]] and all(type(t) is int for t in req.prompt[0])
    assert (req.max_tokens, req.seed, req.n) == (5, -4, 1) and type(req.max_tokens) is int
    assert type(req.temperature) is float
    chat = ChatCompletionRequest.model_validate({**CHAT, "max_completion_tokens": 3e0,
                                                 "logprobs": True, "top_logprobs": 2.0})
    assert (chat.max_completion_tokens, chat.top_logprobs) == (3, 2)
    assert ResponsesRequest.model_validate({"input": "hi", "max_output_tokens": 4.0}
                                           ).max_output_tokens == 4
    assert UnloadLoRAAdapterRequest.model_validate({"lora_name": "a", "lora_int_id": 3.0}
                                                   ).lora_int_id == 3
    body = {"prompt": "x", "max_tokens": 5.0, "min_tokens": 1.5}
    assert _fails(CompletionRequest, body).param == "min_tokens"
    assert body == {"prompt": "x", "max_tokens": 5.0, "min_tokens": 1.5}   # not changed


def test_legitimate_json_forms_stay_valid():
    req = CompletionRequest.model_validate({"prompt": [[1, 2], [3]], "temperature": 1,
                                            "top_p": 0, "stop": "\n", "seed": -(2**63)})
    assert req.temperature == 1.0 and isinstance(req.temperature, float)
    assert req.prompt == [[1, 2], [3]] and req.stop == "\n"
    chat = ChatCompletionRequest.model_validate({
        **CHAT, "n": 2, "logprobs": True, "top_logprobs": 3, "frequency_penalty": 0,
        "chat_template_kwargs": {"enable_thinking": False, "tags": ["a", {"b": 1}]},
        "messages": [{"role": "user", "content": [{"type": "text", "text": "tab\there"}],
                      "name": "Ana-María_2"}]})
    assert chat.messages[0].name == "Ana-María_2"
    assert UnloadLoRAAdapterRequest.model_validate({"lora_name": "org/ad:v1",
                                                    "lora_int_id": 3}).lora_int_id == 3


@pytest.mark.parametrize("name, ok", [
    ("ad0", True), ("org/model-7B:v2", True), ("日本語アダプタ", True), ("a b", True),
    ("\ud800", False), ("x\udfff", False), ("a\x00", False), ("a\nb", False),
    ("\x1b[31mred", False), ("del\x7f", False), ("c1\x85", False), ("ls\u2028", False),
    ("ps\u2029", False), ("rlo\u202etxt.exe", False), ("iso\u2066", False),
    ("a" * MAX_NAME_CHARS, True), ("a" * (MAX_NAME_CHARS + 1), False),
])
def test_check_name(name, ok):
    if ok:
        assert check_name(name) == name
    else:
        with pytest.raises(ValueError) as info:
            check_name(name)
        message = str(info.value)
        message.encode("utf-8")          # the message never echoes what cannot encode
        assert name not in message


@pytest.mark.parametrize("model, field", [
    (CompletionRequest, "model"), (CompletionRequest, "user"),
    (ChatCompletionRequest, "model"), (ChatCompletionRequest, "user"),
    (LoadLoRAAdapterRequest, "lora_name"), (UnloadLoRAAdapterRequest, "lora_name"),
])
def test_issue18_surrogate_and_control_names_are_400_naming_the_field(model, field):
    for bad in ("\ud800", "x\x00y", "x\ny", "\x9b"):
        error = _fails(model, {**BASE_BODY[model], field: bad})
        assert (error.status, error.param) == (400, field)
        error.message.encode("utf-8")


@pytest.mark.parametrize("model, body, param", [
    (CompletionRequest, {"prompt": "ok \ud800"}, "prompt"),
    (CompletionRequest, {"prompt": ["ok", "\udc00"]}, "prompt"),
    (CompletionRequest, {"prompt": "x", "stop": ["\ud83d"]}, "stop"),
    (CompletionRequest, {"prompt": "x", "logit_bias": {"\ud800": 0.0}}, "logit_bias"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "\ud800"}]},
     "messages[0].content"),
    (ChatCompletionRequest, {"messages": [
        {"role": "user", "content": "hi"},
        {"role": "user", "content": [{"type": "text", "text": "a\udfffb"}]}]},
     "messages[1].content"),
    (ChatCompletionRequest, {**CHAT, "chat_template_kwargs": {"k": ["\ud800"]}},
     "chat_template_kwargs"),
    (ChatCompletionRequest, {**CHAT, "chat_template_kwargs": {"\ud800": 1}},
     "chat_template_kwargs"),
    (ChatCompletionRequest, {**CHAT, "tools": [{"function": {"name": "\ud800"}}]},
     "tools[0].function.name"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x",
                                           "name": "\ud800"}]}, "messages[0].name"),
    (LoadLoRAAdapterRequest, {"lora_name": "a", "lora_path": "dir\ud800"}, "lora_path"),
])
def test_issue18_text_that_cannot_encode_is_400_naming_the_field(model, body, param):
    error = _fails(model, body)
    assert (error.status, error.param) == (400, param)
    assert "surrogate" in error.message
    error.message.encode("utf-8")


def test_text_may_hold_control_characters():
    req = CompletionRequest.model_validate({"prompt": "line\nnext\ttab\x00nul", "stop":
                                            ["\n\n"]})
    assert req.prompt == "line\nnext\ttab\x00nul"


def test_first_unencodable():
    assert first_unencodable("plain ascii") is None
    assert first_unencodable("naïve 日本 😀") is None
    assert first_unencodable("ab\ud800c") == 2
    assert first_unencodable("\udc00") == 0


def test_validation_error_shape():
    error = _fails(CompletionRequest, {"prompt": [True]})
    assert error.param == "prompt"
    assert error.message == ("prompt: matches none of the accepted forms (str, list[str], "
                             "list[int], list[list[int]])")
    error = _fails(CompletionRequest, {})
    assert (error.param, error.message) == ("prompt", "prompt: Field required")
    error = _fails(ChatCompletionRequest, {"messages": [{"role": "wizard"}]})
    assert error.param == "messages[0].role"
    json_error = validation_error([{"type": "json_invalid", "loc": ("body", 3),
                                    "msg": "JSON decode error",
                                    "ctx": {"error": "Expecting value"}}])
    assert json_error.param is None and "not valid JSON" in json_error.message


def test_published_name_pattern_is_the_enforced_rule():
    # lone surrogates are no Unicode text: every string refuses them, the pattern (which
    # other languages' regex engines must compile) does not name them
    pattern = re.compile(NAME_PATTERN)
    for code in [*range(0x3000), *range(0xD7F0, 0xE010), *range(0xFFF0, 0x10000), 0x1F600]:
        name = f"a{chr(code)}b"
        try:
            check_name(name)
            accepted = True
        except ValueError:
            accepted = False
        if 0xD800 <= code <= 0xDFFF:
            assert not accepted and pattern.match(name), hex(code)
        else:
            assert accepted == bool(pattern.match(name)), hex(code)
    schema = CompletionRequest.model_json_schema()["properties"]["model"]["anyOf"][0]
    assert schema == {"type": "string", "maxLength": MAX_NAME_CHARS, "pattern": NAME_PATTERN}


def test_validation_error_of_dict_keys_and_no_errors():
    error = _fails(CompletionRequest, {"prompt": "x", "logit_bias": {"a.b": "1"}})
    assert error.param == "logit_bias.a.b" and "valid number" in error.message
    assert validation_error([]).status == 400
