"""``ServerConfig``: the settings of ``manylora serve``'s app beyond the engine's
(``EngineArgs``), as the server's flags give them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from manylora.entrypoints.openai.frontend_args import FrontendConfig
from manylora.entrypoints.openai.serving import DEFAULT_MAX_CHOICES_PER_REQUEST
from manylora.entrypoints.openai.serving_tools import DEFAULT_MAX_TOOLS
from manylora.sampling_params import MAX_LOGPROBS

#: The largest request body by default (``--max-request-body-bytes``), bytes.
DEFAULT_MAX_REQUEST_BODY_BYTES = 16 * 2**20


@dataclass(frozen=True)
class ServerConfig:
    """The server's own settings (the engine's are in ``EngineArgs``).

    Attributes:
        api_keys: accepted Bearer tokens; empty: no authentication.
        max_request_body_bytes: the largest request body, bytes; larger ones get 413.
        enable_lora_runtime_updates: serve the load/unload adapter routes.
        chat_template: a Jinja chat template (text, or a file holding it) replacing the
            tokenizer's, or None.
        max_choices_per_request: the most engine requests (prompts x ``n``) one HTTP
            request may create; more get 400 before anything is tokenized.
        frontend: CORS, root path and request log settings (vLLM's front-end flags).
        enable_auto_tool_choice: serve ``tool_choice: "auto"`` (vLLM's flag).
        tool_call_parser: the format auto tool calls are parsed in (vLLM's names), or None.
        reasoning_parser: the format chat answers' reasoning is split out in (vLLM's
            ``--reasoning-parser`` names), or None.
        trust_request_chat_template: accept a request's own ``chat_template``.
        sampling_defaults: defaults of the sampling fields requests leave unset
            (``--generation-config``); ``max_tokens`` caps every request's.
        max_logprobs: the most log-probabilities per token a request may ask for.
        max_tools: the most ``tools`` one chat request may carry.
        response_role: the role of chat answers to requests that add a generation prompt
            (vLLM's ``--response-role``).
        return_tokens_as_token_ids: the default of requests' ``return_tokens_as_token_ids``
            (vLLM's flag).
        enable_force_include_usage: every stream ends with the usage chunk, as if it asked
            for ``stream_options.include_usage`` (vLLM's flag).
        chat_template_content_format: ``auto``, ``string`` or ``openai`` (vLLM's flag;
            ``chat_template.content_format``).
        enable_prompt_tokens_details: usage has ``prompt_tokens_details.cached_tokens``,
            the prompt tokens served from the prefix cache (vLLM's flag).
    """

    api_keys: tuple[str, ...] = ()
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    enable_lora_runtime_updates: bool = False
    chat_template: str | None = None
    max_choices_per_request: int = DEFAULT_MAX_CHOICES_PER_REQUEST
    frontend: FrontendConfig = FrontendConfig()
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    trust_request_chat_template: bool = False
    sampling_defaults: Mapping[str, Any] = field(default_factory=dict)
    max_logprobs: int = MAX_LOGPROBS
    max_tools: int = DEFAULT_MAX_TOOLS
    response_role: str = "assistant"
    return_tokens_as_token_ids: bool = False
    enable_force_include_usage: bool = False
    chat_template_content_format: str = "auto"
    enable_prompt_tokens_details: bool = False
