"""Host buffers in named shared memory, which every tensor-parallel rank maps by name.

Under tensor parallelism the host cache's pinned adapters (``manylora.lora.pinned``) are
written once, by rank 0's loader thread, into files of ``/dev/shm``; a slot-load message
carries only the file's name and the adapter's small plan, and each rank maps the file and
copies its own part to its GPU (no broadcast of the adapter's tensors). On CUDA each
mapping is page-locked in place (``cudaHostRegister``) so that its host → device copies
run asynchronously, as from ``pin_memory`` tensors.

Lifetimes: rank 0 unlinks a file when its last tensor is freed (the host cache dropped the
adapter and no copy of it is in flight). A rank that has already mapped the file keeps its
pages until it drops the mapping (``SharedHostCache``, bounded like the host cache), so
rank 0 must keep each adapter it sent alive until every rank has opened it: the ranks
report the last slot message they handled in a shared ``int64`` array (``Acks``).

Every file of an engine is named ``manylora-<pid of rank 0>-...``. A process that ends by
``os._exit`` (the engine core's process, always) runs no finalizer, and a killed one runs
nothing: ``remove_files(pid)`` unlinks what is left, called by the core process before its
``os._exit`` and by the front after the core process ended (before it is reaped, so that
its pid cannot name another process yet).
"""

from __future__ import annotations

import itertools
import logging
import os
import secrets
import tempfile
import weakref
from collections import OrderedDict
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SHM = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())


def _register(t: torch.Tensor) -> bool:
    """Page-lock ``t``'s memory in place on CUDA hosts; whether it is now pinned."""
    if not torch.cuda.is_available() or t.numel() == 0:
        return False
    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel(), 0)
    if int(err) != 0:
        logger.warning("cudaHostRegister of %d bytes failed (%s): copies from shared "
                       "memory will be synchronous", t.numel(), err)
        return False
    return True


def _unregister(ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)


def _map(path: Path, nbytes: int) -> torch.Tensor:
    return torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)


def _release(path: Path, ptr: int, pinned: bool) -> None:
    if pinned:
        _unregister(ptr)
    path.unlink(missing_ok=True)


def file_prefix(pid: int) -> str:
    """The name prefix of the shared files of the engine whose rank 0 is process ``pid``."""
    return f"manylora-{pid}-"


def remove_files(pid: int) -> int:
    """Unlink every shared file of the engine whose rank 0 is (or was) process ``pid``; the
    ranks' existing mappings stay valid. Returns how many were removed; never raises."""
    removed = 0
    try:
        paths = list(_SHM.glob(file_prefix(pid) + "*"))
    except OSError:
        return 0
    for path in paths:
        try:
            path.unlink()
            removed += 1
        except OSError:
            pass
    return removed


class SharedHostBuffers:
    """Rank 0's allocator of shared host buffers (``LoRAManager.host_alloc`` under tensor
    parallelism).

    Attributes:
        prefix: the name prefix of this engine's files.
    """

    def __init__(self) -> None:
        self.prefix = file_prefix(os.getpid()) + secrets.token_hex(4)
        self._count = itertools.count()
        self._names: weakref.WeakValueDictionary[str, torch.Tensor] = (
            weakref.WeakValueDictionary())

    def alloc(self, nbytes: int) -> torch.Tensor:
        """A new uint8 ``[nbytes]`` tensor backed by a file of its own in ``/dev/shm``
        (page-locked on CUDA hosts), unlinked when the tensor is freed.

        Raises:
            OSError: the file cannot be created (shared memory full).
        """
        name = f"{self.prefix}-{next(self._count)}"
        path = _SHM / name
        with open(path, "wb") as f:
            f.truncate(nbytes)
        try:
            t = _map(path, nbytes)
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        weakref.finalize(t, _release, path, t.data_ptr(), _register(t))
        self._names[name] = t
        return t

    def name_of(self, t: torch.Tensor) -> str:
        """The file name of a buffer ``alloc`` returned.

        Raises:
            KeyError: ``t`` is not one of this allocator's live buffers.
        """
        for name, buf in self._names.items():
            if buf is t:
                return name
        raise KeyError("not a shared host buffer of this engine")


class SharedHostCache:
    """A worker rank's mappings of rank 0's shared buffers, least recently used dropped first.

    Args:
        capacity: mappings kept (the host cache's ``max_cpu_loras``).
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self._maps: OrderedDict[str, tuple[torch.Tensor, bool, object]] = OrderedDict()

    def get(self, name: str, nbytes: int) -> tuple[torch.Tensor, object | None]:
        """The mapping of file ``name`` (``nbytes`` long), mapped now if new, and the value
        ``put`` stored with it (None if none).

        Raises:
            FileNotFoundError: no such file of that size (rank 0 freed it before this rank
                mapped it).
        """
        hit = self._maps.get(name)
        if hit is not None:
            self._maps.move_to_end(name)
            return hit[0], hit[2]
        path = _SHM / name
        if not path.is_file() or path.stat().st_size != nbytes:
            raise FileNotFoundError(f"shared adapter buffer {path} ({nbytes} bytes) is gone: "
                                    "rank 0 freed it before this rank mapped it")
        t = _map(path, nbytes)
        self._maps[name] = (t, _register(t), None)
        while len(self._maps) > self.capacity:
            _, (old, pinned, _) = self._maps.popitem(last=False)
            if pinned:
                torch.cuda.synchronize()       # no copy from it may be in flight
                _unregister(old.data_ptr())
        return t, None

    def put(self, name: str, value: object) -> None:
        """Keep ``value`` (e.g. this rank's scatter descriptors) with mapping ``name``."""
        t, pinned, _ = self._maps[name]
        self._maps[name] = (t, pinned, value)


class Acks:
    """Per rank, the sequence number of the last slot message it handled, in shared memory.

    Args:
        name: the file (created by rank 0, ``create=True``; mapped by the others).
        size: ranks in the group.
    """

    def __init__(self, name: str, size: int, create: bool = False) -> None:
        path = _SHM / name
        if create:
            with open(path, "wb") as f:
                f.truncate(8 * size)
            weakref.finalize(self, path.unlink, missing_ok=True)
        self.name = name
        self.values = torch.from_file(str(path), shared=True, size=size, dtype=torch.int64)

    def handled(self) -> int:
        """The last slot message every rank other than 0 has handled."""
        return int(self.values[1:].min()) if self.values.numel() > 1 else 1 << 62
