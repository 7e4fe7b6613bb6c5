"""The default ``torch.distributed`` process group of the tensor-parallel ranks: joining it,
ending start-up, and destroying it without hanging.

Two bounds: the *start-up* timeout covers the rendezvous, the process group's creation and
every collective until start-up is over (ranks spawn, import and load their shards at
different speeds); then every rank calls ``end_startup``, which waits for all of them and
bounds every later collective by the (shorter) *collective* timeout.

Under NCCL rank 0 creates its process group with ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` (unless
the variable is set): a collective that times out aborts the communicators and raises in the
engine instead of tearing the process down (NCCL's default).
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

#: Start-up timeout (seconds) when none is given: how long the rendezvous, the process
#: group's creation and any collective before ``end_startup`` may wait. Ranks spawn, import
#: torch and load their shards at different speeds, on a loaded machine too.
DEFAULT_STARTUP_TIMEOUT_S = 600.0

#: Collective timeout (seconds) when none is given: how long any collective after
#: ``end_startup`` may wait before raising; far below torch's 30-minute default.
DEFAULT_TIMEOUT_S = 300.0

# The store key every worker increments once it has reached the rendezvous.
_ARRIVED_KEY = "manylora/tp_workers_arrived"


def free_init_method(host: str = "127.0.0.1") -> str:
    """A ``tcp://host:port`` rendezvous address with a port that was free a moment ago.

    The port is found by binding to port 0 and closing the socket, so another process could
    take it before rank 0 listens on it (rare; ``init_distributed`` then fails on rank 0).
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port = s.getsockname()[1]
    return f"tcp://{host}:{port}"


def _parse_tcp(init_method: str) -> tuple[str, int]:
    """``(host, port)`` of a ``tcp://host:port`` address; ValueError for anything else."""
    parts = urlsplit(init_method)
    if parts.scheme != "tcp" or not parts.hostname or parts.port is None:
        raise ValueError(f"init_method must be tcp://host:port, got {init_method!r}")
    return parts.hostname, parts.port


def init_distributed(rank: int, tp_size: int, backend: str, init_method: str,
                     timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S, *,
                     check: Callable[[], None] | None = None) -> None:
    """Join the default ``torch.distributed`` process group as ``rank`` of ``tp_size``.

    Rank 0 hosts the rendezvous (a ``TCPStore`` listening on ``init_method``'s port) and waits
    until the ``tp_size - 1`` workers have connected, calling ``check`` about every 20 ms
    while it waits; then every rank calls ``init_process_group`` on that store with
    ``timeout_s`` as the process-group timeout, which bounds every collective until
    ``end_startup`` replaces it with the collective timeout. Under NCCL the rank's CUDA device
    is set to ``cuda:rank`` first (one host: the local rank is the rank), and rank 0 sets
    ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` unless it is set (see the module docstring).

    Args:
        rank: this process's rank, ``[0, tp_size)``.
        tp_size: the number of ranks.
        backend: ``"nccl"`` or ``"gloo"``.
        init_method: ``tcp://host:port`` (see ``free_init_method``), the same on every rank.
        timeout_s: the start-up timeout: seconds the rendezvous, and any collective before
            ``end_startup``, may wait before raising.
        check: on rank 0, polled while waiting for the workers (``WorkerGroup.check``);
            whatever it raises propagates. Ignored on other ranks.

    Raises:
        ValueError: ``init_method`` is not ``tcp://host:port``, or ``rank`` is outside
            ``[0, tp_size)``.
        TimeoutError: on rank 0, not every worker connected within ``timeout_s``.
        RuntimeError: ``torch.distributed`` is already initialized in this process, or the
            rendezvous / process-group creation failed (address in use, a peer vanished, a
            worker timed out connecting).
    """
    if not 0 <= rank < tp_size:
        raise ValueError(f"rank {rank} is outside [0, {tp_size})")
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialized in this process")
    host, port = _parse_tcp(init_method)
    if backend == "nccl":
        torch.cuda.set_device(rank)
        if rank == 0:
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    timeout = datetime.timedelta(seconds=timeout_s)
    if rank == 0:
        store = dist.TCPStore(host, port, tp_size, is_master=True, timeout=timeout,
                              wait_for_workers=False)
        deadline = time.monotonic() + timeout_s
        while (arrived := store.add(_ARRIVED_KEY, 0)) < tp_size - 1:
            if check is not None:
                check()
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {arrived} of {tp_size - 1} tensor-parallel workers "
                                   f"reached {init_method} within {timeout_s} s")
            time.sleep(0.02)
    else:
        store = dist.TCPStore(host, port, tp_size, is_master=False, timeout=timeout)
        store.add(_ARRIVED_KEY, 1)
    dist.init_process_group(backend, store=store, rank=rank, world_size=tp_size,
                            timeout=timeout)


def end_startup(device: torch.device | str, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Every rank, once its start-up is over (shard loaded, KV cache allocated; the TP
    engine calls it on the ``"kv"`` message): wait, under the start-up timeout, until every
    rank has got here (a one-element all-reduce on ``device``, synchronized to the host),
    then bound every later collective of the default process group by ``timeout_s``
    seconds. So a short collective timeout never races a slow start.

    Raises:
        RuntimeError: ``torch.distributed`` is not initialized, or the all-reduce failed
            (a rank died or did not arrive within the start-up timeout).
    """
    if not dist.is_initialized():
        raise RuntimeError("end_startup needs an initialized process group")
    flag = torch.ones(1, device=device)
    dist.all_reduce(flag)
    flag.item()
    # torch's setter of a live group's timeout (gloo and NCCL); private, present since 2.3
    dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=timeout_s))


def destroy_process_group_within(timeout_s: float) -> None:
    """Destroy this process's default process group, giving up after ``timeout_s`` seconds:
    then the communicators are aborted instead (NCCL's finalisation can wait forever, e.g.
    on a CUDA graph that still holds a captured collective), so shutdown never hangs."""
    if not dist.is_initialized():
        return
    done = threading.Event()

    def destroy() -> None:
        try:
            dist.destroy_process_group()
        except Exception:
            logger.exception("destroying the process group failed")
        done.set()

    threading.Thread(target=destroy, name="destroy-process-group", daemon=True).start()
    if not done.wait(timeout_s):
        logger.error("destroy_process_group did not finish within %.0f s; aborting the "
                     "process group instead", timeout_s)
        abort_process_groups()


def abort_process_groups() -> None:
    """Abort the communicators of every process group of this process (monitor thread, NCCL
    only): a collective waiting on a dead peer ends, and later ones raise."""
    if not dist.is_initialized():
        return
    world = getattr(dist.distributed_c10d, "_world", None)
    groups = list(getattr(world, "pg_map", {}) or {}) or [dist.group.WORLD]
    for pg in groups:
        try:
            pg.abort()
        except Exception:
            logger.exception("aborting a process group failed")
