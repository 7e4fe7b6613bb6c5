"""A real ``manylora serve`` process (``python -m manylora.entrypoints.cli serve``) on
loopback: when its engine core dies (a failed step, or ``kill -9``) in-flight streams end
at once with an error event, ``/health`` answers 503 until the server exits with status 1;
SIGTERM and SIGINT stop it with status 0. After every one of them nothing is left: the core
process was reaped by the server (not left a zombie or an orphan), and no ``manylora-*``
sockets' folder is left in the server's temporary directory. A server killed outright
cleans nothing; its core sees that, exits and removes the folder itself.

The test process makes itself a child subreaper (Linux ``PR_SET_CHILD_SUBREAPER``) while a
server runs: a process the server leaves behind (a zombie core, a core still running)
becomes this process's child when the server exits, where ``os.waitpid`` finds it.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from server_helpers import BASE, engine_flags

import manylora

#: ``seed`` of the request that makes the injected core fail its next step.
POISON_SEED = 4_242_424_242
#: Installed (as ``sitecustomize``) only in the servers these tests start: in the engine
#: core's process, a request with ``POISON_SEED`` makes the core's next step raise, as any
#: unexpected error of a step would.
_HOOK = f'''
import sys

if any("manylora.engine.core_proc" in a for a in sys.orig_argv):
    from manylora.engine.core import EngineCore

    _add_request, _step = EngineCore.add_request, EngineCore.step

    def add_request(self, request):
        if request.sampling_params.seed == {POISON_SEED}:
            self.test_poisoned = True
        return _add_request(self, request)

    def step(self):
        if getattr(self, "test_poisoned", False):
            raise RuntimeError("a step failure injected by the test")
        return _step(self)

    EngineCore.add_request, EngineCore.step = add_request, step
'''
PR_SET_CHILD_SUBREAPER = 36
START_TIMEOUT_S = 300
EXIT_TIMEOUT_S = 120


def _set_subreaper(on: bool) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) != 0:
        pytest.skip(f"prctl(PR_SET_CHILD_SUBREAPER) failed: errno {ctypes.get_errno()}")


def _children(pid: int) -> list[int]:
    """The pids of ``pid``'s child processes (from ``/proc``)."""
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:
                kids.append(int(stat.parent.name))
    return kids


class Serve:
    """``manylora serve`` in a subprocess on a free loopback port, its engine core in a
    process of its own, its temporary directory ``tmp``."""

    def __init__(self, base_dir: Path, tmp: Path, wait_ready: bool = True) -> None:
        self.tmp = tmp / "tmp"
        self.tmp.mkdir()
        hook = tmp / "hook"
        hook.mkdir()
        (hook / "sitecustomize.py").write_text(_HOOK)
        root = str(Path(manylora.__file__).resolve().parents[1])
        path = os.pathsep.join(p for p in (str(hook), root, os.environ.get("PYTHONPATH"))
                               if p)
        env = {**os.environ, "TMPDIR": str(self.tmp), "PYTHONPATH": path,
               "MANYLORA_ENABLE_MULTIPROCESSING": "1"}
        self.others = set(_children(os.getpid()))      # this process's, not the server's
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "manylora.entrypoints.cli", "serve", "--model",
             str(base_dir), "--served-model-name", BASE, *engine_flags(max_model_len=256),
             "--port", "0", "--disable-log-stats"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            text=True, env=env)
        self.lines: list[str] = []
        self._url = threading.Event()
        self.url = ""
        threading.Thread(target=self._read, daemon=True).start()
        self.core_pid: int | None = None
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._url.wait(0.2) if wait_ready else self.core_pid is None:
            assert self.proc.poll() is None and time.monotonic() < deadline, self.log()
            kids = _children(self.proc.pid)
            self.core_pid = kids[0] if kids and not wait_ready else None
        kids = _children(self.proc.pid)
        assert len(kids) == 1, (kids, self.log())
        self.core_pid = kids[0]

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)
            found = re.search(r"Uvicorn running on (http://\S+)", line)
            if found:
                self.url = found.group(1)
                self._url.set()

    def log(self) -> str:
        return "".join(self.lines[-60:])

    def wait(self) -> int:
        """The server's exit status (it must exit within ``EXIT_TIMEOUT_S``)."""
        try:
            return self.proc.wait(EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.fail("the server did not exit:\n" + self.log())

    def assert_nothing_left(self) -> None:
        """The core was reaped by the server, nothing of its became this process's child,
        and no sockets' folder is left."""
        for pid in [self.core_pid, *self.new_children()]:
            with contextlib.suppress(ChildProcessError):
                # ours only if the server left it behind: a zombie, or still running
                left = os.waitpid(pid, os.WNOHANG)
                if left[0] == 0:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                pytest.fail(f"process {pid} was left behind ({left}):\n" + self.log())
        assert not list(self.tmp.glob("manylora-*")), self.log()

    def new_children(self) -> list[int]:
        """This process's children that were not there before the server started."""
        return [pid for pid in _children(os.getpid()) if pid not in self.others]

    def wait_orphaned_core(self) -> int:
        """The exit status of the core, once the server is gone (the core is then this
        process's child), waiting up to ``EXIT_TIMEOUT_S`` for it to end."""
        deadline = time.monotonic() + EXIT_TIMEOUT_S
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.core_pid, os.WNOHANG)
            if pid:
                self.core_pid = None
                return os.waitstatus_to_exitcode(status)
            time.sleep(0.1)
        pytest.fail("the orphaned core did not exit")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.core_pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.core_pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(self.core_pid, 0)


@contextlib.contextmanager
def _serving(base_dir, tmp_path, wait_ready: bool = True):
    """A ``Serve``, stopped afterwards; the test process is a child subreaper meanwhile."""
    _set_subreaper(True)
    server = None
    try:
        server = Serve(base_dir, tmp_path, wait_ready)
        yield server
    finally:
        if server is not None:
            server.stop()
        _set_subreaper(False)


@pytest.fixture
def serve(base_dir, tmp_path):
    """A ``Serve`` ready for requests."""
    with _serving(base_dir, tmp_path) as server:
        yield server


def _open_stream(client: httpx.Client, url: str) -> tuple[contextlib.ExitStack, object]:
    """Start a long completion stream; its lines, once its first chunk has come."""
    stack = contextlib.ExitStack()
    response = stack.enter_context(client.stream(
        "POST", f"{url}/v1/completions", json={
            "model": BASE, "prompt": "The quick", "max_tokens": 200, "stream": True,
            "ignore_eos": True}))
    assert response.status_code == 200
    lines = response.iter_lines()
    first = next(line for line in lines if line.startswith("data: "))
    assert json.loads(first[6:])["choices"][0]["finish_reason"] is None
    return stack, lines


def _stream_error(lines) -> dict:
    """The error event that ends a stream (which must not finish on its own)."""
    events = [json.loads(line[6:]) for line in lines
              if line.startswith("data: ") and line != "data: [DONE]"]
    assert events and "error" in events[-1], events[-3:]
    assert all(e.get("choices", [{}])[0].get("finish_reason") is None for e in events[:-1])
    return events[-1]["error"]


def _health_until_exit(server: Serve) -> list[int]:
    """``/health``'s status codes from now until the server stops answering (or
    ``EXIT_TIMEOUT_S`` has passed)."""
    codes = []
    deadline = time.monotonic() + EXIT_TIMEOUT_S
    with httpx.Client(timeout=30) as client:
        while time.monotonic() < deadline:
            try:
                codes.append(client.get(f"{server.url}/health").status_code)
            except httpx.TransportError:
                break
            time.sleep(0.05)
    return codes


def test_a_failed_core_step_ends_streams_and_the_server_exits_non_zero(serve):
    with httpx.Client(timeout=60) as client:
        stack, lines = _open_stream(client, serve.url)
        with stack:
            r = client.post(f"{serve.url}/v1/completions", json={
                "model": BASE, "prompt": "Hi", "max_tokens": 4, "seed": POISON_SEED})
            assert r.status_code == 503, r.text
            assert "engine" in r.json()["error"]["message"]
            error = _stream_error(lines)
        assert "engine" in error["message"] and error["code"] == 503, error
    assert 200 not in _health_until_exit(serve)
    assert serve.wait() == 1
    assert "a step failure injected by the test" in serve.log()
    serve.assert_nothing_left()


def test_a_killed_core_ends_streams_and_the_server_exits_non_zero(serve):
    with httpx.Client(timeout=60) as client:
        stack, lines = _open_stream(client, serve.url)
        with stack:
            os.kill(serve.core_pid, signal.SIGKILL)
            error = _stream_error(lines)
        assert "engine" in error["message"] and error["code"] == 503, error
        assert "SIGKILL" in error["message"], error
    assert 200 not in _health_until_exit(serve)
    assert serve.wait() == 1
    serve.assert_nothing_left()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_signal_stops_the_server_and_its_core(serve, sig):
    assert httpx.get(f"{serve.url}/health").status_code == 200
    serve.proc.send_signal(sig)
    assert serve.wait() == 0, serve.log()
    serve.assert_nothing_left()


def test_a_stop_signal_while_starting_stops_the_core(base_dir, tmp_path):
    """SIGTERM once the core process exists (still loading, or already serving: either way
    the same end)."""
    with _serving(base_dir, tmp_path, wait_ready=False) as server:
        server.proc.send_signal(signal.SIGTERM)
        assert server.wait() == 0, server.log()
        server.assert_nothing_left()


def test_a_killed_server_leaves_a_core_that_ends_itself(serve):
    with httpx.Client(timeout=60) as client:
        stack, _ = _open_stream(client, serve.url)     # the core has work
        with stack:
            serve.proc.kill()
            serve.proc.wait()
    assert serve.wait_orphaned_core() == 0
    assert serve.new_children() == []
    assert not list(serve.tmp.glob("manylora-*")), serve.log()
