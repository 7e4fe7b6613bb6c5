"""The one LoRA-aware linear layer every adapter-targetable projection runs through.

A packed projection (q/k/v, gate/up) is one base product over the fused weight followed by
one shrink and one expand over all its LoRA-enabled slices and all adapters of the step
(Punica; vLLM's ``MergedColumnParallelLinearWithLoRA``)::

    y      = linear_method.apply(x) (+ b)                 all rows, base weights read once
    buffer = shrink(x, (A_s)_s, lora_meta)                  [T, S, max_lora_rank] float32
    y     += expand(buffer, (B_s)_s, lora_meta)             in place, per slice's columns

For the rows of a DoRA adapter (Liu et al. 2024; peft's ``use_dora``) the expand also
rescales: ``y = (y + delta) * scale + shift`` with ``scale = m / ||W + BA||`` and
``shift = (1 - scale) * b`` (computed by the expand from the bias), i.e.
``scale * (x W^T + delta) + b``. Which (slot, module)s are DoRA, and each one's rank (0: not
targeted, nothing launched or read for it), come from the model's ``SlotTable``.

How the base product is computed and its weights stored is the layer's linear method
(``manylora.ops.linear_method``: dense today); the shrink and expand are the same for every
method.

The slot buffers (``manylora.lora.slots``) are allocated once, up front, and only for the
projections in ``LoRAConfig.target_modules``.

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
  tp`` columns of the buffer (each (slot, module)'s rank clamped to those rows in the kernel)
  and the buffer is all-gathered along the rank;
* row-parallel: B cut to the rank's output columns; the shrink buffer is all-reduced, the
  base output all-reduced (plus bias), the rank expands its columns and the columns are
  all-gathered: ``y = all_gather_i((all_reduce(x W^T) + b)[:, cols_i] + delta[:, cols_i])``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from manylora.checkpoint.weights import TPSlice
from manylora.distributed.parallel_state import PARALLEL_MODES, TPGroup
from manylora.lora.dora import dora_row_norm_tp
from manylora.lora.kernels.meta import LoRAKernelMeta
from manylora.lora.slots import LoRASlots, SlotSharding
from manylora.ops.linear_method import LinearMethodBase, UnquantizedLinearMethod


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
            whole module this rank holds (e.g. a replicated KV head, or an uneven share of
            heads); None: an even split.
        in_range: row-parallel only: the input columns ``[start, stop)`` this rank holds
            (e.g. an uneven share of attention heads); None: an even split.
        linear_method: how the base product is computed and the weight stored (vLLM's
            ``quant_method``); None: ``UnquantizedLinearMethod`` (a dense weight).

    Parameters: the linear method's (dense: ``weight [sum(local output sizes), local in]``)
    and optionally ``bias`` (the local rows for column-parallel, whole for row-parallel).
    Under tensor parallelism the method receives ``tp_dim`` and ``tp_slices`` (``TPSlice``
    per module, in the dense layout) for its weights, and the bias carries them, so that
    the weight loader reads only the rank's rows (column) or columns (row) of each
    checkpoint tensor.
    Forward: ``x [T, local in]`` and the step's ``LoRAKernelMeta`` (None: no adapters) →
    ``[T, local out]`` (column) or ``[T, out]`` summed over ranks (row). Every rank of the
    group must run the forward of a row-parallel or fully sharded layer together. An eager
    step whose slots none targets this projection (``LoRASlots.used``: the rank table's
    host mirror, the same on every rank) launches no LoRA kernel and no LoRA collective;
    a CUDA-graph step always launches (the kernels return at rank 0).

    Raises:
        ValueError: an unknown ``parallel``, a row-parallel projection of several modules,
            ``output_ranges`` of another length or outside the modules, ``in_range`` outside
            the input, either on a projection of another kind, or a width not divisible by
            the group size where an even split is needed.
    """

    def __init__(self, in_features: int, output_sizes: Sequence[int],
                 module_names: Sequence[str], bias: bool, dtype: torch.dtype,
                 device: torch.device, parallel: str | None = None, tp: TPGroup | None = None,
                 output_ranges: Sequence[tuple[int, int]] | None = None,
                 in_range: tuple[int, int] | None = None,
                 linear_method: LinearMethodBase | None = None) -> None:
        super().__init__()
        if parallel not in PARALLEL_MODES:
            raise ValueError(f"parallel must be one of {PARALLEL_MODES}, got {parallel!r}")
        self.tp = tp or TPGroup.single()
        self.parallel = parallel if self.tp.size > 1 else None
        self.module_names = tuple(module_names)
        self.full_in_features = in_features
        self.full_output_sizes = tuple(output_sizes)
        self.output_ranges, self.in_range = self._ranges(output_ranges, in_range)
        self.output_sizes = tuple(hi - lo for lo, hi in self.output_ranges)
        self.in_features = self.in_range[1] - self.in_range[0]
        out = sum(self.output_sizes)
        self.params_dtype = dtype
        self.linear_method = linear_method or UnquantizedLinearMethod()
        weight_attrs = self._tp_attrs()
        self.linear_method.create_weights(self, self.in_features, out, dtype,
                                          torch.device(device), weight_attrs)
        bias_rows = sum(self.full_output_sizes) if self.parallel == "row" else out
        self.bias = (nn.Parameter(torch.empty(bias_rows, dtype=dtype, device=device),
                                  requires_grad=False) if bias else None)
        if self.bias is not None and self.parallel == "column":
            self.bias.tp_dim, self.bias.tp_slices = 0, weight_attrs["tp_slices"]
        self.lora: LoRASlots | None = None
        self.fully_sharded = False
        self._lora_cols: tuple[int, int] | None = None

    def _ranges(self, output_ranges: Sequence[tuple[int, int]] | None,
                in_range: tuple[int, int] | None
                ) -> tuple[tuple[tuple[int, int], ...], tuple[int, int]]:
        whole = tuple((0, n) for n in self.full_output_sizes)
        if output_ranges is not None and self.parallel != "column":
            raise ValueError("output_ranges are for column-parallel projections on several "
                             "ranks only")
        if in_range is not None and self.parallel != "row":
            raise ValueError("in_range is for row-parallel projections on several ranks only")
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
            if in_range is None:
                names = "/".join(self.module_names)
                return whole, self.tp.even_range(self.full_in_features, f"{names} input")
            lo, hi = int(in_range[0]), int(in_range[1])
            if not 0 <= lo <= hi <= self.full_in_features:
                raise ValueError(f"input range {(lo, hi)} does not fit the input of "
                                 f"{self.full_in_features}")
            return whole, (lo, hi)
        return whole, (0, self.full_in_features)

    def _tp_attrs(self) -> dict[str, object]:
        """``tp_dim`` and ``tp_slices`` of the dense weight ``[out, in]``: the rank's rows of
        each packed module (column-parallel) or its input columns (row-parallel); empty when
        the rank holds the whole weight."""
        if self.parallel == "column":
            parts = tuple(TPSlice(0, lo, hi, n, hi - lo)
                          for (lo, hi), n in zip(self.output_ranges, self.full_output_sizes))
            return {"tp_dim": 0, "tp_slices": parts}
        if self.parallel == "row":
            lo, hi = self.in_range
            return {"tp_dim": 1,
                    "tp_slices": (TPSlice(1, lo, hi, self.full_in_features, hi - lo),)}
        return {}

    def create_lora_slots(self, enabled: Sequence[str], max_loras: int, max_lora_rank: int,
                          fully_sharded: bool = False,
                          dtype: torch.dtype | None = None) -> LoRASlots | None:
        """Allocate slot buffers for the modules in ``enabled`` (None if none is enabled);
        with a bias, the slots keep a view of it (as the expand's output sees it) for DoRA.

        Args:
            fully_sharded: also split the replicated half of each adapter across the ranks
                (vLLM's ``fully_sharded_loras``); no effect on one rank.
            dtype: of the slot buffers (``LoRAConfig.dtype``); None: the weight's.

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
        in_features, sharding = self.in_features, None
        full_out = tuple(full for _, full in kept)
        if self.parallel == "column":
            rank_range = (self.tp.even_range(max_lora_rank, "max_lora_rank")
                          if self.fully_sharded else None)
            sharding = SlotSharding(full_out, tuple(rng for rng, _ in kept), None, rank_range)
        elif self.parallel == "row" and not self.fully_sharded:
            # The bias is added once after the all-reduce: the slots shift by nothing.
            sharding, bias = SlotSharding(full_out, None, self.in_range), None
        elif self.parallel == "row":
            name, full = modules[0][0], full_out[0]
            lo, hi = self.tp.even_range(full, f"{name} output (fully sharded LoRA)")
            self._lora_cols = (lo, hi)
            modules = [(name, 0, hi - lo)]
            bias = None if bias is None else bias[lo:hi]
            sharding = SlotSharding(full_out, ((lo, hi),), self.in_range)
        self.lora = LoRASlots(in_features, modules, max_loras, max_lora_rank,
                              dtype or self.params_dtype, next(self.parameters()).device,
                              bias, sharding)
        return self.lora

    def module_weight(self, module: str) -> torch.Tensor:
        """The rows of the (packed) weight that belong to ``module``, dense
        (``LinearMethodBase.dense_weight``): ``[out_s, in_features]`` (this rank's rows and
        columns under tensor parallelism).

        Raises:
            ValueError: ``module`` is not one of ``module_names``.
        """
        i = self.module_names.index(module)
        start = sum(self.output_sizes[:i])
        return self.linear_method.dense_weight(self)[start: start + self.output_sizes[i]]

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

    def forward(self, x: torch.Tensor, lora_meta: LoRAKernelMeta | None) -> torch.Tensor:
        lora = self.lora if lora_meta is not None and lora_meta.has_lora else None
        if lora is not None and not lora.used(lora_meta):
            lora = None               # an eager step none of whose slots targets this layer
        if self.parallel != "row":
            y = self.linear_method.apply(self, x, self.bias)
            if lora is not None:
                buffer = lora.shrink(x, lora_meta)
                if lora.rank_sharded:
                    buffer = self.tp.all_gather(buffer, dim=-1)       # [T, S, max_lora_rank]
                lora.expand(y, buffer, lora_meta)
            return y
        y = self.linear_method.apply(self, x)                        # partial sum [T, out]
        if lora is None or not self.fully_sharded:
            if lora is not None:
                lora.expand(y, lora.shrink(x, lora_meta), lora_meta)      # partial delta too
            y = self.tp.all_reduce(y)
            return y if self.bias is None else y.add_(self.bias)
        buffer = self.tp.all_reduce(lora.shrink(x, lora_meta))          # x A^T, [T, 1, r]
        y = self.tp.all_reduce(y)
        if self.bias is not None:
            y.add_(self.bias)
        lo, hi = self._lora_cols
        part = y[:, lo:hi].contiguous()
        lora.expand(part, buffer, lora_meta)
        return self.tp.all_gather(part, dim=-1)
