"""Connection limits of ``manylora serve`` (``http_limits.py``) against slow and hostile
clients on loopback, with raw sockets: an oversize unterminated head is refused with 431
before the server buffers it; a head or a body sent a byte at a time gets 408 and is cut
off; idle connections, fresh or kept alive, are closed; ``--limit-concurrency`` answers 503
beyond it; SIGTERM ends ``manylora serve`` within ``--timeout-graceful-shutdown`` while a
slow client is still sending. The time-outs are set small by flags; the tests wait for each
outcome with generous deadlines and assert none of its timings."""

from __future__ import annotations

import json
import logging
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from urllib.parse import urlsplit

import httpx
import pytest
from server_helpers import BASE, engine_flags, running_server

#: The longest a test waits for the server to do something (a time-out firing, a start).
DEADLINE_S = 120.0
HEAD_LIMIT = 8192


@pytest.fixture(scope="module")
def url(base_dir):
    with running_server(base_dir, "--h11-max-incomplete-event-size", str(HEAD_LIMIT),
                        "--timeout-request-head", "1", "--timeout-request-body", "1",
                        "--timeout-keep-alive", "1") as (_, url):
        yield url


def _connect(url: str) -> socket.socket:
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=DEADLINE_S)
    return sock


def _response(sock: socket.socket) -> tuple[int | None, dict, bytes]:
    """Read until the server closes: the status (None: closed without an answer), the
    headers and the body."""
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    if not data:
        return None, {}, b""
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, body


def _trickle(sock: socket.socket, byte: bytes = b"a") -> None:
    """Send ``byte`` every 0.2 s until the server answers or closes (or the deadline)."""
    end = time.monotonic() + DEADLINE_S
    while time.monotonic() < end:
        if select.select([sock], [], [], 0.2)[0]:
            return
        try:
            sock.sendall(byte)
        except (BrokenPipeError, ConnectionResetError):
            return
    pytest.fail("the server neither answered nor closed a slow connection")


def _error(body: bytes) -> dict:
    return json.loads(body)["error"]


def test_oversize_unterminated_head_gets_431_without_being_buffered(url):
    sock = _connect(url)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: ")
    sent, chunk, refused = 0, b"a" * 65536, False
    while sent < 64 * 2**20 and not refused:
        try:
            sock.sendall(chunk)
        except (BrokenPipeError, ConnectionResetError):
            refused = True
            break
        sent += len(chunk)
        refused = bool(select.select([sock], [], [], 0)[0])
    # the server stopped reading long before 64 MB: it held at most the head bound
    assert refused, f"the server took {sent} bytes of one unterminated header"
    status, headers, body = _response(sock)
    sock.close()
    if status is not None:                # the answer may be lost to the connection reset
        assert status == 431
        assert headers["connection"] == "close"
        error = _error(body)
        assert str(HEAD_LIMIT) in error["message"] and error["code"] == (
            "request_header_fields_too_large")
    assert httpx.get(f"{url}/health").status_code == 200


def test_head_within_the_bound_is_served(url):
    r = httpx.get(f"{url}/health", headers={"X-Pad": "a" * (HEAD_LIMIT // 2)})
    assert r.status_code == 200


def test_slow_head_gets_408_and_is_closed(url):
    sock = _connect(url)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    _trickle(sock, b"a")
    status, headers, body = _response(sock)
    sock.close()
    assert status == 408
    assert headers["connection"] == "close"
    error = _error(body)
    assert "--timeout-request-head" in error["message"]
    assert error["code"] == "request_timeout"


def test_slow_body_gets_408_and_is_closed(url, caplog):
    uvicorn_log = logging.getLogger("uvicorn")       # does not propagate to caplog's root
    uvicorn_log.addHandler(caplog.handler)
    try:
        sock = _connect(url)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n{")
        _trickle(sock, b" ")
        status, _, body = _response(sock)
        sock.close()
    finally:
        uvicorn_log.removeHandler(caplog.handler)
    assert status == 408
    assert "--timeout-request-body" in _error(body)["message"]
    # the app reading the body saw a disconnect, not an error
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    # the server goes on serving
    r = httpx.post(f"{url}/v1/completions", json={"model": BASE, "prompt": "hi",
                                                  "max_tokens": 1}, timeout=DEADLINE_S)
    assert r.status_code == 200, r.text


def test_idle_connections_are_closed(url):
    fresh = _connect(url)                 # opened, nothing sent: closed without an answer
    assert _response(fresh) == (None, {}, b"")
    fresh.close()
    kept = _connect(url)                  # one request, then idle past the keep-alive
    kept.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    status, headers, body = _response(kept)
    kept.close()
    assert status == 200 and headers.get("connection") != "close"


def test_open_connections_beyond_the_limit_get_503(base_dir):
    limit = 3
    with running_server(base_dir, "--limit-concurrency", str(limit),
                        "--timeout-keep-alive", "600", "--timeout-request-head", "600"
                        ) as (_, url):
        held = []
        for _ in range(limit - 1):        # kept-alive connections count as open
            sock = _connect(url)
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert sock.recv(65536).startswith(b"HTTP/1.1 200")
            held.append(sock)
        assert httpx.get(f"{url}/health").status_code == 503
        for sock in held:
            sock.close()
        end = time.monotonic() + DEADLINE_S   # the server sees the closes in its own time
        while httpx.get(f"{url}/health").status_code != 200:
            assert time.monotonic() < end, "connections closed but still counted"
            time.sleep(0.1)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_sigterm_ends_serve_within_the_graceful_deadline_despite_a_slow_client(
        base_dir, tmp_path):
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = (tmp_path / "serve.log").open("w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "manylora.entrypoints.cli", "serve", "--model", str(base_dir),
         "--served-model-name", BASE, *engine_flags(), "--port", str(port),
         "--timeout-graceful-shutdown", "2", "--timeout-request-body", "3600",
         "--uvicorn-log-level", "warning", "--disable-log-stats"],
        stdout=log, stderr=subprocess.STDOUT)
    stop = threading.Event()
    try:
        end = time.monotonic() + DEADLINE_S
        while True:
            assert proc.poll() is None and time.monotonic() < end, _log(log)
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        sock = _connect(url)              # a body a byte a second, due in 100,000 s
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n{")
        slow = threading.Thread(target=_send_slowly, args=(sock, stop), daemon=True)
        slow.start()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=DEADLINE_S)
        except subprocess.TimeoutExpired:
            pytest.fail("SIGTERM did not end manylora serve while a slow client was "
                        "connected\n" + _log(log))
    finally:
        stop.set()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


def _send_slowly(sock: socket.socket, stop: threading.Event) -> None:
    try:
        while not stop.wait(1.0):
            sock.sendall(b" ")
    except OSError:
        pass
    finally:
        sock.close()


def _log(log) -> str:
    log.flush()
    log.seek(0)
    return log.read()[-4000:]
