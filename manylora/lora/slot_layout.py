"""Where each piece of a pinned adapter goes in this engine rank's slots, and the slot load.

Built once per engine (per tensor-parallel rank) from the model's ``LoRASlots`` and their
``SlotTable``: for every (layer, module) with slot buffers, the A, rank-major B and DoRA
scale buffers, this rank's cuts of the adapter's whole tensors, and the module's table
column. ``prepare`` turns a ``PinnedAdapter``'s plan into scatter descriptors (on the loader
thread, once per adapter); ``load`` then writes a slot with a fixed number of device
operations whatever the model size: one host → device copy of the pinned buffer into the
staging buffer, one of the descriptors, and one scatter kernel (``ops.triton_slot_load``),
all on the current stream (the manager's side stream on CUDA). What one slot load writes,
for slot ``k`` and each (layer, module) with slot buffers, rank ``r`` (0 if untargeted)::

    lora_a[k, :n_a]   = A[a_rows, in_cols]     (n_a = r, or this rank's rows of r when the
                                                A is cut along the rank)
    lora_b[k, :r]     = B^T[:, out_cols]       (rank-major)
    dora_scale[k]     = scale[out_cols]        (DoRA modules)
    ranks[k, col]     = r;  dora[k, col] = has scale     (and the table's host mirrors)

and for a MoE layer's expert module (``ExpertLoRASlots``), the same A and B rows once per
expert ``e`` into ``a[k, e]`` / ``b[k, e]`` (one rank column for all experts).

Cuts, after Megatron-LM's split (``LoRALinear``): column-parallel keeps ``out_cols`` =
the rank's output rows of each packed module; row-parallel keeps ``in_cols`` = its input
columns; fully sharded column-parallel keeps A's rows ``[start, start + width)`` of the
padded rank (the table holds the true rank; the shrink clamps it to its rows), fully
sharded row-parallel keeps B's output columns too. Nothing is zeroed: no kernel reads a slot past a
module's rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from manylora.config import LORA_ALL_MODULES, LORA_EXPERT_MODULES
from manylora.lora.kernels.slot_load import DESC_COLS, scatter_slot
from manylora.lora.pinned import (
    P_A,
    P_B,
    P_EXPERT,
    P_IN,
    P_LAYER,
    P_MODULE,
    P_OUT,
    P_RANK,
    P_SCALE,
    PinnedAdapter,
    SlotLoad,
    align,
)

if TYPE_CHECKING:
    from manylora.lora.expert_slots import ExpertLoRASlots
    from manylora.lora.slots import LoRASlots

_DESC_BYTES = DESC_COLS * 8


@dataclass(frozen=True)
class _Target:
    """One (layer, module)'s slot buffers and this rank's cut of the whole tensors."""

    a: torch.Tensor                  # [max_loras, R_a, in_local] (an expert's: a view)
    b: torch.Tensor                  # [max_loras, R, out_local]
    scale: torch.Tensor | None       # float32 [max_loras, out_local]; None: no DoRA
    full_in: int
    full_out: int
    in_cols: tuple[int, int]
    out_cols: tuple[int, int]
    a_rows: tuple[int, int] | None   # fully sharded column-parallel: rows of the padded rank
    column: int


class SlotLayout:
    """This engine rank's slot layout, its staging buffer, and the one-copy slot load.

    Args:
        slots: ``{(layer, module): LoRASlots}`` (the model's ``create_lora_slots``), all
            bound to one ``SlotTable``.
        module_shapes: ``{module: (in_features, out_features)}``, the whole (unsharded)
            projections (``ModelConfig.module_shapes``).
        max_lora_rank: the slots' padded rank.

    Attributes:
        staging: uint8 device ``[staging_bytes]``, room for the largest adapter the slots can
            hold (every module at ``max_lora_rank``, with DoRA) and its descriptors.
        destinations: every tensor a slot load writes into.

    Raises:
        ValueError: no slots, slots bound to several tables, or slot buffers in a dtype
            whose element is not a whole number of 16-bit words.
    """

    def __init__(self, slots: Mapping[tuple[int, str], LoRASlots],
                 module_shapes: Mapping[str, tuple[int, int]], max_lora_rank: int) -> None:
        tables = {id(lora.table): lora.table for lora in slots.values()}
        if len(tables) != 1:
            raise ValueError(f"slot loads need slots bound to one rank table, got "
                             f"{len(tables)}")
        self.table = table = tables.popitem()[1]
        self.max_lora_rank = max_lora_rank
        self._targets: dict[tuple[int, int, int], _Target] = {}
        buffers: dict[int, torch.Tensor] = {}
        for (layer, module), lora in slots.items():
            m, column = LORA_ALL_MODULES.index(module), table.column(layer, module)
            if module in LORA_EXPERT_MODULES:
                a, b = lora.buffers_of(module)
                buffers.update({id(a): a, id(b): b})
                for e in range(lora.num_experts):
                    self._targets[(layer, m, e)] = _expert_target(lora, module, e, column)
            else:
                t = self._targets[(layer, m, -1)] = _target(
                    lora, module, module_shapes[module], column)
                buffers.update({id(buf): buf for buf in (t.a, t.b, t.scale)})
        first = next(iter(self._targets.values()))
        self.dtype, device = first.a.dtype, first.a.device
        self.elem = first.a.element_size()
        if self.elem % 2:
            raise ValueError(f"slot loads copy 16-bit words; slot buffers in {self.dtype}")
        self.num_columns = table.num_columns
        largest = sum(align(max_lora_rank * t.full_in * self.elem)
                      + align(max_lora_rank * t.full_out * self.elem)
                      + (0 if t.scale is None else align(4 * t.full_out))
                      for t in self._targets.values())
        self.staging = torch.empty(largest + self._blob_bytes(3 * len(self._targets) + 2),
                                   dtype=torch.uint8, device=device)
        self._words = self.staging.view(torch.int16)
        self.destinations = [table.ranks, table.dora] + list(buffers.values())
        if device.type == "cuda":   # compile the scatter now, not on the first slot load
            scatter_slot(self._words, torch.zeros(1, DESC_COLS, dtype=torch.int64,
                                                  device=device), 0, self.destinations)

    def _blob_bytes(self, entries: int) -> int:
        return align(entries * _DESC_BYTES) + 2 * align(4 * self.num_columns)

    def prepare(self, pinned: PinnedAdapter) -> SlotLoad:
        """The scatter of ``pinned`` into any slot of this layout (host work; any thread).

        Returns:
            ``SlotLoad``: pinned (on CUDA hosts) descriptors and table rows.

        Raises:
            ValueError: a module the slots do not have, shapes or a dtype other than the
                slots', or a rank above ``max_lora_rank``.
        """
        if pinned.dtype != self.dtype:
            raise ValueError(f"adapter {pinned.name!r} is in {pinned.dtype}, the slots in "
                             f"{self.dtype}")
        words = self.elem // 2
        ranks = np.zeros(self.num_columns, np.int32)
        dora = np.zeros(self.num_columns, np.int32)
        rows: list[list[int]] = []
        for p in pinned.plan.tolist():
            layer, module = p[P_LAYER], LORA_ALL_MODULES[p[P_MODULE]]
            t = self._targets.get((layer, p[P_MODULE], p[P_EXPERT]))
            if t is None:
                raise ValueError(f"adapter {pinned.name!r} targets layer {layer} {module}"
                                 + (f" expert {p[P_EXPERT]}" if p[P_EXPERT] >= 0 else "")
                                 + ", which has no slot buffers")
            r, n_in, n_out = p[P_RANK], p[P_IN], p[P_OUT]
            if (n_in, n_out) != (t.full_in, t.full_out) or r > self.max_lora_rank:
                raise ValueError(
                    f"adapter {pinned.name!r}: layer {layer} {module} is [{r}, {n_in}] x "
                    f"[{n_out}, {r}], the slots take [≤{self.max_lora_rank}, {t.full_in}] x "
                    f"[{t.full_out}, ≤{self.max_lora_rank}]")
            lo, hi = t.a_rows if t.a_rows is not None else (0, r)
            n_a = min(max(r - lo, 0), hi - lo)
            (i0, i1), (o0, o1) = t.in_cols, t.out_cols
            if n_a:
                rows.append(_entry(t.a, p[P_A] // 2 + (lo * n_in + i0) * words, n_in * words,
                                   n_a, (i1 - i0) * words))
            rows.append(_entry(t.b, p[P_B] // 2 + o0 * words, n_out * words, r,
                               (o1 - o0) * words))
            if p[P_SCALE] >= 0:
                if t.scale is None:
                    raise ValueError(f"adapter {pinned.name!r}: layer {layer} {module} has "
                                     "DoRA scales, which its slots do not take")
                rows.append(_entry(t.scale, p[P_SCALE] // 2 + 2 * o0, 2 * n_out, 1,
                                   2 * (o1 - o0)))
                dora[t.column] = 1
            ranks[t.column] = r
        blob = torch.zeros(self._blob_bytes(len(rows) + 2), dtype=torch.uint8,
                           pin_memory=torch.cuda.is_available())
        tail = (align(pinned.buf.numel()) + align((len(rows) + 2) * _DESC_BYTES)) // 2
        step = align(4 * self.num_columns) // 2
        rows.append(_entry(self.table.ranks, tail, 0, 1, 2 * self.num_columns))
        rows.append(_entry(self.table.dora, tail + step, 0, 1, 2 * self.num_columns))
        desc = blob[: len(rows) * _DESC_BYTES].view(torch.int64).view(len(rows), DESC_COLS)
        desc.copy_(torch.tensor(rows, dtype=torch.int64))
        at = align(len(rows) * _DESC_BYTES)
        rows_in_blob = []
        for values in (ranks, dora):
            row = blob[at: at + 4 * self.num_columns].view(torch.int32)
            row.copy_(torch.from_numpy(values))
            rows_in_blob.append(row.numpy())
            at += 2 * step
        return SlotLoad(blob, len(rows), *rows_in_blob)

    def load(self, slot: int, pinned: PinnedAdapter, load: SlotLoad) -> None:
        """Write ``pinned`` into ``slot``: two host → device copies (the buffer, then the
        descriptors) into the staging buffer and one scatter, enqueued on the current
        stream; nothing synchronises. The host buffers must stay alive until the copies
        are done (on CUDA, until an event recorded after this call completes).

        Raises:
            ValueError: a slot outside ``[0, max_loras)``, or an adapter too large for the
                staging buffer (one that ``prepare`` did not accept).
        """
        max_loras = self.table.max_loras
        if not 0 <= slot < max_loras:
            raise ValueError(f"slot {slot} outside [0, {max_loras})")
        n = pinned.buf.numel()
        at = align(n)
        m = load.blob.numel()
        if at + m > self.staging.numel():
            raise ValueError(f"adapter {pinned.name!r} ({at + m} bytes) exceeds the staging "
                             f"buffer ({self.staging.numel()} bytes)")
        self.staging[:n].copy_(pinned.buf, non_blocking=True)
        self.staging[at: at + m].copy_(load.blob, non_blocking=True)
        desc = self.staging[at: at + load.entries * _DESC_BYTES].view(torch.int64).view(
            load.entries, DESC_COLS)
        scatter_slot(self._words, desc, slot, self.destinations)
        self.table.ranks_host[slot] = load.ranks
        self.table.dora_host[slot] = load.dora


def _entry(dst: torch.Tensor, src_off: int, src_stride: int, n: int, n_len: int) -> list[int]:
    """A descriptor row writing ``n`` rows of ``n_len`` words into ``dst[slot]`` (rows of
    ``dst.stride(1)`` elements), read from word ``src_off`` of the staging buffer at a
    stride of ``src_stride`` words."""
    if n * n_len >= 2**31:
        raise ValueError(f"a slot-load entry of {n} x {n_len} words exceeds 2**31")
    elem_words = dst.element_size() // 2
    row_stride = dst.stride(1) * elem_words if dst.dim() > 2 else 0
    return [src_off, src_stride, dst.data_ptr(), dst.stride(0) * dst.element_size(),
            row_stride, n, n_len, 0]


def _target(lora: LoRASlots, module: str, shape: tuple[int, int], column: int) -> _Target:
    s = lora.module_names.index(module)
    a, b = lora.lora_a_stacked[s], lora.lora_b_stacked[s]
    scale = lora.dora_scale_stacked[s]
    for buf in (a, b, scale):
        if not buf.is_contiguous():
            raise ValueError(f"{module}: slot buffers must be contiguous")
    full_in, full_out = shape
    sh = lora.sharding
    out_cols = (0, full_out) if sh is None or sh.out_ranges is None else sh.out_ranges[s]
    in_cols = (0, full_in) if sh is None or sh.in_range is None else sh.in_range
    if out_cols[1] - out_cols[0] != b.shape[2] or in_cols[1] - in_cols[0] != a.shape[2]:
        raise ValueError(f"{module}: slot buffers A {tuple(a.shape)}, B {tuple(b.shape)} do "
                         f"not hold columns {in_cols} of {full_in} and {out_cols} of "
                         f"{full_out}")
    a_rows = None if sh is None else sh.rank_range
    return _Target(a, b, scale, full_in, full_out, tuple(in_cols), tuple(out_cols), a_rows,
                   column)


def _expert_target(lora: ExpertLoRASlots, module: str, expert: int, column: int) -> _Target:
    """Expert ``expert``'s part of an expert module's slot buffers: views ``[max_loras, R,
    width]`` whose rows are contiguous (the descriptors' row stride), one target each."""
    a, b = (buf[:, expert] for buf in lora.buffers_of(module))
    for buf in (a, b):
        if buf.stride(2) != 1 or buf.stride(1) != buf.shape[2]:
            raise ValueError(f"{module}: expert slot buffers must have contiguous rows")
    return _Target(a, b, None, lora.full_in[module], lora.full_out[module],
                   lora.in_cols[module], lora.out_cols[module], None, column)
