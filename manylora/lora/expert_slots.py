"""Device-resident adapter slots of one MoE layer's experts (``ExpertLoRASlots``).

One A and one B per (slot, expert) for each of the experts' three projections, stacked so
that one fused launch reads any (token, expert, adapter) triple (vLLM's
``FusedMoEWithLoRA`` ``w13_lora_a_stacked`` / ``w2_lora_b_stacked``; the kernel is
``manylora.lora.kernels.fused_moe_lora``). Buffers, in the slots' dtype::

    a_gate, a_up [max_loras, E, R, H]       b_gate, b_up [max_loras, E, R, I_local]
    a_down       [max_loras, E, R, I_local] b_down       [max_loras, E, R, H]

(``R = max_lora_rank``; B rank-major, rows ``[0, r)`` of a slot's expert hold ``B_e^T``
with the LoRA scaling folded in). The three modules get slots together
(``lora_target_modules`` names all or none of them). Each (slot, module)'s rank, the same
for all experts of the module (0: the slot's adapter does not target it), lives in the
model's ``SlotTable`` (a column each of ``experts.gate_proj``, ``experts.up_proj``,
``experts.down_proj``), written by the slot load (``manylora.lora.slot_layout``).

Tensor parallelism splits the experts as the dense MLP (``manylora.model.layers.moe``):
gate and up are column-parallel (each B keeps this rank's ``I / tp`` output columns, A
whole), down is row-parallel (A keeps the same input columns, B whole); the block's output
is all-reduced after the LoRA terms are added, as a row-parallel projection's is.
"""

from __future__ import annotations

import torch
from torch import nn

from manylora.config import LORA_EXPERT_MODULES
from manylora.lora.kernels.fused_moe_lora import MoELoRAWeights
from manylora.lora.kernels.meta import LoRAKernelMeta
from manylora.lora.slot_table import SlotTable


class ExpertLoRASlots(nn.Module):
    """Adapter slots of one MoE layer's experts.

    Args:
        hidden_size: ``H``.
        intermediate_size: each expert's whole ``I``.
        num_experts: ``E``.
        max_loras, max_lora_rank: slot count and padded rank.
        dtype, device: of the buffers.
        inter_range: this tensor-parallel rank's columns ``[start, stop)`` of ``I``
            (None: all of them).

    Attributes:
        module_names: ``LORA_EXPERT_MODULES`` (one table column each).
        full_in, full_out: per module, the whole per-expert widths an adapter brings.
        in_cols, out_cols: per module, the columns of the whole A (input) and B (output)
            the slots keep.

    Raises:
        ValueError: an ``inter_range`` outside ``I``.
    """

    module_names: tuple[str, ...] = LORA_EXPERT_MODULES

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int,
                 max_loras: int, max_lora_rank: int, dtype: torch.dtype, device: torch.device,
                 inter_range: tuple[int, int] | None = None) -> None:
        super().__init__()
        lo, hi = inter_range or (0, intermediate_size)
        if not 0 <= lo < hi <= intermediate_size:
            raise ValueError(f"intermediate range {(lo, hi)} outside {intermediate_size}")
        self.max_loras, self.num_experts = max_loras, num_experts
        h, inter = hidden_size, intermediate_size
        gate_up = ((h, inter), (0, h), (lo, hi))
        self.full_in, self.full_out, self.in_cols, self.out_cols = {}, {}, {}, {}
        for name, (full, in_cols, out_cols) in zip(self.module_names, (
                gate_up, gate_up, ((inter, h), (lo, hi), (0, h)))):
            self.full_in[name], self.full_out[name] = full
            self.in_cols[name], self.out_cols[name] = in_cols, out_cols
            short = _short(name)
            self.register_buffer(f"a_{short}", torch.zeros(
                max_loras, num_experts, max_lora_rank, in_cols[1] - in_cols[0], dtype=dtype,
                device=device))
            self.register_buffer(f"b_{short}", torch.zeros(
                max_loras, num_experts, max_lora_rank, out_cols[1] - out_cols[0], dtype=dtype,
                device=device))
        SlotTable({(0, name): self for name in self.module_names}, max_loras, device)

    def buffers_of(self, module: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(A [max_loras, E, R, in], B [max_loras, E, R, out])`` of one expert module.

        Raises:
            ValueError: not one of ``module_names``.
        """
        if module not in self.module_names:
            raise ValueError(f"{module!r} is not an expert module ({self.module_names})")
        return getattr(self, f"a_{_short(module)}"), getattr(self, f"b_{_short(module)}")

    def bind(self, table: SlotTable, rank_col: int) -> None:
        """Use columns ``[rank_col, rank_col + 3)`` of ``table`` (``SlotTable`` calls this):
        ``ranks`` becomes their int32 ``[max_loras, 3]`` view."""
        self.table, self.rank_col = table, rank_col
        self.ranks = table.ranks[:, rank_col: rank_col + len(self.module_names)]

    def used(self, lora_meta: LoRAKernelMeta) -> bool:
        """Whether the experts' LoRA runs in the step: one of their columns is in
        ``lora_meta.used_columns`` (as ``LoRASlots.used``), or it does not say."""
        cols = lora_meta.used_columns
        return cols is None or any(cols[self.rank_col: self.rank_col + len(self.module_names)])

    def weights(self) -> MoELoRAWeights:
        """The buffers and rank columns as the fused MoE LoRA kernel reads them."""
        return MoELoRAWeights(self.a_gate, self.b_gate, self.a_up, self.b_up, self.a_down,
                              self.b_down, self.ranks)


def _short(module: str) -> str:
    """The buffers' infix of an expert module: ``experts.gate_proj`` → ``gate``."""
    return module.removeprefix("experts.").removesuffix("_proj")
