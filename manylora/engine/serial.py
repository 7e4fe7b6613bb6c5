"""msgpack (msgspec) encoding of the messages between the front and the engine-core
process, with tensors carried as raw bytes (vLLM's ``MsgpackEncoder`` idea; no pickle).

A torch tensor or numpy array anywhere in a message (TensorRT-LLM adapter weights and
configs in a ``LoRARequest``) travels as a msgpack extension: the length of a msgpack
header (4 bytes, little-endian), the header ``[dtype, shape]``, then the C-contiguous
bytes. It comes back as the same type
(torch tensors on the CPU). Errors travel as :class:`ErrorInfo` and are raised again on
the other side as the same exception class when it is a builtin or a manylora one.
"""

from __future__ import annotations

import builtins
import importlib
import struct
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import torch

_EXT_TORCH = 1
_EXT_NUMPY = 2

#: torch dtypes numpy has no name for travel as raw 16-bit words.
_TORCH_ONLY = frozenset({torch.bfloat16})
_TORCH_BY_NAME = {str(t).removeprefix("torch."): t for t in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool)}


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        t = obj.detach().to("cpu").contiguous()
        name = str(t.dtype).removeprefix("torch.")
        if name not in _TORCH_BY_NAME:
            raise TypeError(f"a {t.dtype} tensor cannot be sent to the engine core")
        raw = t.view(torch.int16) if t.dtype in _TORCH_ONLY else t
        return msgspec.msgpack.Ext(_EXT_TORCH, _header(name, t.shape) + raw.numpy().tobytes())
    if isinstance(obj, np.ndarray):
        a = np.ascontiguousarray(obj)
        if a.dtype.hasobject:
            raise TypeError("an object array cannot be sent to the engine core")
        return msgspec.msgpack.Ext(_EXT_NUMPY, _header(a.dtype.str, a.shape) + a.tobytes())
    if isinstance(obj, frozenset):
        return sorted(obj)
    raise TypeError(f"cannot encode {type(obj).__name__} for the engine core")


def _header(dtype: str, shape) -> bytes:
    header = msgspec.msgpack.encode([dtype, list(shape)])
    return struct.pack("<I", len(header)) + header


def _ext_hook(code: int, data: memoryview) -> Any:
    (size,) = struct.unpack_from("<I", data)
    name, shape = msgspec.msgpack.decode(data[4:4 + size])
    body = data[4 + size:]
    if code == _EXT_TORCH:
        dtype = _TORCH_BY_NAME[name]
        if dtype in _TORCH_ONLY:
            words = np.frombuffer(body, dtype=np.int16).reshape(shape).copy()
            return torch.from_numpy(words).view(dtype)
        np_dtype = torch.empty((), dtype=dtype).numpy().dtype
        return torch.from_numpy(np.frombuffer(body, dtype=np_dtype).reshape(shape).copy())
    if code == _EXT_NUMPY:
        return np.frombuffer(body, dtype=np.dtype(name)).reshape(shape).copy()
    raise ValueError(f"unknown msgpack extension {code}")


class Encoder:
    """msgpack encoder for front ↔ core messages (tensors as raw bytes)."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)

    def encode(self, obj: Any) -> bytes:
        return self._encoder.encode(obj)


class Decoder:
    """msgpack decoder into ``type`` (tensors rebuilt from raw bytes).

    Raises:
        msgspec.ValidationError: the message does not match ``type``.
    """

    def __init__(self, type: Any = Any) -> None:
        self._decoder = msgspec.msgpack.Decoder(type, ext_hook=_ext_hook)

    def decode(self, data: bytes | memoryview) -> Any:
        return self._decoder.decode(data)


@dataclass
class ErrorInfo:
    """An exception raised on one side, to raise again on the other.

    Attributes:
        type: ``"module:QualName"`` of the exception's class.
        message: ``str(exception)``.
    """

    type: str
    message: str

    @classmethod
    def of(cls, exc: BaseException) -> ErrorInfo:
        kind = type(exc)
        return cls(f"{kind.__module__}:{kind.__qualname__}", str(exc))

    def to_exception(self) -> Exception:
        """The same exception class with the same message when it is a builtin or a
        manylora exception taking one message; else a ``RuntimeError`` naming it."""
        module, _, name = self.type.partition(":")
        kind = None
        if module == "builtins":
            kind = getattr(builtins, name, None)
        elif module.startswith("manylora.") and "." not in name:
            try:
                kind = getattr(importlib.import_module(module), name, None)
            except ImportError:
                kind = None
        if isinstance(kind, type) and issubclass(kind, Exception):
            try:
                return kind(self.message)
            except Exception:
                pass
        return RuntimeError(f"{self.type}: {self.message}")
