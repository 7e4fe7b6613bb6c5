"""``POST /tokenize``, ``POST /detokenize`` and ``GET /tokenizer_info``: vLLM's tokenizer
routes, so that clients (lm-evaluation-harness without a local tokenizer, token counters,
prompt builders) use the server's own tokenizer and chat template.

``model`` resolves as for completions (the base model's name, an adapter's, or none; an
unknown name is a 404): every adapter shares the base model's tokenizer. Encoding, decoding
and chat-template rendering run on the shared tokenization worker
(:class:`~manylora.entrypoints.openai.tokenization.PromptTokenizer`), off the event loop.
A text longer than the context is tokenized all the same (the answer's ``count`` says so),
as vLLM does; the request-body limit bounds the work.
"""

from __future__ import annotations

from typing import Any

from manylora.entrypoints.openai.errors import bad_request
from manylora.entrypoints.openai.protocol_tokenization import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeRequest,
    TokenizeResponse,
)
from manylora.entrypoints.openai.serving import OpenAIServing
from manylora.entrypoints.openai.serving_chat import OpenAIServingChat

__all__ = ["OpenAIServingTokenization", "tokenizer_info"]

# Configuration keys that name files on the server (its paths are not the client's business)
_PRIVATE_KEYS = frozenset({"name_or_path", "_name_or_path"})


def _json_safe(value: Any) -> Any:
    """``value`` as JSON can carry it: an ``AddedToken`` as its content, containers
    element-wise, anything else unknown as ``str``."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [_json_safe(v) for v in value]
    content = getattr(value, "content", None)
    return content if isinstance(content, str) else str(value)


def tokenizer_info(tokenizer: Any, chat_template: str | None) -> dict[str, Any]:
    """vLLM's ``/tokenizer_info`` body: the tokenizer's ``init_kwargs`` made JSON-safe
    (without keys naming server files: ``*_file``, ``name_or_path``), ``tokenizer_class``
    (the Python class's name), the special tokens (``bos_token``, ``eos_token``,
    ``pad_token``, ``unk_token``: from the tokenizer when ``init_kwargs`` lacks them, as
    lm-eval's remote tokenizer needs ``eos_token``) and ``chat_template`` (the server's
    ``--chat-template`` over the tokenizer's; absent when neither exists)."""
    info = {key: _json_safe(value)
            for key, value in (getattr(tokenizer, "init_kwargs", None) or {}).items()
            if key not in _PRIVATE_KEYS and not key.endswith("_file")}
    info["tokenizer_class"] = type(tokenizer).__name__
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):   # lm-eval reads these
        if info.get(key) is None and getattr(tokenizer, key, None) is not None:
            info[key] = _json_safe(getattr(tokenizer, key))
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if isinstance(template, str):
        info["chat_template"] = template
    else:
        info.pop("chat_template", None)
    return info


class OpenAIServingTokenization(OpenAIServing):
    """The tokenizer routes.

    Args:
        engine: an ``AsyncLLM`` (``tokenizer``, ``max_model_len``).
        models: the models registry (``base_model_name``, ``resolve(name)``).
        chat: the chat endpoint, whose template and rendering ``/tokenize`` of messages
            uses (so both render alike).
        kwargs: ``prompt_tokenizer`` of :class:`OpenAIServing` (share the chat endpoint's).
    """

    def __init__(self, engine: Any, models: Any, chat: OpenAIServingChat,
                 **kwargs: Any) -> None:
        super().__init__(engine, models, **kwargs)
        self.chat = chat

    def tokenize_now(self, request: TokenizeRequest) -> list[int]:
        """The token ids of a ``/tokenize`` body, on the calling thread (run it on the
        tokenization worker).

        Raises:
            OpenAIError: 400 when the chat template fails or the tokenizer fails.
        """
        if isinstance(request, TokenizeChatRequest):
            text, param = self.chat.render(request), "messages"
        else:
            text, param = request.prompt, "prompt"
        try:
            return self.prompts.encode_now([text], request.add_special_tokens)[0]
        except Exception as e:
            raise bad_request(f"the {param} could not be tokenized: {e}", param=param) from e

    async def tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        """Answer ``POST /tokenize``.

        Raises:
            OpenAIError: 404 for an unknown ``model``; 400 without a tokenizer, for a chat
                request :meth:`TokenizeChatRequest.check` refuses or whose template fails,
                or when the tokenizer fails on the text.
        """
        is_chat = isinstance(request, TokenizeChatRequest)
        if is_chat:
            request.check()
        self.resolve_model(request.model)
        self.require_tokenizer("/tokenize", param="messages" if is_chat else "prompt")
        ids = await self.prompts.run(self.tokenize_now, request)
        strs = None
        if request.return_token_strs:
            strs = [str(s) for s in await self.prompts.run(
                self.tokenizer.convert_ids_to_tokens, ids)]
        return TokenizeResponse(count=len(ids), max_model_len=self.max_model_len, tokens=ids,
                                token_strs=strs)

    async def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        """Answer ``POST /detokenize``: ``tokenizer.decode(tokens)``, special tokens kept.

        Raises:
            OpenAIError: 404 for an unknown ``model``; 400 without a tokenizer or for a
                token id outside ``[0, len(tokenizer))`` (``param`` ``tokens[i]``).
        """
        self.resolve_model(request.model)
        tokenizer = self.require_tokenizer("/detokenize", param="tokens")
        size = len(tokenizer)
        for i, token in enumerate(request.tokens):
            if not 0 <= token < size:
                raise bad_request(f"tokens[{i}] is {token}, outside the tokenizer's "
                                  f"vocabulary [0, {size})", param=f"tokens[{i}]")
        text = await self.prompts.run(tokenizer.decode, request.tokens)
        return DetokenizeResponse(prompt=text)

    def tokenizer_info(self) -> dict[str, Any]:
        """Answer ``GET /tokenizer_info`` (see :func:`tokenizer_info`).

        Raises:
            OpenAIError: 400 when the server runs without a tokenizer.
        """
        tokenizer = self.require_tokenizer("/tokenizer_info")
        return tokenizer_info(tokenizer, self.chat.chat_template)
