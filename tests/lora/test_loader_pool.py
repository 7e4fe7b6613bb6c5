"""``LoaderPool``: a read past its deadline fails alone with ``LoRALoadTimeoutError`` and
its stuck worker is replaced, so later reads still run; the bound runs from a read's start
(reads queued behind slow ones wait their turn) and from each progress it reports (a read
that works on outlives it); reads queued behind workers that are all
stuck, with none to replace them, fail at once; results of written-off reads are dropped.
The stuck read is an event the test holds, so no assertion depends on how fast the machine
is."""

from __future__ import annotations

import threading
import time

import pytest

from manylora.lora.adapter import LoRAAdapterError, LoRALoadTimeoutError
from manylora.lora.loader_pool import LoaderPool, outside_timeout, report_progress


def _blocked(release: threading.Event, started: threading.Event | None = None) -> str:
    if started is not None:
        started.set()
    release.wait()
    return "late"


def test_stuck_read_times_out_alone_and_its_worker_is_replaced():
    pool = LoaderPool(1, timeout=0.3)
    release, started = threading.Event(), threading.Event()
    try:
        stuck = pool.submit(_blocked, release, started, what="adapter 'slow'")
        assert started.wait(30)
        with pytest.raises(LoRALoadTimeoutError,
                           match=r"adapter 'slow': its read made no progress for 0.3 s"):
            stuck.result(timeout=60)
        assert isinstance(stuck.exception(), LoRAAdapterError)
        assert pool.stuck == 1
        # the one worker is stuck, its replacement runs the next read
        assert pool.submit(lambda: "ok").result(timeout=60) == "ok"
    finally:
        release.set()
    assert pool.submit(lambda: "after").result(timeout=60) == "after"
    assert stuck.exception() is not None         # the late result was dropped
    pool.shutdown()


def test_reads_queued_behind_stuck_workers_time_out_too():
    pool = LoaderPool(1, timeout=0.3, max_abandoned=0)      # no replacement
    release = threading.Event()
    try:
        first = pool.submit(_blocked, release, what="adapter 'a'")
        queued = pool.submit(lambda: "never", what="adapter 'b'")
        with pytest.raises(LoRALoadTimeoutError, match="adapter 'a': its read"):
            first.result(timeout=60)
        with pytest.raises(LoRALoadTimeoutError,
                           match="adapter 'b': every adapter loader thread is stuck"):
            queued.result(timeout=60)
        assert pool.pending() == []
    finally:
        release.set()
    # the worker was not replaced: it came back and works on
    assert pool.submit(lambda: "ok").result(timeout=60) == "ok"
    assert pool.stuck == 0
    pool.shutdown()


def test_the_bound_runs_from_the_start_of_a_read_not_from_its_submission():
    """A read queued behind a slow one (slower than the bound in total, each read within
    it) still runs: the deadline starts when a worker takes it."""
    pool = LoaderPool(1, timeout=30)
    release, started = threading.Event(), threading.Event()
    first = pool.submit(_blocked, release, started, what="adapter 'a'")
    queued = pool.submit(lambda: "ran", what="adapter 'b'")
    assert started.wait(30)
    with pool._lock:                       # the queued read has no deadline yet
        assert [j.future for j in pool._deadlines] == [first]
    release.set()
    assert first.result(timeout=60) == "late"
    assert queued.result(timeout=60) == "ran"
    pool.shutdown()


def test_errors_and_results_pass_through_without_timeout():
    pool = LoaderPool(2, timeout=None)

    def fail():
        raise LoRAAdapterError("adapter 'x': bad")

    assert pool.submit(lambda: 7).result(timeout=60) == 7
    with pytest.raises(LoRAAdapterError, match="bad"):
        pool.submit(fail).result(timeout=60)
    pool.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        pool.submit(lambda: 1)


def test_a_read_that_works_on_outlives_the_bound():
    """A read that reports progress (``report_progress``, a module at a time) is not failed
    however long it takes in all, as one starved of the GIL by the engine's step loop; it
    fails once its reports stop for the bound. The watchdog renews its deadline twice
    (seen in the pool), so the read ran past two bounds; reports come every 10 ms against
    a 1 s bound."""
    pool = LoaderPool(1, timeout=1.0)
    stop_reporting, stopped = threading.Event(), threading.Event()

    def working(renewals_wanted: int) -> str:
        me = threading.current_thread()
        seen: set[float] = set()
        while len(seen) <= renewals_wanted:
            report_progress()
            with pool._lock:
                seen.add(pool._running[me].deadline)
            time.sleep(0.01)
        return "done"

    assert pool.submit(working, 2, what="adapter 'slow'").result(timeout=120) == "done"
    assert pool.stuck == 0

    def works_then_hangs() -> str:
        working(1)
        stop_reporting.wait(120)
        stopped.set()
        return "late"

    hung = pool.submit(works_then_hangs, what="adapter 'hung'")
    with pytest.raises(LoRALoadTimeoutError, match="adapter 'hung': its read made no progress"):
        hung.result(timeout=120)
    stop_reporting.set()
    assert stopped.wait(60)
    report_progress()                    # outside a loader thread: nothing
    pool.shutdown()


def test_work_outside_the_timeout_outlives_the_bound_and_the_bound_returns_after_it():
    pool = LoaderPool(1, timeout=0.3)
    release, inside, after = threading.Event(), threading.Event(), threading.Event()

    def read(hang_after: bool) -> str:
        with outside_timeout():             # e.g. a page-locked allocation on a busy GPU
            inside.set()
            release.wait()
        after.set()
        if hang_after:                      # stuck in the store again: the bound applies
            threading.Event().wait()
        return "pinned"

    try:
        slow = pool.submit(read, False, what="adapter 'slow-pin'")
        assert inside.wait(30)
        # several bounds pass while the read is inside the block; the watchdog keeps it
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            assert not slow.done()
            time.sleep(0.05)
        release.set()
        assert slow.result(timeout=60) == "pinned"
        inside.clear()
        after.clear()
        release.clear()
        stuck = pool.submit(read, True, what="adapter 'stuck-after'")
        assert inside.wait(30)
        release.set()
        assert after.wait(30)
        with pytest.raises(LoRALoadTimeoutError, match="adapter 'stuck-after': its read"):
            stuck.result(timeout=60)
    finally:
        release.set()
        pool.shutdown()


def test_outside_timeout_is_a_no_op_off_a_loader_thread():
    with outside_timeout():
        pass
