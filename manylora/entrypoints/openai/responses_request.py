"""A ``/v1/responses`` request in the chat route's terms (vLLM's conversion): input and output
items as chat messages (a run of ``function_call`` items as one assistant message's
``tool_calls``, a ``function_call_output`` as a ``tool`` message), the chat request the input
renders as, and the engine's sampling parameters (``text.format`` as ``structured_outputs``)."""

from __future__ import annotations

from typing import Any

from manylora.entrypoints.openai.errors import bad_request
from manylora.entrypoints.openai.protocol import (
    ChatCompletionMessageParam,
    ChatCompletionRequest,
)
from manylora.entrypoints.openai.protocol_responses import (
    ResponsesRequest,
    TextFormatJSONObject,
    TextFormatJSONSchema,
)
from manylora.entrypoints.openai.request_sampling import make_sampling_params, output_kind
from manylora.sampling_params import SamplingParams
from manylora.structured.grammar import check_spec_size
from manylora.structured_params import StructuredOutputsParams

__all__ = ["as_chat_request", "chat_messages", "input_messages", "sampling_params"]


def chat_messages(items: list[Any]) -> list[dict[str, Any]]:
    """Input or output items as chat messages: a message as its role and text; a run of
    ``function_call`` items as the ``tool_calls`` of one assistant message (joining the
    assistant message right before them); a ``function_call_output`` as a ``tool``
    message answering its ``call_id`` (the chat route's shapes, as vLLM converts them)."""
    messages: list[dict[str, Any]] = []
    for item in items:
        if item.type == "function_call":
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif item.type == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item.call_id,
                             "content": item.text()})
        elif hasattr(item, "text"):
            messages.append({"role": item.role, "content": item.text()})
        else:                                                  # an output message
            messages.append({"role": item.role,
                             "content": "".join(part.text for part in item.content)})
    return messages


def input_messages(request: ResponsesRequest) -> list[dict[str, Any]]:
    if isinstance(request.input, str):
        return [{"role": "user", "content": request.input}]
    return chat_messages(request.input)


def _structured(request: ResponsesRequest, max_bytes: int) -> StructuredOutputsParams | None:
    """The output constraint of ``text.format`` (vLLM's mapping: a JSON schema without
    optional whitespace or properties it does not name; ``json_object``: any object).

    Raises:
        OpenAIError: 400 (``text``) for a schema the constraint refuses or one over
            ``max_bytes`` (``--max-structured-output-spec-bytes``).
    """
    fmt = request.text.format if request.text is not None else None
    try:
        if isinstance(fmt, TextFormatJSONSchema):
            params = StructuredOutputsParams(json=fmt.schema_, disable_any_whitespace=True,
                                             disable_additional_properties=True)
            check_spec_size(params, max_bytes)
            return params
        if isinstance(fmt, TextFormatJSONObject):
            return StructuredOutputsParams(json_object=True)
    except ValueError as e:
        raise bad_request(f"text.format: {e}", param="text") from None
    return None


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """``logit_bias`` with integer token ids.

    Raises:
        OpenAIError: 400 (``logit_bias``) for a key that is not a token id.
    """
    if not bias:
        return None
    try:
        return {int(k): v for k, v in bias.items()}
    except ValueError:
        raise bad_request("logit_bias keys must be token ids (integers as strings)",
                          param="logit_bias") from None


def as_chat_request(request: ResponsesRequest,
                    conversation: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request the input renders as: ``instructions`` as a leading system
    message, the conversation, and the tools in the chat route's shape."""
    messages = [{"role": "system", "content": request.instructions}] \
        if request.instructions is not None else []
    return ChatCompletionRequest(
        messages=[ChatCompletionMessageParam(**m) for m in messages + conversation],
        chat_template_kwargs=request.chat_template_kwargs,
        tools=request.chat_tools(), tool_choice=request.chat_tool_choice(),
        parallel_tool_calls=request.parallel_tool_calls)


def sampling_params(request: ResponsesRequest, max_tokens: int,
                    max_spec_bytes: int) -> SamplingParams:
    """The engine's parameters of a Responses request: its sampling fields (OpenAI's
    defaults for those unset), ``max_tokens`` (fitted to the context by the caller),
    ``logit_bias``, ``top_logprobs`` when log-probabilities are asked for, and
    ``text.format`` as the output constraint.

    Raises:
        OpenAIError: 400 naming ``logit_bias`` or ``text`` (a ``text.format`` schema the
            constraint refuses, or one over ``max_spec_bytes``), or the field a
            ``SamplingParams`` error names.
    """
    return make_sampling_params(
        temperature=1.0 if request.temperature is None else request.temperature,
        top_p=1.0 if request.top_p is None else request.top_p,
        top_k=request.top_k or 0, seed=request.seed, max_tokens=max_tokens,
        stop=request.stop, ignore_eos=bool(request.ignore_eos),
        skip_special_tokens=(True if request.skip_special_tokens is None
                             else request.skip_special_tokens),
        include_stop_str_in_output=bool(request.include_stop_str_in_output),
        repetition_penalty=(1.0 if request.repetition_penalty is None
                            else request.repetition_penalty),
        logit_bias=_logit_bias(request.logit_bias),
        logprobs=(request.top_logprobs or 0) if request.wants_logprobs() else None,
        structured_outputs=_structured(request, max_spec_bytes),
        output_kind=output_kind(bool(request.stream)))
