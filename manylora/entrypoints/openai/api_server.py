"""The FastAPI app of ``manylora serve``: vLLM's OpenAI-compatible routes over ``AsyncLLM``.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models`` (and
``GET /v1/models/{id}``),
``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter`` (with
``--enable-lora-runtime-updates``), ``GET /health``, ``GET /version``, ``GET /metrics``.
Every ``/v1`` route wants ``Authorization: Bearer <key>`` when API keys are set; ``/health``,
``/version`` and ``/metrics`` stay open. Errors have OpenAI's shape
(``{"error": {"message", "type", "param", "code"}}``); bad input is never a 500.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

import manylora
from manylora.engine.async_llm import AsyncLLM
from manylora.entrypoints.openai.errors import OpenAIError, too_large
from manylora.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from manylora.entrypoints.openai.serving import DEFAULT_MAX_CHOICES_PER_REQUEST
from manylora.entrypoints.openai.serving_chat import OpenAIServingChat
from manylora.entrypoints.openai.serving_completion import OpenAIServingCompletion
from manylora.entrypoints.openai.serving_models import OpenAIServingModels
from manylora.entrypoints.openai.tokenization import PromptTokenizer
from manylora.entrypoints.openai.validation import ClientName, RequestModel, validation_error

logger = logging.getLogger(__name__)

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
    """

    api_keys: tuple[str, ...] = ()
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    enable_lora_runtime_updates: bool = False
    chat_template: str | None = None
    max_choices_per_request: int = DEFAULT_MAX_CHOICES_PER_REQUEST


class LoadLoRAAdapterRequest(RequestModel):
    """Body of ``POST /v1/load_lora_adapter`` (vLLM's)."""

    lora_name: ClientName
    lora_path: str


class UnloadLoRAAdapterRequest(RequestModel):
    """Body of ``POST /v1/unload_lora_adapter`` (vLLM's)."""

    lora_name: ClientName
    lora_int_id: int | None = None


def _error_response(error: OpenAIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


class BodyLimitMiddleware:
    """ASGI middleware: a request body over ``limit`` bytes gets 413, whether its
    ``Content-Length`` says so or its chunks add up to more. The body is read whole (at
    most ``limit`` bytes) before the app sees it."""

    def __init__(self, app, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        message = f"the request body is over {self.limit} bytes (--max-request-body-bytes)"
        length = dict(scope.get("headers") or ()).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            await _error_response(too_large(message, code="request_too_large"))(
                scope, receive, send)
            return
        body = bytearray()
        more = True
        while more:
            msg = await receive()
            if msg["type"] != "http.request":
                await self.app(scope, _replay(msg, receive), send)
                return
            body += msg.get("body", b"")
            more = msg.get("more_body", False)
            if len(body) > self.limit:
                await _error_response(too_large(message, code="request_too_large"))(
                    scope, receive, send)
                return
        whole = {"type": "http.request", "body": bytes(body), "more_body": False}
        await self.app(scope, _replay(whole, receive), send)


def _replay(first: dict, receive):
    """A ``receive`` that gives ``first`` once, then defers to ``receive``."""
    pending = [first]

    async def replay():
        return pending.pop() if pending else await receive()

    return replay


class AuthMiddleware:
    """ASGI middleware: with ``keys``, every ``/v1`` route wants ``Authorization: Bearer
    <key>`` (compared in constant time) and answers 401 otherwise."""

    def __init__(self, app, keys: tuple[str, ...]) -> None:
        self.app = app
        self.keys = tuple(k.encode() for k in keys)

    async def __call__(self, scope, receive, send) -> None:
        if (self.keys and scope["type"] == "http" and scope["path"].startswith("/v1")
                and not self._authorized(dict(scope.get("headers") or ()))):
            error = OpenAIError(401, "a valid API key is needed: 'Authorization: Bearer "
                                "<key>'", code="invalid_api_key")
            await _error_response(error)(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        token = token.strip()
        # every key is compared, so the time taken does not say which one was close
        matches = [secrets.compare_digest(token, k) for k in self.keys]
        return scheme.lower() == b"bearer" and any(matches)


async def _until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _with_cancellation(request: Request, handler: Awaitable):
    """Run ``handler``; if the client disconnects first, cancel it (which aborts its engine
    requests) and return None."""
    work = asyncio.ensure_future(handler)
    watch = asyncio.ensure_future(_until_disconnected(request))
    try:
        done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if work in done:
        return work.result()
    work.cancel()
    return None


def _respond(result) -> Response:
    if isinstance(result, AsyncIterator):
        return StreamingResponse(result, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    if isinstance(result, BaseModel):
        return JSONResponse(result.model_dump(mode="json"))
    return JSONResponse(result)


def build_app(engine: AsyncLLM, models: OpenAIServingModels, config: ServerConfig,
              registry: CollectorRegistry) -> FastAPI:
    """The app for one engine.

    Args:
        engine: the running engine front.
        models: the base model and adapters it serves.
        config: keys, body limit, runtime adapter updates, chat template, choices bound.
        registry: the Prometheus registry ``GET /metrics`` renders.

    The app's ``state.prompt_tokenizer`` is the tokenization worker both endpoints share.
    """
    app = FastAPI(title="manylora", version=manylora.__version__)
    # one tokenization worker for both endpoints (a tokenizer is not used by two threads)
    prompts = PromptTokenizer(engine.tokenizer)
    app.state.prompt_tokenizer = prompts
    completions = OpenAIServingCompletion(engine, models, prompt_tokenizer=prompts,
                                          max_choices=config.max_choices_per_request)
    chat = OpenAIServingChat(engine, models, config.chat_template, prompt_tokenizer=prompts,
                             max_choices=config.max_choices_per_request)

    @app.exception_handler(OpenAIError)
    async def openai_error(_: Request, exc: OpenAIError):
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: Request, exc: RequestValidationError):
        return _error_response(validation_error(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException):
        return _error_response(OpenAIError(exc.status_code, str(exc.detail)))

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if engine.is_running else 503)

    @app.get("/version")
    async def version() -> dict:
        return {"version": manylora.__version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def list_models() -> dict:
        return models.list_models()

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: ClientName) -> dict:
        return models.retrieve(model_id)

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, request: Request):
        result = await _with_cancellation(request, completions.create_completion(body))
        return Response(status_code=499) if result is None else _respond(result)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, request: Request):
        result = await _with_cancellation(request, chat.create_chat_completion(body))
        return Response(status_code=499) if result is None else _respond(result)

    if config.enable_lora_runtime_updates:
        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(body: LoadLoRAAdapterRequest):
            return Response(await models.load_lora_adapter(body.lora_name, body.lora_path),
                            media_type="text/plain")

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(body: UnloadLoRAAdapterRequest):
            return Response(await models.unload_lora_adapter(body.lora_name),
                            media_type="text/plain")

    app.add_middleware(BodyLimitMiddleware, limit=config.max_request_body_bytes)
    app.add_middleware(AuthMiddleware, keys=config.api_keys)
    return app
