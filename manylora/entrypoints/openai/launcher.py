"""``manylora serve``: flags, the server's parts, and uvicorn in the foreground or a thread."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import threading
from dataclasses import dataclass, field
from pathlib import Path

import uvicorn
from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from manylora.checkpoint.hub import resolve_model_path
from manylora.distributed.workers import exit_when_stuck
from manylora.engine.arg_utils import EngineArgs
from manylora.engine.async_llm import AsyncLLM
from manylora.entrypoints.openai.api_server import (
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    ServerConfig,
    build_app,
)
from manylora.entrypoints.openai.errors import OpenAIError
from manylora.entrypoints.openai.frontend_args import (
    add_frontend_args,
    frontend_config,
    resolver_roots,
    runtime_lora_updates,
    uvicorn_tls_options,
)
from manylora.entrypoints.openai.generation_config import generation_defaults, parse_override
from manylora.entrypoints.openai.http_limits import (
    ConnectionLimits,
    add_connection_args,
    connection_limits,
)
from manylora.entrypoints.openai.lora_resolver import FilesystemResolver
from manylora.entrypoints.openai.reasoning_parsers import REASONING_PARSERS
from manylora.entrypoints.openai.serving import DEFAULT_MAX_CHOICES_PER_REQUEST
from manylora.entrypoints.openai.serving_chat import CONTENT_FORMATS
from manylora.entrypoints.openai.serving_models import LoRAModulePath, OpenAIServingModels
from manylora.entrypoints.openai.serving_tools import DEFAULT_MAX_TOOLS
from manylora.entrypoints.openai.tool_parsers import TOOL_PARSERS, import_tool_parser_plugin
from manylora.entrypoints.openai.validation import check_name
from manylora.entrypoints.openai.vllm_flags import (
    VllmArgumentParser,
    add_vllm_flags,
    check_vllm_flags,
)
from manylora.metrics.log_stats import LoggingStatLogger
from manylora.metrics.prometheus import NAME_SETS, PrometheusStatLogger
from manylora.sampling_params import MAX_LOGPROBS

logger = logging.getLogger(__name__)

#: Seconds after a tensor-parallel worker's death by which ``manylora serve``'s engine must
#: have taken the error (``WorkerDiedError`` from a step) before the server ends its own
#: process (SIGTERM, then exit status 70): an idle or stuck engine would otherwise leave a
#: server that looks healthy with a dead worker. Only ``run_server`` opts in
#: (``exit_when_stuck``); a server built inside another program (``create_server``) does not.
STUCK_ENGINE_EXIT_S = 10.0


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


def cache_config_info(args: EngineArgs, num_gpu_blocks: int) -> dict[str, str]:
    """The labels of ``cache_config_info``: the fields of vLLM's ``CacheConfig`` that
    manylora has, under vLLM's names, as strings (``str`` of the value, as vLLM writes
    them)."""
    return {"block_size": str(args.block_size), "cache_dtype": str(args.kv_cache_dtype),
            "enable_prefix_caching": str(args.enable_prefix_caching),
            "gpu_memory_utilization": str(args.gpu_memory_utilization),
            "num_gpu_blocks": str(num_gpu_blocks), "swap_space": str(args.swap_space)}


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


@dataclass
class Server:
    """The parts of one server: the engine front, the served models, the app, the metrics,
    and the limits uvicorn serves the app's connections with (``http_limits.py``)."""

    engine: AsyncLLM
    models: OpenAIServingModels
    app: FastAPI
    registry: CollectorRegistry
    limits: ConnectionLimits = field(default_factory=ConnectionLimits)

    def shutdown(self) -> None:
        """Stop the engine loop."""
        self.engine.shutdown()


def create_server(args: argparse.Namespace) -> Server:
    """Build the engine, load the ``--lora-modules`` adapters, and the app.

    Raises:
        ValueError: a bad flag (engine arguments, ``--lora-modules``, runtime updates
            without ``--lora-root``, ``--enable-auto-tool-choice`` without
            ``--tool-call-parser``, ``--max-choices-per-request`` below 1, a served or
            adapter name that breaks the client-name rules of ``validation.py``) or a
            ``--lora-modules`` adapter that cannot be served, ``--max-logprobs`` outside
            ``[0, MAX_LOGPROBS]``, a bad ``--generation-config`` or
            ``--override-generation-config``; the front-end flags' errors
            (``frontend_args.py``) and the connection limits' (``http_limits.py``); the
            LoRA resolver without runtime updates; a vLLM flag refused (``vllm_flags.py``),
            a ``--tool-parser-plugin`` that cannot be
            imported, a ``--tool-call-parser`` no parser is registered for, an unknown
            ``--reasoning-parser``.
    """
    check_vllm_flags(args)
    if args.tool_parser_plugin:
        import_tool_parser_plugin(args.tool_parser_plugin)
    if args.tool_call_parser is not None and args.tool_call_parser not in TOOL_PARSERS:
        raise ValueError(f"--tool-call-parser {args.tool_call_parser!r}: no such parser (one "
                         f"of {', '.join(sorted(TOOL_PARSERS))}, or a name a "
                         "--tool-parser-plugin registers)")
    if args.reasoning_parser is not None and args.reasoning_parser not in REASONING_PARSERS:
        raise ValueError(f"--reasoning-parser {args.reasoning_parser!r}: no such parser (one "
                         f"of {', '.join(sorted(REASONING_PARSERS))})")
    if args.max_choices_per_request < 1:
        raise ValueError("--max-choices-per-request must be at least 1, got "
                         f"{args.max_choices_per_request}")
    if args.max_tools < 0:
        raise ValueError(f"--max-tools must be ≥ 0, got {args.max_tools}")
    if not 0 <= args.max_logprobs <= MAX_LOGPROBS:
        raise ValueError(f"--max-logprobs must be in [0, {MAX_LOGPROBS}] (the most this "
                         f"engine returns per token), got {args.max_logprobs}")
    modules = [LoRAModulePath.parse(s) for s in args.lora_modules]
    names = list(dict.fromkeys(args.served_model_name or [args.model]))
    name = names[0]
    # names go into every /v1/models answer and metric label; argv may carry lone
    # surrogates (undecodable bytes under surrogateescape)
    for flag, value in [*(("--served-model-name", n) for n in names),
                        *(("--lora-modules", m.name) for m in modules),
                        *(("--lora-modules", m.base_model_name) for m in modules
                          if m.base_model_name is not None)]:
        try:
            check_name(value)
        except ValueError as e:
            raise ValueError(f"{flag} {ascii(value)}: {e}") from None
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (one of "
                         f"{', '.join(sorted(TOOL_PARSERS))})")
    runtime_updates = runtime_lora_updates(args.enable_lora_runtime_updates)
    resolver, lora_roots = resolver_roots(args.enable_lora_resolver, args.lora_root)
    if resolver and not runtime_updates:
        raise ValueError("the LoRA resolver needs runtime updates: --enable-lora-runtime-"
                         "updates or VLLM_ALLOW_RUNTIME_LORA_UPDATING=1")
    if runtime_updates and not lora_roots:
        raise ValueError("--enable-lora-runtime-updates needs --lora-root: the directories "
                         "adapters may be loaded from")
    frontend = frontend_config(args)
    uvicorn_tls_options(args)          # bad --ssl-* flags refused before the engine starts
    limits = connection_limits(args)
    roots = [Path(r) for r in lora_roots]
    missing = [r for r in roots if not r.is_dir()]
    if missing:
        raise ValueError(f"--lora-root {missing[0]} is not a directory")
    keys = args.api_key or ([os.environ["MANYLORA_API_KEY"]]
                            if os.environ.get("MANYLORA_API_KEY") else [])
    engine_args = EngineArgs.from_cli_args(args)
    sampling_defaults = generation_defaults(
        args.generation_config,
        str(resolve_model_path(args.model, args.revision, args.download_dir)),
        parse_override(args.override_generation_config))
    registry = CollectorRegistry()
    engine = AsyncLLM.from_engine_args(
        engine_args, in_process=True if args.disable_frontend_multiprocessing else None,
        max_waiting_requests=args.max_waiting_requests)
    engine.stat_loggers.append(PrometheusStatLogger(
        registry, name, engine.snapshot, max_model_len=engine.max_model_len,
        names=args.metrics_names, max_lora_labels=args.max_lora_metric_labels,
        cache_config=cache_config_info(engine_args, engine.num_gpu_blocks)))
    models = OpenAIServingModels(engine, name, args.model, modules, roots,
                                 aliases=names[1:],
                                 resolver=FilesystemResolver(roots) if resolver else None)
    try:
        asyncio.run(models.load_static_loras())
    except OpenAIError as e:
        engine.shutdown()
        raise ValueError(f"--lora-modules: {e.message}") from None
    except BaseException:         # a stop signal while the adapters load
        engine.shutdown()
        raise
    config = ServerConfig(tuple(keys), args.max_request_body_bytes,
                          runtime_updates, args.chat_template,
                          args.max_choices_per_request, frontend=frontend,
                          enable_auto_tool_choice=args.enable_auto_tool_choice,
                          tool_call_parser=args.tool_call_parser,
                          reasoning_parser=args.reasoning_parser,
                          trust_request_chat_template=args.trust_request_chat_template,
                          sampling_defaults=sampling_defaults,
                          max_logprobs=args.max_logprobs, max_tools=args.max_tools,
                          response_role=args.response_role,
                          return_tokens_as_token_ids=args.return_tokens_as_token_ids,
                          enable_force_include_usage=args.enable_force_include_usage,
                          chat_template_content_format=args.chat_template_content_format,
                          enable_prompt_tokens_details=args.enable_prompt_tokens_details)
    if not args.disable_log_stats:
        engine.stat_loggers.append(LoggingStatLogger(engine.snapshot))
    return Server(engine, models, build_app(engine, models, config, registry), registry,
                  limits)


def serve_parser() -> argparse.ArgumentParser:
    """A parser of ``manylora serve``'s flags alone (for callers that build servers); it
    reads ``--config`` files (``vllm_flags.VllmArgumentParser``)."""
    return add_serve_args(VllmArgumentParser(prog="manylora serve"))


#: Exit status of ``manylora serve`` when its engine died (the core process failed or was
#: killed): the server stops so that a supervisor starts a new one.
ENGINE_DEAD_EXIT_CODE = 1


class _StopSignals:
    """SIGINT and SIGTERM as stop requests, inside a ``with`` block. While the server starts
    (``http`` None) the first one raises ``KeyboardInterrupt``: what is built so far is
    stopped. Once ``http`` is set, a signal only asks it to stop; while it serves, uvicorn
    takes the signals itself (a graceful stop) and, after its shutdown, raises them again,
    into this handler, which then only records them: the engine's stop still runs, where
    Python's default SIGTERM action would end the process at once.

    Attributes:
        received: the signals received, in order.
        http: the uvicorn server, once built.
    """

    def __init__(self) -> None:
        self.received: list[int] = []
        self.http: uvicorn.Server | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, frame) -> None:
        self.received.append(signum)
        if self.http is not None:
            self.http.should_exit = True
        elif len(self.received) == 1:
            raise KeyboardInterrupt

    def __enter__(self) -> _StopSignals:
        self._previous = {sig: signal.signal(sig, self._handle)
                          for sig in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def run_server(args: argparse.Namespace) -> int:
    """``manylora serve``: serve in the foreground until SIGINT or SIGTERM, or until the
    engine dies. The process is the server's alone, so it opts in to ending itself if the
    engine does not take a dead tensor-parallel worker's error (``STUCK_ENGINE_EXIT_S``).

    A stop signal (also while starting) stops uvicorn gracefully, then the engine: its core
    process is reaped and its sockets' folder and shared files removed. When the engine
    dies, in-flight requests end with an error at once, ``/health`` answers 503, and the
    server stops the same way (vLLM's server shuts down when its engine is dead).

    Returns:
        the exit status: 0 after a stop signal, ``ENGINE_DEAD_EXIT_CODE`` when the engine
        died.
    """
    exit_when_stuck(STUCK_ENGINE_EXIT_S)
    with _StopSignals() as stop:
        try:
            server = create_server(args)
        except KeyboardInterrupt:
            logger.warning("stopped while starting")
            return 0
        http = uvicorn.Server(uvicorn.Config(
            server.app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
            access_log=not args.disable_uvicorn_access_log,
            **server.limits.uvicorn_options(), **uvicorn_tls_options(args)))
        stop.http = http
        http.should_exit = bool(stop.received)
        server.engine.on_dead(lambda error: setattr(http, "should_exit", True))
        try:
            http.run()
        finally:
            server.shutdown()
    if server.engine.errored:
        logger.error("the engine died: the server exits with status %d",
                     ENGINE_DEAD_EXIT_CODE)
        return ENGINE_DEAD_EXIT_CODE
    return 0


class ServerThread:
    """uvicorn serving an app on a background thread, on a socket bound before it starts
    (so ``port=0`` picks a free port without a race).

    Args:
        app: the ASGI app.
        host: address to bind.
        port: 0 for a free port.
        tls: uvicorn's TLS keywords (``frontend_args.uvicorn_tls_options``); empty: plain
            HTTP.
        limits: the connection limits (``Server.limits``; default: the flags' defaults),
            as ``run_server`` serves with them.

    Attributes:
        url: ``http://host:port``, or ``https://`` with ``tls``.

    Raises:
        RuntimeError: from ``start`` when uvicorn did not start within ``timeout`` seconds.
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0,
                 log_level: str = "warning", tls: dict | None = None,
                 limits: ConnectionLimits | None = None) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        scheme = "https" if tls else "http"
        self.url = f"{scheme}://{host}:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(
            app, log_level=log_level, **(limits or ConnectionLimits()).uvicorn_options(),
            **(tls or {})))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="uvicorn", daemon=True)

    def start(self, timeout: float = 30.0) -> ServerThread:
        self.thread.start()
        for _ in range(int(timeout / 0.02)):
            if self.server.started:
                return self
            if not self.thread.is_alive():
                break
            threading.Event().wait(0.02)
        raise RuntimeError(f"uvicorn did not start on {self.url}")

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
