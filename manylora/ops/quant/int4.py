"""What the INT4 weight-only (W4A16) linear methods share: the one layout their checkpoint
tensors are repacked into (``manylora.ops.quant.w4a16``'s), its product, dequantization and
warm-up, and the tensor-parallel cuts of packed tensors.

After ``process_weights_after_loading`` a layer holds ``w4_qweight`` (int32
``[ceil(K/8), N]``), ``w4_scales`` and ``w4_zeros`` (``[G, N]``, the model dtype, integer
zero points ``0 .. 16``), ``w4_g_idx`` (int32 ``[K]``, or None where row ``k``'s group is
``k // w4_group_size``) and ``w4_perm`` (int64 ``[K]``, or None): with GPTQ's activation order
the weight's input rows are permuted once at load so that each group's rows are contiguous,
and ``apply`` reads ``x[:, w4_perm]`` (exllama's and Marlin's way).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from manylora.config.quantization import QuantizationError
from manylora.ops.linear_method import LinearMethodBase, applied_bias
from manylora.ops.quant.w4a16 import (
    DECODE_CONFIGS,
    DECODE_MAX_ROWS,
    dequantize,
    pack_planes,
    w4a16_linear,
)

#: Codes per packed int32 word.
PACK = 8


def param(layer: nn.Module, name: str, shape: tuple[int, ...], dtype: torch.dtype,
          device: torch.device, **attrs: object) -> nn.Parameter:
    """Register an empty ``name`` parameter on ``layer`` with the loader's attributes."""
    p = nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)
    for key, value in attrs.items():
        setattr(p, key, value)
    layer.register_parameter(name, p)
    return p


def column_slices(layer: nn.Module, weight_attrs: Mapping[str, Any], dim: int,
                  per: int = 1) -> tuple[Any, ...]:
    """A column-parallel layer's rows of each packed module, as the dense weight's
    ``TPSlice`` (``weight_attrs["tp_slices"]``) moved to ``dim`` of a tensor holding ``per``
    output rows per entry (8 for a tensor packed along N).

    Raises:
        QuantizationError: a rank's rows that cut a packed word.
    """
    parts = []
    for name, (lo, hi), full, dense in zip(layer.module_names, layer.output_ranges,
                                           layer.full_output_sizes, weight_attrs["tp_slices"]):
        if lo % per or hi % per or full % per:
            raise QuantizationError(
                f"{name}: tensor-parallel rows [{lo}, {hi}) of {full} cut a packed int32 "
                f"word of {per} output columns")
        parts.append(replace(dense, dim=dim, start=lo // per, stop=hi // per, full=full // per,
                             size=(hi - lo) // per))
    return tuple(parts)


def row_slice(layer: nn.Module, weight_attrs: Mapping[str, Any], dim: int,
              per: int) -> tuple[Any, ...]:
    """A row-parallel layer's input rows as the dense weight's ``TPSlice``
    (``weight_attrs["tp_slices"]``) moved to ``dim`` of a tensor holding ``per`` input rows
    per entry (8 for a tensor packed along K, the group size for scales).

    Raises:
        QuantizationError: a rank's input rows that cut a packed word or a group.
    """
    lo, hi = layer.in_range
    full = layer.full_in_features
    if lo % per or (hi % per and hi != full):
        raise QuantizationError(
            f"{layer.module_names[0]}: tensor-parallel input rows [{lo}, {hi}) of {full} cut "
            f"a group or packed word of {per} rows")
    stop, whole = -(-hi // per), -(-full // per)
    return (replace(weight_attrs["tp_slices"][0], dim=dim, start=lo // per, stop=stop,
                    full=whole, size=stop - lo // per),)


def same_tensors(name: str):
    """A ``weight_loader`` for a tensor every packed module repeats (GPTQ's ``g_idx`` of
    q, k and v, compressed-tensors' ``weight_shape``): they must agree; the first is kept.

    Raises:
        QuantizationError: the parts differ (e.g. q, k and v in different activation
            orders, which one product cannot take).
    """
    def load(p: nn.Parameter, tensors: list[torch.Tensor]) -> None:
        if any(not torch.equal(t, tensors[0]) for t in tensors[1:]):
            raise QuantizationError(f"{name} differs between the fused modules; manylora "
                                    "computes them in one product")
        p.data.copy_(tensors[0])
    return load


def unpack_columns(packed: torch.Tensor) -> torch.Tensor:
    """int32 ``[R, N/8]`` packed along N, low nibble first → codes ``[R, N]`` (int32)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    return ((packed.unsqueeze(-1) >> shifts) & 0xF).reshape(packed.shape[0], -1)


def raise_shape(layer: nn.Module, in_features: int, out_features: int) -> None:
    """Refuse a layer whose rank-local shape does not pack into int32 words.

    Raises:
        QuantizationError: always, naming the layer and its sizes.
    """
    raise QuantizationError(f"{'/'.join(layer.module_names)}: [{out_features}, "
                            f"{in_features}] on this rank does not pack 8 INT4 codes per "
                            "int32 word along both dimensions")


class Int4LinearMethod(LinearMethodBase):
    """INT4 weight-only base weights in the ``w4a16`` layout (module docstring).

    ``apply``: on CUDA the ``w4a16_linear`` kernel (K split over programs up to
    ``DECODE_MAX_ROWS`` rows, the bias added inside), elsewhere the torch reference
    (dequantize, then ``torch.nn.functional.linear``). A format's subclass registers its
    checkpoint tensors (``create_weights``) and turns them into the canonical codes
    (``canonical``).
    """

    @abstractmethod
    def canonical(self, layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                   torch.Tensor | None, int]:
        """The loaded checkpoint tensors as ``(q [K, N] int codes 0..15, scales [G, N],
        zeros [G, N] (integer-valued, 0..16), g_idx [K] int (the rank's groups, 0-based) or
        None, group_size)``; the format's parameters are removed from the layer."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Repack the format's tensors (``canonical``) into the module's layout.

        Raises:
            QuantizationError: a ``g_idx`` naming a group the layer does not hold, or zero
                points that are not integers in ``0 .. 16`` (the kernel's exact
                dequantization needs them).
        """
        q, scales, zeros, g_idx, group_size = self.canonical(layer)
        if zeros.numel() and (not torch.equal(zeros, zeros.round()) or zeros.min() < 0
                              or zeros.max() > 16):
            raise QuantizationError(
                f"{'/'.join(layer.module_names)}: zero points in [{float(zeros.min())}, "
                f"{float(zeros.max())}] are not all integers in 0 .. 16")
        k = q.shape[0]
        dtype = layer.w4_dtype
        perm = None
        if g_idx is not None:
            g_idx = g_idx.long()
            if k and (g_idx.min() < 0 or g_idx.max() >= scales.shape[0]):
                raise QuantizationError(
                    f"{'/'.join(layer.module_names)}: g_idx names groups "
                    f"[{int(g_idx.min())}, {int(g_idx.max())}] of the {scales.shape[0]} this "
                    "rank holds")
            if not torch.equal(g_idx, g_idx.sort().values):
                perm = torch.argsort(g_idx, stable=True)
                q, g_idx = q[perm], g_idx[perm]
            if torch.equal(g_idx, torch.arange(k, device=g_idx.device) // group_size):
                g_idx = None
        keep = {"w4_qweight": pack_planes(q), "w4_scales": scales.to(dtype).contiguous(),
                "w4_zeros": zeros.to(dtype).contiguous(),
                "w4_g_idx": None if g_idx is None else g_idx.to(torch.int32).contiguous(),
                "w4_perm": perm}
        for name, tensor in keep.items():
            setattr(layer, name, None if tensor is None
                    else nn.Parameter(tensor, requires_grad=False))
        layer.w4_group_size = group_size
        layer.w4_in_features = k

    def _input(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return x if layer.w4_perm is None else x.index_select(1, layer.w4_perm)

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        x = self._input(layer, x)
        if x.is_cuda:
            return w4a16_linear(x.contiguous(), layer.w4_qweight, layer.w4_scales,
                                layer.w4_zeros, layer.w4_g_idx, layer.w4_group_size, bias)
        w = dequantize(layer.w4_qweight, layer.w4_scales, layer.w4_zeros, layer.w4_g_idx,
                       layer.w4_group_size, layer.w4_in_features, x.dtype)
        return torch.nn.functional.linear(x, w.T, bias)

    def dense_weight(self, layer: nn.Module) -> torch.Tensor:
        w = dequantize(layer.w4_qweight, layer.w4_scales, layer.w4_zeros, layer.w4_g_idx,
                       layer.w4_group_size, layer.w4_in_features, layer.w4_dtype)
        if layer.w4_perm is not None:
            w = w[torch.argsort(layer.w4_perm)]
        return w.T.contiguous()

    def warm_up(self, layer: nn.Module) -> int:
        if not layer.w4_qweight.is_cuda:
            return 0
        row_cases = (*DECODE_CONFIGS, DECODE_MAX_ROWS + 1)   # each decode bucket, prefill
        for rows in row_cases:
            x = torch.zeros(rows, layer.w4_in_features, dtype=layer.w4_dtype,
                            device=layer.w4_qweight.device)
            self.apply(layer, x, applied_bias(layer))
        return len(row_cases)
