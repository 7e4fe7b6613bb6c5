"""The server's published contract: what ``GET /openapi.json`` says each route answers.

FastAPI documents only a route's 200 and the 422 of its own request validation. The server
answers differently: request validation errors are 400 (as OpenAI's API and vLLM answer
them), and the middlewares and handlers answer 401 (API key), 413 (body size), 403, 404 and
503. This module holds, per route, the statuses the server really answers, every error body
being :class:`~manylora.entrypoints.openai.errors.ErrorResponse`, and rewrites the document:
no 422 anywhere (never answered), and with API keys a Bearer security scheme on the routes
that want the key (:func:`needs_key`; 401 documented there only then).

Statuses not documented, on purpose: 405 (answered for a method a path does not serve, with
``Allow``, to an operation the document does not list), 404 for an unknown path, and 499
(the client disconnected: nobody reads that answer). A 500 is a server bug.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from manylora.entrypoints.openai.errors import ErrorResponse

__all__ = ["KEYED_PATHS", "errors", "install_openapi", "needs_key", "sse_content"]

#: Routes outside ``/v1`` that want the API key too: vLLM's tokenizer routes (they name
#: the served adapters and do tokenizer work on request).
KEYED_PATHS = frozenset({"/tokenize", "/detokenize", "/tokenizer_info"})


def needs_key(path: str) -> bool:
    """Whether the route at ``path`` wants ``Authorization: Bearer <key>`` when the server
    has API keys: every ``/v1`` route and :data:`KEYED_PATHS`."""
    return path.startswith("/v1") or path in KEYED_PATHS

_WHY = {
    400: "Invalid request: a malformed body, a parameter of the wrong type or out of range, "
         "or a request the model cannot serve (too many tokens for the context).",
    401: "No valid API key: 'Authorization: Bearer <key>' is missing or wrong.",
    403: "Not allowed: the adapter path lies outside the --lora-root directories.",
    404: "Unknown model, adapter or adapter directory, or no stored response of that id.",
    413: "The request body is over --max-request-body-bytes, or the prompt fills the "
         "context.",
    503: "The engine is overloaded (its waiting queue is full) or not serving.",
    504: "The adapter's read from disk made no progress for --lora-load-timeout seconds.",
}


def sse_content(chunk: type[BaseModel]) -> dict[str, Any]:
    """The ``text/event-stream`` entry of a streaming route's 200: per event (OpenAPI 3.1
    has ``schema`` describe one event, as Schemathesis reads it), ``data`` is a ``chunk``
    as JSON, an error (``ErrorResponse``) met after streaming began, or ``[DONE]`` last.
    ``chunk``'s schema joins the document's components (:func:`install_openapi`)."""
    as_json = {"contentMediaType": "application/json", "contentSchema": {"anyOf": [
        {"$ref": f"#/components/schemas/{chunk.__name__}"},
        {"$ref": "#/components/schemas/ErrorResponse"}]}}
    return {"text/event-stream": {"schema": {
        "type": "object", "required": ["data"],
        "description": "One server-sent event: 'data: <chunk JSON>' per chunk, "
                       "'data: {\"error\": ...}' for an error after streaming began, "
                       "'data: [DONE]' last.",
        "properties": {"data": {"type": "string",
                                "anyOf": [{"const": "[DONE]"}, as_json]}}}}}


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """FastAPI ``responses=`` entries for ``statuses``, each with OpenAI's error body and a
    description of when it is answered (401 is added by :func:`install_openapi` where API
    keys are set, and 413 on every route: the body limit applies to all).

    Raises:
        KeyError: a status this module has no description for (add one to ``_WHY``).
    """
    return {status: {"model": ErrorResponse, "description": _WHY[status]}
            for status in sorted({*statuses, 413})}


def install_openapi(app: FastAPI, api_keys: bool,
                    stream_chunks: tuple[type[BaseModel], ...] = (),
                    narrow: Callable[[dict[str, Any]], None] | None = None) -> None:
    """Make ``app.openapi()`` return the document as the server behaves (see the module
    docstring); built once, on first use.

    Args:
        app: the FastAPI app, every route already added.
        api_keys: whether the ``/v1`` routes want ``Authorization: Bearer <key>``.
        stream_chunks: the chunk models :func:`sse_content` refers to, added to the
            components (no route returns them, so FastAPI does not).
        narrow: edits the finished document with what depends on the server's flags.
    """

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = _document(app, api_keys, stream_chunks)
            if narrow is not None:
                narrow(app.openapi_schema)
        return app.openapi_schema

    app.openapi = openapi


_NUMERIC_KEYWORDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
                     "multipleOf")
_INT64 = (-(2**63), 2**63 - 1)


def _exact_bounds(node: Any) -> None:
    """Give back the integer bounds FastAPI's document model turned into floats (its
    ``Schema.maximum`` is a float: 128 becomes 128.0, and 2**63 - 1 becomes 2**63): whole
    numbers as integers, and an ``int64`` schema's bounds as the exact int64 range (as
    generators and validators that read the JSON as decimals would see them otherwise,
    2**63 would be admitted)."""
    pending = [node]
    while pending:
        item = pending.pop()
        if isinstance(item, list):
            pending += item
        if not isinstance(item, dict):
            continue
        for key in _NUMERIC_KEYWORDS:
            value = item.get(key)
            if type(value) is float and value.is_integer():
                item[key] = int(value)
        if item.get("format") == "int64":
            if isinstance(item.get("minimum"), int):
                item["minimum"] = max(item["minimum"], _INT64[0])
            if isinstance(item.get("maximum"), int):
                item["maximum"] = min(item["maximum"], _INT64[1])
        pending += item.values()


def _document(app: FastAPI, api_keys: bool,
              stream_chunks: tuple[type[BaseModel], ...]) -> dict[str, Any]:
    # behind a proxy (--root-path) the document names the prefix as its server, as FastAPI's
    # own document does
    servers = app.servers or ([{"url": app.root_path}] if app.root_path else None)
    doc = get_openapi(title=app.title, version=app.version, description=app.description,
                      routes=app.routes, servers=servers)
    if stream_chunks:
        _, defs = models_json_schema([(m, "serialization") for m in stream_chunks],
                                     ref_template="#/components/schemas/{model}")
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        for name, schema in defs.get("$defs", {}).items():
            schemas.setdefault(name, schema)
    error_content = {"application/json": {"schema": {
        "$ref": "#/components/schemas/ErrorResponse"}}}
    for path, operations in doc.get("paths", {}).items():
        for operation in operations.values():
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)
            if api_keys and needs_key(path):
                operation["security"] = [{"bearer": []}]
                responses["401"] = {"description": _WHY[401]}
            for status, response in responses.items():
                if int(status) >= 400:   # JSON, whatever the route's own media type
                    response["content"] = error_content
            operation["responses"] = dict(sorted(responses.items()))
    schemas = doc.get("components", {}).get("schemas", {})
    for unused in ("HTTPValidationError", "ValidationError"):
        schemas.pop(unused, None)
    _exact_bounds(doc)
    if api_keys:
        doc.setdefault("components", {})["securitySchemes"] = {
            "bearer": {"type": "http", "scheme": "bearer",
                       "description": "one of the server's --api-key values"}}
    return doc
