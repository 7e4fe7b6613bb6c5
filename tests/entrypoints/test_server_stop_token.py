"""The stop token never reaches ``content``, ``text`` or a delta (vLLM's behaviour), on a
real ``manylora serve`` of SmolLM2-135M-Instruct's GGUF with ``--enable-auto-tool-choice
--tool-call-parser hermes``: chat with its own ChatML template and with a hermes tool
template, tool choice absent/auto/none/required/named, completions, streamed or not,
``skip_special_tokens`` either way. The model is trained, so greedy answers end on its EOS
``<|im_end|>`` (checked: ``finish_reason`` stop or tool_calls, never length).

Reference: the tokenizer's own EOS text (transformers, read from the GGUF), and the
server's answer without the stop token id for ``stop_token_ids``."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from server_helpers import BASE, running_server
from test_chat_tools_render import HERMES_TEMPLATE

ALERT = {"type": "object", "properties": {"severe": {"type": "boolean"}},
         "required": ["severe"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "alert", "description": "Raise an alert.",
                                           "parameters": ALERT}}]
MESSAGES = [{"role": "system", "content": "You are a helpful assistant. Answer briefly."},
            {"role": "user", "content": "Say hello."}]
CHOICES = {"absent": None, "auto": "auto", "none": "none", "required": "required",
           "named": {"type": "function", "function": {"name": "alert"}}}
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def url(smollm2_gguf):
    with running_server(smollm2_gguf, "--enable-auto-tool-choice", "--tool-call-parser",
                        "hermes", "--trust-request-chat-template", max_model_len=512,
                        block_size=16, num_kv_blocks=64, max_num_seqs=8) as (_, url):
        yield url


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def eos_text(smollm2_tokenizer):
    assert smollm2_tokenizer.eos_token == "<|im_end|>"
    return smollm2_tokenizer.eos_token


def _chat(client, stream: bool, **kwargs) -> tuple[list[str], str | None, list]:
    """The content pieces (one per delta when streamed), the finish reason and the tool
    calls of one chat choice."""
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        return [choice.message.content or ""], choice.finish_reason, \
            choice.message.tool_calls or []
    pieces, reason, calls = [], None, []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            calls += choice.delta.tool_calls or []
            reason = choice.finish_reason or reason
    return pieces, reason, calls


# SmolLM2's own template renders no tools: tool choices other than auto add nothing there
MODES = [(template, choice, stream, skip)
         for template, choice in [("smollm2", "absent"), ("smollm2", "auto"),
                                  ("hermes", "auto"), ("hermes", "none"),
                                  ("hermes", "required"), ("hermes", "named")]
         for stream in (False, True) for skip in (True, False)]


def _chat_mode(client, eos_text, template, choice, stream, skip) -> str | None:
    """What is wrong with one mode's answer (None: nothing)."""
    extra = {"skip_special_tokens": skip}
    if template == "hermes":
        extra["chat_template"] = HERMES_TEMPLATE
    tools = {} if choice == "absent" else {"tools": TOOLS, "tool_choice": CHOICES[choice]}
    pieces, reason, calls = _chat(client, stream, model=BASE, messages=MESSAGES,
                                  temperature=0, max_tokens=MAX_TOKENS, extra_body=extra,
                                  **tools)
    if reason not in ("stop", "tool_calls"):
        return f"ended with {reason!r}, not on the EOS"
    leaks = [p for p in pieces if eos_text in p] + [
        c.function.arguments for c in calls if eos_text in (c.function.arguments or "")]
    if leaks or eos_text in "".join(pieces):
        return f"the EOS text reached the answer: {leaks or pieces}"
    if choice in ("required", "named") and not calls:
        return "no tool call"
    return None


def test_chat_never_shows_the_stop_token(client, eos_text):
    # every mode at once: the server batches them (one request per mode, all greedy)
    with ThreadPoolExecutor(8) as pool:
        problems = dict(zip(MODES, pool.map(lambda m: _chat_mode(client, eos_text, *m),
                                            MODES)))
    assert {mode: p for mode, p in problems.items() if p} == {}


@pytest.mark.parametrize("skip", [True, False], ids=["skip", "keep"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_completions_never_show_the_stop_token(client, smollm2_tokenizer, eos_text, stream,
                                               skip):
    prompt = smollm2_tokenizer.apply_chat_template(MESSAGES, tokenize=False,
                                                   add_generation_prompt=True)
    kwargs = dict(model=BASE, prompt=prompt, temperature=0, max_tokens=MAX_TOKENS,
                  extra_body={"skip_special_tokens": skip})
    if stream:
        pieces, reason = [], None
        for chunk in client.completions.create(stream=True, **kwargs):
            for choice in chunk.choices:
                pieces.append(choice.text)
                reason = choice.finish_reason or reason
    else:
        choice = client.completions.create(**kwargs).choices[0]
        pieces, reason = [choice.text], choice.finish_reason
    assert reason == "stop"
    assert all(eos_text not in p for p in pieces)
    assert "".join(pieces).strip()


@pytest.mark.parametrize("skip", [True, False], ids=["skip", "keep"])
def test_a_stop_token_is_dropped_from_the_text_and_kept_in_logprobs(client, smollm2_tokenizer,
                                                                    eos_text, skip):
    prompt = smollm2_tokenizer.apply_chat_template(MESSAGES, tokenize=False,
                                                   add_generation_prompt=True)
    kwargs = dict(model=BASE, prompt=prompt, temperature=0, max_tokens=MAX_TOKENS, logprobs=0)
    free = client.completions.create(**kwargs).choices[0]
    tokens = free.logprobs.tokens
    assert len(tokens) >= 3
    assert free.finish_reason == "stop" and tokens[-1] == eos_text   # the EOS, as vLLM
    assert eos_text not in free.text
    stop_text = tokens[1]                                 # the answer's second token
    stop_id = smollm2_tokenizer.encode(tokens[0] + stop_text, add_special_tokens=False)[-1]
    assert smollm2_tokenizer.decode([stop_id]) == stop_text
    got = client.completions.create(
        extra_body={"stop_token_ids": [stop_id], "skip_special_tokens": skip},
        **kwargs).choices[0]
    assert got.finish_reason == "stop"
    assert got.stop_reason == stop_id
    assert got.text == tokens[0]                          # the stop token's text is not there
    assert got.logprobs.tokens == tokens[:2]              # but its log-probability is


def test_per_request_disable_any_whitespace_finishes_json(client, smollm2_tokenizer):
    # this module's server has no server-wide config: the option comes from the request
    # (vLLM's structured_outputs extra, beside the response_format the client sends)
    from test_server_structured_whitespace import check_parse_finishes

    check_parse_finishes(client, smollm2_tokenizer,
                         extra_body={"structured_outputs": {"disable_any_whitespace": True}})
