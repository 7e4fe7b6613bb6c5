"""Device-resident adapter slots of one packed projection, and their writer.

Slot buffers are allocated once, up front (vLLM's ``lora_a_stacked`` / ``lora_b_stacked``;
Punica's per-slot adapter stacks), one ``LoRASlots`` per LoRA-enabled packed projection,
only for the modules in ``LoRAConfig.target_modules``. ``set_slot`` writes one adapter's
tensors into a slot and, under tensor parallelism, keeps the rank's part of them
(``SlotSharding``; the split is explained in ``manylora.lora.linear``), and writes the
(slot, module)'s rank and DoRA flag into the model's ``SlotTable``, which the kernels read.
``shrink`` / ``expand`` run the step's Punica ops over the buffers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from manylora.lora.kernels.expand import lora_expand
from manylora.lora.kernels.meta import LoRAKernelMeta
from manylora.lora.kernels.shrink import lora_shrink
from manylora.lora.slot_table import SlotTable


@dataclass(frozen=True)
class SlotSharding:
    """Which part of an adapter's whole tensors a tensor-parallel rank's slots keep.

    Attributes:
        full_out: per enabled module, its whole output width (B's rows and the DoRA scale's
            length as ``set_slot`` receives them).
        out_ranges: per enabled module, the rows ``[start, stop)`` of B and of the DoRA scale
            kept; None: all rows.
        in_range: the columns ``[start, stop)`` of A kept; None: all columns.
        rank_range: the rows ``[start, stop)`` of A, padded to ``max_lora_rank``, kept (fully
            sharded column-parallel); None: all.
    """

    full_out: tuple[int, ...]
    out_ranges: tuple[tuple[int, int], ...] | None = None
    in_range: tuple[int, int] | None = None
    rank_range: tuple[int, int] | None = None


class LoRASlots(nn.Module):
    """Device-resident adapter slots of one packed projection.

    Buffers, per enabled slice ``s`` (module name ``modules[s]``), in ``dtype`` (the
    model's, or float32 over a 16-bit model: ``LoRAConfig.dtype``):

    * ``lora_a_{s}: [max_loras, R_a, in_features]``: a slot's A, rows ``[0, r)`` (``R_a`` is
      ``max_lora_rank``, or the width of ``sharding.rank_range``);
    * ``lora_b_{s}: [max_loras, max_lora_rank, out_s]``: a slot's B transposed, rank-major,
      rows ``[0, r)``, so that the expand's loads run along ``out`` (coalesced) and a slot
      write of rank ``r`` is one contiguous block per tensor;
    * ``dora_scale_{s}``: float32 ``[max_loras, out_s]``, the slot's DoRA scale
      ``m / ||W + BA||``, read only where the table flags DoRA.

    Each (slot, slice)'s rank ``r`` and DoRA flag live in the model's ``SlotTable``
    (``ranks`` / ``dora``: this projection's columns); rows of A and B at or past ``r`` are
    never read, so nothing is ever zeroed. Until the model binds the slots to its table,
    they have a table of their own.

    Args:
        in_features: input width of the A buffers (the rank's columns when sharded).
        modules: the enabled slices as ``(module_name, column_offset, out_features)``, the
            rank's widths and offsets in the output the expand writes.
        max_loras, max_lora_rank: slot count and padded rank.
        dtype, device: of the A/B buffers (the DoRA scales are float32). When it is not
            the activations' dtype, ``shrink`` casts ``x`` to it and ``expand`` runs on
            ``y`` cast to it and copies the result back (one rounding to ``y``'s dtype).
        bias: None (no bias, or one the slots must not shift by), or the projection's bias
            as the expand's output sees it (``[out]``, indexed by the slices' offsets); DoRA
            rows then get ``(1 - scale) * bias`` added after the scaling. Kept as a view, or
            as a copy in ``dtype`` when the bias is in another (the weights are loaded
            before the slots are made).
        sharding: how the whole adapter tensors given to ``set_slot`` are cut for this
            tensor-parallel rank; None: kept whole.

    Raises:
        ValueError: a ``bias`` that does not cover the slices, or a ``sharding`` whose
            ranges do not match the slices' widths or ``in_features``.
    """

    def __init__(self, in_features: int, modules: Sequence[tuple[str, int, int]],
                 max_loras: int, max_lora_rank: int, dtype: torch.dtype,
                 device: torch.device, bias: torch.Tensor | None = None,
                 sharding: SlotSharding | None = None) -> None:
        super().__init__()
        self.module_names = tuple(name for name, _, _ in modules)
        self.output_slices = tuple((offset, size) for _, offset, size in modules)
        if bias is not None and (bias.dim() != 1 or any(
                offset + size > bias.shape[0] for offset, size in self.output_slices)):
            raise ValueError(f"a bias of {tuple(bias.shape)} does not cover the slices "
                             f"{list(self.output_slices)}")
        _check_sharding(sharding, modules, in_features)
        self.sharding = sharding
        self.dtype = dtype
        self.bias = None if bias is None else bias.to(dtype)
        self.max_loras = max_loras
        rank_range = None if sharding is None else sharding.rank_range
        self.rank_start = 0 if rank_range is None else rank_range[0]
        a_rank = max_lora_rank if rank_range is None else rank_range[1] - rank_range[0]
        for s, (_, _, size) in enumerate(modules):
            self.register_buffer(f"lora_a_{s}", torch.zeros(
                max_loras, a_rank, in_features, dtype=dtype, device=device))
            self.register_buffer(f"lora_b_{s}", torch.zeros(
                max_loras, max_lora_rank, size, dtype=dtype, device=device))
            self.register_buffer(f"dora_scale_{s}", torch.ones(
                max_loras, size, dtype=torch.float32, device=device))
        self.lora_a_stacked = self._stack("lora_a")
        self.lora_b_stacked = self._stack("lora_b")
        self.dora_scale_stacked = self._stack("dora_scale")
        SlotTable({(0, name): self for name in self.module_names}, max_loras, device)

    def _stack(self, prefix: str) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(self, f"{prefix}_{s}") for s in range(len(self.module_names)))

    def bind(self, table: SlotTable, rank_col: int) -> None:
        """Use columns ``[rank_col, rank_col + S)`` of ``table`` (``SlotTable`` calls this):
        ``ranks`` / ``dora`` become int32 ``[max_loras, S]`` views of them."""
        cols = slice(rank_col, rank_col + len(self.module_names))
        self.table, self.rank_col = table, rank_col
        self.ranks, self.dora = table.ranks[:, cols], table.dora[:, cols]

    @property
    def rank_sharded(self) -> bool:
        """Whether A is cut along the rank (fully sharded column-parallel): the shrink then
        yields only this rank's columns of the buffer."""
        return self.sharding is not None and self.sharding.rank_range is not None

    def set_slot(self, slot: int, module: str, a: torch.Tensor | None,
                 b: torch.Tensor | None, dora_scale: torch.Tensor | None = None) -> None:
        """Write one adapter's weights for ``module`` into ``slot`` (``a`` None: the adapter
        does not target it, rank 0), and the slot's entry of the rank table.

        The tensors are the adapter's whole ones; under tensor parallelism the slot keeps
        this rank's part (``sharding``). Only rows ``[0, r)`` of A and B are written;
        nothing is zeroed. Every copy is ``non_blocking`` and every write is enqueued on the
        current stream (a side stream when called under ``torch.cuda.stream``); nothing
        synchronises. The table entry holds the module's true rank ``r`` on every
        tensor-parallel rank (a rank-sharded shrink clamps it to its rank rows itself).

        Args:
            a: ``[r, in]``, 1 <= r <= max_lora_rank (``in``: the whole projection's input
                width).
            b: ``[out, r]`` with the LoRA scaling already folded in (``out``: the module's
                whole output width).
            dora_scale: DoRA only: float32 ``[out]``, ``m / ||W + b @ a||`` (host, possibly
                pinned, or device); None: plain LoRA.

        Raises:
            ValueError: ``module`` is not one of ``module_names``, ``a`` without ``b`` (or
                the reverse), shapes that do not match the slot buffers, or a
                ``dora_scale`` that is not ``[out]``.
        """
        s = self.module_names.index(module)
        col = self.rank_col + s
        if a is None or b is None:
            if a is not None or b is not None:
                raise ValueError(f"{module}: A and B must be given together")
            self.table.set(slot, col, 0, False)
            return
        sh = self.sharding
        full = self.output_slices[s][1] if sh is None else sh.full_out[s]
        a_buf, b_buf = self.lora_a_stacked[s][slot], self.lora_b_stacked[s][slot]
        r = a.shape[0]
        full_in = a_buf.shape[1] if sh is None or sh.in_range is None else None
        if (a.dim() != 2 or not 1 <= r <= b_buf.shape[0] or tuple(b.shape) != (full, r)
                or (full_in is not None and a.shape[1] != full_in)):
            raise ValueError(f"{module}: A {tuple(a.shape)} and B {tuple(b.shape)} do not fit "
                             f"rank <= {b_buf.shape[0]} slots of {full} outputs")
        if dora_scale is not None and tuple(dora_scale.shape) != (full,):
            raise ValueError(f"{module}: DoRA scale {tuple(dora_scale.shape)}, expected "
                             f"({full},)")
        if sh is not None and sh.out_ranges is not None:
            rows = slice(*sh.out_ranges[s])
            b = b[rows]
            dora_scale = None if dora_scale is None else dora_scale[rows]
        if b.device != b_buf.device:        # copy as stored, transpose on the device
            b = b.to(b_buf.device, non_blocking=True)
        b_buf[:r].copy_(b.t(), non_blocking=True)
        if sh is not None and sh.in_range is not None:
            a = a[:, sh.in_range[0]: sh.in_range[1]]
        if sh is not None and sh.rank_range is not None:
            a = a[sh.rank_range[0]: sh.rank_range[1]]
        if a.shape[0]:
            a_buf[: a.shape[0]].copy_(a, non_blocking=True)
        if dora_scale is not None:
            self.dora_scale_stacked[s][slot].copy_(dora_scale, non_blocking=True)
        self.table.set(slot, col, r, dora_scale is not None)

    def used(self, lora_meta: LoRAKernelMeta) -> bool:
        """Whether this projection launches its LoRA kernels in the step: one of its columns
        is in ``lora_meta.used_columns`` (an eager step: some slot of the step has a nonzero
        rank there; a CUDA-graph step: its kind is in the graph's projection mask), or
        ``lora_meta`` does not say (``used_columns`` None)."""
        cols = lora_meta.used_columns
        return cols is None or any(cols[self.rank_col: self.rank_col + len(self.module_names)])

    def shrink(self, x: torch.Tensor, lora_meta: LoRAKernelMeta) -> torch.Tensor:
        """``x [T, in] → float32 [T, S, R_a]``: every row through its slot's A (``R_a`` is
        this rank's part of the rank when ``rank_sharded``, else ``max_lora_rank``); ``x``
        in the slots' dtype first."""
        return lora_shrink(x.to(self.dtype), self.lora_a_stacked, self.ranks, lora_meta,
                           rank_start=self.rank_start)

    def expand(self, y: torch.Tensor, buffer: torch.Tensor, lora_meta: LoRAKernelMeta) -> None:
        """``y += expand(buffer)`` in place, DoRA-rescaled for the (slot, slice)s the table
        flags; ``buffer`` float32 ``[T, S, max_lora_rank]``, ``y [T, out]`` (in another
        dtype than the slots': updated through a copy in theirs)."""
        out = y.to(self.dtype)
        lora_expand(out, buffer, self.lora_b_stacked, self.ranks, lora_meta, self.output_slices,
                    self.dora, self.dora_scale_stacked, self.bias)
        if out is not y:
            y.copy_(out)

    def apply(self, x: torch.Tensor, y: torch.Tensor, lora_meta: LoRAKernelMeta) -> None:
        """``y += expand(shrink(x))`` for every enabled slice, DoRA-rescaled where the table
        flags it; ``x [T, in]``, ``y [T, out]`` (bias included). Slots with
        ``rank_sharded`` need the buffer all-gathered in between: use ``shrink`` and
        ``expand``."""
        self.expand(y, self.shrink(x, lora_meta), lora_meta)


def _check_sharding(sharding: SlotSharding | None, modules: Sequence[tuple[str, int, int]],
                    in_features: int) -> None:
    if sharding is None:
        return
    widths = [size for _, _, size in modules]
    if len(sharding.full_out) != len(widths):
        raise ValueError(f"sharding gives {len(sharding.full_out)} module widths for "
                         f"{len(widths)} slices")
    ranges = sharding.out_ranges
    if ranges is None and list(sharding.full_out) != widths:
        raise ValueError(f"unsharded outputs {widths} differ from {list(sharding.full_out)}")
    if ranges is not None and (len(ranges) != len(widths) or any(
            not 0 <= lo <= hi <= full or hi - lo != w
            for (lo, hi), full, w in zip(ranges, sharding.full_out, widths))):
        raise ValueError(f"output ranges {ranges} do not fit slices {widths} of "
                         f"{list(sharding.full_out)}")
    if sharding.in_range is not None and (
            sharding.in_range[1] - sharding.in_range[0] != in_features):
        raise ValueError(f"input range {sharding.in_range} is not {in_features} wide")
