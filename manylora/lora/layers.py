"""The one LoRA-aware linear layer every adapter-targetable projection runs through.

A packed projection (q/k/v, gate/up) is one base matmul over the fused weight followed by
one shrink and one expand over all its LoRA-enabled slices and all adapters of the step
(Punica; vLLM's ``MergedColumnParallelLinearWithLoRA``)::

    y      = x W^T (+ b)                                  all rows, base weights read once
    buffer = shrink(x, (A_s)_s, mapping)                  [T, S, max_lora_rank] float32
    y     += expand(buffer, (B_s)_s, mapping)             in place, per slice's columns

For the rows of a DoRA adapter (Liu et al. 2024; peft's ``use_dora``) the expand also
rescales: ``y = (y + delta) * scale + shift`` with ``scale = m / ||W + BA||`` and
``shift = (1 - scale) * b``, i.e. ``scale * (x W^T + delta) + b``.

Slot buffers are allocated once, up front (vLLM's ``lora_a_stacked`` / ``lora_b_stacked``)
and only for the projections in ``LoRAConfig.target_modules``.

Tensor parallelism (Megatron-LM's split; the adapters' split of TensorRT-LLM's "LoRA with
tensor parallel" and vLLM's ``ColumnParallelLinearWithLoRA`` /
``RowParallelLinearWithLoRA``). Slots always receive an adapter's whole tensors and keep
the rank's part:

* column-parallel (``qkv_proj``, ``gate_up_proj``; output rows split): A ``[r, in]`` whole
  on every rank, B and the DoRA scales cut to the rank's output rows of each packed module::

      y_i = x W_i^T (+ b_i);  y_i += expand(shrink(x, A), B_i)

* row-parallel (``o_proj``, ``down_proj``; input columns split): A cut to the rank's input
  columns, B whole. ``x_i A_i^T`` summed over ranks is ``x A^T``, so the delta is added to
  the partial output before the all-reduce, and the bias once after it::

      y = all_reduce(x_i W_i^T + expand(shrink(x_i, A_i), B)) + b

  A DoRA row stays exact: ``sum_i scale * (y_i + delta_i) + b = scale * (x W^T + delta) + b``.

With ``fully_sharded`` (vLLM's ``fully_sharded_loras``, after S-LoRA) the replicated half is
split too, for more collectives:

* column-parallel: A cut along the (padded) rank; each rank shrinks to its ``max_lora_rank /
  tp`` columns of the buffer and the buffer is all-gathered along the rank;
* row-parallel: B cut to the rank's output columns; the shrink buffer is all-reduced, the
  base output all-reduced (plus bias), the rank expands its columns and the columns are
  all-gathered: ``y = all_gather_i((all_reduce(x W^T) + b)[:, cols_i] + delta[:, cols_i])``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from manylora.distributed.parallel_state import TPGroup
from manylora.lora.punica import LoRAMapping
from manylora.model.weight_loader import TPSlice
from manylora.ops.lora_expand import lora_expand
from manylora.ops.lora_shrink import lora_shrink
from manylora.ops.triton_skinny import base_linear

#: ``LoRALinear(parallel=...)`` values: not split, output rows split, input columns split.
PARALLEL_MODES = (None, "column", "row")


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


class LoRALinear(nn.Module):
    """A (possibly packed, possibly tensor-parallel) linear projection that applies each
    row's own adapter delta.

    Args:
        in_features: the whole projection's input width.
        output_sizes: the whole widths of the packed modules, e.g. ``(q, kv, kv)``; one entry
            if unpacked.
        module_names: HF names of those modules, e.g. ``("q_proj", "k_proj", "v_proj")``.
        bias: whether the projection has a bias.
        dtype, device: of the weights.
        parallel: None (whole on every rank), ``"column"`` (output rows split, Megatron's
            ColumnParallelLinear) or ``"row"`` (input columns split, RowParallelLinear; one
            module only). Ignored on a group of one rank.
        tp: the tensor-parallel group (None: a single rank).
        output_ranges: column-parallel only: per module, the rows ``[start, stop)`` of the
            whole module this rank holds (e.g. a replicated KV head); None: an even split.

    Parameters: ``weight [sum(local output sizes), local in]`` and optionally ``bias`` (the
    local rows for column-parallel, whole for row-parallel). Under tensor parallelism each
    carries ``tp_dim`` and ``tp_slices`` (``TPSlice`` per module) so that the weight loader
    reads only the rank's rows (column) or columns (row) of each checkpoint tensor.
    Forward: ``x [T, local in]`` and the step's ``LoRAMapping`` (None: no adapters) →
    ``[T, local out]`` (column) or ``[T, out]`` summed over ranks (row). Every rank of the
    group must run the forward of a row-parallel or fully sharded layer together.

    Raises:
        ValueError: an unknown ``parallel``, a row-parallel projection of several modules,
            ``output_ranges`` of another length or outside the modules, or a width not
            divisible by the group size where an even split is needed.
    """

    def __init__(self, in_features: int, output_sizes: Sequence[int],
                 module_names: Sequence[str], bias: bool, dtype: torch.dtype,
                 device: torch.device, parallel: str | None = None, tp: TPGroup | None = None,
                 output_ranges: Sequence[tuple[int, int]] | None = None) -> None:
        super().__init__()
        if parallel not in PARALLEL_MODES:
            raise ValueError(f"parallel must be one of {PARALLEL_MODES}, got {parallel!r}")
        self.tp = tp or TPGroup.single()
        self.parallel = parallel if self.tp.size > 1 else None
        self.module_names = tuple(module_names)
        self.full_in_features = in_features
        self.full_output_sizes = tuple(output_sizes)
        self.output_ranges, self.in_range = self._ranges(output_ranges)
        self.output_sizes = tuple(hi - lo for lo, hi in self.output_ranges)
        self.in_features = self.in_range[1] - self.in_range[0]
        out = sum(self.output_sizes)
        self.weight = nn.Parameter(torch.empty(out, self.in_features, dtype=dtype,
                                               device=device), requires_grad=False)
        bias_rows = sum(self.full_output_sizes) if self.parallel == "row" else out
        self.bias = (nn.Parameter(torch.empty(bias_rows, dtype=dtype, device=device),
                                  requires_grad=False) if bias else None)
        self._mark_tp_params()
        self.lora: LoRASlots | None = None
        self.fully_sharded = False
        self._lora_cols: tuple[int, int] | None = None

    def _ranges(self, output_ranges: Sequence[tuple[int, int]] | None
                ) -> tuple[tuple[tuple[int, int], ...], tuple[int, int]]:
        whole = tuple((0, n) for n in self.full_output_sizes)
        if output_ranges is not None and self.parallel != "column":
            raise ValueError("output_ranges are for column-parallel projections on several "
                             "ranks only")
        if self.parallel == "column":
            if output_ranges is None:
                output_ranges = [self.tp.even_range(n, f"{name} output")
                                 for name, n in zip(self.module_names, self.full_output_sizes)]
            ranges = tuple((int(lo), int(hi)) for lo, hi in output_ranges)
            if len(ranges) != len(whole) or any(
                    not 0 <= lo <= hi <= n for (lo, hi), n in zip(ranges,
                                                                  self.full_output_sizes)):
                raise ValueError(f"output ranges {ranges} do not fit the modules "
                                 f"{self.full_output_sizes}")
            return ranges, (0, self.full_in_features)
        if self.parallel == "row":
            if len(self.module_names) != 1:
                raise ValueError(f"a row-parallel projection has one module, not "
                                 f"{self.module_names}")
            names = "/".join(self.module_names)
            return whole, self.tp.even_range(self.full_in_features, f"{names} input")
        return whole, (0, self.full_in_features)

    def _mark_tp_params(self) -> None:
        """``tp_dim`` and ``tp_slices`` on the parameters the rank holds a slice of."""
        if self.parallel == "column":
            parts = tuple(TPSlice(0, lo, hi, n, hi - lo)
                          for (lo, hi), n in zip(self.output_ranges, self.full_output_sizes))
            for p in (self.weight, self.bias):
                if p is not None:
                    p.tp_dim, p.tp_slices = 0, parts
        elif self.parallel == "row":
            lo, hi = self.in_range
            self.weight.tp_dim = 1
            self.weight.tp_slices = (TPSlice(1, lo, hi, self.full_in_features, hi - lo),)

    def create_lora_slots(self, enabled: Sequence[str], max_loras: int, max_lora_rank: int,
                          fully_sharded: bool = False) -> LoRASlots | None:
        """Allocate slot buffers for the modules in ``enabled`` (None if none is enabled);
        with a bias, the slots keep views of each enabled module's bias slice for DoRA.

        Args:
            fully_sharded: also split the replicated half of each adapter across the ranks
                (vLLM's ``fully_sharded_loras``); no effect on one rank.

        Raises:
            ValueError: ``fully_sharded`` column-parallel with ``max_lora_rank`` not
                divisible by the group size, or row-parallel with an output width not
                divisible by it.
        """
        modules, kept, offset = [], [], 0
        for name, size, rng, full in zip(self.module_names, self.output_sizes,
                                         self.output_ranges, self.full_output_sizes):
            if name in enabled:
                modules.append((name, offset, size))
                kept.append((rng, full))
            offset += size
        if not modules:
            return self.lora
        self.fully_sharded = fully_sharded and self.parallel is not None
        bias = None if self.bias is None else self.bias.detach()
        biases = None if bias is None else [bias[o: o + n] for _, o, n in modules]
        in_features, sharding = self.in_features, None
        full_out = tuple(full for _, full in kept)
        if self.parallel == "column":
            rank_range = (self.tp.even_range(max_lora_rank, "max_lora_rank")
                          if self.fully_sharded else None)
            sharding = SlotSharding(full_out, tuple(rng for rng, _ in kept), None, rank_range)
        elif self.parallel == "row" and not self.fully_sharded:
            # The bias is added once after the all-reduce: the slots shift by nothing.
            sharding, biases = SlotSharding(full_out, None, self.in_range), None
        elif self.parallel == "row":
            name, full = modules[0][0], full_out[0]
            lo, hi = self.tp.even_range(full, f"{name} output (fully sharded LoRA)")
            self._lora_cols = (lo, hi)
            modules = [(name, 0, hi - lo)]
            biases = None if bias is None else [bias[lo:hi]]
            sharding = SlotSharding(full_out, ((lo, hi),), self.in_range)
        self.lora = LoRASlots(in_features, modules, max_loras, max_lora_rank,
                              self.weight.dtype, self.weight.device, biases, sharding)
        return self.lora

    def module_weight(self, module: str) -> torch.Tensor:
        """The rows of the (packed) weight that belong to ``module``: ``[out_s, in_features]``
        (this rank's rows and columns under tensor parallelism).

        Raises:
            ValueError: ``module`` is not one of ``module_names``.
        """
        i = self.module_names.index(module)
        start = sum(self.output_sizes[:i])
        return self.weight[start: start + self.output_sizes[i]]

    def dora_norm(self, module: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``||W + b @ a||`` per output row of ``module``'s whole weight, float32 ``[out]``
        on every rank (``dora_row_norm_tp`` over this rank's part). A collective: every rank
        must call it, for the same module, together.

        Args:
            a: the adapter's whole ``[r, in]``; b: its whole ``[out, r]`` (scaling folded).

        Raises:
            ValueError: ``module`` is not one of ``module_names``.
        """
        i = self.module_names.index(module)
        return dora_row_norm_tp(self.module_weight(module), a, b, self.tp, self.parallel,
                                out_range=self.output_ranges[i], in_range=self.in_range)

    def forward(self, x: torch.Tensor, mapping: LoRAMapping | None) -> torch.Tensor:
        lora = self.lora if mapping is not None and mapping.has_lora else None
        if self.parallel != "row":
            y = base_linear(x, self.weight, self.bias)
            if lora is not None:
                buffer = lora.shrink(x, mapping)
                if lora.rank_sharded:
                    buffer = self.tp.all_gather(buffer, dim=-1)       # [T, S, max_lora_rank]
                lora.expand(y, buffer, mapping)
            return y
        y = base_linear(x, self.weight)                              # partial sum [T, out]
        if lora is None or not self.fully_sharded:
            if lora is not None:
                lora.expand(y, lora.shrink(x, mapping), mapping)      # partial delta too
            y = self.tp.all_reduce(y)
            return y if self.bias is None else y.add_(self.bias)
        buffer = self.tp.all_reduce(lora.shrink(x, mapping))          # x A^T, [T, 1, r]
        y = self.tp.all_reduce(y)
        if self.bias is not None:
            y.add_(self.bias)
        lo, hi = self._lora_cols
        part = y[:, lo:hi].contiguous()
        lora.expand(part, buffer, mapping)
        return self.tp.all_gather(part, dim=-1)


def dora_row_norm(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                  rows_per_chunk: int = 4096) -> torch.Tensor:
    """``||W + b @ a||`` per output row, what DoRA normalizes its magnitude by (peft's
    ``get_weight_norm``; Liu et al. 2024), in float32, a chunk of rows at a time.

    Args:
        weight: the base weight ``W`` ``[out, in]`` (any float dtype, any device).
        a: ``[r, in]``; b: ``[out, r]`` with the LoRA scaling folded in.

    Returns:
        float32 ``[out]`` on ``weight``'s device.
    """
    a32 = a.to(weight.device, torch.float32)
    b32 = b.to(weight.device, torch.float32)
    out = torch.empty(weight.shape[0], dtype=torch.float32, device=weight.device)
    for i in range(0, weight.shape[0], rows_per_chunk):
        w = weight[i: i + rows_per_chunk].float() + b32[i: i + rows_per_chunk] @ a32
        out[i: i + rows_per_chunk] = torch.linalg.vector_norm(w, dim=1)
    return out


def dora_row_norm_tp(weight_shard: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                     tp: TPGroup, parallel: str | None, *,
                     out_range: tuple[int, int] | None = None,
                     in_range: tuple[int, int] | None = None,
                     rows_per_chunk: int = 4096) -> torch.Tensor:
    """``||W + b @ a||`` per output row of the whole weight ``W`` when this rank holds only
    ``weight_shard`` of it (DoRA, Liu et al. 2024, under Megatron-LM's split). Every rank
    gets the same full-length result, so an adapter's DoRA scale stays one whole ``[out]``
    vector that ``LoRASlots.set_slot`` cuts like B's rows.

    * ``parallel="column"``: the rank has whole rows ``out_range`` of ``W``; it computes their
      norms and the ranks' norms are all-gathered into place (rows held by several ranks,
      replicated KV heads, come out the same from each).
    * ``parallel="row"``: the rank has columns ``in_range`` of every row; the partial squared
      sums ``||W_i + b @ a[:, in_range]||^2`` are all-reduced, then square-rooted.
    * None or one rank: ``dora_row_norm(weight_shard, a, b)``.

    A collective at more than one rank: every rank of ``tp`` must call it, for the same
    module, with the same ``a`` and ``b``, in the same order as the others.

    Args:
        weight_shard: this rank's part of ``W`` (``[rows, in]`` or ``[out, cols]``), any float
            dtype and device (the device the collectives run on).
        a: the adapter's whole ``[r, in]``; b: its whole ``[out, r]``, scaling folded in.
        tp: the tensor-parallel group.
        parallel: None, ``"column"`` or ``"row"``.
        out_range: column: this rank's rows of ``W`` (default: an even split).
        in_range: row: this rank's columns of ``W`` (default: an even split).

    Returns:
        float32 ``[out]`` on ``weight_shard``'s device.

    Raises:
        ValueError: an unknown ``parallel``, or ranges that do not match ``weight_shard``.
    """
    if parallel not in PARALLEL_MODES:
        raise ValueError(f"parallel must be one of {PARALLEL_MODES}, got {parallel!r}")
    if parallel is None or tp.size == 1:
        return dora_row_norm(weight_shard, a, b, rows_per_chunk)
    if parallel == "column":
        lo, hi = out_range or tp.even_range(b.shape[0], "DoRA output")
        if hi - lo != weight_shard.shape[0]:
            raise ValueError(f"rows {(lo, hi)} do not match a weight shard of "
                             f"{tuple(weight_shard.shape)}")
        local = dora_row_norm(weight_shard, a, b[lo:hi], rows_per_chunk)
        norms = tp.all_gather(local, dim=0).view(tp.size, hi - lo)
        starts = tp.all_gather(torch.tensor([lo], dtype=torch.int64,
                                            device=weight_shard.device), dim=0).tolist()
        out = torch.empty(b.shape[0], dtype=torch.float32, device=weight_shard.device)
        for start, part in zip(starts, norms):
            out[start: start + part.shape[0]] = part
        return out
    lo, hi = in_range or tp.even_range(a.shape[1], "DoRA input")
    if hi - lo != weight_shard.shape[1]:
        raise ValueError(f"columns {(lo, hi)} do not match a weight shard of "
                         f"{tuple(weight_shard.shape)}")
    a32 = a[:, lo:hi].to(weight_shard.device, torch.float32)
    b32 = b.to(weight_shard.device, torch.float32)
    sq = torch.empty(weight_shard.shape[0], dtype=torch.float32, device=weight_shard.device)
    for i in range(0, weight_shard.shape[0], rows_per_chunk):
        w = weight_shard[i: i + rows_per_chunk].float() + b32[i: i + rows_per_chunk] @ a32
        sq[i: i + rows_per_chunk] = w.square().sum(dim=1)
    return tp.all_reduce(sq).sqrt_()
