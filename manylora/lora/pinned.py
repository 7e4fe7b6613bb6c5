"""The host cache's form of an adapter: one buffer in slot order, copied to a slot in one go.

``pin_adapter`` lays an adapter out once, on the loader thread that read it, as one uint8
buffer (page-locked on a CUDA host, or in shared memory under tensor parallelism) holding
for every targeted (layer, module), in ``(layer, module)`` order, each piece 16-byte
aligned::

    A      [r, in]   model dtype   (rows 0..r of the slot's lora_a)
    B^T    [r, out]  model dtype   (rank-major: rows 0..r of the slot's lora_b)
    scale  [out]     float32       (DoRA only: m / ||W + BA||)

and a small ``plan`` (int64 ``[M, PLAN_COLS]``: layer, module index in
``LORA_ALL_MODULES``, rank, in, out, the byte offsets of the three pieces (-1 for no
scale), and the expert, -1 outside the MoE experts). An expert module (A ``[E, r, in]``,
B ``[E, out, r]``) is laid out as ``E`` pieces, one per expert, in expert order. A slot
load (``SlotLayout``) copies the buffer to the device as it is and scatters it; each
tensor-parallel rank cuts its own part from the same buffer with its own layout.
This replaces per-tensor pinned copies (one allocation and one copy per tensor, S-LoRA /
vLLM's host cache) with TensorRT-LLM's idea of a paged, slot-ready host cache.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from manylora.config import LORA_ALL_MODULES
from manylora.lora.adapter import LoRAAdapter

#: Columns of ``PinnedAdapter.plan``.
PLAN_COLS = 9
P_LAYER, P_MODULE, P_RANK, P_IN, P_OUT, P_A, P_B, P_SCALE, P_EXPERT = range(PLAN_COLS)
#: Byte alignment of every piece in the buffer (16: vector loads, float32 and int64 views).
ALIGN = 16


def align(n: int) -> int:
    """``n`` rounded up to ``ALIGN`` bytes."""
    return -(-n // ALIGN) * ALIGN


def pinned_bytes(nbytes: int) -> torch.Tensor:
    """uint8 ``[nbytes]`` host memory, page-locked when a CUDA device is available (so host →
    device copies from it run asynchronously)."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())


@dataclass(frozen=True, eq=False)
class SlotLoad:
    """One engine rank's scatter of one pinned adapter (``SlotLayout.prepare``).

    Attributes:
        blob: uint8 host bytes copied after the buffer into the staging buffer: the
            descriptors int64 ``[entries, DESC_COLS]`` (``lora.kernels.slot_load``), then the
            slot's rank and DoRA table rows (int32 ``[E]`` each).
        entries: rows of descriptors at the start of ``blob``.
        ranks, dora: int32 ``[E]``, views of the table rows in ``blob`` (what the scatter
            writes, and the table's host mirrors get).
    """

    blob: torch.Tensor
    entries: int
    ranks: np.ndarray
    dora: np.ndarray


@dataclass(frozen=True, eq=False)
class PinnedAdapter:
    """An adapter as the host cache keeps it.

    Attributes:
        lora_int_id, name, digest: the adapter's identity (``LoRAAdapter``'s).
        buf: uint8 ``[nbytes]``, the pieces of every targeted module (module docstring).
        plan: int64 ``[M, PLAN_COLS]`` on the CPU, one row per targeted (layer, module), or
            per (layer, module, expert) for the experts' modules.
        dtype: the dtype of A and B (the model's).
        slot_load: this engine rank's scatter descriptors (``SlotLayout.prepare``); None until
            prepared (and on tensor-parallel ranks > 0, which prepare their own).
        rank: the largest rank over its modules.
        has_dora: whether any module has DoRA scales.
        invocation_tokens: an activated adapter's invocation tokens (``LoRAAdapter``'s).
    """

    lora_int_id: int
    name: str
    digest: str
    buf: torch.Tensor
    plan: torch.Tensor
    dtype: torch.dtype
    rank: int
    has_dora: bool
    slot_load: SlotLoad | None = field(default=None)
    invocation_tokens: tuple[int, ...] | None = None

    @property
    def nbytes(self) -> int:
        """Host bytes it holds (the buffer and the descriptors), what the host cache's byte
        bound counts."""
        return self.buf.numel() + (0 if self.slot_load is None else self.slot_load.blob.numel())

    def module_ranks(self) -> dict[tuple[int, str], int]:
        """``{(layer, module): rank}`` of its targeted modules."""
        return {(int(row[P_LAYER]), LORA_ALL_MODULES[int(row[P_MODULE])]): int(row[P_RANK])
                for row in self.plan.tolist()}

    def tensors(self, layer: int, module: str, expert: int = -1
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Views into ``buf`` of one module (of one ``expert`` for the experts' modules): A
        ``[r, in]``, B^T ``[r, out]`` (model dtype) and the DoRA scale float32 ``[out]`` or
        None.

        Raises:
            KeyError: the adapter does not target ``(layer, module)`` (or that expert).
        """
        m = LORA_ALL_MODULES.index(module)
        for row in self.plan.tolist():
            if row[P_LAYER] == layer and row[P_MODULE] == m and row[P_EXPERT] == expert:
                return _views(self.buf, row, self.dtype)
        raise KeyError(f"adapter {self.name!r} does not target layer {layer} {module}"
                       + (f" expert {expert}" if expert >= 0 else ""))


def _views(buf: torch.Tensor, row: list[int], dtype: torch.dtype
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    r, n_in, n_out = row[P_RANK], row[P_IN], row[P_OUT]
    elem = torch.empty((), dtype=dtype).element_size()
    a = buf[row[P_A]: row[P_A] + r * n_in * elem].view(dtype).view(r, n_in)
    bt = buf[row[P_B]: row[P_B] + r * n_out * elem].view(dtype).view(r, n_out)
    scale = None if row[P_SCALE] < 0 else buf[row[P_SCALE]: row[P_SCALE] + 4 * n_out].view(
        torch.float32)
    return a, bt, scale


def pin_adapter(adapter: LoRAAdapter,
                 alloc: Callable[[int], torch.Tensor] = pinned_bytes) -> PinnedAdapter:
    """Lay ``adapter`` out as one buffer (module docstring); any thread.

    Args:
        adapter: a validated adapter (A ``[r, in]`` and B ``[out, r]``, or ``[E, r, in]`` and
            ``[E, out, r]`` for an expert module, in one dtype; DoRA scales float32
            ``[out]``).
        alloc: ``nbytes → uint8 [nbytes]`` host tensor the buffer is written into
            (``pinned_bytes``, or shared memory under tensor parallelism).

    Raises:
        ValueError: an adapter without modules, or with A/B of different dtypes.
    """
    keys = sorted(adapter.weights)
    if not keys:
        raise ValueError(f"adapter {adapter.name!r} targets no module")
    dtypes = {t.dtype for w in adapter.weights.values() for t in (w.a, w.b)}
    if len(dtypes) != 1:
        raise ValueError(f"adapter {adapter.name!r}: A and B in several dtypes {dtypes}")
    dtype = dtypes.pop()
    elem = torch.empty((), dtype=dtype).element_size()
    rows, pieces, offset = [], [], 0
    for layer, module in keys:
        w = adapter.weights[(layer, module)]
        experts = ((-1, w.a, w.b),) if w.a.dim() == 2 else tuple(
            (e, w.a[e], w.b[e]) for e in range(w.a.shape[0]))
        for expert, a, b in experts:
            r, n_in = a.shape
            n_out = b.shape[0]
            a_off = offset
            b_off = a_off + align(r * n_in * elem)
            offset = b_off + align(r * n_out * elem)
            s_off = -1
            if w.dora_scale is not None:
                s_off, offset = offset, offset + align(4 * n_out)
            rows.append([layer, LORA_ALL_MODULES.index(module), r, n_in, n_out,
                         a_off, b_off, s_off, expert])
            pieces.append((a, b, w.dora_scale))
    buf = alloc(offset)
    plan = torch.tensor(rows, dtype=torch.int64)
    for (a, b, dora_scale), row in zip(pieces, rows):
        a_view, bt, scale = _views(buf, row, dtype)
        a_view.copy_(a)
        bt.copy_(b.t())
        if scale is not None:
            scale.copy_(dora_scale)
    return PinnedAdapter(adapter.lora_int_id, adapter.name, adapter.digest, buf, plan, dtype,
                         adapter.rank, adapter.has_dora,
                         invocation_tokens=adapter.invocation_tokens)
