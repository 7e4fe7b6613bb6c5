"""Request and response bodies of ``POST /tokenize``, ``POST /detokenize`` and
``GET /tokenizer_info``, with vLLM's field names, defaults and shapes.

``/tokenize`` takes either a text (:class:`TokenizeCompletionRequest`: ``prompt``) or chat
messages (:class:`TokenizeChatRequest`: ``messages``, rendered by the chat template); a body
with neither matches no member of :data:`TokenizeRequest` and gets a 400. The bodies obey
the edge rules of :class:`~manylora.entrypoints.openai.validation.RequestModel`.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from manylora.entrypoints.openai.errors import bad_request
from manylora.entrypoints.openai.protocol import ChatCompletionMessageParam
from manylora.entrypoints.openai.protocol_tools import ChatCompletionToolsParam
from manylora.entrypoints.openai.validation import ClientName, RequestModel, publish_rule

__all__ = [
    "DetokenizeRequest",
    "DetokenizeResponse",
    "TokenizeChatRequest",
    "TokenizeCompletionRequest",
    "TokenizeRequest",
    "TokenizeResponse",
    "TokenizerInfoResponse",
]

#: A token id as a client sends it: a non-negative integer (the upper bound, the
#: tokenizer's size, is checked by the route).
TokenId = Annotated[int, Field(ge=0, description="a token id")]


class TokenizeCompletionRequest(RequestModel):
    """``/tokenize`` of a text: ``prompt`` encoded as a completion prompt is (with the
    tokenizer's special tokens, such as BOS, unless ``add_special_tokens`` is false)."""

    model: ClientName | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


def _publish_chat_rules(schema: dict[str, Any]) -> None:
    """Publish the rule of :meth:`TokenizeChatRequest.check` between fields:
    ``continue_final_message`` only with ``add_generation_prompt`` false."""
    publish_rule(schema, {"continue_final_message": {"const": True}},
                 {"add_generation_prompt": {"const": False}})


class TokenizeChatRequest(RequestModel):
    """``/tokenize`` of chat messages: rendered by the chat template as
    ``/v1/chat/completions`` renders them, then encoded (no special tokens added by default:
    the template carries them, as in vLLM); ``tools`` reach the template as they do for a
    chat completion."""

    model_config = ConfigDict(json_schema_extra=_publish_chat_rules)

    model: ClientName | None = None
    messages: list[ChatCompletionMessageParam] = Field(json_schema_extra={"minItems": 1})
    tools: list[ChatCompletionToolsParam] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None

    def check(self) -> None:
        """Reject what the schema cannot state.

        Raises:
            OpenAIError: 400 for no ``messages``, a non-text content part, or both
                ``add_generation_prompt`` and ``continue_final_message``.
        """
        if not self.messages:
            raise bad_request("messages must not be empty", param="messages")
        for message in self.messages:
            message.text()
        if self.add_generation_prompt and self.continue_final_message:
            raise bad_request("add_generation_prompt and continue_final_message cannot both "
                              "be true", param="continue_final_message")


#: The body of ``POST /tokenize``: a text or chat messages.
TokenizeRequest = TokenizeCompletionRequest | TokenizeChatRequest


class TokenizeResponse(BaseModel):
    """``/tokenize``'s answer.

    Attributes:
        count: the number of tokens.
        max_model_len: the server's context length, tokens.
        tokens: the token ids.
        token_strs: each id's vocabulary entry (``convert_ids_to_tokens``), when
            ``return_token_strs`` was set; else None.
    """

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(RequestModel):
    """``/detokenize``: the text of ``tokens`` (ids in ``[0, len(tokenizer))``), special
    tokens kept."""

    model: ClientName | None = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    """``/detokenize``'s answer: ``prompt``, the decoded text."""

    prompt: str


class TokenizerInfoResponse(BaseModel):
    """``/tokenizer_info``'s answer (vLLM's): ``tokenizer_class``, the chat template when
    there is one, and the tokenizer's JSON-serializable configuration (its special tokens,
    ``model_max_length``, ``add_bos_token``, ...) as further fields."""

    model_config = ConfigDict(extra="allow")

    tokenizer_class: str
