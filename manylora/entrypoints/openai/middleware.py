"""The ASGI middleware of ``manylora serve``'s app (the Ray Serve ingress uses the body limit
too): request bodies bounded in bytes, and API keys on the routes that want one."""

from __future__ import annotations

import secrets

from starlette._utils import get_route_path

from manylora.entrypoints.openai.errors import OpenAIError, error_response, too_large
from manylora.entrypoints.openai.openapi import needs_key


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
            await error_response(too_large(message, code="request_too_large"))(
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
                await error_response(too_large(message, code="request_too_large"))(
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
                await error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _authorized(self, header: bytes) -> bool:
        scheme, _, token = header.partition(b" ")
        token = token.strip()
        # every key is compared, so the time taken does not say which one was close
        matches = [secrets.compare_digest(token, k) for k in self.keys]
        return scheme.lower() == b"bearer" and any(matches)
