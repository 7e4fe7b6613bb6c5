"""A PEFT adapter's weights file (``adapter_model.safetensors`` or ``adapter_model.bin``),
opened so that its structure is known before any tensor data is read.

A safetensors header is checked against the file's size and by safetensors' own
``safe_open`` before anything else; each tensor is then read with ``pread`` from the very
file checked (a file truncated while it is read is an error, not a SIGBUS through a
mapping). An ``adapter_model.bin`` is read whole with ``torch.load(weights_only=True)``, as
vLLM reads it.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import re
import struct
from collections.abc import Callable
from pathlib import Path

import torch

from manylora.lora.adapter import LoRAAdapterError, all_finite
from manylora.lora.formats.files import is_present, open_regular
from manylora.lora.loader_pool import report_progress

#: The largest safetensors header read (bytes); an adapter's lists its few hundred tensors in
#: some 100 KB (safetensors itself allows 100 MB).
MAX_HEADER_BYTES = 16 << 20


#: safetensors' dtype names → torch dtypes (the ones a tensor of an adapter may have; the
#: integer ones are read only to be refused by name).
_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64,
    "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


class PeftWeights:
    """The tensors of a PEFT adapter's weights file, their keys, dtypes and shapes known
    before any tensor is processed (from the safetensors header, before any data is read;
    an ``adapter_model.bin`` is read whole). A context manager that closes the file.

    Attributes:
        meta: ``{key: tensor on the meta device}``, each of the stored dtype and shape.
    """

    def __init__(self, meta: dict[str, torch.Tensor], read: Callable[[str], torch.Tensor],
                 stack: contextlib.ExitStack) -> None:
        self.meta, self._read, self._stack = meta, read, stack

    def read(self, key: str) -> torch.Tensor:
        """The tensor ``key`` on the CPU (only its bytes are read); on a loader thread, each
        tensor read counts as the read's progress (``report_progress``)."""
        tensor = self._read(key)
        report_progress()
        return tensor

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> PeftWeights:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_peft_weights(path: str | os.PathLike, name: str) -> PeftWeights:
    """Open ``adapter_model.safetensors`` (or ``adapter_model.bin``) of a PEFT adapter, a
    regular file only, reading no more than a safetensors file's header: it must fit the
    file (``MAX_HEADER_BYTES`` at most, tensor data within the file's size, and safetensors'
    own validation). An ``adapter_model.bin`` (a pickle) is read whole.

    Raises:
        LoRAAdapterError: neither file exists, it is not a regular file, or its header is
            corrupt or does not fit the file (naming the problem).
    """
    path, what = Path(path), f"adapter {name!r}"
    for file in ("adapter_model.safetensors", "adapter_model.bin"):
        if not is_present(path / file):
            continue
        stack = contextlib.ExitStack()
        try:
            f = stack.enter_context(open_regular(path / file, f"{what}: {file}"))
            if file.endswith(".safetensors"):
                return _open_safetensors(f, path / file, f"{what}: cannot read {file}", stack)
            return _open_bin(f, path / file, what, stack)
        except BaseException:
            stack.close()
            raise
    raise LoRAAdapterError(f"{what}: no adapter_model.safetensors or adapter_model.bin")


def read_peft_tensors(path: str | os.PathLike, name: str) -> dict[str, torch.Tensor]:
    """Every tensor of a PEFT adapter's weights file (``open_peft_weights``).

    Returns:
        ``{key: tensor}`` as stored, on the CPU.

    Raises:
        LoRAAdapterError: as ``open_peft_weights``.
    """
    with open_peft_weights(path, name) as weights:
        return {key: weights.read(key) for key in weights.meta}


def _open_safetensors(f, path: Path, what: str, stack: contextlib.ExitStack) -> PeftWeights:
    """The header checked against the file's size, then validated by safetensors'
    ``safe_open`` (which maps the file without reading its data); each tensor's bytes are
    then read with ``pread`` from the file checked (not through a mapping: a file truncated
    while it is read is an error here, where a mapped page past its end would be SIGBUS)."""
    from safetensors import SafetensorError, safe_open

    size = os.fstat(f.fileno()).st_size
    head = f.read(8)
    if len(head) < 8:
        raise LoRAAdapterError(f"{what}: no safetensors header ({size} bytes)")
    (n,) = struct.unpack("<Q", head)
    if n > MAX_HEADER_BYTES:
        raise LoRAAdapterError(f"{what}: its safetensors header claims {n} bytes, more than "
                               f"{MAX_HEADER_BYTES}")
    if 8 + n > size:
        raise LoRAAdapterError(f"{what}: its safetensors header claims {n} bytes, but the file "
                               f"holds {size}")
    header = f.read(n)
    end = _data_end(header)
    if end is not None and 8 + n + end > size:
        raise LoRAAdapterError(f"{what}: its safetensors header places tensor data up to byte "
                               f"{8 + n + end}, but the file holds {size} bytes")
    try:
        with safe_open(_fd_path(f, path), framework="pt"):
            pass                             # the header's own validation
    except SafetensorError as e:
        raise LoRAAdapterError(f"{what}: {_first_line(e)}") from None
    meta, places = {}, {}
    for key, entry in json.loads(header).items():
        if key == "__metadata__":
            continue
        dtype = _SAFETENSORS_DTYPES.get(entry["dtype"])
        if dtype is None:
            raise LoRAAdapterError(f"{what}: tensor {key!r} has dtype {entry['dtype']}, which "
                                   "no LoRA weight has")
        meta[key] = torch.empty(entry["shape"], dtype=dtype, device="meta")
        begin, stop = entry["data_offsets"]
        places[key] = (8 + n + begin, stop - begin)
    fd = f.fileno()

    def read(key: str) -> torch.Tensor:
        offset, nbytes = places[key]
        raw = torch.empty(nbytes, dtype=torch.uint8)
        view, done = memoryview(raw.numpy()), 0
        while done < nbytes:
            try:
                got = os.preadv(fd, [view[done:]], offset + done)
            except OSError as e:
                raise LoRAAdapterError(f"{what}: tensor {key!r}: {e.strerror or e}") from None
            if got == 0:
                raise LoRAAdapterError(f"{what}: the file ended within tensor {key!r}'s data "
                                       "(it changed while it was read)")
            done += got
        t = meta[key]
        return raw.view(t.dtype).reshape(t.shape)
    return PeftWeights(meta, read, stack)


def _data_end(header: bytes) -> int | None:
    """The largest end offset of tensor data a safetensors header names (bytes after the
    header); None when the header is not what safetensors writes (``safe_open`` says why)."""
    try:
        entries = json.loads(header)
    except (ValueError, RecursionError):
        return None
    if not isinstance(entries, dict):
        return None
    ends = [e["data_offsets"][1] for k, e in entries.items()
            if k != "__metadata__" and isinstance(e, dict)
            and isinstance(e.get("data_offsets"), list) and len(e["data_offsets"]) == 2
            and isinstance(e["data_offsets"][1], int)]
    return max(ends, default=0)


def _open_bin(f, path: Path, what: str, stack: contextlib.ExitStack) -> PeftWeights:
    """``torch.load`` with ``weights_only``, as vLLM reads ``adapter_model.bin`` (read
    whole: a memory map would turn a file truncated while it is read into SIGBUS)."""
    try:
        state = torch.load(f, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise LoRAAdapterError(f"{what}: cannot read {path.name}: it holds Python objects "
                               "other than tensors, which are never unpickled "
                               "(weights_only)") from None
    except Exception as e:  # pickle and zip raise many types for a corrupt file
        raise LoRAAdapterError(f"{what}: cannot read {path.name}: {_first_line(e)}") from None
    if not isinstance(state, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()):
        raise LoRAAdapterError(f"{what}: {path.name} does not hold a dict of named tensors")
    return PeftWeights({k: _meta(v) for k, v in state.items()}, state.__getitem__, stack)


def _fd_path(f, path: Path) -> str:
    """A name that opens the very file ``f`` has open (``/proc/self/fd``, so a file swapped
    under the adapter directory since it was checked is not read), else ``path``."""
    fd_dir = "/proc/self/fd"
    return f"{fd_dir}/{f.fileno()}" if os.path.isdir(fd_dir) else str(path)


def _meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


def _first_line(e: Exception) -> str:
    """An exception's message without torch's multi-line, ANSI-coloured hints."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(e)).strip()
    return text.splitlines()[0] if text else type(e).__name__


def check_peft_pair(name: str, module_key: str, ab: dict[str, torch.Tensor],
                    use_dora: bool) -> None:
    """Check that one module has both A and B, a magnitude exactly when the adapter is DoRA,
    floating-point tensors, 2-D A ``[r, in]`` and B ``[out, r]`` with ``r ≥ 1``, and only
    finite values (tensors on the meta device: all but the values).

    Raises:
        LoRAAdapterError: naming the adapter, the module and the problem.
    """
    if not {"A", "B"} <= set(ab):
        raise LoRAAdapterError(
            f"adapter {name!r}: {module_key} has lora_{''.join(sorted(ab))} but not both "
            "A and B")
    for label, t in ab.items():
        if not t.is_floating_point():
            raise LoRAAdapterError(
                f"adapter {name!r}: {module_key} has {_tensor_name(label)} of dtype "
                f"{t.dtype}, not a floating-point dtype")
    a, b = ab["A"], ab["B"]
    if a.dim() != 2 or b.dim() != 2:
        raise LoRAAdapterError(
            f"adapter {name!r}: {module_key} has lora_A {tuple(a.shape)} and lora_B "
            f"{tuple(b.shape)}, not 2-D [r, in] and [out, r]")
    if a.shape[0] < 1 or b.shape[1] != a.shape[0]:
        raise LoRAAdapterError(
            f"adapter {name!r}: {module_key} has lora_A {tuple(a.shape)} and lora_B "
            f"{tuple(b.shape)}: their rank must agree and be at least 1")
    if use_dora != ("M" in ab):
        raise LoRAAdapterError(
            f"adapter {name!r}: {module_key} " + (
                "has no lora_magnitude_vector, but the adapter is DoRA (use_dora)"
                if use_dora else "has a lora_magnitude_vector, but use_dora is not set"))
    for label, t in ab.items():
        if not t.is_meta and not all_finite(t):
            raise LoRAAdapterError(
                f"adapter {name!r}: {module_key} has NaN or Inf in {_tensor_name(label)}")


def _tensor_name(label: str) -> str:
    return "lora_magnitude_vector" if label == "M" else "lora_" + label
