"""Chat templates as vLLM reads them: ``--chat-template`` given as Jinja text or a file
(:func:`load_chat_template`), the form message content reaches the template in
(``--chat-template-content-format``: :func:`content_format`), the keyword arguments vLLM
adds from request fields (:func:`template_extras`), and the messages rendered through it
(:func:`render_messages`)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from manylora.entrypoints.openai.errors import bad_request
from manylora.entrypoints.openai.protocol import ChatCompletionRequest
from manylora.entrypoints.openai.serving_tools import template_tools

__all__ = ["CONTENT_FORMATS", "as_parts", "content_format", "load_chat_template",
           "render_messages", "template_extras", "thinking_kwargs"]

#: vLLM's ``--chat-template-content-format`` values.
CONTENT_FORMATS = ("auto", "string", "openai")

# a Jinja loop over a message's content (``for part in message['content']``,
# ``... in m.content``): the template reads content as a list of parts
_LOOPS_OVER_CONTENT = re.compile(
    r"\bfor\s+\w+\s+in\s+\w+\s*(?:\[\s*['\"]content['\"]\s*\]|\.content\b)")


def content_format(flag: str, template: str | None) -> str:
    """The form message content reaches a chat template in (vLLM's
    ``--chat-template-content-format``): ``string`` (the text) or ``openai`` (a list of
    ``{"type": "text", "text": ...}`` parts); ``auto`` is ``openai`` when the template loops
    over a message's content (vLLM reads that from the template's Jinja syntax tree; here
    from its text), else ``string``."""
    if flag != "auto":
        return flag
    return "openai" if template and _LOOPS_OVER_CONTENT.search(template) else "string"


def as_parts(message: dict[str, Any]) -> dict[str, Any]:
    """A template message with its text content as OpenAI content parts."""
    text = message.get("content") or ""
    return {**message, "content": [{"type": "text", "text": text}] if text else []}


def load_chat_template(template: str | None) -> str | None:
    """A chat template given as Jinja text or as the path of a file holding it (vLLM's
    ``--chat-template`` takes both); None stays None.

    Raises:
        OSError: the path names a file that cannot be read.
    """
    if template is None:
        return None
    try:
        path = Path(template)
        is_file = path.is_file()
    except (OSError, ValueError):        # not a usable path (too long, NUL bytes): text
        return template
    return path.read_text(encoding="utf-8") if is_file else template


def template_extras(request: Any) -> dict[str, Any]:
    """The chat-template keyword arguments vLLM adds from request fields: ``documents``,
    ``reasoning_effort``, and ``enable_thinking`` (``reasoning_effort != "none"``) when a
    reasoning effort is given; only those set."""
    extras: dict[str, Any] = {}
    if getattr(request, "documents", None) is not None:
        extras["documents"] = request.documents
    effort = getattr(request, "reasoning_effort", None)
    if effort is not None:
        extras["reasoning_effort"] = effort
        extras["enable_thinking"] = effort != "none"
    return extras


def thinking_kwargs(request: Any) -> dict[str, Any]:
    """The chat-template keyword arguments a reasoning parser reads (``enable_thinking``):
    the request's ``chat_template_kwargs`` over those :func:`template_extras` adds, as
    :meth:`~manylora.entrypoints.openai.serving_chat.OpenAIServingChat.render`
    passes them."""
    return {**template_extras(request), **(request.chat_template_kwargs or {})}


def render_messages(tokenizer: Any, request: Any, server_template: str | None,
                    content_format_flag: str) -> str:
    """A chat request's messages as prompt text, through the chat template: the request's
    own (``chat_template``, or that key of ``chat_template_kwargs``; refused by
    ``check_fields`` without ``--trust-request-chat-template``), else ``server_template``,
    else the tokenizer's; ``documents`` and ``reasoning_effort`` are passed to the template
    as vLLM passes them (``enable_thinking`` follows ``reasoning_effort`` unless
    ``chat_template_kwargs`` sets it). The request's ``tools`` go to the template as its
    ``tools=`` argument (a template that does not use them ignores it). Blocking (Jinja).

    Args:
        tokenizer: a Hugging Face tokenizer (``apply_chat_template``).
        request: a ``ChatCompletionRequest`` (or a body with ``messages`` and the chat
            template fields).
        server_template: ``--chat-template``'s text, or None.
        content_format_flag: ``--chat-template-content-format``.

    Raises:
        OpenAIError: 400 (``messages``) without a chat template, for a non-text content
            part, or when the template fails on the messages or renders no text.
    """
    own = None          # a request's own template (trusted: check_fields)
    if isinstance(request, ChatCompletionRequest):
        own = request.chat_template or (request.chat_template_kwargs or {}).get(
            "chat_template")
    template = own or server_template
    if template is None and not getattr(tokenizer, "chat_template", None):
        raise bad_request("the model's tokenizer has no chat template, and the server "
                          "was started without --chat-template", param="messages")
    messages = [m.to_template() for m in request.messages]
    if content_format(content_format_flag,
                      template or getattr(tokenizer, "chat_template", None)) == "openai":
        messages = [as_parts(m) for m in messages]
    kwargs = dict(request.chat_template_kwargs or {})
    for key, value in template_extras(request).items():
        if key != "enable_thinking" or key not in kwargs:
            kwargs[key] = value
    kwargs.update(tokenize=False,
                  add_generation_prompt=bool(request.add_generation_prompt),
                  continue_final_message=bool(request.continue_final_message),
                  chat_template=template, tools=template_tools(request))
    try:
        text = tokenizer.apply_chat_template(messages, **kwargs)
    except Exception as e:
        raise bad_request(f"the chat template could not render the messages: {e}",
                          param="messages") from e
    if not isinstance(text, str):
        raise bad_request("the chat template did not render to text", param="messages")
    return text
