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

    * ``lora_a_{s}: [max_loras, max_lora_rank, in_features]`` and
      ``lora_b_{s}: [max_loras, out_s, max_lora_rank]``, in the model dtype, zero where a
      slot holds no adapter or the adapter does not target that module;
    * ``dora_scale_{s}``: float32 ``[max_loras, out_s]``, the slot's DoRA scale
      ``m / ||W + BA||`` (ones where the slot's adapter has none for that module);
    * ``dora_shift_{s}`` (only for a projection with a bias): float32 ``[max_loras, out_s]``,
      ``(1 - scale) * bias_s``, so that the expand's ``(y + delta) * scale + shift`` of a row
      whose ``y`` includes the bias is DoRA's ``scale * (x W^T + delta) + bias``.

    Args:
        in_features: input width.
        modules: the enabled slices as ``(module_name, column_offset, out_features)``.
        max_loras, max_lora_rank: slot count and padded rank.
        dtype, device: of the A/B buffers (the DoRA buffers are float32).
        biases: None (the projection has no bias), or per enabled slice its bias ``[out_s]``
            (views of the projection's bias, read whenever a slot is written).

    Raises:
        ValueError: ``biases`` that are not one ``[out_s]`` tensor per slice.
    """

    def __init__(self, in_features: int, modules: Sequence[tuple[str, int, int]],
                 max_loras: int, max_lora_rank: int, dtype: torch.dtype,
                 device: torch.device, biases: Sequence[torch.Tensor] | None = None) -> None:
        super().__init__()
        self.module_names = tuple(name for name, _, _ in modules)
        self.output_slices = tuple((offset, size) for _, offset, size in modules)
        if biases is not None and [tuple(b.shape) for b in biases] != [
                (size,) for _, _, size in modules]:
            raise ValueError(f"biases {[tuple(b.shape) for b in biases]} do not match the "
                             f"slices {list(self.output_slices)}")
        self.biases = None if biases is None else tuple(biases)
        for s, (_, _, size) in enumerate(modules):
            self.register_buffer(f"lora_a_{s}", torch.zeros(
                max_loras, max_lora_rank, in_features, dtype=dtype, device=device))
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

    def set_slot(self, slot: int, module: str, a: torch.Tensor | None,
                 b: torch.Tensor | None, dora_scale: torch.Tensor | None = None) -> None:
        """Copy one adapter's weights for ``module`` into ``slot`` (zeros when ``a`` is None).

        Every copy is ``non_blocking`` and every write is enqueued on the current stream (a
        side stream when called under ``torch.cuda.stream``); nothing synchronises.

        Args:
            a: ``[r, in_features]``, r ≤ max_lora_rank.
            b: ``[out_s, r]`` with the LoRA scaling already folded in.
            dora_scale: DoRA only: float32 ``[out_s]``, ``m / ||W + b @ a||`` (host, possibly
                pinned, or device); None writes ones (plain LoRA). The slot's shift becomes
                ``(1 - dora_scale) * bias``.

        Raises:
            ValueError: ``module`` is not one of ``module_names``, or ``dora_scale`` is not
                ``[out_s]``.
        """
        s = self.module_names.index(module)
        width = self.output_slices[s][1]
        if dora_scale is not None and tuple(dora_scale.shape) != (width,):
            raise ValueError(f"{module}: DoRA scale {tuple(dora_scale.shape)}, expected "
                             f"({width},)")
        a_buf, b_buf = self.lora_a_stacked[s][slot], self.lora_b_stacked[s][slot]
        a_buf.zero_()
        b_buf.zero_()
        if a is not None and b is not None:
            r = a.shape[0]
            a_buf[:r].copy_(a, non_blocking=True)
            b_buf[:, :r].copy_(b, non_blocking=True)
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

    def apply(self, x: torch.Tensor, y: torch.Tensor, mapping: LoRAMapping) -> None:
        """``y += expand(shrink(x))`` for every enabled slice, DoRA-rescaled for the slots
        flagged in ``mapping.slot_dora``; ``x [T, in]``, ``y [T, out]`` (bias included)."""
        buffer = lora_shrink(x, self.lora_a_stacked, mapping)
        lora_expand(y, buffer, self.lora_b_stacked, mapping, self.output_slices,
                    self.dora_scale_stacked, self.dora_shift_stacked)


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
        """Allocate slot buffers for the modules in ``enabled`` (None if none is enabled);
        with a bias, the slots keep views of each enabled module's bias slice for DoRA."""
        modules, offset = [], 0
        for name, size in zip(self.module_names, self.output_sizes):
            if name in enabled:
                modules.append((name, offset, size))
            offset += size
        if modules:
            biases = None if self.bias is None else [
                self.bias.detach()[offset: offset + size] for _, offset, size in modules]
            self.lora = LoRASlots(self.in_features, modules, max_loras, max_lora_rank,
                                  self.weight.dtype, self.weight.device, biases)
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
