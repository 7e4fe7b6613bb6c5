"""TensorRT-LLM's LoRA files: ``model.lora_weights.npy`` and ``model.lora_config.npy``, as
its ``examples/hf_lora_convert.py`` writes them, read with bounded work and written.

Each file's ``.npy`` header is checked against the file's size before its data is read;
bfloat16 weights are numpy's 2-byte void dtype (``'|V2'``), as TensorRT-LLM writes them.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from manylora.lora.adapter import LoRAAdapterError
from manylora.lora.formats.files import open_regular
from manylora.lora.formats.target import AdapterTarget
from manylora.lora.formats.trtllm_modules import (
    LoraModuleType,
    max_rows,
    row_values,
    trtllm_parts,
)
from manylora.lora.loader_pool import report_progress

WEIGHTS_FILE = "model.lora_weights.npy"


CONFIG_FILE = "model.lora_config.npy"


_BF16_NUMPY = np.dtype("V2")


def read_trtllm_dir(path: str | os.PathLike, name: str | None = None,
                    target: AdapterTarget | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Read TensorRT-LLM's ``model.lora_weights.npy`` and ``model.lora_config.npy``.

    Each file's ``.npy`` header is checked against the file's size before its data is read
    (``np.load`` allocates what a header declares). With ``target``, the config is read
    first and of each weights row only the prefix its config row uses (``D x Hi + Ho x D``,
    ``+ Ho`` for DoRA) is read: rows padded to a large width cost what they hold.

    Args:
        path: the directory holding both files.
        name: the adapter's name, for error messages (default: the path).
        target: the base model the rows are for; None: every row is read whole.

    Returns:
        ``(weights, config)`` as CPU torch tensors, shapes as stored (usually ``[1, N, W]``
        and ``[1, N, 3|4]``; with ``target``, weights ``[N, w]``, ``w`` the widest prefix
        used); ``'|V2'`` weights come back as bfloat16.

    Raises:
        LoRAAdapterError: a missing or unreadable file, one that is not a regular file
            (refused without blocking), a header that declares more data than the file
            holds, an array of Python objects, or a file that changed while it was read.
    """
    path = Path(path)
    who = name if name is not None else str(path)
    out = {}
    for fname in (CONFIG_FILE, WEIGHTS_FILE):
        what = f"adapter {who!r}: {fname}"
        try:
            with open_regular(path / fname, what) as f:
                header = _NpyHeader.read(f, what)
                if fname == WEIGHTS_FILE and target is not None:
                    array = header.read_prefixes(f, _row_needs(out[CONFIG_FILE], target))
                else:
                    array = header.read_all(f)
        except FileNotFoundError:
            raise LoRAAdapterError(f"{what} is missing (TensorRT-LLM's LoRA format needs "
                                   f"{WEIGHTS_FILE} and {CONFIG_FILE})") from None
        except (OSError, ValueError, EOFError) as e:
            if isinstance(e, LoRAAdapterError):
                raise
            raise LoRAAdapterError(f"adapter {who!r}: cannot read {fname}: {e}") from None
        out[fname] = as_tensor(array, fname, who)
    return out[WEIGHTS_FILE], out[CONFIG_FILE]


def write_trtllm_dir(path: str | os.PathLike, weights: Any, config: Any) -> Path:
    """Write ``model.lora_weights.npy`` and ``model.lora_config.npy`` as TensorRT-LLM's
    ``hf_lora_convert.py`` does: weights ``[1, N, W]`` in their dtype (bfloat16 as numpy
    ``'|V2'``), config ``[1, N, 3|4]`` int32.

    Args:
        path: the directory (created if missing).
        weights, config: ``[N, ...]`` or ``[1, N, ...]``, torch or numpy.

    Returns:
        ``Path(path)``.

    Raises:
        ValueError: weights and config that are not 2-D or 3-D with a batch of 1.
    """
    out = Path(path)
    arrays = {}
    for fname, t in ((WEIGHTS_FILE, _to_numpy(weights)), (CONFIG_FILE, _to_numpy(config))):
        if t.ndim == 2:
            t = t[None]
        if t.ndim != 3 or t.shape[0] != 1:
            raise ValueError(f"{fname}: shape {list(t.shape)} is not [N, X] or [1, N, X]")
        arrays[fname] = t
    arrays[CONFIG_FILE] = arrays[CONFIG_FILE].astype(np.int32)
    out.mkdir(parents=True, exist_ok=True)
    for fname, t in arrays.items():
        np.save(out / fname, np.ascontiguousarray(t), allow_pickle=False)
    return out


def _row_needs(config: torch.Tensor, target: AdapterTarget) -> list[int] | None:
    """Values of each weights row its config row uses (0 for a row the adapter will be
    refused for); None when the config's shape is not one ``adapter_from_trtllm`` takes or
    it has more rows than the model has (layer, module) pairs (nothing needs reading)."""
    if config.dim() == 3 and config.shape[0] == 1:
        config = config[0]
    if (config.dim() != 2 or config.shape[1] not in (3, 4) or config.dtype == torch.bool
            or config.is_complex()
            or config.shape[0] > max_rows(target)):
        return None
    if config.is_floating_point():
        if not bool((torch.isfinite(config) & (config == config.round())).all()):
            return None
        config = config.to(torch.int64)
    needs = []
    for values in config.tolist():
        try:
            parts = trtllm_parts(LoraModuleType(values[0]), values[1], target)
        except ValueError:
            parts = None
        rank = values[2]
        if parts is None or not 1 <= rank <= target.max_lora_rank:
            needs.append(0)
            continue
        ho = sum(target.module_shapes[p][1] for p in parts)
        needs.append(row_values(parts, rank, target)
                     + (ho if len(values) == 4 and values[3] == 1 else 0))
    return needs


@dataclass(frozen=True)
class _NpyHeader:
    """A ``.npy`` file's header, checked against the file's size."""

    shape: tuple[int, ...]
    fortran: bool
    dtype: np.dtype
    offset: int
    what: str

    @classmethod
    def read(cls, f, what: str) -> _NpyHeader:
        """Raises ``LoRAAdapterError``: not a ``.npy`` file of version 1 or 2, an object
        dtype (pickles are never loaded), or more data declared than the file holds."""
        size = os.fstat(f.fileno()).st_size
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
        elif version == (2, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
        else:
            raise LoRAAdapterError(f"{what}: .npy format version {version} is not read (only "
                                   "1.0 and 2.0, which np.save writes)")
        if dtype.hasobject:
            raise LoRAAdapterError(f"{what}: it holds Python objects, which are never "
                                   "unpickled")
        offset = f.tell()
        nbytes = math.prod(shape) * dtype.itemsize
        if offset + nbytes > size:
            raise LoRAAdapterError(f"{what}: its header declares a {dtype} array of shape "
                                   f"{list(shape)} ({nbytes} bytes), but the file holds "
                                   f"{size - offset} bytes of data")
        return cls(tuple(shape), fortran, dtype, offset, what)

    def _pread(self, f, at: int, into: np.ndarray) -> None:
        view, done = memoryview(into).cast("B"), 0
        while done < len(view):
            got = os.preadv(f.fileno(), [view[done:]], self.offset + at + done)
            if got == 0:
                raise LoRAAdapterError(f"{self.what}: the file ended within its data (it "
                                       "changed while it was read)")
            done += got

    def read_all(self, f) -> np.ndarray:
        """The whole array."""
        out = np.empty(self.shape, dtype=self.dtype, order="F" if self.fortran else "C")
        if out.size:
            self._pread(f, 0, out.reshape(-1, order="A"))
        return out

    def read_prefixes(self, f, needs: list[int] | None) -> np.ndarray:
        """``[N, w]``: of each row of a C-order ``[N, W]`` / ``[1, N, W]`` array its first
        ``w = min(max(needs), W)`` values; the whole array for any other layout, or
        ``[N, 0]`` when ``needs`` is None (the adapter is refused on shapes alone)."""
        shape = self.shape[1:] if len(self.shape) == 3 and self.shape[0] == 1 else self.shape
        if self.fortran or len(shape) != 2:
            return self.read_all(f)
        rows, width = shape
        if needs is None or len(needs) != rows:
            return np.empty((rows, 0), dtype=self.dtype)
        w = min(max(needs, default=0), width)
        out = np.empty((rows, w), dtype=self.dtype)
        if w:
            for i in range(rows):
                self._pread(f, i * width * self.dtype.itemsize, out[i])
                report_progress()
        return out


def as_tensor(x: Any, what: str, name: str) -> torch.Tensor:
    """A CPU torch view of a torch tensor or numpy array (numpy ``'|V2'`` read as bfloat16)."""
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if isinstance(x, np.ndarray):
        if not x.flags.writeable:  # torch.from_numpy warns on read-only arrays
            x = x.copy()
        if x.dtype.kind == "V" and x.dtype.itemsize == 2:
            return torch.from_numpy(np.ascontiguousarray(x).view(np.int16)).view(torch.bfloat16)
        if x.dtype.kind in "biuf":
            return torch.from_numpy(np.ascontiguousarray(x))
        raise LoRAAdapterError(f"adapter {name!r}: {what} has numpy dtype {x.dtype}, which "
                               "TensorRT-LLM's LoRA format does not use")
    raise LoRAAdapterError(f"adapter {name!r}: {what} must be a torch tensor or a numpy array, "
                           f"got {type(x).__name__}")


def _to_numpy(t: Any) -> np.ndarray:
    """torch or numpy → numpy; bfloat16 as TensorRT-LLM's ``'|V2'``."""
    if isinstance(t, np.ndarray):
        return t
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(_BF16_NUMPY)
    return t.numpy()
