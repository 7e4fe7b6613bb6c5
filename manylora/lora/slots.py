"""Device-resident adapter slots of one packed projection, and their writer.

Slot buffers are allocated once, up front (vLLM's ``lora_a_stacked`` / ``lora_b_stacked``;
Punica's per-slot adapter stacks), one ``LoRASlots`` per LoRA-enabled packed projection,
only for the modules in ``LoRAConfig.target_modules``. ``set_slot`` writes one adapter's
tensors into a slot and, under tensor parallelism, keeps the rank's part of them
(``SlotSharding``; the split is explained in ``manylora.lora.linear``). ``shrink`` /
``expand`` run the step's Punica ops over the buffers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from manylora.lora.punica import LoRAMapping
from manylora.ops.lora_expand import lora_expand
from manylora.ops.lora_shrink import lora_shrink


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

    Buffers, per enabled slice ``s`` (module name ``modules[s]``):

    * ``lora_a_{s}: [max_loras, R, in_features]`` and
      ``lora_b_{s}: [max_loras, out_s, max_lora_rank]``, in the model dtype, zero where a
      slot holds no adapter or the adapter does not target that module (``R`` is
      ``max_lora_rank``, or the width of ``sharding.rank_range``);
    * ``dora_scale_{s}``: float32 ``[max_loras, out_s]``, the slot's DoRA scale
      ``m / ||W + BA||`` (ones where the slot's adapter has none for that module);
    * ``dora_shift_{s}`` (only for a projection with a bias): float32 ``[max_loras, out_s]``,
      ``(1 - scale) * bias_s``, so that the expand's ``(y + delta) * scale + shift`` of a row
      whose ``y`` includes the bias is DoRA's ``scale * (x W^T + delta) + bias``.

    Args:
        in_features: input width of the A buffers (the rank's columns when sharded).
        modules: the enabled slices as ``(module_name, column_offset, out_features)``, the
            rank's widths and offsets in the output the expand writes.
        max_loras, max_lora_rank: slot count and padded rank.
        dtype, device: of the A/B buffers (the DoRA buffers are float32).
        biases: None (no bias, or one the slots must not shift by), or per enabled slice its
            bias ``[out_s]`` (views of the projection's bias, read whenever a slot is written).
        sharding: how the whole adapter tensors given to ``set_slot`` are cut for this
            tensor-parallel rank; None: kept whole.

    Raises:
        ValueError: ``biases`` that are not one ``[out_s]`` tensor per slice, or a
            ``sharding`` whose ranges do not match the slices' widths or ``in_features``.
    """

    def __init__(self, in_features: int, modules: Sequence[tuple[str, int, int]],
                 max_loras: int, max_lora_rank: int, dtype: torch.dtype,
                 device: torch.device, biases: Sequence[torch.Tensor] | None = None,
                 sharding: SlotSharding | None = None) -> None:
        super().__init__()
        self.module_names = tuple(name for name, _, _ in modules)
        self.output_slices = tuple((offset, size) for _, offset, size in modules)
        if biases is not None and [tuple(b.shape) for b in biases] != [
                (size,) for _, _, size in modules]:
            raise ValueError(f"biases {[tuple(b.shape) for b in biases]} do not match the "
                             f"slices {list(self.output_slices)}")
        _check_sharding(sharding, modules, in_features)
        self.sharding = sharding
        self.biases = None if biases is None else tuple(biases)
        rank_range = None if sharding is None else sharding.rank_range
        a_rank = max_lora_rank if rank_range is None else rank_range[1] - rank_range[0]
        for s, (_, _, size) in enumerate(modules):
            self.register_buffer(f"lora_a_{s}", torch.zeros(
                max_loras, a_rank, in_features, dtype=dtype, device=device))
            self.register_buffer(f"lora_b_{s}", torch.zeros(
                max_loras, size, max_lora_rank, dtype=dtype, device=device))
            self.register_buffer(f"dora_scale_{s}", torch.ones(
                max_loras, size, dtype=torch.float32, device=device))
            if biases is not None:
                self.register_buffer(f"dora_shift_{s}", torch.zeros(
                    max_loras, size, dtype=torch.float32, device=device))

    def _stack(self, prefix: str) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(self, f"{prefix}_{s}") for s in range(len(self.module_names)))

    @property
    def lora_a_stacked(self) -> tuple[torch.Tensor, ...]:
        return self._stack("lora_a")

    @property
    def lora_b_stacked(self) -> tuple[torch.Tensor, ...]:
        return self._stack("lora_b")

    @property
    def dora_scale_stacked(self) -> tuple[torch.Tensor, ...]:
        """Per slice float32 ``[max_loras, out_s]``: each slot's DoRA scales."""
        return self._stack("dora_scale")

    @property
    def dora_shift_stacked(self) -> tuple[torch.Tensor, ...] | None:
        """Per slice float32 ``[max_loras, out_s]``: ``(1 - scale) * bias``; None without a
        bias."""
        return None if self.biases is None else self._stack("dora_shift")

    @property
    def rank_sharded(self) -> bool:
        """Whether A is cut along the rank (fully sharded column-parallel): the shrink then
        yields only this rank's columns of the buffer."""
        return self.sharding is not None and self.sharding.rank_range is not None

    def set_slot(self, slot: int, module: str, a: torch.Tensor | None,
                 b: torch.Tensor | None, dora_scale: torch.Tensor | None = None) -> None:
        """Copy one adapter's weights for ``module`` into ``slot`` (zeros when ``a`` is None).

        The tensors are the adapter's whole ones; under tensor parallelism the slot keeps
        this rank's part (``sharding``). Every copy is ``non_blocking`` and every write is
        enqueued on the current stream (a side stream when called under
        ``torch.cuda.stream``); nothing synchronises.

        Args:
            a: ``[r, in]``, r ≤ max_lora_rank (``in``: the whole projection's input width).
            b: ``[out, r]`` with the LoRA scaling already folded in (``out``: the module's
                whole output width).
            dora_scale: DoRA only: float32 ``[out]``, ``m / ||W + b @ a||`` (host, possibly
                pinned, or device); None writes ones (plain LoRA). The slot's shift becomes
                ``(1 - dora_scale) * bias``.

        Raises:
            ValueError: ``module`` is not one of ``module_names``, or ``dora_scale`` is not
                ``[out]``.
        """
        s = self.module_names.index(module)
        sh = self.sharding
        full = self.output_slices[s][1] if sh is None else sh.full_out[s]
        if dora_scale is not None and tuple(dora_scale.shape) != (full,):
            raise ValueError(f"{module}: DoRA scale {tuple(dora_scale.shape)}, expected "
                             f"({full},)")
        a_buf, b_buf = self.lora_a_stacked[s][slot], self.lora_b_stacked[s][slot]
        a_buf.zero_()
        b_buf.zero_()
        if sh is not None and sh.out_ranges is not None:
            rows = slice(*sh.out_ranges[s])
            b = None if b is None else b[rows]
            dora_scale = None if dora_scale is None else dora_scale[rows]
        if a is not None and b is not None:
            r = a.shape[0]
            b_buf[:, :r].copy_(b, non_blocking=True)
            if sh is not None and sh.in_range is not None:
                a = a[:, sh.in_range[0]: sh.in_range[1]]
            if sh is not None and sh.rank_range is not None:
                a = a[sh.rank_range[0]: sh.rank_range[1]]
            a_buf[: a.shape[0]].copy_(a, non_blocking=True)
        self._set_dora(s, slot, dora_scale)

    def _set_dora(self, s: int, slot: int, dora_scale: torch.Tensor | None) -> None:
        """Write slice ``s``'s DoRA scale row of ``slot`` (ones for None) and its shift
        ``(1 - scale) * bias``, computed on the scales' device after their copy."""
        scale = self.dora_scale_stacked[s][slot]
        if dora_scale is None:
            scale.fill_(1.0)
        else:
            scale.copy_(dora_scale, non_blocking=True)
        if self.biases is None:
            return
        shift = self.dora_shift_stacked[s][slot]
        if dora_scale is None:
            shift.zero_()
        else:
            torch.mul(1.0 - scale, self.biases[s], out=shift)

    def shrink(self, x: torch.Tensor, mapping: LoRAMapping) -> torch.Tensor:
        """``x [T, in] → float32 [T, S, R]``: every row through its slot's A (``R`` is this
        rank's part of the rank when ``rank_sharded``, else ``max_lora_rank``)."""
        if self.rank_sharded:
            start, stop = self.sharding.rank_range
            mapping = _local_ranks(mapping, start, stop - start)
        return lora_shrink(x, self.lora_a_stacked, mapping)

    def expand(self, y: torch.Tensor, buffer: torch.Tensor, mapping: LoRAMapping) -> None:
        """``y += expand(buffer)`` in place, DoRA-rescaled for the slots flagged in
        ``mapping.slot_dora``; ``buffer`` float32 ``[T, S, max_lora_rank]``, ``y [T, out]``."""
        lora_expand(y, buffer, self.lora_b_stacked, mapping, self.output_slices,
                    self.dora_scale_stacked, self.dora_shift_stacked)

    def apply(self, x: torch.Tensor, y: torch.Tensor, mapping: LoRAMapping) -> None:
        """``y += expand(shrink(x))`` for every enabled slice, DoRA-rescaled for the slots
        flagged in ``mapping.slot_dora``; ``x [T, in]``, ``y [T, out]`` (bias included).
        Slots with ``rank_sharded`` need the buffer all-gathered in between: use
        ``shrink`` and ``expand``."""
        self.expand(y, self.shrink(x, mapping), mapping)


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


def _local_ranks(mapping: LoRAMapping, start: int, width: int) -> LoRAMapping:
    """The mapping seen by rows ``[start, start + width)`` of every slot's A: each slot's
    rank becomes how many of its rows fall there (so kernels read no row past it)."""
    ranks = (mapping.slot_ranks - start).clamp_(0, width)
    segments = tuple(seg._replace(rank=min(max(seg.rank - start, 0), width))
                     for seg in mapping.segments)
    return mapping._replace(slot_ranks=ranks, segments=segments)
