"""``manylora serve``: the server's parts built from its flags (``serve_args.py``), and uvicorn
in the foreground or a thread."""

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
from manylora.entrypoints.openai.api_server import build_app
from manylora.entrypoints.openai.errors import OpenAIError
from manylora.entrypoints.openai.frontend_args import (
    frontend_config,
    resolver_roots,
    runtime_lora_updates,
    uvicorn_tls_options,
)
from manylora.entrypoints.openai.generation_config import generation_defaults, parse_override
from manylora.entrypoints.openai.http_limits import ConnectionLimits, connection_limits
from manylora.entrypoints.openai.lora_resolver import FilesystemResolver
from manylora.entrypoints.openai.reasoning_parsers import REASONING_PARSERS
from manylora.entrypoints.openai.server_config import ServerConfig
from manylora.entrypoints.openai.serving_models import LoRAModulePath, OpenAIServingModels
from manylora.entrypoints.openai.tool_parsers import TOOL_PARSERS, import_tool_parser_plugin
from manylora.entrypoints.openai.validation import check_name
from manylora.entrypoints.openai.vllm_flags import check_vllm_flags
from manylora.metrics.log_stats import LoggingStatLogger
from manylora.metrics.prometheus import PrometheusStatLogger
from manylora.sampling_params import MAX_LOGPROBS

logger = logging.getLogger(__name__)

#: Seconds after a tensor-parallel worker's death by which ``manylora serve``'s engine must
#: have taken the error (``WorkerDiedError`` from a step) before the server ends its own
#: process (SIGTERM, then exit status 70): an idle or stuck engine would otherwise leave a
#: server that looks healthy with a dead worker. Only ``run_server`` opts in
#: (``exit_when_stuck``); a server built inside another program (``create_server``) does not.
STUCK_ENGINE_EXIT_S = 10.0


def cache_config_info(args: EngineArgs, num_gpu_blocks: int) -> dict[str, str]:
    """The labels of ``cache_config_info``: the fields of vLLM's ``CacheConfig`` that
    manylora has, under vLLM's names, as strings (``str`` of the value, as vLLM writes
    them)."""
    return {"block_size": str(args.block_size), "cache_dtype": str(args.kv_cache_dtype),
            "enable_prefix_caching": str(args.enable_prefix_caching),
            "gpu_memory_utilization": str(args.gpu_memory_utilization),
            "num_gpu_blocks": str(num_gpu_blocks), "swap_space": str(args.swap_space)}


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
