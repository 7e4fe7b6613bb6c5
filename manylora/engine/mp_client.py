"""The engine core in a process of its own (vLLM v1's ``SyncMPClient``): spawned as
``python -m manylora.engine.core_proc``, reached over two ZMQ ``ipc://`` sockets, watched
through a pidfd, shut down and reaped. Same interface as ``InprocClient``
(``engine/core_client.py``)."""

from __future__ import annotations

import atexit
import contextlib
import itertools
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import weakref
from collections import deque
from concurrent.futures import Future
from typing import Any

import msgspec
import zmq

from manylora.distributed.shared_host import remove_files
from manylora.engine.arg_utils import EngineArgs
from manylora.engine.protocol import (
    UTILITY_METHODS,
    AbortRequests,
    AddDone,
    AddResult,
    CoreInfo,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineDeadError,
    FinishReason,
    ReplyType,
    RequestType,
    UtilityCall,
    UtilityResult,
)
from manylora.engine.serial import Decoder, Encoder, ErrorInfo

logger = logging.getLogger(__name__)

#: How long the core gets to stop its workers and exit before it is killed, seconds.
SHUTDOWN_TIMEOUT_S = 30.0


#: Core clients not shut down yet: whatever ends the interpreter normally (an interrupt
#: while the front was still being built, say) still stops and reaps their cores.
_LIVE_CLIENTS: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _shut_down_live_clients() -> None:
    for client in list(_LIVE_CLIENTS):
        client.shutdown()


@contextlib.contextmanager
def _stop_signals_deferred():
    """SIGINT and SIGTERM held back inside the block (main thread only; elsewhere Python
    runs no signal handler) and delivered to the handlers in place once it ends, so that an
    interrupt never lands between a process being started and its owner knowing it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, _: held.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for sig in held:
            signal.raise_signal(sig)


class MPClient:
    """The core in a process of its own (``python -m manylora.engine.core_proc``), over two
    ZMQ ``ipc://`` sockets this side binds.

    Start-up waits for the core's ``READY`` (its model loaded, graphs captured). Any thread
    may send (a lock orders the sends) and call ``wake``; one thread at a time receives.
    The core process's death is seen at once (a pidfd of it is polled with the socket)
    and raised as ``EngineDeadError``, as is its report of a failed step (``DEAD``); either
    way the client shuts itself down first (as vLLM's, whose monitor shuts the client down
    when the core dies): the process is reaped (no zombie), its sockets' folder under the
    temporary directory and its tensor-parallel shared files are removed.

    Raises:
        CheckpointError, ValueError, FileNotFoundError, ...: the core's start-up error.
        EngineDeadError: the process died during start-up.
    """

    in_process = False

    def __init__(self, args: EngineArgs) -> None:
        try:
            with _stop_signals_deferred():
                self._spawn(args)
            self.info = self._wait_ready()
        except BaseException:
            if self in _LIVE_CLIENTS:         # its core was started
                self.shutdown()
            raise

    def _spawn(self, args: EngineArgs) -> None:
        """The sockets, their folder and the core process, registered for ``shutdown``
        before any stop signal can interrupt the front."""
        self._dir = tempfile.mkdtemp(prefix="manylora-")
        self._ctx = zmq.Context()
        self._input = self._ctx.socket(zmq.PUSH)
        self._input.setsockopt(zmq.LINGER, 0)
        self._input.setsockopt(zmq.SNDHWM, 0)
        self._output = self._ctx.socket(zmq.PULL)
        self._output.setsockopt(zmq.LINGER, 0)
        self._output.setsockopt(zmq.RCVHWM, 0)
        input_address = f"ipc://{self._dir}/input"
        output_address = f"ipc://{self._dir}/output"
        self._input.bind(input_address)
        self._output.bind(output_address)
        self._encoder = Encoder()
        self._decoders = {ReplyType.READY: Decoder(CoreInfo),
                          ReplyType.ADD_RESULT: Decoder(list[AddResult]),
                          ReplyType.UTILITY_RESULT: Decoder(UtilityResult),
                          ReplyType.OUTPUTS: Decoder(EngineCoreOutputs),
                          ReplyType.DEAD: Decoder(ErrorInfo)}
        self._send_lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._calls = itertools.count()
        self._utility: dict[int, tuple[str, Future]] = {}
        self._kept: deque[AddDone | EngineCoreOutputs] = deque()
        self.error: EngineDeadError | None = None
        self._closed = False
        self._exiting = False           # the core reported DEAD: it exits on its own
        self._shutdown_lock = threading.Lock()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "manylora.engine.core_proc", input_address,
             output_address, str(os.getpid())], stdin=subprocess.PIPE)
        self.process.stdin.write(self._encoder.encode(args))
        self.process.stdin.close()
        # a pidfd becomes readable when the process ends: its death wakes every poll
        self._pidfd = os.pidfd_open(self.process.pid)
        self._poller = zmq.Poller()
        self._poller.register(self._output, zmq.POLLIN)
        self._poller.register(self._wake_r, zmq.POLLIN)
        self._poller.register(self._pidfd, zmq.POLLIN)
        _LIVE_CLIENTS.add(self)

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def _wait_ready(self) -> CoreInfo:
        while True:
            ready = dict(self._poller.poll())
            if self._output in ready:
                kind, message = self._recv()
                if kind is ReplyType.READY:
                    return message
                if kind is ReplyType.DEAD:
                    self._exiting = True
                    raise message.to_exception()
            elif self._pidfd in ready:
                raise EngineDeadError("the engine core process died while starting ("
                                      f"{self._exit_status()})")
            else:
                self._drain_wake()

    def _recv(self, flags: int = 0) -> tuple[ReplyType, Any]:
        """The next message (``zmq.NOBLOCK``: raise ``zmq.Again`` when none is there)."""
        kind, body = self._output.recv_multipart(flags, copy=False)
        kind = ReplyType(bytes(kind.buffer))
        return kind, self._decoders[kind].decode(body.buffer)

    def _send(self, kind: RequestType, message: Any = None) -> None:
        """Queue one message for the core without blocking: a PUSH socket whose peer is
        gone would block a send forever, so no peer means the core has died.

        Raises:
            EngineDeadError: the core is gone (or was shut down).
        """
        self._check_alive()
        frames = [kind.value, b"" if message is None else self._encoder.encode(message)]
        with self._send_lock:
            try:
                self._input.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                raise EngineDeadError("the engine core is gone: its input socket has no "
                                      "peer") from None

    def _check_alive(self) -> None:
        if self.error is not None:
            raise self.error
        if self._closed:
            raise EngineDeadError("the engine core was shut down")

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        """Send requests in one message: the core takes them all in before its next step."""
        if requests:
            self._send(RequestType.ADD, requests)

    def abort_requests(self, request_ids: list[str],
                       reason: FinishReason = FinishReason.ABORT) -> None:
        if request_ids and self.error is None and not self._closed:
            self._send(RequestType.ABORT, AbortRequests(list(request_ids), reason))

    def call(self, method: str, *args: Any) -> Any:
        """Run ``EngineCore.<method>(*args)`` in the core and return its answer; messages
        that arrive meanwhile are kept for ``get_messages``.

        Raises:
            ValueError: ``method`` is not one the core offers.
            EngineDeadError: the core process died.
            Exception: what the method raised, raised again here.
        """
        future = self.call_async(method, *args)
        while not future.done():
            self._kept.extend(self._poll(block=True))
        return future.result()

    def call_async(self, method: str, *args: Any) -> Future:
        """Send ``EngineCore.<method>(*args)`` to the core without waiting: the returned
        ``concurrent.futures.Future`` is answered (result or the core's error, raised again
        as its class; ``EngineDeadError`` when the core dies first) by the ``get_messages``
        or ``call`` that receives the answer, on that caller's thread.

        Raises:
            ValueError: ``method`` is not one the core offers.
            EngineDeadError: the core is gone.
        """
        if method not in UTILITY_METHODS:
            raise ValueError(f"the engine core has no method {method!r} to call")
        call_id = next(self._calls)
        future: Future = Future()
        self._utility[call_id] = (method, future)
        try:
            self._send(RequestType.UTILITY, UtilityCall(call_id, method, list(args)))
        except BaseException:
            del self._utility[call_id]
            raise
        return future

    def has_pending_calls(self) -> bool:
        """Whether a utility call is still unanswered."""
        return bool(self._utility)

    def _answer(self, result: UtilityResult) -> None:
        method, future = self._utility.pop(result.call_id, (None, None))
        if future is None:
            return
        if result.error is not None:
            future.set_exception(result.error.to_exception())
            return
        try:
            future.set_result(msgspec.convert(result.result, UTILITY_METHODS[method][1]))
        except msgspec.ValidationError as e:
            future.set_exception(e)

    def get_messages(self, block: bool) -> list[AddDone | EngineCoreOutputs]:
        """Every message received so far (waiting for one, or for ``wake``, when
        ``block``), in order.

        Raises:
            EngineDeadError: the core reported a failure or its process died.
        """
        if self._kept:
            kept = list(self._kept)
            self._kept.clear()
            return kept
        return self._poll(block)

    def _poll(self, block: bool) -> list[AddDone | EngineCoreOutputs]:
        if self.error is not None:
            self.shutdown()
            raise self.error
        self._check_alive()
        ready = dict(self._poller.poll(None if block else 0))
        if self._wake_r in ready:
            self._drain_wake()
        messages: list[AddDone | EngineCoreOutputs] = []
        while True:
            try:
                kind, message = self._recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            if kind is ReplyType.OUTPUTS:
                messages.append(message)
            elif kind is ReplyType.ADD_RESULT:
                messages.extend(AddDone(r.request_id, r.history, None if r.error is None
                                        else r.error.to_exception()) for r in message)
            elif kind is ReplyType.UTILITY_RESULT:
                self._answer(message)
            elif kind is ReplyType.DEAD:
                self.error = EngineDeadError(f"the engine core failed: {message.type}: "
                                             f"{message.message}")
        if self.error is None and not messages and self._pidfd in ready:
            self.error = EngineDeadError(f"the engine core process died ({self._exit_status()})")
        if self.error is not None:
            self._fail_calls(self.error)
            if not messages:
                self.shutdown()        # a core that reported its failure is exiting
                raise self.error
        return messages

    def _fail_calls(self, error: Exception) -> None:
        calls, self._utility = self._utility, {}
        for _, future in calls.values():
            future.set_exception(error)

    def wake(self) -> None:
        """Make a blocked ``get_messages`` return (any thread)."""
        if self._closed:
            return
        try:
            os.write(self._wake_w, b"\0")
        except (BlockingIOError, OSError):
            pass           # a wake-up is pending already (or the client is closed)

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def _exit_status(self) -> str:
        """How the ended core process ended, in words ("exit code 1", "killed by SIGKILL"),
        without reaping it."""
        info = os.waitid(os.P_PID, self.process.pid, os.WEXITED | os.WNOWAIT)
        if info is not None and info.si_code == os.CLD_EXITED:
            return f"exit code {info.si_status}"
        if info is not None:
            try:
                return f"killed by {signal.Signals(info.si_status).name}"
            except ValueError:
                return f"killed by signal {info.si_status}"
        return "exit status unknown"

    def _exited(self, timeout: float | None) -> bool:
        """Wait up to ``timeout`` seconds (None: for ever) for the core process to end;
        whether it has (it is not reaped: its pid stays its own)."""
        return bool(select.select([self._pidfd], [], [], timeout)[0])

    def shutdown(self) -> None:
        """Ask the core to stop (it stops its workers; SIGTERM while it starts), wait for
        it, kill it if it hangs, remove the shared files it left, reap it, and release the
        sockets and their folder (idempotent; a second caller waits for the first)."""
        with self._shutdown_lock:
            if not self._closed:
                self._closed = True
                self._shut_down()

    def _shut_down(self) -> None:
        self._fail_calls(self.error or EngineDeadError("the engine core was shut down"))
        if not self._exited(0):
            try:
                with self._send_lock:       # the core may be exiting: never block here
                    self._input.send_multipart([RequestType.SHUTDOWN.value, b""],
                                               flags=zmq.NOBLOCK)
            except zmq.ZMQError:            # no peer: the core cannot read it
                self.process.terminate()
            else:
                if not hasattr(self, "info") and not self._exiting:
                    self.process.terminate()    # starting: it would read it once loaded
            if not self._exited(SHUTDOWN_TIMEOUT_S):
                logger.error("the engine core did not stop in %.0f s: killed",
                             SHUTDOWN_TIMEOUT_S)
                self.process.kill()
                self._exited(None)
        # a killed core left its shared files; removed before the reaping frees its pid
        remove_files(self.process.pid)
        self.process.wait()
        self._input.close()
        self._output.close()
        self._ctx.term()
        for fd in (self._wake_r, self._wake_w, self._pidfd):
            os.close(fd)
        shutil.rmtree(self._dir, ignore_errors=True)
