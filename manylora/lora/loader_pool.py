"""Loader threads for adapter reads, each failed when it stops making progress.

A read stuck in the kernel (a hung network filesystem, a device) cannot be killed. So a
read that has made no progress for ``timeout`` seconds fails: the read reports progress
(``report_progress``, e.g. after each module it read) and a watchdog fails its future with
``LoRALoadTimeoutError`` once ``timeout`` seconds pass since its start or its last report
(time in the queue does not count: a burst of registrations, e.g. hundreds of
``--lora-modules``, waits its turn; nor does a read that works on but slowly, as one
starved of the GIL or the CPU by the engine's step loop right after start-up is; nor does
work a read marks ``outside_timeout``, such as the page-locked allocation of its packed
buffer, which waits on the CUDA driver rather than on the adapter store), its
caller moves on at once, and the worker stuck in it is written off and replaced, so the
pool keeps its full number of working threads. Workers are daemon threads (a stuck one
never holds the process at exit); at most ``max_abandoned`` stuck workers are replaced at
a time, which bounds the threads a hostile adapter store can leak. When every worker is
stuck and none may be replaced, the queued reads fail at once instead of waiting behind
them. A replaced worker that comes back from its read drops the result and exits; one
that was not replaced drops it and works on.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from manylora.lora.adapter import LoRALoadTimeoutError


@dataclass(order=True)
class _Job:
    deadline: float
    seq: int
    future: Future = field(compare=False)
    fn: Callable[..., Any] = field(compare=False)
    args: tuple = field(compare=False)
    what: str = field(compare=False)
    started: float = field(compare=False)
    progress: float = field(compare=False, default=0.0)    # its last report (monotonic)


_current = threading.local()


def report_progress() -> None:
    """Tell the pool that the read running on this thread is making progress (its
    ``timeout`` starts again); nothing outside a loader thread. Cheap: call it after each
    unit of work (a module read and checked)."""
    job = getattr(_current, "job", None)
    if job is not None:
        job.progress = time.monotonic()


@contextlib.contextmanager
def outside_timeout() -> Iterator[None]:
    """Run the block outside the current read's ``timeout`` (nothing outside a loader
    thread): for work that is slow for reasons other than the adapter store, such as a
    page-locked allocation (``cudaHostAlloc``) that waits behind the engine's own driver
    calls for tens of seconds on a busy device. The bound starts again when the block
    ends."""
    job = getattr(_current, "job", None)
    if job is None:
        yield
        return
    job.progress = math.inf
    try:
        yield
    finally:
        job.progress = time.monotonic()


class LoaderPool:
    """Worker threads that run reads, each failed once it has made no progress for
    ``timeout`` seconds.

    Args:
        workers: working threads (``loader_threads``).
        timeout: seconds a read may go without progress (``report_progress``), counted
            from its start on a worker; None: no bound.
        max_abandoned: stuck workers replaced at most (see the module docstring).
        name: the threads' name prefix.
    """

    def __init__(self, workers: int, timeout: float | None, max_abandoned: int = 16,
                 name: str = "lora-loader") -> None:
        self.timeout = timeout
        self.max_abandoned = max_abandoned
        self.name = name
        self._lock = threading.Condition()
        self._queue: deque[_Job] = deque()
        self._deadlines: list[_Job] = []          # heap of unfinished jobs by deadline
        self._seq = itertools.count()
        self._threads = itertools.count()
        self._stuck: set[threading.Thread] = set()      # inside a read that timed out
        self._replaced: set[threading.Thread] = set()   # of those, the ones replaced
        self._running: dict[threading.Thread, _Job] = {}
        self._alive: set[threading.Thread] = set()      # started, not exited
        self._stopped = False
        for _ in range(workers):
            self._start_worker()
        if timeout is not None:
            threading.Thread(target=self._watch, name=f"{name}-watchdog", daemon=True).start()

    # ------------------------------------------------------------------ the caller's side

    def submit(self, fn: Callable[..., Any], *args: Any, what: str = "adapter read") -> Future:
        """Run ``fn(*args)`` on a worker; its future, failed with ``LoRALoadTimeoutError``
        (naming ``what`` and the bound) if it goes ``timeout`` seconds without progress
        from its start on, or if every worker is stuck and none may be replaced.

        Raises:
            RuntimeError: the pool was shut down.
        """
        future: Future = Future()
        job = _Job(float("inf"), next(self._seq), future, fn, args, what, time.monotonic())
        with self._lock:
            if self._stopped:
                raise RuntimeError("the adapter loader threads were shut down")
            self._queue.append(job)
            self._lock.notify_all()
        return future

    @property
    def stuck(self) -> int:
        """Workers written off while still inside a read that timed out."""
        with self._lock:
            return len(self._stuck)

    def pending(self) -> list[float]:
        """The submission times (``time.monotonic()``) of the reads not ended yet (neither
        finished nor timed out)."""
        with self._lock:
            return [j.started for j in self._queue] + [j.started for j in self._running.values()]

    def shutdown(self) -> None:
        """Stop taking reads; queued ones are cancelled, running ones end on their own."""
        with self._lock:
            self._stopped = True
            for job in self._queue:
                job.future.cancel()
            self._queue.clear()
            self._lock.notify_all()

    # ------------------------------------------------------------------ threads

    def _start_worker(self) -> None:
        thread = threading.Thread(target=self._work, name=f"{self.name}_{next(self._threads)}",
                                  daemon=True)
        self._alive.add(thread)
        thread.start()

    def _work(self) -> None:
        me = threading.current_thread()
        while True:
            with self._lock:
                while not self._queue and not self._stopped:
                    self._lock.wait()
                if self._stopped:
                    self._alive.discard(me)
                    return
                job = self._queue.popleft()
                if job.future.done() or not job.future.set_running_or_notify_cancel():
                    continue                   # failed (or cancelled) while queued
                self._running[me] = job
                job.progress = time.monotonic()
                if self.timeout is not None:
                    job.deadline = job.progress + self.timeout
                    heapq.heappush(self._deadlines, job)
                    self._lock.notify_all()
            _current.job = job
            try:
                result, error = job.fn(*job.args), None
            except BaseException as e:     # the caller gets whatever the read raised
                result, error = None, e
            finally:
                _current.job = None
            with self._lock:
                self._running.pop(me, None)
                self._stuck.discard(me)
                if me in self._replaced:       # replaced already: drop the result, exit
                    self._replaced.discard(me)
                    self._alive.discard(me)
                    return
                if not job.future.done():
                    if error is None:
                        job.future.set_result(result)
                    else:
                        job.future.set_exception(error)

    def _watch(self) -> None:
        while True:
            with self._lock:
                while self._deadlines and self._deadlines[0].future.done():
                    heapq.heappop(self._deadlines)
                if self._stopped and not self._running:
                    return
                wait = (self._deadlines[0].deadline - time.monotonic()
                        if self._deadlines else None)
                if wait is None or wait > 0:
                    self._lock.wait(wait if wait is None else min(wait, 1.0))
                    continue
                job = heapq.heappop(self._deadlines)
                now = time.monotonic()
                renewed = job.progress + self.timeout
                if renewed > now:                      # progress since, or outside_timeout
                    job.deadline = min(renewed, now + self.timeout)
                    heapq.heappush(self._deadlines, job)
                    continue
                self._expire(job)

    def _expire(self, job: _Job) -> None:
        """Fail a job past its deadline; write off and replace its worker (lock held)."""
        if job.future.done():
            return
        worker = next((t for t, j in self._running.items() if j is job), None)
        if worker is None:                     # ended meanwhile
            return
        del self._running[worker]
        self._stuck.add(worker)
        if len(self._replaced) < self.max_abandoned:
            self._replaced.add(worker)
            self._start_worker()
        job.future.set_exception(LoRALoadTimeoutError(
            f"{job.what}: its read made no progress for {self.timeout:g} s "
            "(lora_load_timeout)"))
        if self._alive <= self._stuck:         # no worker left to run the queued reads
            for queued in self._queue:
                queued.future.set_exception(LoRALoadTimeoutError(
                    f"{queued.what}: every adapter loader thread is stuck in a read that "
                    f"did not finish within {self.timeout:g} s (lora_load_timeout)"))
            self._queue.clear()
