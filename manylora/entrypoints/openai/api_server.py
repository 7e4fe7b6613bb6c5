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
from collections.abc import AsyncIterator, Awaitable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

import manylora
from manylora.engine.async_llm import AsyncLLM
from manylora.entrypoints.openai.encoding import SafeJSONResponse, safe_text
from manylora.entrypoints.openai.errors import OpenAIError, error_response
from manylora.entrypoints.openai.middleware import AuthMiddleware, BodyLimitMiddleware
from manylora.entrypoints.openai.openapi import errors, install_openapi, sse_content
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
from manylora.entrypoints.openai.server_config import ServerConfig
from manylora.entrypoints.openai.serving_chat import OpenAIServingChat
from manylora.entrypoints.openai.serving_completion import OpenAIServingCompletion
from manylora.entrypoints.openai.serving_models import (
    ModelCard,
    ModelList,
    OpenAIServingModels,
)
from manylora.entrypoints.openai.serving_responses import OpenAIServingResponses
from manylora.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from manylora.entrypoints.openai.tokenization import PromptTokenizer
from manylora.entrypoints.openai.validation import ClientName, RequestModel, validation_error

logger = logging.getLogger(__name__)


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
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: Request, exc: RequestValidationError):
        return error_response(validation_error(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        message = str(exc.detail)
        if exc.status_code == 404 and message == "Not Found":
            message = f"{request.method} {request.url.path}: no such route"
        elif exc.status_code == 405:
            allowed = (exc.headers or {}).get("Allow", "")
            message = (f"{request.method} is not allowed on {request.url.path} "
                       f"(allowed: {allowed})")
        return error_response(OpenAIError(exc.status_code, message), headers=exc.headers)

    @app.exception_handler(Exception)
    async def server_bug(_: Request, exc: Exception):
        # Starlette's ServerErrorMiddleware re-raises after this answer, to be logged, and
        # uvicorn then drops the connection: "close" keeps a client from reusing it
        return error_response(OpenAIError(500, "internal server error", code="internal_error"),
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
