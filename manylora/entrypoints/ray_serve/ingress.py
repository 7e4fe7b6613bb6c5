"""The ingress of ``manylora serve-ray``: the HTTP front Ray Serve's proxy hands every request
to, which forwards it to an engine replica chosen by Ray Serve's model multiplexing.

* A request whose JSON body names an adapter in ``model`` goes through the engine
  deployment's handle with ``multiplexed_model_id`` set to that name: Ray Serve prefers a
  replica that reports the adapter (in a GPU slot or the host cache, ``replica.py``), the
  least loaded of them, and sends an adapter no replica holds to one holding the fewest
  adapters. Base-model requests, and every other route, are balanced by load (power of two
  choices on queue length).
* ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` are answered by one replica
  first (its checks, API keys and errors are the single server's); once it succeeds, the
  change goes to every other replica through the control replica, and the answer comes when
  all have applied it. A load any replica cannot apply is undone on all of them and
  answered with that replica's error.
* ``GET /metrics`` merges the live replicas' metrics, each sample labelled with its
  ``replica``; ``GET /health`` is 200 while at least one replica is live.
* A replica that dies before a response has begun is replaced by another attempt on another
  replica (``ATTEMPTS`` in all); one that dies while streaming ends the stream with an error
  event in OpenAI's shape. Every response names the replica that served it in the
  ``x-manylora-replica`` header.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import GaugeMetricFamily
from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from starlette._utils import get_route_path

from manylora.entrypoints.openai.encoding import SafeJSONResponse
from manylora.entrypoints.openai.errors import OpenAIError
from manylora.entrypoints.openai.middleware import BodyLimitMiddleware
from manylora.entrypoints.openai.sse import sse_error
from manylora.entrypoints.ray_serve.bridge import (
    HOP_HEADERS,
    REPLICA_HEADER,
    HTTPRequest,
    ResponseHead,
)
from manylora.entrypoints.ray_serve.relabel import merge_replica_metrics

logger = logging.getLogger(__name__)

#: How many replicas a request may be tried on when the one serving it dies before its
#: response began.
ATTEMPTS = 3
#: Response headers the ingress sets itself.
_OWN_HEADERS = frozenset({b"content-length", *HOP_HEADERS})
_LOAD, _UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"


@dataclass(frozen=True)
class IngressConfig:
    """What the ingress needs of the server's flags.

    Attributes:
        base_model_names: the names that select the base model (``--served-model-name``, or
            ``--model``); any other ``model`` is routed as an adapter.
        max_request_body_bytes: the largest body the ingress reads; larger ones get 413.
        adapter_change_timeout: seconds a load or unload may take to reach every replica.
    """

    base_model_names: tuple[str, ...]
    max_request_body_bytes: int
    adapter_change_timeout: float


class ReplicaGone(Exception):
    """The replica serving a request died (or could not be reached) before it answered."""


class OpenAIIngress:
    """A Ray Serve deployment class (``@serve.ingress()``): the HTTP front of the replicas.

    Args:
        engines: a handle to the :class:`~manylora.entrypoints.ray_serve.replica.
            EngineReplica` deployment.
        control: a handle to the :class:`~manylora.entrypoints.ray_serve.control.
            AdapterControl` deployment.
        config: :class:`IngressConfig`.
    """

    def __init__(self, engines, control, config: IngressConfig) -> None:
        self.engines = engines
        self.control = control
        self.config = config

    def __serve_build_asgi_app__(self) -> FastAPI:
        return ingress_app(self)

    def adapter_of(self, request: HTTPRequest) -> str:
        """The multiplexed model id of ``request``: the ``model`` of its JSON body when that
        names no base model, else "" (routed by load)."""
        if request.method != "POST" or request.path in (_LOAD, _UNLOAD):
            return ""
        try:
            body = json.loads(request.body)
        except (ValueError, UnicodeDecodeError):
            return ""
        model = body.get("model") if isinstance(body, dict) else None
        if not isinstance(model, str) or not model or model in self.config.base_model_names:
            return ""
        return model

    def _stream(self, request: HTTPRequest, adapter: str):
        return self.engines.options(stream=True, multiplexed_model_id=adapter).forward.remote(
            request, adapter)

    async def call(self, request: HTTPRequest) -> Response:
        """Forward ``request`` to a replica and answer with its response: streamed when it
        is server-sent events, else whole.

        Raises:
            OpenAIError: 503 when every attempt's replica died or none is available.
        """
        adapter = self.adapter_of(request)
        error: Exception | None = None
        for _ in range(ATTEMPTS):
            stream = self._stream(request, adapter)
            try:
                head = await _first(stream)
                if (head.header(b"content-type") or b"").startswith(b"text/event-stream"):
                    return StreamingResponse(_rest(stream, head), status_code=head.status,
                                             headers=_headers(head))
                body = b"".join([chunk async for chunk in _chunks(stream)])
            except asyncio.CancelledError:
                stream.cancel()         # the client left: the replica aborts the request
                raise
            except ReplicaGone as e:
                error = e
                logger.warning("%s %s: %s; trying another replica", request.method,
                               request.path, e)
                continue
            return Response(body, status_code=head.status, headers=_headers(head))
        raise OpenAIError(503, f"no replica could serve the request: {error}")

    async def change_adapter(self, request: HTTPRequest) -> Response:
        """``POST /v1/load_lora_adapter`` or ``/v1/unload_lora_adapter`` on every replica.

        One replica answers the request itself (its checks, keys and errors); on success the
        change is published to all the others, and the answer waits until they applied it.
        A load that fails on any of them is undone everywhere (the name gets back the path
        it had before, or is unloaded), and answered with that replica's error.
        """
        response = await self.call(request)
        if response.status_code != 200:
            return response
        body = json.loads(request.body)
        name, unload = body["lora_name"], request.path == _UNLOAD
        origin = response.headers.get(REPLICA_HEADER, "")
        before = (await self.control.desired.remote()).adapters.get(name)
        failed = await self.control.publish.remote(
            name, None if unload else body["lora_path"], origin,
            self.config.adapter_change_timeout)
        if not failed:
            return response
        replica, (status, message) = next(iter(sorted(failed.items())))
        if not unload:
            await self.control.publish.remote(
                name, before.path if before is not None else None, "",
                self.config.adapter_change_timeout)
            message += " (the load was undone on every replica)"
        raise OpenAIError(status, f"replica {replica}: {message}", param="lora_path")

    async def metrics(self) -> bytes:
        """Every live replica's metrics with a ``replica`` label, and
        ``manylora:serve_replicas`` (the live replica count)."""
        texts = await self.control.metrics.remote()
        live = GaugeMetricFamily("manylora:serve_replicas",
                                 "Engine replicas polling the control replica.",
                                 value=len(texts))
        return merge_replica_metrics(texts, [live])


async def _first(stream) -> ResponseHead:
    try:
        head = await stream.__anext__()
    except StopAsyncIteration:
        raise ReplicaGone("the replica answered nothing") from None
    except (RayActorError, DeploymentUnavailableError) as e:
        raise ReplicaGone(f"replica unreachable ({type(e).__name__})") from e
    except BackPressureError as e:
        raise OpenAIError(503, f"every replica is at its queue bound: {e}") from None
    if not isinstance(head, ResponseHead):
        raise RuntimeError(f"a replica answered {type(head).__name__} before the head")
    return head


async def _chunks(stream) -> AsyncIterator[bytes]:
    try:
        async for chunk in stream:
            yield chunk
    except RayActorError as e:
        raise ReplicaGone(f"replica died mid-response ({type(e).__name__})") from e


async def _rest(stream, head: ResponseHead) -> AsyncIterator[bytes]:
    try:
        async for chunk in _chunks(stream):
            yield chunk
    except ReplicaGone as e:
        replica = (head.header(REPLICA_HEADER.encode()) or b"?").decode()
        logger.warning("a stream of replica %s ended: %s", replica, e)
        yield sse_error(OpenAIError(503, f"replica {replica}: {e}")).encode()
    finally:
        stream.cancel()


def _headers(head: ResponseHead) -> dict[str, str]:
    headers: dict[str, str] = {}
    for name, value in head.headers:
        if name not in _OWN_HEADERS:
            key = name.decode("latin-1")
            text = value.decode("latin-1")
            headers[key] = f"{headers[key]}, {text}" if key in headers else text
    return headers


def ingress_app(ingress: OpenAIIngress) -> FastAPI:
    """The ingress's ASGI app: ``/metrics`` and ``/health`` answered here, the adapter
    routes through :meth:`OpenAIIngress.change_adapter`, everything else forwarded."""
    app = FastAPI(title="manylora (Ray Serve ingress)", openapi_url=None, docs_url=None,
                  redoc_url=None)

    @app.exception_handler(OpenAIError)
    async def openai_error(_: Request, exc: OpenAIError):
        return SafeJSONResponse(exc.body(), status_code=exc.status)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(await ingress.metrics(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/health")
    async def health() -> Response:
        live = await ingress.control.replicas.remote()
        return Response(status_code=200 if live else 503)

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD",
                                            "OPTIONS"])
    async def forward(request: Request) -> Response:
        forwarded = HTTPRequest(
            request.method, get_route_path(request.scope), request.scope["query_string"],
            tuple((k, v) for k, v in request.scope["headers"] if k not in HOP_HEADERS),
            await request.body(),
            tuple(request.client) if request.client else None)
        if request.method == "POST" and forwarded.path in (_LOAD, _UNLOAD):
            return await ingress.change_adapter(forwarded)
        return await ingress.call(forwarded)

    app.add_middleware(BodyLimitMiddleware, limit=ingress.config.max_request_body_bytes)
    return app
