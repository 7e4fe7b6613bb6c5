"""Broadcasting one step's inputs from rank 0 to the other tensor-parallel ranks.

``broadcast_tensor_dict`` sends a flat dict of tensors and plain values as a few
``torch.distributed.broadcast`` calls from ``src``:

1. the metadata's length: a 1-element int64 tensor;
2. the metadata: UTF-8 JSON bytes in a uint8 tensor (the keys in order; for a tensor its
   dtype name and shape, for any other value the value itself);
3. the raw bytes of every *small* tensor (fewer than ``COALESCE_LIMIT_BYTES``), coalesced into one
   uint8 buffer in key order, each starting at a multiple of 16 bytes (skipped when there is
   none);
4. the raw bytes of each *large* tensor, one broadcast each, in key order.

Zero-element tensors send nothing. Receivers derive the packing from the metadata, so it
carries no offsets. Packing keeps a step's broadcast at three collectives however many small
tensors it holds (each collective costs tens of microseconds of latency, more with NCCL's
host-device copies), while large tensors travel without a packing copy.

No pickle is involved anywhere: receivers rebuild everything from JSON and raw bytes, so a
rank never executes anything a peer sent. Sending bytes rather than the tensor's own dtype is
what lets every supported dtype travel over every backend: gloo (as of torch 2.13) has no
int16 or float8 broadcast (it raises ``Invalid scalar type``), while uint8 works everywhere.
"""

from __future__ import annotations

import json
import math
from typing import Any

import torch
import torch.distributed as dist

#: The tensor dtypes ``broadcast_tensor_dict`` carries, by the name the metadata uses.
SUPPORTED_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16",
                 "int8", "uint8", "bool", "float8_e4m3fn", "float8_e5m2")
    if hasattr(torch, name)
}
_DTYPE_NAMES = {dtype: name for name, dtype in SUPPORTED_DTYPES.items()}

#: Tensors of at least this many bytes are broadcast on their own; smaller ones are coalesced.
COALESCE_LIMIT_BYTES = 1 << 20

# Metadata layout version: a receiver refuses metadata it does not understand.
_FORMAT = 1
# Alignment (bytes) of each tensor inside the coalesced buffer.
_ALIGN = 16


def _check_plain(value: Any, key: str) -> None:
    """Raise TypeError (naming ``key``) unless ``value`` is JSON-able: None, bool, int, float,
    str, or lists/tuples/str-keyed dicts of those."""
    if value is None or isinstance(value, bool | int | float | str):
        return
    if isinstance(value, list | tuple):
        for item in value:
            _check_plain(item, key)
        return
    if isinstance(value, dict):
        for k, item in value.items():
            if not isinstance(k, str):
                raise TypeError(f"broadcast_tensor_dict: value of key {key!r} holds a dict "
                                f"with a non-str key {k!r} ({type(k).__name__})")
            _check_plain(item, key)
        return
    raise TypeError(f"broadcast_tensor_dict: value of key {key!r} has unsupported type "
                    f"{type(value).__name__} (tensors only at the top level; other values "
                    "must be None, bool, int, float, str, or lists/dicts of those)")


def _transfer_device(group: Any, device: torch.device | str | None) -> torch.device:
    """``device`` if given; else the current CUDA device for NCCL, the CPU otherwise."""
    if device is not None:
        return torch.device(device)
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _encode(data: dict) -> tuple[bytes, list[torch.Tensor]]:
    """The metadata JSON bytes and the tensors to send after it, in key order.

    Raises:
        TypeError: ``data`` is not a dict, a key is not a str, a tensor has an unsupported
            dtype or layout, or another value is not JSON-able (the message names the key).
    """
    if not isinstance(data, dict):
        raise TypeError(f"broadcast_tensor_dict: src must pass a dict, got {type(data).__name__}")
    items: list[list[Any]] = []
    tensors: list[torch.Tensor] = []
    for key, value in data.items():
        if not isinstance(key, str):
            raise TypeError(f"broadcast_tensor_dict: keys must be str, got {key!r} "
                            f"({type(key).__name__})")
        if isinstance(value, torch.Tensor):
            name = _DTYPE_NAMES.get(value.dtype)
            if name is None:
                raise TypeError(f"broadcast_tensor_dict: tensor {key!r} has unsupported dtype "
                                f"{value.dtype} (supported: {', '.join(SUPPORTED_DTYPES)})")
            if value.layout != torch.strided or value.device.type == "meta":
                raise TypeError(f"broadcast_tensor_dict: tensor {key!r} must be a dense tensor "
                                f"with data, got layout {value.layout} on {value.device}")
            items.append([key, "t", name, list(value.shape)])
            tensors.append(value)
        else:
            _check_plain(value, key)
            items.append([key, "v", value])
    meta = json.dumps({"format": _FORMAT, "items": items}, separators=(",", ":"))
    return meta.encode("utf-8"), tensors


def _as_bytes(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t``'s elements as a flat contiguous uint8 tensor on ``device`` (``numel * itemsize``
    bytes; a view where no copy is needed)."""
    t = t.detach().to(device).contiguous().reshape(-1)
    return t.view(torch.uint8)


def _layout(specs: list[tuple[torch.dtype, list[int]]], coalesce_all: bool = False
            ) -> tuple[list[int | None], int]:
    """Where each tensor's bytes go: its offset in the coalesced buffer, or None when it is
    broadcast on its own (large, unless ``coalesce_all``) or not at all (empty); and the coalesced
    buffer's size."""
    offsets: list[int | None] = []
    total = 0
    for dtype, shape in specs:
        nbytes = math.prod(shape) * dtype.itemsize
        if 0 < nbytes and (coalesce_all or nbytes < COALESCE_LIMIT_BYTES):
            total = -(-total // _ALIGN) * _ALIGN
            offsets.append(total)
            total += nbytes
        else:
            offsets.append(None)
    return offsets, total


def _send_tensors(tensors: list[torch.Tensor], src: int, group: Any, dev: torch.device) -> None:
    """Stages 3 and 4 of the module docstring, on ``src``."""
    offsets, total = _layout([(t.dtype, list(t.shape)) for t in tensors])
    if total:
        coalesced = torch.empty(total, dtype=torch.uint8, device=dev)
        small = [(t, o) for t, o in zip(tensors, offsets) if o is not None]
        # Small tensors on another device (host tensors, usually) are coalesced there first, so
        # that the buffer crosses devices once; the slices of the others are written after.
        stage_dev = next((t.device for t, _ in small if t.device != dev), None)
        if stage_dev is not None:
            staging = torch.empty(total, dtype=torch.uint8, device=stage_dev)
            for t, o in small:
                if t.device == stage_dev:
                    b = _as_bytes(t, stage_dev)
                    staging[o:o + b.numel()].copy_(b)
            coalesced.copy_(staging)
        for t, o in small:
            if t.device != stage_dev:
                b = _as_bytes(t, dev)
                coalesced[o:o + b.numel()].copy_(b)
        dist.broadcast(coalesced, src=src, group=group)
    for t, o in zip(tensors, offsets):
        if o is None and t.numel():
            dist.broadcast(_as_bytes(t, dev), src=src, group=group)


def broadcast_tensor_dict(data: dict | None, src: int = 0, group: Any = None,
                          device: torch.device | str | None = None) -> dict:
    """Send ``data`` from rank ``src`` to every rank of ``group``; every rank returns it.

    Every rank of ``group`` must call this, in the same order relative to its other
    collectives. On ``src``, ``data`` is a dict with str keys whose values are tensors or
    plain values; on the other ranks ``data`` is ignored (pass None).

    Tensors: any shape (0-d and zero-element included), any strides (non-contiguous ones are
    sent through a contiguous copy), dtype one of ``SUPPORTED_DTYPES`` (float32, float16,
    bfloat16, float64, int64, int32, int16, int8, uint8, bool, float8_e4m3fn, float8_e5m2
    where this torch has them). They travel as raw bytes, so received values are bit-exact,
    NaNs included; ``requires_grad`` is not carried.

    Plain values: None, bool, int, float, str, and lists/tuples/str-keyed dicts of those
    (JSON): a tuple arrives as a list. Tensors nested inside plain values are not allowed.

    Devices: all transfers use one device, ``device`` if given, else the current CUDA device
    when the group's backend is NCCL and the CPU otherwise (gloo). ``src`` copies tensors
    living elsewhere to it before sending; receivers allocate their tensors on it. Received
    tensors smaller than ``COALESCE_LIMIT_BYTES`` are contiguous views into one shared buffer
    (writing to one never changes another).

    Args:
        data: the dict to send (on ``src``); None elsewhere.
        src: the sender's rank in the default (world) group, ``torch.distributed``'s
            convention.
        group: the process group (None: the default group).
        device: the transfer device described above.

    Returns:
        On ``src``, a new dict holding ``data``'s own values (not copies); elsewhere, an equal
        dict of contiguous tensors on the transfer device and plain values, keys in ``src``'s
        order.

    Raises:
        TypeError: on ``src``, ``data`` is not a dict, a key is not a str, a tensor has an
            unsupported dtype or is not a dense tensor, or a value has an unsupported type;
            the message names the key. This is raised before anything is sent, so ``src``
            stays in step with the group, but the receivers, already waiting in this call,
            stay blocked until the next broadcast from ``src`` (or the process group's
            timeout): the caller must not treat the error as recoverable without sending
            them something.
        ValueError: on a receiver, metadata in a format it does not understand.
        RuntimeError: ``torch.distributed`` is not initialized, or a collective failed
            (e.g. a peer process died; see ``manylora.distributed.workers``).
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("broadcast_tensor_dict needs torch.distributed to be initialized")
    dev = _transfer_device(group, device)
    if dist.get_rank() == src:
        meta, tensors = _encode(data)
        length = torch.tensor([len(meta)], dtype=torch.int64, device=dev)
        dist.broadcast(length, src=src, group=group)
        payload = torch.frombuffer(bytearray(meta), dtype=torch.uint8).to(dev)
        dist.broadcast(payload, src=src, group=group)
        _send_tensors(tensors, src, group, dev)
        return dict(data)

    length = torch.empty(1, dtype=torch.int64, device=dev)
    dist.broadcast(length, src=src, group=group)
    payload = torch.empty(int(length.item()), dtype=torch.uint8, device=dev)
    dist.broadcast(payload, src=src, group=group)
    meta = json.loads(payload.cpu().numpy().tobytes().decode("utf-8"))
    if not isinstance(meta, dict) or meta.get("format") != _FORMAT:
        version = meta.get("format") if isinstance(meta, dict) else None
        raise ValueError(f"broadcast_tensor_dict: metadata format {version!r} from rank {src} "
                         f"is not {_FORMAT}")
    items = meta["items"]
    specs = [(SUPPORTED_DTYPES[it[2]], it[3]) for it in items if it[1] == "t"]
    offsets, total = _layout(specs)
    coalesced = None
    if total:
        coalesced = torch.empty(total, dtype=torch.uint8, device=dev)
        dist.broadcast(coalesced, src=src, group=group)
    out: dict[str, Any] = {}
    tensor_index = 0
    for item in items:
        key, kind = item[0], item[1]
        if kind == "v":
            out[key] = item[2]
            continue
        (dtype, shape), off = specs[tensor_index], offsets[tensor_index]
        tensor_index += 1
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes == 0:
            out[key] = torch.empty(shape, dtype=dtype, device=dev)
        elif off is not None:
            out[key] = coalesced[off:off + nbytes].view(dtype).view(shape)
        else:
            buf = torch.empty(nbytes, dtype=torch.uint8, device=dev)
            dist.broadcast(buf, src=src, group=group)
            out[key] = buf.view(dtype).view(shape)
    return out


def encode_tensor_dict(data: dict) -> bytes:
    """``data`` (as ``broadcast_tensor_dict`` takes it; tensors are copied to the host) as
    one byte string for a pipe: an 8-byte little-endian metadata length, the JSON metadata,
    then every tensor's raw bytes at the offsets ``_layout`` gives (all of them coalesced,
    whatever their size). ``decode_tensor_dict`` reverses it; no pickle is involved.

    Raises:
        TypeError: as ``broadcast_tensor_dict`` (the message names the key).
    """
    meta, tensors = _encode(data)
    specs = [(t.dtype, list(t.shape)) for t in tensors]
    offsets, total = _layout(specs, coalesce_all=True)
    body = bytearray(total)
    for t, off in zip(tensors, offsets):
        if off is not None:
            raw = _as_bytes(t, torch.device("cpu")).numpy()
            body[off:off + raw.size] = raw.data
    return b"".join((len(meta).to_bytes(8, "little"), meta, body))


def decode_tensor_dict(buf: bytes) -> dict:
    """The dict ``encode_tensor_dict`` coalesced into ``buf``: host tensors (read-only views of
    one copy of ``buf``'s tensor bytes) and plain values, keys in the sender's order.

    Raises:
        ValueError: ``buf`` is not in the format ``encode_tensor_dict`` writes.
    """
    n = int.from_bytes(buf[:8], "little")
    meta = json.loads(bytes(buf[8:8 + n]).decode("utf-8"))
    if not isinstance(meta, dict) or meta.get("format") != _FORMAT:
        raise ValueError("decode_tensor_dict: not an encoded tensor dict of format "
                         f"{_FORMAT}")
    items = meta["items"]
    specs = [(SUPPORTED_DTYPES[it[2]], it[3]) for it in items if it[1] == "t"]
    offsets, total = _layout(specs, coalesce_all=True)
    body = memoryview(buf)[8 + n:]
    if len(body) != total:
        raise ValueError(f"decode_tensor_dict: {len(body)} bytes of tensors, expected {total}")
    coalesced = torch.frombuffer(bytearray(body), dtype=torch.uint8) if total else None
    out: dict[str, Any] = {}
    specs_iter = iter(zip(specs, offsets))
    for item in items:
        if item[1] == "v":
            out[item[0]] = item[2]
            continue
        (dtype, shape), off = next(specs_iter)
        nbytes = math.prod(shape) * dtype.itemsize
        out[item[0]] = (torch.empty(shape, dtype=dtype) if nbytes == 0
                        else coalesced[off:off + nbytes].view(dtype).view(shape))
    return out
