"""The FastAPI app of ``manylora serve``: vLLM's OpenAI-compatible routes over ``AsyncLLM``.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models`` (and
``GET /v1/models/{id}``), ``POST /v1/responses`` (OpenAI's Responses API, text) and
``GET /v1/responses/{id}``,
``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter`` (with
``--enable-lora-runtime-updates``), vLLM's tokenizer routes ``POST /tokenize``,
``POST /detokenize`` and ``GET /tokenizer_info``, ``GET /health``, ``GET /version``,
``GET /metrics``. Every ``/v1`` route and the tokenizer routes want ``Authorization: Bearer
<key>`` when API keys are set (:func:`~manylora.entrypoints.openai.openapi.needs_key`);
``/health``, ``/version`` and ``/metrics`` stay open. Errors have OpenAI's shape
(``{"error": {"message", "type", "param", "code"}}``); bad input is never a 500. Every
status a route answers is in ``GET /openapi.json`` (``openapi.py``); a method a path does
not serve gets 405 with ``Allow``, an unknown path 404, both in OpenAI's shape. Bodies
encode whatever a name holds (``encoding.py``).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Mapping
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import BaseModel, Field
from starlette._utils import get_route_path
from starlette.exceptions import HTTPException as StarletteHTTPException

import manylora
from manylora.engine.async_llm import AsyncLLM
from manylora.entrypoints.openai.encoding import SafeJSONResponse, safe_text
from manylora.entrypoints.openai.errors import OpenAIError, too_large
from manylora.entrypoints.openai.frontend_args import FrontendConfig
from manylora.entrypoints.openai.openapi import errors, install_openapi, needs_key, sse_content
from manylora.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    StreamOptions,
    publish_no_auto_tool_choice,
    publish_no_request_chat_template,
)
from manylora.entrypoints.openai.protocol_responses import (
    STREAM_EVENTS,
    ResponsesRequest,
    ResponsesResponse,
    responses_sse_content,
)
from manylora.entrypoints.openai.protocol_tokenization import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfoResponse,
)
from manylora.entrypoints.openai.request_logger import RequestLogger
from manylora.entrypoints.openai.serving import DEFAULT_MAX_CHOICES_PER_REQUEST
from manylora.entrypoints.openai.serving_chat import OpenAIServingChat
from manylora.entrypoints.openai.serving_completion import OpenAIServingCompletion
from manylora.entrypoints.openai.serving_models import (
    ModelCard,
    ModelList,
    OpenAIServingModels,
)
from manylora.entrypoints.openai.serving_responses import OpenAIServingResponses
from manylora.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from manylora.entrypoints.openai.serving_tools import DEFAULT_MAX_TOOLS
from manylora.entrypoints.openai.tokenization import PromptTokenizer
from manylora.entrypoints.openai.validation import ClientName, RequestModel, validation_error
from manylora.sampling_params import MAX_LOGPROBS

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
            ``serving_chat.content_format``).
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


class LoadLoRAAdapterRequest(RequestModel):
    """Body of ``POST /v1/load_lora_adapter`` (vLLM's); an empty name or path is a 400 from
    the route (the published schema says so: ``minLength``).
    ``load_inplace``: a name already served gets the new weights instead of a 400."""

    lora_name: ClientName = Field(json_schema_extra={"minLength": 1})
    lora_path: str = Field(json_schema_extra={"minLength": 1})
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(RequestModel):
    """Body of ``POST /v1/unload_lora_adapter`` (vLLM's); ``lora_int_id`` is accepted and
    ignored, as vLLM does."""

    lora_name: ClientName = Field(json_schema_extra={"minLength": 1})
    lora_int_id: int | None = None


class VersionInfo(BaseModel):
    """Body of ``GET /version``."""

    version: str


def _error_response(error: OpenAIError, headers: dict[str, str] | None = None
                    ) -> SafeJSONResponse:
    return SafeJSONResponse(error.body(), status_code=error.status, headers=headers)


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
    """ASGI middleware: with ``keys``, every route :func:`needs_key` names (``/v1``, the
    tokenizer routes) wants ``Authorization: Bearer <key>`` (compared in constant time) and
    answers 401 otherwise, and to a request with more than one ``Authorization`` header
    (which one a proxy or framework would read differs). The route is the path without the
    app's ``root_path``, as the router matches it, so a prefixed path is guarded like the
    bare one."""

    def __init__(self, app, keys: tuple[str, ...]) -> None:
        self.app = app
        self.keys = tuple(k.encode() for k in keys)

    async def __call__(self, scope, receive, send) -> None:
        if self.keys and scope["type"] == "http" and needs_key(get_route_path(scope)):
            values = [v for k, v in scope.get("headers") or () if k == b"authorization"]
            error = None
            if len(values) > 1:
                error = OpenAIError(401, f"the request has {len(values)} Authorization "
                                    "headers; send exactly one: 'Authorization: Bearer "
                                    "<key>'", code="invalid_api_key")
            elif not self._authorized(values[0] if values else b""):
                error = OpenAIError(401, "a valid API key is needed: 'Authorization: "
                                    "Bearer <key>'", code="invalid_api_key")
            if error is not None:
                await _error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _authorized(self, header: bytes) -> bool:
        scheme, _, token = header.partition(b" ")
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
        return SafeJSONResponse(result.model_dump(mode="json"))
    return SafeJSONResponse(result)


def _publish_flags(doc: dict[str, Any], config: ServerConfig) -> None:
    """What the OpenAPI document ``doc`` says that depends on the server's flags: auto tool
    choice and a per-request chat template refused unless the flags serve them."""
    if not (config.enable_auto_tool_choice and config.tool_call_parser):
        publish_no_auto_tool_choice(doc)
    if not config.trust_request_chat_template:
        publish_no_request_chat_template(doc)


def build_app(engine: AsyncLLM, models: OpenAIServingModels, config: ServerConfig,
              registry: CollectorRegistry) -> FastAPI:
    """The app for one engine.

    Args:
        engine: the running engine front.
        models: the base model and adapters it serves.
        config: keys, body limit, runtime adapter updates, chat template, choices bound,
            CORS, root path and request log.
        registry: the Prometheus registry ``GET /metrics`` renders.

    The app's ``state.prompt_tokenizer`` is the tokenization worker every endpoint shares.
    Starlette's ``CORSMiddleware`` is the outermost layer: a preflight is answered before
    the API key is asked for, and errors carry the CORS headers too.
    """
    app = FastAPI(title="manylora", version=manylora.__version__,
                  description="OpenAI-compatible completions and chat over one base model "
                              "and many LoRA adapters.",
                  default_response_class=SafeJSONResponse,
                  root_path=config.frontend.root_path)
    # one tokenization worker for every endpoint (a tokenizer is not used by two threads)
    prompts = PromptTokenizer(engine.tokenizer)
    app.state.prompt_tokenizer = prompts
    shared = dict(prompt_tokenizer=prompts, max_choices=config.max_choices_per_request,
                  sampling_defaults=config.sampling_defaults, max_logprobs=config.max_logprobs,
                  enable_prompt_tokens_details=config.enable_prompt_tokens_details)
    completions = OpenAIServingCompletion(engine, models, **shared)
    chat = OpenAIServingChat(engine, models, config.chat_template,
                             config.trust_request_chat_template, **shared,
                             enable_auto_tool_choice=config.enable_auto_tool_choice,
                             tool_call_parser=config.tool_call_parser,
                             reasoning_parser=config.reasoning_parser,
                             max_tools=config.max_tools,
                             response_role=config.response_role,
                             chat_template_content_format=config.chat_template_content_format)

    def server_defaults(body: CompletionRequest | ChatCompletionRequest) -> None:
        """The server-wide defaults of request fields (vLLM's flags): a request's own
        ``return_tokens_as_token_ids`` wins; ``--enable-force-include-usage`` turns
        ``stream_options.include_usage`` on for every stream."""
        if body.return_tokens_as_token_ids is None or (
                "return_tokens_as_token_ids" not in body.model_fields_set):
            body.return_tokens_as_token_ids = config.return_tokens_as_token_ids
        if config.enable_force_include_usage and body.stream:
            options = body.stream_options
            body.stream_options = StreamOptions(
                include_usage=True,
                continuous_usage_stats=bool(options and options.continuous_usage_stats))
    tokenization = OpenAIServingTokenization(engine, models, chat, prompt_tokenizer=prompts)
    responses = OpenAIServingResponses(engine, models, chat, prompt_tokenizer=prompts,
                                       max_choices=config.max_choices_per_request)
    if config.frontend.log_requests:
        completions.request_logger = chat.request_logger = responses.request_logger = (
            RequestLogger(config.frontend.max_log_len))

    @app.exception_handler(OpenAIError)
    async def openai_error(_: Request, exc: OpenAIError):
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: Request, exc: RequestValidationError):
        return _error_response(validation_error(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        message = str(exc.detail)
        if exc.status_code == 404 and message == "Not Found":
            message = f"{request.method} {request.url.path}: no such route"
        elif exc.status_code == 405:
            allowed = (exc.headers or {}).get("Allow", "")
            message = (f"{request.method} is not allowed on {request.url.path} "
                       f"(allowed: {allowed})")
        return _error_response(OpenAIError(exc.status_code, message), headers=exc.headers)

    @app.exception_handler(Exception)
    async def server_bug(_: Request, exc: Exception):
        # Starlette's ServerErrorMiddleware re-raises after this answer, to be logged, and
        # uvicorn then drops the connection: "close" keeps a client from reusing it
        return _error_response(OpenAIError(500, "internal server error", code="internal_error"),
                               headers={"Connection": "close"})

    @app.get("/health", response_class=Response, responses={
        200: {"description": "The engine is serving (empty body).", "content": None},
        **errors(503)})
    async def health() -> Response:
        return Response(status_code=200 if engine.is_running else 503)

    @app.get("/version", response_model=VersionInfo, responses=errors())
    async def version() -> dict:
        return {"version": manylora.__version__}

    @app.get("/metrics", response_class=PlainTextResponse, responses={
        200: {"description": "Prometheus text exposition format.",
              "content": {"text/plain": {"schema": {"type": "string"}}}},
        **errors()})
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", response_model=ModelList, responses=errors())
    async def list_models() -> dict:
        return models.list_models()

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard,
             responses=errors(400, 404))
    async def retrieve_model(model_id: ClientName) -> dict:
        return models.retrieve(model_id)

    @app.post("/v1/completions", response_model=None, responses={
        200: {"model": CompletionResponse, "content": sse_content(CompletionStreamResponse),
              "description": "The completion; with \"stream\": true, server-sent events."},
        **errors(400, 404, 503, 504)})
    async def create_completion(body: CompletionRequest, request: Request):
        await models.resolve_lora(body.model)
        server_defaults(body)
        result = await _with_cancellation(request, completions.create_completion(body))
        return Response(status_code=499) if result is None else _respond(result)

    @app.post("/v1/chat/completions", response_model=None, responses={
        200: {"model": ChatCompletionResponse,
              "content": sse_content(ChatCompletionStreamResponse),
              "description": "The chat completion; with \"stream\": true, server-sent "
                             "events."},
        **errors(400, 404, 503, 504)})
    async def create_chat_completion(body: ChatCompletionRequest, request: Request):
        await models.resolve_lora(body.model)
        server_defaults(body)
        result = await _with_cancellation(request, chat.create_chat_completion(body))
        return Response(status_code=499) if result is None else _respond(result)

    @app.post("/v1/responses", response_model=None, responses={
        200: {"model": ResponsesResponse, "content": responses_sse_content(),
              "description": "The response; with \"stream\": true, server-sent events."},
        **errors(400, 404, 503, 504)})
    async def create_response(body: ResponsesRequest, request: Request):
        await models.resolve_lora(body.model)
        result = await _with_cancellation(request, responses.create_response(body))
        return Response(status_code=499) if result is None else _respond(result)

    @app.get("/v1/responses/{response_id}", response_model=ResponsesResponse,
             responses=errors(400, 404))
    async def retrieve_response(response_id: ClientName) -> ResponsesResponse:
        return responses.retrieve(response_id)

    @app.post("/tokenize", response_model=TokenizeResponse,
              responses=errors(400, 404, 503, 504))
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        await models.resolve_lora(body.model)
        return await tokenization.tokenize(body)

    @app.post("/detokenize", response_model=DetokenizeResponse,
              responses=errors(400, 404, 503, 504))
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        await models.resolve_lora(body.model)
        return await tokenization.detokenize(body)

    @app.get("/tokenizer_info", response_model=TokenizerInfoResponse, responses=errors(400))
    async def get_tokenizer_info() -> dict:
        return tokenization.tokenizer_info()

    if config.enable_lora_runtime_updates:
        @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse,
                  responses={200: {"description": "The adapter is served."},
                             **errors(400, 403, 404, 503, 504)})
        async def load_lora_adapter(body: LoadLoRAAdapterRequest):
            return PlainTextResponse(safe_text(await models.load_lora_adapter(
                body.lora_name, body.lora_path, load_inplace=body.load_inplace)))

        @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse,
                  responses={200: {"description": "The adapter is no longer served."},
                             **errors(400, 404, 503)})
        async def unload_lora_adapter(body: UnloadLoRAAdapterRequest):
            return PlainTextResponse(safe_text(await models.unload_lora_adapter(
                body.lora_name)))

    install_openapi(app, api_keys=bool(config.api_keys),
                    stream_chunks=(CompletionStreamResponse, ChatCompletionStreamResponse,
                                   *STREAM_EVENTS),
                    narrow=lambda doc: _publish_flags(doc, config))
    app.add_middleware(BodyLimitMiddleware, limit=config.max_request_body_bytes)
    app.add_middleware(AuthMiddleware, keys=config.api_keys)
    app.add_middleware(CORSMiddleware, **config.frontend.cors_options())
    return app
