"""What a spawned tensor-parallel worker process runs around its target (``WorkerGroup``'s
workers): SIGINT ignored, a watch that ends the process once rank 0 is gone, and an end by
``os._exit`` that never tears its process group down."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

# Seconds a worker's parent watch sleeps between looks at os.getppid().
_PARENT_POLL_S = 0.5


def _watch_parent(parent_pid: int) -> None:
    """Worker side: end this process (``os._exit(1)``) once its parent is no longer
    ``parent_pid`` (rank 0 died and the worker was re-parented)."""
    while os.getppid() == parent_pid:
        time.sleep(_PARENT_POLL_S)
    logger.error("tensor-parallel worker (pid %d): rank 0 (pid %d) is gone; exiting",
                 os.getpid(), parent_pid)
    os._exit(1)


def worker_entry(target: Callable[..., Any], rank: int, tp_size: int, init_method: str,
                 parent_pid: int, args: tuple) -> None:
    """What a spawned worker runs: ignore SIGINT, watch the parent, call ``target``, then end
    the process with ``os._exit`` (0 when ``target`` returned, 1 when it raised, after
    printing the traceback; ``SystemExit``'s code when it exited).

    The worker never destroys its process group: under NCCL, ``destroy_process_group`` on a
    worker waits for rank 0 to destroy its own (seen on two H200s: a worker's destroy did not
    return in 15 s while rank 0 waited for it to exit), and an interpreter's normal exit would
    run that teardown. Ending with ``os._exit`` skips it, and the worker's ``atexit`` handlers
    with it; rank 0 destroys its own process group after ``WorkerGroup.shutdown``.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True,
                     name="manylora-parent-watch").start()
    code = 0
    try:
        target(rank, tp_size, init_method, *args)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
    os._exit(code)
