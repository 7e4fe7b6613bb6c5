"""The one LoRA-aware linear layer every adapter-targetable projection runs through.

A packed projection (q/k/v, gate/up) is one base matmul over the fused weight followed by
one shrink and one expand over all its LoRA-enabled slices and all adapters of the step
(Punica; vLLM's ``MergedColumnParallelLinearWithLoRA``)::

    y      = x W^T (+ b)                                  all rows, base weights read once
    buffer = shrink(x, (A_s)_s, mapping)                  [T, S, max_lora_rank] float32
    y     += expand(buffer, (B_s)_s, mapping)             in place, per slice's columns

Slot buffers are allocated once, up front (vLLM's ``lora_a_stacked`` / ``lora_b_stacked``)
and only for the projections in ``LoRAConfig.target_modules``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from manylora.lora.punica import LoRAMapping
from manylora.ops.lora_expand import lora_expand
from manylora.ops.lora_shrink import lora_shrink


class LoRASlots(nn.Module):
    """Device-resident adapter slots of one packed projection.

    Buffers, per enabled slice ``s`` (module name ``modules[s]``):
    ``lora_a_stacked[s]: [max_loras, max_lora_rank, in_features]`` and
    ``lora_b_stacked[s]: [max_loras, out_s, max_lora_rank]``, in the model dtype, zero
    where a slot holds no adapter or the adapter does not target that module.

    Args:
        in_features: input width.
        modules: the enabled slices as ``(module_name, column_offset, out_features)``.
        max_loras, max_lora_rank: slot count and padded rank.
    """

    def __init__(self, in_features: int, modules: Sequence[tuple[str, int, int]],
                 max_loras: int, max_lora_rank: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.module_names = tuple(name for name, _, _ in modules)
        self.output_slices = tuple((offset, size) for _, offset, size in modules)
        for s, (_, _, size) in enumerate(modules):
            self.register_buffer(f"lora_a_{s}", torch.zeros(
                max_loras, max_lora_rank, in_features, dtype=dtype, device=device))
            self.register_buffer(f"lora_b_{s}", torch.zeros(
                max_loras, size, max_lora_rank, dtype=dtype, device=device))

    @property
    def lora_a_stacked(self) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(self, f"lora_a_{s}") for s in range(len(self.module_names)))

    @property
    def lora_b_stacked(self) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(self, f"lora_b_{s}") for s in range(len(self.module_names)))

    def set_slot(self, slot: int, module: str, a: torch.Tensor | None,
                 b: torch.Tensor | None) -> None:
        """Copy one adapter's weights for ``module`` into ``slot`` (zeros when ``a`` is None).

        Args:
            a: ``[r, in_features]``, r ≤ max_lora_rank.
            b: ``[out_s, r]`` with the LoRA scaling already folded in.
        """
        s = self.module_names.index(module)
        a_buf, b_buf = self.lora_a_stacked[s][slot], self.lora_b_stacked[s][slot]
        a_buf.zero_()
        b_buf.zero_()
        if a is not None and b is not None:
            r = a.shape[0]
            a_buf[:r].copy_(a, non_blocking=True)
            b_buf[:, :r].copy_(b, non_blocking=True)

    def apply(self, x: torch.Tensor, y: torch.Tensor, mapping: LoRAMapping) -> None:
        """``y += expand(shrink(x))`` for every enabled slice; ``x [T, in]``, ``y [T, out]``."""
        buffer = lora_shrink(x, self.lora_a_stacked, mapping)
        lora_expand(y, buffer, self.lora_b_stacked, mapping, self.output_slices)


class LoRALinear(nn.Module):
    """A (possibly packed) linear projection that applies each row's own adapter delta.

    Args:
        in_features: input width.
        output_sizes: widths of the packed modules, e.g. ``(q, kv, kv)``; one entry if unpacked.
        module_names: HF names of those modules, e.g. ``("q_proj", "k_proj", "v_proj")``.
        bias: whether the projection has a bias.
        dtype, device: of the weights.

    Parameters: ``weight [sum(output_sizes), in_features]`` and optionally ``bias``; the
    weight loader fills a packed weight by concatenating the modules' weights (dim 0).
    Forward: ``x [T, in]`` and the step's ``LoRAMapping`` (None: no adapters) → ``[T, out]``.
    """

    def __init__(self, in_features: int, output_sizes: Sequence[int],
                 module_names: Sequence[str], bias: bool, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.in_features = in_features
        self.output_sizes = tuple(output_sizes)
        self.module_names = tuple(module_names)
        out = sum(self.output_sizes)
        self.weight = nn.Parameter(torch.empty(out, in_features, dtype=dtype, device=device),
                                   requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out, dtype=dtype, device=device),
                                  requires_grad=False) if bias else None)
        self.lora: LoRASlots | None = None

    def create_lora_slots(self, enabled: Sequence[str], max_loras: int,
                          max_lora_rank: int) -> LoRASlots | None:
        """Allocate slot buffers for the modules in ``enabled`` (None if none is enabled)."""
        modules, offset = [], 0
        for name, size in zip(self.module_names, self.output_sizes):
            if name in enabled:
                modules.append((name, offset, size))
            offset += size
        if modules:
            self.lora = LoRASlots(self.in_features, modules, max_loras, max_lora_rank,
                                  self.weight.dtype, self.weight.device)
        return self.lora

    def module_weight(self, module: str) -> torch.Tensor:
        """The rows of the (packed) weight that belong to ``module``: ``[out_s, in_features]``.

        Raises:
            ValueError: ``module`` is not one of ``module_names``.
        """
        i = self.module_names.index(module)
        start = sum(self.output_sizes[:i])
        return self.weight[start: start + self.output_sizes[i]]

    def forward(self, x: torch.Tensor, mapping: LoRAMapping | None) -> torch.Tensor:
        y = torch.nn.functional.linear(x, self.weight, self.bias)
        if self.lora is not None and mapping is not None and mapping.has_lora:
            self.lora.apply(x, y, mapping)
        return y


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
