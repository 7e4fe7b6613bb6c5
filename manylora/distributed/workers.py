"""Tensor-parallel worker processes: starting them, watching them, stopping them.

One process per rank. Rank 0 is the engine's own process; ``WorkerGroup`` starts ranks
``1 .. tp_size-1`` with the ``spawn`` start method, each running ``target(rank, tp_size,
init_method, *args)``.

Division of responsibility:

* ``WorkerGroup`` owns the worker *processes*: it starts them, watches them and stops them.
  It never creates or destroys a process group.
* Every rank joins ``torch.distributed`` itself through ``init_distributed``: a worker from
  inside its ``target``; rank 0 through ``WorkerGroup.join_process_group`` (which fails at
  once, with ``WorkerDiedError``, if a worker dies while starting); its start-up and
  collective timeouts: ``distributed/process_group.py``.
* Stopping, in this order: rank 0 sends its own stop message (the workers' targets return),
  calls ``WorkerGroup.shutdown()`` (the workers exit with ``os._exit``, never destroying
  their process group), then destroys its process group.

What happens when a worker dies (any exit before ``shutdown``, exit code 0 included):

1. Within milliseconds (the monitor thread waits on the processes' sentinels) the group
   records a ``WorkerDiedError`` naming the rank, pid and exit code, logs it, and calls
   ``on_failure`` if given. From then on ``check()``, ``guard()`` and ``broadcast()`` raise it.
2. The monitor kills the other workers (SIGTERM, then SIGKILL after 2 s): a group that lost a
   rank cannot run another collective, and their closed connections make a gloo collective
   rank 0 is waiting in raise.
3. Under NCCL the monitor also aborts this process's communicators (``ProcessGroup.abort()``):
   a collective waiting on the dead rank ends, possibly *without* an error and with a
   garbage result, and every later collective raises. Hence ``guard()`` checks again when its
   block ends: run a whole step (send, forward, the copy of the sampled tokens to the host)
   inside one ``guard()`` and never use a result the guard did not let through.
4. Rank 0's process is never signalled or ended by this module: the death reaches the engine
   as ``WorkerDiedError`` from its current or next step. The one exception is opt-in, for a
   process that is nothing but a server (``manylora serve``): after ``exit_when_stuck(s)``,
   if no ``check()`` / ``guard()`` / ``broadcast()`` has delivered the error ``s`` seconds
   after a death, the monitor sends SIGTERM to its own process, and ``os._exit(
   HARD_EXIT_CODE)`` if it is still there ``s`` seconds later.

Orphans: if rank 0 exits normally (even without ``shutdown``) a ``weakref.finalize``
(which runs at interpreter exit, before ``multiprocessing``'s own exit handler would join
the workers) kills the workers. If rank 0 is killed outright, each worker notices within
0.5 s that its parent process is gone (a thread polls ``os.getppid()``) and exits with
``os._exit(1)``.

Workers ignore SIGINT: a Ctrl-C in a terminal reaches the whole process group, and the
workers are rank 0's to stop. How gloo and NCCL behaved when ranks die (what the rules above
rest on): docs/notes-tensor-parallel.md.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing.connection
import multiprocessing.util  # noqa: F401  (imported first: see WorkerGroup's finalizer)
import os
import signal
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.multiprocessing as torch_mp

from manylora.distributed.broadcast import broadcast_tensor_dict
from manylora.distributed.process_group import (
    DEFAULT_STARTUP_TIMEOUT_S,
    abort_process_groups,
    init_distributed,
)
from manylora.distributed.shared_host import remove_files
from manylora.distributed.worker_entry import worker_entry

logger = logging.getLogger(__name__)

#: Exit status of rank 0 when the opt-in of ``exit_when_stuck`` ends it (EX_SOFTWARE).
HARD_EXIT_CODE = 70

# Seconds after an undelivered death before the monitor ends its own process; None: never
# (set only by ``exit_when_stuck``).
_stuck_exit_after_s: float | None = None


def exit_when_stuck(after_s: float | None) -> None:
    """Opt in (or out, with None) to ending this process when rank 0 is stuck: if a worker
    dies and no ``check()`` / ``guard()`` / ``broadcast()`` of its group has delivered the
    error ``after_s`` seconds later, the monitor thread sends SIGTERM to this process, and
    ends it with ``os._exit(HARD_EXIT_CODE)`` if it is still there ``after_s`` seconds after
    that. For a process that is nothing but a server (``manylora serve``'s launcher), where
    an engine thread that is idle or stuck would otherwise leave a process that looks
    healthy with a dead worker; never for one that embeds an engine (the default: off).
    Applies to every ``WorkerGroup`` of the process, existing ones too.

    Raises:
        ValueError: ``after_s`` is not positive.
    """
    global _stuck_exit_after_s
    if after_s is not None and not after_s > 0:
        raise ValueError(f"after_s must be > 0 seconds, got {after_s}")
    _stuck_exit_after_s = after_s


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker process exited while the engine still needed it.

    Attributes:
        rank: the worker's tensor-parallel rank.
        pid: its process id.
        exitcode: its exit status: ``>= 0`` an exit code, ``< 0`` minus the signal that
            killed it (``multiprocessing``'s convention).
    """

    def __init__(self, rank: int, pid: int | None, exitcode: int | None) -> None:
        self.rank, self.pid, self.exitcode = rank, pid, exitcode
        if exitcode is not None and exitcode < 0:
            try:
                how = f"was killed by {signal.Signals(-exitcode).name}"
            except ValueError:
                how = f"was killed by signal {-exitcode}"
        else:
            how = f"exited with code {exitcode}"
        super().__init__(f"tensor-parallel worker rank {rank} (pid {pid}) {how}; the engine "
                         "cannot continue without it")

    def __reduce__(self):
        return type(self), (self.rank, self.pid, self.exitcode)


def _reap(procs: dict[int, Any], stopping: threading.Event, polite_s: float) -> dict[int, Any]:
    """Stop ``procs`` (rank -> process): wait up to ``polite_s`` for them to exit on their
    own, SIGTERM the rest, SIGKILL whatever is left 2 s later. Returns rank -> exit code."""
    stopping.set()
    deadline = time.monotonic() + polite_s
    for p in procs.values():
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs.values():
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 2.0
    for p in procs.values():
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs.values():
        if p.is_alive():
            p.kill()
            p.join(1.0)
    return {rank: p.exitcode for rank, p in procs.items()}


class WorkerGroup:
    """Ranks ``1 .. tp_size-1`` as spawned processes, watched from rank 0.

    Construction starts the processes (``torch.multiprocessing`` ``spawn`` context, not
    daemonic, so workers may start processes of their own) and the monitor thread, and
    returns at once; rank 0 then joins the process group with ``join_process_group()``. See
    the module docstring for what happens when a worker dies and for the orphan guarantees.

    Args:
        target: a module-level function (spawn imports it by name), called in each worker
            as ``target(rank, tp_size, init_method, *args)``; it is expected to call
            ``init_distributed(rank, tp_size, backend, init_method, timeout_s)`` (and
            ``end_startup`` when rank 0 does) and then serve rank 0's messages until told to
            stop, and must not destroy the process group. Its return
            ends the worker (exit code 0); an exception ends it with code 1 after the
            traceback is printed (see ``worker_entry``).
        tp_size: ranks in all, rank 0 included (``tp_size - 1`` processes are started).
        backend: ``"nccl"`` or ``"gloo"``: decides how the monitor escalates.
        init_method: the ``tcp://host:port`` rendezvous (``free_init_method()``).
        args: extra arguments for ``target`` (picklable: spawn sends them to the child).
        timeout_s: the start-up timeout rank 0 joins with (``join_process_group``).
        on_failure: called once, from the monitor thread, with the ``WorkerDiedError`` as
            soon as a death is noticed (e.g. to wake an idle engine loop); what it raises is
            logged and ignored.

    Raises:
        ValueError: ``tp_size < 1``, or an unknown backend.
    """

    def __init__(self, target: Callable[..., Any], tp_size: int, *, backend: str,
                 init_method: str, args: tuple = (),
                 timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
                 on_failure: Callable[[WorkerDiedError], None] | None = None) -> None:
        if tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {tp_size}")
        if backend not in ("nccl", "gloo"):
            raise ValueError(f"backend must be 'nccl' or 'gloo', got {backend!r}")
        self.tp_size, self.backend, self.init_method = tp_size, backend, init_method
        self.timeout_s, self.on_failure = timeout_s, on_failure
        self._lock = threading.Lock()
        self._error: WorkerDiedError | None = None
        self._delivered = threading.Event()
        self._stopping = threading.Event()
        self._wake_r, self._wake_w = os.pipe()
        ctx = torch_mp.get_context("spawn")
        self._procs: dict[int, Any] = {}
        # Registered before any process starts, so even a failed start reaps what started.
        # weakref.finalize's exit hook is registered after multiprocessing.util's (imported
        # above), so at interpreter exit it runs first and multiprocessing's join of
        # non-daemonic children finds them already gone.
        self._finalizer = weakref.finalize(self, _reap, self._procs, self._stopping, 0.0)
        try:
            for rank in range(1, tp_size):
                proc = ctx.Process(target=worker_entry, name=f"manylora-tp-worker-{rank}",
                                   args=(target, rank, tp_size, init_method, os.getpid(),
                                         tuple(args)), daemon=False)
                proc.start()
                self._procs[rank] = proc
        except BaseException:
            self._finalizer()
            self._close_wake()
            raise
        self._monitor = threading.Thread(target=self._watch, daemon=True,
                                         name="manylora-worker-monitor")
        self._monitor.start()

    @property
    def pids(self) -> dict[int, int]:
        """rank -> process id of each worker."""
        return {rank: p.pid for rank, p in self._procs.items()}

    @property
    def error(self) -> WorkerDiedError | None:
        """The recorded death, if any (reading it does not count as delivering it)."""
        return self._error

    def join_process_group(self) -> None:
        """Rank 0's side of ``init_distributed``: ``init_distributed(0, tp_size, backend,
        init_method, timeout_s, check=self.check)``.

        Raises:
            WorkerDiedError: a worker died before every worker had connected.
            TimeoutError, RuntimeError, ValueError: as ``init_distributed``.
        """
        init_distributed(0, self.tp_size, self.backend, self.init_method, self.timeout_s,
                         check=self.check)

    def _scan(self) -> WorkerDiedError | None:
        """Record (once) and return the death of the lowest dead rank, if any."""
        with self._lock:
            if self._error is None and not self._stopping.is_set():
                for rank, p in sorted(self._procs.items()):
                    if p.exitcode is not None:
                        self._error = WorkerDiedError(rank, p.pid, p.exitcode)
                        break
            return self._error

    def _raise(self) -> None:
        err = self._error
        if err is not None:
            self._delivered.set()
            raise WorkerDiedError(err.rank, err.pid, err.exitcode)

    def check(self) -> None:
        """Raise if a worker has exited before ``shutdown()``; cheap (no system call beyond a
        non-blocking ``waitpid`` per worker). Call it at least once per engine step.

        Raises:
            WorkerDiedError: naming the (lowest) dead rank, its pid and exit code; raised by
                every later call too.
        """
        self._scan()
        self._raise()

    @contextlib.contextmanager
    def guard(self, wait_s: float = 2.0) -> Iterator[None]:
        """Run a block of collectives, turning a failure caused by a dead worker into
        ``WorkerDiedError``.

        Calls ``check()`` before the block and again after it completes (a collective that
        NCCL's abort ended returns garbage without an error). If the block raises a
        ``RuntimeError`` (what failed collectives raise; ``WorkerDiedError`` itself
        excepted), waits up to ``wait_s`` seconds for a worker's death to show (a collective
        can fail a moment before the process is reaped) and raises ``WorkerDiedError`` from
        the original exception if one did; otherwise, and for every other exception, the
        original exception propagates.

        Raises:
            WorkerDiedError: a worker has died.
        """
        self.check()
        try:
            yield
        except WorkerDiedError:
            raise
        except RuntimeError as exc:
            deadline = time.monotonic() + wait_s
            while self._scan() is None and time.monotonic() < deadline:
                time.sleep(0.02)
            if self._error is not None:
                self._delivered.set()
                err = self._error
                raise WorkerDiedError(err.rank, err.pid, err.exitcode) from exc
            raise
        self.check()

    def broadcast(self, data: dict, device: torch.device | str | None = None) -> dict:
        """``broadcast_tensor_dict(data, src=0, device=device)`` inside ``guard()``.

        Raises:
            WorkerDiedError: a worker has died (before or during the broadcast).
            TypeError: as ``broadcast_tensor_dict`` (bad ``data``; nothing was sent).
            RuntimeError: another collective failure.
        """
        with self.guard():
            return broadcast_tensor_dict(data, src=0, device=device)

    def _watch(self) -> None:
        """Monitor thread: wait on the workers' sentinels; escalate on the first death."""
        sentinels = [p.sentinel for p in self._procs.values()]
        while not self._stopping.is_set():
            multiprocessing.connection.wait([*sentinels, self._wake_r], timeout=1.0)
            if self._stopping.is_set():
                return
            err = self._scan()
            if err is not None:
                self._escalate(err)
                return

    def _escalate(self, err: WorkerDiedError) -> None:
        """Monitor thread, after a death: steps 1-4 of the module docstring. Returns at
        once after step 3 unless ``exit_when_stuck`` opted in."""
        logger.error("%s; stopping the other workers", err)
        if self.on_failure is not None:
            try:
                self.on_failure(err)
            except Exception:
                logger.exception("on_failure callback raised")
        others = {r: p for r, p in self._procs.items() if p.exitcode is None}
        if others:
            _reap(others, threading.Event(), 0.0)
        if self.backend == "nccl":
            abort_process_groups()
        after_s = _stuck_exit_after_s
        if after_s is None or self._wait_delivered(after_s):
            return
        logger.critical("rank 0 did not react to the death of worker rank %d within %.1f s; "
                        "sending SIGTERM to itself (pid %d, exit_when_stuck)", err.rank,
                        after_s, os.getpid())
        os.kill(os.getpid(), signal.SIGTERM)
        if self._wait_delivered(after_s):
            return
        logger.critical("rank 0 is still stuck %.1f s after SIGTERM; exiting with status %d",
                        after_s, HARD_EXIT_CODE)
        remove_files(os.getpid())        # os._exit runs no finalizer of the shared files
        logging.shutdown()
        os._exit(HARD_EXIT_CODE)

    def _wait_delivered(self, seconds: float) -> bool:
        """Wait up to ``seconds`` for the error to be delivered or the group shut down."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self._delivered.wait(0.05) or self._stopping.is_set():
                return True
        return self._delivered.is_set() or self._stopping.is_set()

    def shutdown(self, timeout: float = 10.0) -> dict[int, int | None]:
        """Stop the workers: wait up to ``timeout`` seconds for them to exit on their own,
        then SIGTERM, then (2 s later) SIGKILL what is left. Idempotent; never raises for a
        dead worker.

        The polite part is the caller's: before this, rank 0 broadcasts its own stop message
        (while ``check()`` passes) so the workers' targets return. Afterwards rank 0 destroys
        its process group (``torch.distributed.destroy_process_group()``).

        Returns:
            rank -> exit code of each worker (negative: killed by that signal).
        """
        self._stopping.set()
        self._delivered.set()
        if self._wake_w >= 0:
            with contextlib.suppress(OSError):
                os.write(self._wake_w, b"x")
        if self._monitor.is_alive() and self._monitor is not threading.current_thread():
            self._monitor.join(5.0)
        codes = _reap(self._procs, self._stopping, timeout)
        self._finalizer.detach()
        if not self._monitor.is_alive():
            self._close_wake()
        return codes

    def _close_wake(self) -> None:
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._wake_r = self._wake_w = -1

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
