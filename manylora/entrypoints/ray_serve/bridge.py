"""One HTTP exchange through an in-process ASGI app, as a stream of parts a Ray Serve replica
can yield back to the ingress.

A replica of ``manylora serve-ray`` runs the whole ``manylora serve`` app (routes, checks,
tokenizer, engine) in its own process; the ingress hands it each request's method, path,
headers and body, and gets the response back as :class:`ResponseHead` then the body's
chunks, so server-sent events stream through Ray Serve's streaming handles chunk by chunk.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

#: Request headers that describe one HTTP hop, not the request: the in-process call has its
#: own framing (the body is handed over whole).
HOP_HEADERS = frozenset({b"connection", b"keep-alive", b"transfer-encoding", b"te",
                         b"upgrade", b"proxy-connection", b"expect"})
#: The response header naming the engine replica that served a request (set by the replica,
#: read by the ingress).
REPLICA_HEADER = "x-manylora-replica"


@dataclass(frozen=True)
class HTTPRequest:
    """What the ingress forwards to a replica.

    Attributes:
        method: ``GET``, ``POST``, ...
        path: the route path (no query string, no root path).
        query: the raw query string, bytes.
        headers: the request's headers as (lower-case name, value) byte pairs, hop-by-hop
            ones removed.
        body: the whole body, bytes (the ingress already bounded its size).
        client: the client's (host, port), or None.
    """

    method: str
    path: str
    query: bytes
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes
    client: tuple[str, int] | None = None


@dataclass(frozen=True)
class ResponseHead:
    """The status line and headers of a response (ASGI's ``http.response.start``).

    Attributes:
        status: the HTTP status code.
        headers: (lower-case name, value) byte pairs.
    """

    status: int
    headers: tuple[tuple[bytes, bytes], ...]

    def header(self, name: bytes) -> bytes | None:
        """The first value of header ``name`` (lower case), or None."""
        return next((v for k, v in self.headers if k == name), None)


async def call_asgi(app, request: HTTPRequest, extra_headers: tuple[tuple[bytes, bytes], ...]
                    = ()) -> AsyncIterator[ResponseHead | bytes]:
    """Run ``request`` through the ASGI ``app``: yield the :class:`ResponseHead` (with
    ``extra_headers`` appended), then each non-empty body chunk as the app sends it.

    The app sees the body as one ``http.request`` message. When the caller stops iterating
    early (the client went away, or Ray Serve cancelled the call), the app's next
    ``receive()`` answers ``http.disconnect``, so the server's cancellation path aborts the
    request's engine work, as it does for a dropped connection.

    Raises:
        Exception: whatever the app raised before it finished its response.
        RuntimeError: the app ended without starting a response.
    """
    sent: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    body_given = False

    async def receive() -> dict:
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await sent.put(message)

    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1", "method": request.method, "scheme": "http",
        "path": request.path, "raw_path": request.path.encode("utf-8", "surrogateescape"),
        "query_string": request.query, "root_path": "", "headers": list(request.headers),
        "client": request.client, "server": None, "state": {},
    }
    task = asyncio.ensure_future(app(scope, receive, send))
    task.add_done_callback(lambda _: sent.put_nowait(None))
    started = False
    try:
        while True:
            message = await sent.get()
            if message is None:
                task.result()           # the app's own error, if it raised
                if not started:
                    raise RuntimeError(f"{request.method} {request.path}: the app ended "
                                       "without a response")
                return
            if message["type"] == "http.response.start":
                started = True
                headers = tuple((bytes(k).lower(), bytes(v))
                                for k, v in message.get("headers", ()))
                yield ResponseHead(message["status"], headers + tuple(extra_headers))
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    return
    finally:
        gone.set()
        if not task.done():
            # a response cut short: let the app see the disconnect and clean up
            await asyncio.wait({task}, timeout=5.0)
