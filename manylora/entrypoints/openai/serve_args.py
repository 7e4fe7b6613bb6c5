"""``manylora serve``'s flags: every engine argument (``EngineArgs``), the server's own, vLLM's
front-end and connection flags, and the ``vllm serve`` flags it takes for compatibility
(``vllm_flags.py``)."""

from __future__ import annotations

import argparse

from manylora.engine.arg_utils import EngineArgs
from manylora.entrypoints.openai.chat_template import CONTENT_FORMATS
from manylora.entrypoints.openai.frontend_args import add_frontend_args
from manylora.entrypoints.openai.http_limits import add_connection_args
from manylora.entrypoints.openai.reasoning_parsers import REASONING_PARSERS
from manylora.entrypoints.openai.server_config import DEFAULT_MAX_REQUEST_BODY_BYTES
from manylora.entrypoints.openai.serving import DEFAULT_MAX_CHOICES_PER_REQUEST
from manylora.entrypoints.openai.serving_tools import DEFAULT_MAX_TOOLS
from manylora.entrypoints.openai.tool_parsers import TOOL_PARSERS
from manylora.entrypoints.openai.vllm_flags import VllmArgumentParser, add_vllm_flags
from manylora.metrics.catalog import NAME_SETS
from manylora.sampling_params import MAX_LOGPROBS


def _metrics_names(text: str) -> tuple[str, ...]:
    """``--metrics-names``: a comma-separated, non-empty subset of ``NAME_SETS``."""
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    unknown = [n for n in names if n not in NAME_SETS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated list of {', '.join(NAME_SETS)}, got {text!r}")
    return names


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Every engine argument (``EngineArgs.add_cli_args``) and the server's own flags."""
    EngineArgs.add_cli_args(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on")
    parser.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                        help="the names requests may use for the base model; responses and "
                             "/v1/models use the first (default: --model)")
    parser.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                        help="adapters served from start-up: NAME=PATH or JSON "
                             '{"name": ..., "path": ..., "base_model_name": ...}')
    parser.add_argument("--enable-lora-runtime-updates", action="store_true",
                        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter "
                             "(also on with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 or true)")
    parser.add_argument("--enable-lora-resolver", action="store_true",
                        help="load an unknown model name on its first request when it names "
                             "an adapter directory directly under a --lora-root (vLLM's "
                             "filesystem resolver; also on with VLLM_PLUGINS="
                             "lora_filesystem_resolver and VLLM_LORA_RESOLVER_CACHE_DIR); "
                             "needs runtime updates")
    parser.add_argument("--lora-root", action="append", default=[], metavar="DIR",
                        help="a directory run-time adapter loads may read from (repeatable)")
    parser.add_argument("--api-key", action="append", default=None,
                        help="a Bearer token every /v1 route wants (repeatable; default: "
                             "$MANYLORA_API_KEY; none: no authentication)")
    parser.add_argument("--max-waiting-requests", type=int, default=None,
                        help="requests waiting to run beyond which new ones get 503")
    parser.add_argument("--max-request-body-bytes", type=int,
                        default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                        help="larger request bodies get 413")
    parser.add_argument("--max-choices-per-request", type=int,
                        default=DEFAULT_MAX_CHOICES_PER_REQUEST,
                        help="the most choices (prompts x n, one engine request each) one "
                             "request may ask for; more get 400 before any tokenization")
    parser.add_argument("--chat-template", default=None,
                        help="a Jinja chat template, or a file holding one, replacing the "
                             "tokenizer's")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='serve tool_choice "auto": tool calls parsed from the output '
                             "(needs --tool-call-parser)")
    parser.add_argument("--tool-call-parser", default=None,
                        help="the format the model writes tool calls in (vLLM's names: "
                             f"{', '.join(sorted(TOOL_PARSERS))}, or one a "
                             "--tool-parser-plugin registers)")
    parser.add_argument("--tool-parser-plugin", default="", metavar="FILE",
                        help="a Python file registering tool call parsers "
                             "(tool_parsers.register_tool_parser), imported at start as vLLM "
                             "imports its plugin file; its names may be --tool-call-parser's")
    parser.add_argument("--reasoning-parser", default=None,
                        help="split chat answers into reasoning_content (between <think> and "
                             "</think>) and content (vLLM's names: "
                             f"{', '.join(sorted(REASONING_PARSERS))})")
    parser.add_argument("--trust-request-chat-template", action="store_true",
                        help="accept a chat template sent with a request (chat_template); "
                             "without it such requests get 400")
    parser.add_argument("--generation-config", default="auto",
                        help="default sampling parameters of requests that do not set them: "
                             "'auto' (the model's generation_config.json), 'vllm' (none) or "
                             "a folder holding a generation_config.json")
    parser.add_argument("--override-generation-config", default=None, metavar="JSON",
                        help="generation-config entries (JSON object) over the file's, "
                             "e.g. '{\"temperature\": 0.5}'")
    parser.add_argument("--max-logprobs", type=int, default=MAX_LOGPROBS,
                        help="the most log-probabilities a request may ask for per token "
                             f"(logprobs, top_logprobs); at most {MAX_LOGPROBS}")
    parser.add_argument("--max-tools", type=int, default=DEFAULT_MAX_TOOLS,
                        help="the most tools one chat request may carry (default "
                             f"{DEFAULT_MAX_TOOLS}, OpenAI's bound); more get 400")
    parser.add_argument("--uvicorn-log-level", default="info",
                        choices=("critical", "error", "warning", "info", "debug", "trace"))
    parser.add_argument("--metrics-names", type=_metrics_names, default=NAME_SETS,
                        metavar="SETS",
                        help="the metric names /metrics exposes, comma-separated: "
                             "'manylora' (manylora:*), 'vllm' (vLLM's vllm:* names and "
                             "labels); default both")
    parser.add_argument("--max-lora-metric-labels", type=_non_negative, default=100,
                        metavar="N",
                        help="adapters with per-adapter metric series of their own (first "
                             "come); later ones are counted under lora_name=\"other\" "
                             "(default 100)")
    parser.add_argument("--disable-uvicorn-access-log", action=argparse.BooleanOptionalAction,
                        default=False, help="no uvicorn access log line per request")
    parser.add_argument("--config", default=None, metavar="YAML",
                        help="read flags from a YAML file (flag names with dashes or "
                             "underscores, without --, to values); flags on the command "
                             "line win (vLLM's --config)")
    parser.add_argument("--response-role", default="assistant",
                        help="the role of chat completion messages when the request adds a "
                             "generation prompt (vLLM's)")
    parser.add_argument("--return-tokens-as-token-ids", default=False,
                        action=argparse.BooleanOptionalAction,
                        help="the default of requests' return_tokens_as_token_ids: "
                             "log-probability tokens as 'token_id:<id>'")
    parser.add_argument("--enable-force-include-usage", default=False,
                        action=argparse.BooleanOptionalAction,
                        help="every streamed completion and chat completion ends with the "
                             "usage chunk, as with stream_options.include_usage (vLLM's)")
    parser.add_argument("--chat-template-content-format", default="auto",
                        choices=CONTENT_FORMATS,
                        help="how message content reaches the chat template: 'string' (the "
                             "text), 'openai' (a list of {\"type\": \"text\", \"text\": "
                             "...} parts) or 'auto' (openai when the template loops over a "
                             "message's content, else string), vLLM's formats")
    parser.add_argument("--enable-prompt-tokens-details", default=False,
                        action=argparse.BooleanOptionalAction,
                        help="usage.prompt_tokens_details.cached_tokens: the prompt tokens "
                             "served from the prefix cache (vLLM's flag)")
    parser.add_argument("--disable-frontend-multiprocessing", default=False,
                        action=argparse.BooleanOptionalAction,
                        help="run the engine core in the server's process (as "
                             "MANYLORA_ENABLE_MULTIPROCESSING=0)")
    add_frontend_args(parser)
    add_connection_args(parser)
    add_vllm_flags(parser)
    return parser


def serve_parser() -> argparse.ArgumentParser:
    """A parser of ``manylora serve``'s flags alone (for callers that build servers); it
    reads ``--config`` files (``vllm_flags.VllmArgumentParser``)."""
    return add_serve_args(VllmArgumentParser(prog="manylora serve"))
