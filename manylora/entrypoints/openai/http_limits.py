"""Connection limits of ``manylora serve``: what one TCP connection may cost the server before
it has sent a whole request, and how long shutting down may wait for connections.

uvicorn's own settings carry most of them (``ConnectionLimits.uvicorn_options``): the
request head's size (h11's ``max_incomplete_event_size``: a larger head gets 431 and the
connection is closed, so the server buffers at most that much per connection), the idle
keep-alive time-out, the bound on open connections and running requests (503 beyond it,
uvicorn's ``limit_concurrency``), the listen backlog, and the graceful-shutdown deadline
(after which uvicorn cancels the requests still running). uvicorn has no time-out for
receiving a request; :class:`LimitedH11Protocol`, uvicorn's h11 protocol with two deadlines,
adds them as nginx's ``client_header_timeout`` and Apache's ``RequestReadTimeout`` do: the
request head must arrive within ``timeout_request_head`` seconds of the server starting to
wait for it (the connection opened, or the previous response ended), and the whole body
within ``timeout_request_body`` seconds of the head. A connection past either deadline gets
408 in OpenAI's error shape (none when it sent no byte of a new request: then it is only
closed, as an idle connection is) and is closed; the request's app sees a disconnect.

Both ways the server runs, ``uvicorn.run`` in the foreground and the threaded
``launcher.ServerThread``, take the same :meth:`ConnectionLimits.uvicorn_options`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from manylora.entrypoints.openai.errors import OpenAIError

__all__ = ["ConnectionLimits", "LimitedH11Protocol", "add_connection_args",
           "connection_limits"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ConnectionLimits:
    """The limits on one server's connections (``manylora serve``'s flags of the same names).

    Attributes:
        h11_max_incomplete_event_size: the largest request head (request line and headers),
            bytes; a larger one gets 431 and its connection is closed. vLLM's flag name;
            64 KiB is between nginx's 32 KiB and vLLM's 4 MiB.
        timeout_request_head: seconds a connection may take to send a whole request head,
            from its opening or from the end of the previous response (nginx's
            ``client_header_timeout``, 60 s).
        timeout_request_body: seconds a request may take to send its whole body after its
            head (stricter than nginx's ``client_body_timeout``, which bounds the pause
            between two reads: a body sent a byte at a time is bounded too).
        timeout_keep_alive: seconds an idle keep-alive connection stays open (uvicorn's
            and vLLM's 5).
        limit_concurrency: open connections plus running requests beyond which a new
            request gets 503 (uvicorn's ``limit_concurrency``).
        backlog: connections the kernel queues before they are accepted (uvicorn's 2048).
        timeout_graceful_shutdown: seconds a shutdown waits for open connections and
            running requests before it cancels them (uvicorn's; Kubernetes' default grace
            period is 30 s).
    """

    h11_max_incomplete_event_size: int = 64 * 1024
    timeout_request_head: float = 60.0
    timeout_request_body: float = 60.0
    timeout_keep_alive: float = 5.0
    limit_concurrency: int = 2048
    backlog: int = 2048
    timeout_graceful_shutdown: float = 30.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not value > 0:
                raise ValueError(f"--{f.name.replace('_', '-')} must be > 0, got {value}")

    def uvicorn_options(self) -> dict[str, Any]:
        """``uvicorn.Config`` keywords: the HTTP protocol (:class:`LimitedH11Protocol` with
        these deadlines) and uvicorn's own settings."""
        protocol = type("LimitedH11Protocol", (LimitedH11Protocol,), {"limits": self})
        return dict(http=protocol,
                    h11_max_incomplete_event_size=self.h11_max_incomplete_event_size,
                    timeout_keep_alive=self.timeout_keep_alive,
                    limit_concurrency=self.limit_concurrency, backlog=self.backlog,
                    timeout_graceful_shutdown=self.timeout_graceful_shutdown)


def add_connection_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``ConnectionLimits`` flags (``--h11-max-incomplete-event-size``,
    ``--timeout-*``, ``--limit-concurrency``, ``--backlog``) with its defaults."""
    d = ConnectionLimits()
    parser.add_argument("--h11-max-incomplete-event-size", type=int,
                        default=d.h11_max_incomplete_event_size, metavar="BYTES",
                        help="the largest request head (request line and headers); larger "
                             "ones get 431")
    parser.add_argument("--timeout-request-head", type=float,
                        default=d.timeout_request_head, metavar="S",
                        help="seconds a connection may take to send a whole request head; "
                             "then 408 and the connection is closed")
    parser.add_argument("--timeout-request-body", type=float,
                        default=d.timeout_request_body, metavar="S",
                        help="seconds a request may take to send its whole body after its "
                             "head; then 408 and the connection is closed")
    parser.add_argument("--timeout-keep-alive", type=float, default=d.timeout_keep_alive,
                        metavar="S", help="seconds an idle keep-alive connection stays open")
    parser.add_argument("--limit-concurrency", type=int, default=d.limit_concurrency,
                        metavar="N", help="open connections plus running requests beyond "
                                          "which new requests get 503 (uvicorn's)")
    parser.add_argument("--backlog", type=int, default=d.backlog, metavar="N",
                        help="connections queued before they are accepted (uvicorn's)")
    parser.add_argument("--timeout-graceful-shutdown", type=float,
                        default=d.timeout_graceful_shutdown, metavar="S",
                        help="seconds a shutdown (SIGTERM, SIGINT) waits for open "
                             "connections and running requests before cancelling them")
    return parser


def connection_limits(args: argparse.Namespace) -> ConnectionLimits:
    """The :class:`ConnectionLimits` of parsed flags.

    Raises:
        ValueError: a limit that is not > 0.
    """
    return ConnectionLimits(**{f.name: getattr(args, f.name) for f in fields(ConnectionLimits)})


def _response(status: int, reason: str, error: OpenAIError) -> bytes:
    body = json.dumps(error.body()).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode() + body


class LimitedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with deadlines for receiving a request's head and body, and
    431 (not uvicorn's 400) for a head over ``h11_max_incomplete_event_size``.

    One timer per connection follows h11's view of the client: waiting for a head
    (``IDLE``) arms ``timeout_request_head``, reading a body (``SEND_BODY``) arms
    ``timeout_request_body``, anything else (the request received, the connection closing)
    disarms it. ``uvicorn_options`` makes the subclass that carries ``limits``.
    """

    limits: ClassVar[ConnectionLimits] = ConnectionLimits()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._waiting_for: str | None = None          # "head", "body" or None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._watch()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._waiting_for = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch()

    def send_400_response(self, msg: str) -> None:
        # uvicorn calls this while handling h11's RemoteProtocolError, whose status hint
        # tells a head over the size bound (431) from a malformed request (400)
        error = sys.exc_info()[1]
        if isinstance(error, h11.RemoteProtocolError) and error.error_status_hint == 431:
            self._disarm()
            limit = self.limits.h11_max_incomplete_event_size
            self.transport.write(_response(431, "Request Header Fields Too Large", OpenAIError(
                431, f"the request head is over {limit} bytes "
                     "(--h11-max-incomplete-event-size)", type="BadRequestError",
                code="request_header_fields_too_large")))
            self.transport.close()
            return
        super().send_400_response(msg)

    def _watch(self) -> None:
        """Arm, keep or disarm the deadline for what the connection is waiting for."""
        state = self.conn.their_state
        phase = None
        if not self.transport.is_closing():
            phase = "head" if state is h11.IDLE else "body" if state is h11.SEND_BODY else None
        if phase == self._waiting_for:
            return
        self._disarm()
        self._waiting_for = phase
        if phase is not None:
            timeout = (self.limits.timeout_request_head if phase == "head"
                       else self.limits.timeout_request_body)
            self._deadline = self.loop.call_later(timeout, self._timed_out, phase)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _timed_out(self, phase: str) -> None:
        """408 and close: the head or the body did not arrive in time. No 408 for a
        connection that sent no byte of a new request (an idle one: a client may be
        about to reuse it) or whose request was already answered."""
        self._deadline = None
        self._waiting_for = None
        if self.transport.is_closing():
            return
        cycle = self.cycle
        if phase == "head":
            answer = bool(self.conn.trailing_data[0])
        else:
            answer = cycle is not None and not cycle.response_started
        if cycle is not None and not cycle.response_complete:
            # the app reading this body gets a disconnect, and its answer goes nowhere
            cycle.disconnected = True
            cycle.message_event.set()
        if answer:
            flag = f"--timeout-request-{phase}"
            timeout = getattr(self.limits, f"timeout_request_{phase}")
            logger.info("%s:%s - request %s not received within %g s (%s): 408",
                        *(self.client or ("?", "?")), phase, timeout, flag)
            self.transport.write(_response(408, "Request Timeout", OpenAIError(
                408, f"the request {phase} was not received within {timeout:g} s ({flag})",
                type="TimeoutError", code="request_timeout")))
        self.transport.close()
