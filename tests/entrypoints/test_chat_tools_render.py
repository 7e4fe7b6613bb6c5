"""Chat requests with tools and a tool-call history render as transformers'
``apply_chat_template`` renders the same conversation written by hand in its own form
(tool calls' arguments as dicts, tools as OpenAI function dicts), on the tiny checkpoint's
tokenizer with a Hermes-style and a Llama-3.1-style tool template; a template that does
not take tools still renders."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from manylora.entrypoints.openai.protocol import ChatCompletionRequest
from manylora.entrypoints.openai.serving_chat import OpenAIServingChat
from manylora.testing import make_tokenizer

HERMES_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

You may call one or more functions. Function signatures within <tools></tools>:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>

Return each call as <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}\
<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant
{%- if message.content %}
{{ message.content }}
{%- endif %}
{%- for tool_call in message.tool_calls or [] %}
{%- set fn = tool_call.function %}
<tool_call>
{"name": "{{ fn.name }}", "arguments": {{ fn.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response id="{{ message.tool_call_id }}">
{{ message.content }}
</tool_response><|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

LLAMA31_TEMPLATE = """\
{{- bos_token }}
{%- if messages[0].role == 'system' %}
{%- set system_message = messages[0].content %}{%- set messages = messages[1:] %}
{%- else %}{%- set system_message = "" %}{%- endif %}
<|start_header_id|>system<|end_header_id|>

{% if tools is not none %}Environment: ipython
{% endif %}{{ system_message }}<|eot_id|>
{%- if tools is not none %}<|start_header_id|>user<|end_header_id|>

Respond in the format {"name": function name, "parameters": dictionary of argument name and \
its value}.

{% for t in tools %}{{ t | tojson(indent=4) }}

{% endfor %}<|eot_id|>
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}
{%- set tool_call = message.tool_calls[0].function %}\
<|start_header_id|>assistant<|end_header_id|>

{"name": "{{ tool_call.name }}", "parameters": {{ tool_call.arguments | tojson }}}<|eot_id|>
{%- elif message.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- else %}<|start_header_id|>{{ message.role }}<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
        "required": ["city"]}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "tz": {"type": "string"}}}}}
ARGS = {"city": "Paris", "unit": "c"}

# the request as an OpenAI client sends it
REQUEST_MESSAGES = [
    {"role": "system", "content": "You are helpful."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": json.dumps(ARGS)}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"},
    {"role": "user", "content": [{"type": "text", "text": "And the time?"}]},
]
# the same conversation in transformers' form, written out by hand
HF_MESSAGES = [
    {"role": "system", "content": "You are helpful."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": ARGS}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"},
    {"role": "user", "content": "And the time?"},
]


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


def _chat(tokenizer, template: str) -> OpenAIServingChat:
    tokenizer.chat_template = template
    engine = SimpleNamespace(tokenizer=tokenizer, max_model_len=4096)
    return OpenAIServingChat(engine, SimpleNamespace(base_model_name="base"))


@pytest.mark.parametrize("template", [HERMES_TEMPLATE, LLAMA31_TEMPLATE],
                         ids=["hermes", "llama3.1"])
def test_tools_and_tool_history_render_as_transformers(tokenizer, template):
    chat = _chat(tokenizer, template)
    request = ChatCompletionRequest(messages=REQUEST_MESSAGES,
                                    tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="none")
    request.check()
    want = tokenizer.apply_chat_template(HF_MESSAGES, tools=[WEATHER_TOOL, TIME_TOOL],
                                         tokenize=False, add_generation_prompt=True)
    got = chat.render(request)
    assert got == want
    assert '"arguments": {"city": "Paris", "unit": "c"}' in got or \
        '"parameters": {"city": "Paris", "unit": "c"}' in got
    assert "get_time" in got                     # every tool reached the template


@pytest.mark.parametrize("template", [HERMES_TEMPLATE, LLAMA31_TEMPLATE],
                         ids=["hermes", "llama3.1"])
def test_without_tools_renders_as_transformers_without_tools(tokenizer, template):
    chat = _chat(tokenizer, template)
    messages = [{"role": "user", "content": "hi"}]
    got = chat.render(ChatCompletionRequest(messages=messages))
    assert got == tokenizer.apply_chat_template(messages, tokenize=False,
                                                add_generation_prompt=True)
    assert "Tools" not in got and "ipython" not in got


def test_a_template_without_tools_still_renders(tokenizer):
    from manylora.testing.tokenizer import CHAT_TEMPLATE
    chat = _chat(tokenizer, CHAT_TEMPLATE)
    messages = [{"role": "user", "content": "hi"}]
    with_tools = chat.render(ChatCompletionRequest(messages=messages, tools=[WEATHER_TOOL],
                                                   tool_choice="none"))
    assert with_tools == chat.render(ChatCompletionRequest(messages=messages))
    assert with_tools == tokenizer.apply_chat_template(messages, tokenize=False,
                                                       add_generation_prompt=True)
