"""Open an adapter's files without blocking on what is not a regular file.

``open()`` of a FIFO blocks until a writer appears, and a read of a character device may
never end; an adapter directory is untrusted input, so every file of it is opened here:
``os.stat`` first (which never blocks), then ``open`` with ``O_NONBLOCK`` and an ``fstat``
of the descriptor (the file may have been swapped between the two). Messages name a file
relative to its adapter directory, never by a server path.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import BinaryIO

from manylora.lora.adapter import LoRAAdapterError

#: The largest ``adapter_config.json`` read (bytes); PEFT writes a few hundred.
MAX_CONFIG_BYTES = 1 << 20

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"))


def _kind(mode: int) -> str:
    return next((what for test, what in _KINDS if test(mode)), "not a regular file")


def is_present(path: Path) -> bool:
    """Whether anything (of any kind, a dangling symlink excepted) is at ``path``; never
    blocks, never raises."""
    try:
        os.stat(path)
    except (OSError, ValueError):
        return False
    return True


def _os_error(e: OSError, what: str) -> LoRAAdapterError:
    if e.errno == errno.ELOOP:
        return LoRAAdapterError(f"{what} is a symlink loop")
    if e.errno == errno.ENAMETOOLONG:
        return LoRAAdapterError(f"{what}: the path is too long")
    return LoRAAdapterError(f"cannot read {what}: {e.strerror or e}")


def open_regular(path: str | os.PathLike, what: str) -> BinaryIO:
    """Open ``path`` for reading if it is a regular file (after following symlinks).

    Args:
        path: the file.
        what: how messages name it, e.g. ``"adapter 'x': adapter_config.json"``.

    Returns:
        A binary file object (blocking mode again, at offset 0); the caller closes it.

    Raises:
        FileNotFoundError: nothing is there.
        LoRAAdapterError: it is a directory, a FIFO, a socket or a device (refused without
            opening it), a symlink loop, or cannot be opened.
    """
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} is missing") from None
    except OSError as e:
        raise _os_error(e, what) from None
    if not stat.S_ISREG(st.st_mode):
        raise LoRAAdapterError(f"{what} is {_kind(st.st_mode)}, not a regular file")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} is missing") from None
    except OSError as e:
        raise _os_error(e, what) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise LoRAAdapterError(f"{what} is {_kind(st.st_mode)}, not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: str | os.PathLike, what: str, max_bytes: int | None = None) -> bytes:
    """The bytes of a regular file (``open_regular``), refusing one over ``max_bytes``.

    Raises:
        FileNotFoundError, LoRAAdapterError: as ``open_regular``; a file over
            ``max_bytes``, or an I/O error while reading.
    """
    with open_regular(path, what) as f:
        try:
            data = f.read() if max_bytes is None else f.read(max_bytes + 1)
        except OSError as e:
            raise _os_error(e, what) from None
    if max_bytes is not None and len(data) > max_bytes:
        raise LoRAAdapterError(f"{what} is larger than {max_bytes} bytes")
    return data
