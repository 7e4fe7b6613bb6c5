"""The engine core in a process of its own (vLLM v1's ``EngineCoreProc``): a busy loop
that takes the front's messages and steps the core, so that nothing of the front
(tokenizer, detokenizer, HTTP, SSE, metrics) shares its interpreter.

Two ZMQ sockets, both bound by the front: the core PULLs ``RequestType`` messages and
PUSHes ``ReplyType`` messages, in order (``engine/protocol.py``). The loop:

1. take every message waiting (block for one, or for an adapter read to end, when there is
   no work or nothing can run before a read ends): ``ADD`` (a list of requests) →
   ``EngineCore.add_request`` for each and their ``AddResult``s at once; ``ABORT``;
   ``UTILITY`` → ``UtilityResult`` (at once; for ``DEFERRED_UTILITY_METHODS``, e.g.
   ``add_lora``, when its work ends: the read runs on a loader thread while steps go on);
   ``SHUTDOWN`` → ``EngineCore.shutdown`` and exit;
2. one ``EngineCore.step`` when requests are unfinished (else ``poll_adapters`` while a
   read is in flight);
3. the deferred ``UtilityResult``s answered meanwhile, then ``OUTPUTS`` with the step's
   deltas and ``SchedulerStats``, when the step produced any or a message changed the
   state.

A failed start-up or step sends ``DEAD`` with the error and ends the process (exit 1). The
core also exits when its parent dies (checked once a second, idle or busy), and then
removes the sockets' folder, which the dead front cannot. Before every exit it unlinks the
tensor-parallel shared host files of its engine (``distributed/shared_host.py``): the
process ends by ``os._exit``, which runs no finalizer.

The front starts it as ``python -m manylora.engine.core_proc INPUT OUTPUT PARENT_PID`` with
the msgpack-encoded ``EngineArgs`` on standard input: a fresh interpreter that imports
nothing of the caller's ``__main__`` (no ``if __name__ == "__main__"`` guard needed in
scripts, notebooks welcome) and receives no pickle.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import time
from concurrent.futures import Future

import msgspec
import torch
import zmq

from manylora.distributed.shared_host import remove_files
from manylora.distributed.workers import exit_when_stuck
from manylora.engine.arg_utils import EngineArgs
from manylora.engine.core import EngineCore
from manylora.engine.protocol import (
    DEFERRED_UTILITY_METHODS,
    UTILITY_METHODS,
    AbortRequests,
    AddResult,
    EngineCoreOutputs,
    EngineCoreRequest,
    ReplyType,
    RequestType,
    UtilityCall,
    UtilityResult,
)
from manylora.engine.serial import Decoder, Encoder, ErrorInfo

logger = logging.getLogger(__name__)


_IDLE_POLL_MS = 1000
# Seconds between looks at the parent's pid while the core is busy.
_PARENT_CHECK_S = 1.0

#: Seconds a core blocked past a tensor-parallel worker's death waits before ending itself.
STUCK_EXIT_S = 10.0


def run_engine_core(args: bytes, input_address: str, output_address: str,
                    parent_pid: int) -> None:
    """The core process's main: build an ``EngineCore`` from msgpack-encoded
    ``EngineArgs``, report ``READY`` (or ``DEAD``), then serve until ``SHUTDOWN``.

    Args:
        args: ``EngineArgs`` encoded by ``serial.Encoder``.
        input_address, output_address: the front's bound ZMQ addresses (``ipc://...``).
        parent_pid: the front's pid; the core exits when it is gone.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)      # the front decides when to stop
    # this process is nothing but the core: one stuck on a dead tensor-parallel worker ends
    # itself, which the front sees at once (EngineDeadError, an unhealthy server)
    exit_when_stuck(STUCK_EXIT_S)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    ctx = zmq.Context()
    out = ctx.socket(zmq.PUSH)
    out.setsockopt(zmq.LINGER, 10_000)
    out.setsockopt(zmq.SNDHWM, 0)     # a send never blocks: a busy orphan still sees it is one
    out.connect(output_address)
    inp = ctx.socket(zmq.PULL)
    inp.setsockopt(zmq.LINGER, 0)
    inp.connect(input_address)
    encoder = Encoder()
    code = 0
    orphaned = False
    try:
        try:
            core = EngineCore(Decoder(EngineArgs).decode(args))
        except BaseException as e:
            logger.exception("the engine core failed to start")
            out.send_multipart([ReplyType.DEAD.value, encoder.encode(ErrorInfo.of(e))])
            code = 1
            return
        out.send_multipart([ReplyType.READY.value, encoder.encode(core.info())])
        proc = EngineCoreProc(core, inp, out, parent_pid)
        try:
            proc.run()
            orphaned = proc.orphaned
        except BaseException as e:
            logger.exception("the engine core stopped")
            out.send_multipart([ReplyType.DEAD.value, encoder.encode(ErrorInfo.of(e))])
            code = 1
            core.shutdown()
    finally:
        inp.close()
        out.close(linger=0 if orphaned else None)
        ctx.term()
        remove_files(os.getpid())
        if orphaned:          # the front died without removing its sockets' folder
            shutil.rmtree(os.path.dirname(input_address.removeprefix("ipc://")),
                          ignore_errors=True)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)        # this process's own end: no atexit work on a half-dead core


class EngineCoreProc:
    """The core's loop over its two sockets (see the module doc).

    Args:
        core: the started ``EngineCore``.
        inp: PULL socket of ``RequestType`` messages; out: PUSH socket of replies.
        parent_pid: the front's pid.
    """

    def __init__(self, core: EngineCore, inp: zmq.Socket, out: zmq.Socket,
                 parent_pid: int) -> None:
        self.core = core
        self.inp = inp
        self.out = out
        self.parent_pid = parent_pid
        self.encoder = Encoder()
        self._decoders = {RequestType.ADD: Decoder(list[EngineCoreRequest]),
                          RequestType.ABORT: Decoder(AbortRequests),
                          RequestType.UTILITY: Decoder(UtilityCall)}
        self._deferred: list[tuple[int, Future]] = []
        #: True once ``run`` returned because the front is gone (not on ``SHUTDOWN``)
        self.orphaned = False
        # a finished adapter read writes a byte here: it wakes a loop waiting for messages
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._poller = zmq.Poller()
        self._poller.register(inp, zmq.POLLIN)
        self._poller.register(self._wake_r, zmq.POLLIN)
        core.set_load_notify(self._notify)

    def _notify(self) -> None:
        try:
            os.write(self._wake_w, b"\0")
        except (BlockingIOError, OSError):
            pass           # a wake-up is pending already

    def run(self) -> None:
        """Serve until ``SHUTDOWN`` (or the parent's death).

        Raises:
            Exception: whatever a step raised (the caller reports it as ``DEAD``).
        """
        core = self.core
        next_parent_check = time.monotonic() + _PARENT_CHECK_S
        with torch.inference_mode():
            while True:
                block = not core.has_unfinished_requests() or core.waiting_on_reads()
                handled = self._take_messages(block)
                now = time.monotonic()
                if handled is None or (now > next_parent_check and self._front_gone()):
                    core.shutdown()
                    return
                if now > next_parent_check:
                    next_parent_check = now + _PARENT_CHECK_S
                if core.has_unfinished_requests():
                    outputs = core.step()
                elif core.has_pending_loads() or self._deferred:
                    outputs = core.poll_adapters()
                else:
                    outputs = EngineCoreOutputs()
                handled = self._send_deferred() or handled
                if outputs.outputs or handled:
                    outputs.scheduler_stats = core.scheduler_stats()
                    self._send(ReplyType.OUTPUTS, outputs)

    def _take_messages(self, block: bool) -> bool | None:
        """Handle every waiting message (waiting for one when ``block``); whether any was
        handled, or None on ``SHUTDOWN`` (or when the parent is gone)."""
        handled = False
        while True:
            if block and not handled:
                while True:
                    ready = dict(self._poller.poll(_IDLE_POLL_MS))
                    if self._wake_r in ready:
                        self._drain_wake()
                        return handled         # a read ended: poll it in
                    if ready:
                        break
                    if self._front_gone():
                        return None
            try:
                kind, body = self.inp.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return handled
            kind = RequestType(bytes(kind.buffer))
            if kind is RequestType.SHUTDOWN:
                return None
            self._handle(kind, self._decoders[kind].decode(body.buffer))
            handled = True

    def _front_gone(self) -> bool:
        """Whether the front's process has died (this one was re-parented); sets
        ``orphaned``."""
        if os.getppid() != self.parent_pid:
            logger.error("the front (pid %d) is gone: the engine core exits", self.parent_pid)
            self.orphaned = True
        return self.orphaned

    def _handle(self, kind: RequestType, message) -> None:
        core = self.core
        if kind is RequestType.ADD:
            results = []
            for request in message:
                try:
                    results.append(AddResult(request.request_id, core.add_request(request)))
                except Exception as e:
                    results.append(AddResult(request.request_id, [], ErrorInfo.of(e)))
            self._send(ReplyType.ADD_RESULT, results)
        elif kind is RequestType.ABORT:
            core.abort_requests(message.request_ids, message.reason)
        else:
            result = self._call(message)
            if result is not None:
                self._send(ReplyType.UTILITY_RESULT, result)

    def _call(self, call: UtilityCall) -> UtilityResult | None:
        """The call's answer, or None for a deferred call still at work (answered by
        ``_send_deferred``)."""
        types, _ = UTILITY_METHODS.get(call.method, (None, None))
        try:
            if types is None:
                raise ValueError(f"the engine core has no method {call.method!r} to call")
            if len(call.args) != len(types):
                raise ValueError(f"{call.method} takes {len(types)} arguments, got "
                                 f"{len(call.args)}")
            args = [msgspec.convert(a, t) for a, t in zip(call.args, types)]
            deferred = DEFERRED_UTILITY_METHODS.get(call.method)
            if deferred is None:
                return UtilityResult(call.call_id, getattr(self.core, call.method)(*args))
            future = getattr(self.core, deferred)(*args)
        except Exception as e:
            return UtilityResult(call.call_id, error=ErrorInfo.of(e))
        if future.done():
            return _result_of(call.call_id, future)
        self._deferred.append((call.call_id, future))
        return None

    def _send_deferred(self) -> bool:
        """Answer the deferred calls whose work ended; whether any was."""
        done = [(cid, f) for cid, f in self._deferred if f.done()]
        if not done:
            return False
        self._deferred = [(cid, f) for cid, f in self._deferred if not f.done()]
        for call_id, future in done:
            self._send(ReplyType.UTILITY_RESULT, _result_of(call_id, future))
        return True

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def _send(self, kind: ReplyType, message) -> None:
        self.out.send_multipart([kind.value, self.encoder.encode(message)], copy=False)


def _result_of(call_id: int, future: Future) -> UtilityResult:
    error = future.exception()
    if error is not None:
        return UtilityResult(call_id, error=ErrorInfo.of(error))
    return UtilityResult(call_id, future.result())


def main(argv: list[str] | None = None) -> None:
    """``python -m manylora.engine.core_proc INPUT OUTPUT PARENT_PID`` < encoded args."""
    input_address, output_address, parent_pid = (argv or sys.argv[1:])[:3]
    run_engine_core(sys.stdin.buffer.read(), input_address, output_address, int(parent_pid))


if __name__ == "__main__":
    main()
