"""``manylora serve --reasoning-parser qwen3`` through the ``openai`` client: the answer's
``reasoning_content`` and ``content`` split (vLLM's fields), streamed and not, and Qwen3's
``enable_thinking`` switch reaching both the chat template (through
``chat_template_kwargs``) and the parser. The engine writes a scripted answer so that the
split is known in advance."""

from __future__ import annotations

import asyncio

import openai
import pytest
from server_helpers import BASE, running_server

from manylora.engine.outputs import CompletionOutput, RequestOutput
from manylora.sampling_params import RequestOutputKind

# a Qwen3-like template: enable_thinking=false closes an empty thinking block in the prompt
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
            "<assistant>{% if enable_thinking is defined and enable_thinking is false %}"
            "<think>\n\n</think>\n\n{% endif %}")
ANSWER = "<think>Two and two make four.</think>It is 4."
MESSAGES = [{"role": "user", "content": "2+2?"}]


@pytest.fixture(scope="module")
def server(base_dir):
    """A qwen3 reasoning server whose engine writes ``ANSWER`` in 4-character pieces and
    records each prompt's text."""
    with running_server(base_dir, "--reasoning-parser", "qwen3",
                        "--chat-template", TEMPLATE) as (srv, url):
        prompts: list[str] = []

        async def scripted(prompt, params, request_id=None, lora_request=None,
                           client_group=None):
            prompts.append(prompt["prompt"])
            pieces = [ANSWER[i:i + 4] for i in range(0, len(ANSWER), 4)]
            delta = params.output_kind is RequestOutputKind.DELTA
            for i, piece in enumerate(pieces):
                await asyncio.sleep(0)
                last = i == len(pieces) - 1
                if not delta and not last:
                    continue
                text = piece if delta else ANSWER
                out = CompletionOutput(0, text, [0] * (1 if delta else len(pieces)),
                                       "stop" if last else None)
                yield RequestOutput(request_id, prompt["prompt"], prompt["prompt_token_ids"],
                                    [out], last)

        srv.engine.generate = scripted
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0), prompts


def _streamed(client, **extra):
    reasoning = content = ""
    for chunk in client.chat.completions.create(model=BASE, messages=MESSAGES, stream=True,
                                                **extra):
        delta = chunk.choices[0].delta
        piece = (delta.model_extra or {}).get("reasoning_content")
        assert not (piece and "think>" in piece)
        reasoning += piece or ""
        content += delta.content or ""
    return reasoning or None, content or None


def test_reasoning_and_content_split(server):
    client, _ = server
    message = client.chat.completions.create(model=BASE, messages=MESSAGES).choices[0].message
    assert (message.model_extra["reasoning_content"], message.content) == (
        "Two and two make four.", "It is 4.")
    assert _streamed(client) == ("Two and two make four.", "It is 4.")


def test_enable_thinking_false_reaches_template_and_parser(server):
    client, prompts = server
    off = {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}
    message = client.chat.completions.create(model=BASE, messages=MESSAGES,
                                             **off).choices[0].message
    assert prompts[-1].endswith("<assistant><think>\n\n</think>\n\n")
    assert (message.model_extra.get("reasoning_content"), message.content) == (None, ANSWER)
    assert _streamed(client, **off) == (None, ANSWER)
    assert prompts[-1].endswith("<assistant><think>\n\n</think>\n\n")
