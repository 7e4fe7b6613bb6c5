"""AWQ INT4 base weights in AutoAWQ's GEMM packing (vLLM's ``AWQLinearMethod``).

A quantized module's checkpoint tensors (``K`` inputs, ``N`` outputs, ``G = K /
group_size`` groups):

* ``qweight`` int32 ``[K, N/8]``: packed along N; nibble ``i`` (bits ``4i .. 4i+3``) of a
  word holds column ``AWQ_ORDER[i]`` of its 8 columns (AutoAWQ's interleaving), unsigned
  codes ``0 .. 15``;
* ``qzeros`` int32 ``[G, N/8]``: the zero points, packed the same way;
* ``scales`` float16 ``[G, N]``.

``w = s[k // group_size] · (q − z[k // group_size])``. Tensor parallelism: column-parallel
layers take their output columns (dim 1 of all three, in words of 8 for the packed ones);
row-parallel ones their input rows of ``qweight`` (dim 0) and those rows' groups of
``scales`` / ``qzeros``. A rank's rows that cut a word or a group are refused
(``QuantizationError``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from manylora.config.quantization import AWQConfig
from manylora.ops.quant.int4 import (
    PACK,
    Int4LinearMethod,
    column_slices,
    param,
    raise_shape,
    row_slice,
)

#: The column of its group of 8 that nibble ``i`` of an AWQ word holds.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """int32 ``[R, N/8]`` in AutoAWQ's packing → codes ``[R, N]`` (int32)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF
    codes = torch.empty_like(nibbles)
    codes[..., list(AWQ_ORDER)] = nibbles
    return codes.reshape(packed.shape[0], -1)


class AWQLinearMethod(Int4LinearMethod):
    """An AWQ (GEMM) checkpoint's layer (module docstring), repacked for ``w4a16`` at
    load."""

    def __init__(self, config: AWQConfig) -> None:
        self.config = config

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int,
                       params_dtype: torch.dtype, device: torch.device,
                       weight_attrs: Mapping[str, Any]) -> None:
        group = self.config.group_size
        groups = -(-in_features // group)
        # the fused modules' tensors lie side by side along N (dim 1)
        qw, qz, sc = {"pack_dim": 1}, {"pack_dim": 1}, {"pack_dim": 1}
        if layer.parallel == "column":
            qw["tp_slices"] = qz["tp_slices"] = column_slices(layer, weight_attrs, 1, PACK)
            sc["tp_slices"] = column_slices(layer, weight_attrs, 1)
        elif layer.parallel == "row":
            qw["tp_slices"] = row_slice(layer, weight_attrs, 0, 1)
            qz["tp_slices"] = sc["tp_slices"] = row_slice(layer, weight_attrs, 0, group)
        if in_features % PACK or out_features % PACK:
            raise_shape(layer, in_features, out_features)
        layer.w4_dtype = params_dtype
        param(layer, "qweight", (in_features, out_features // PACK), torch.int32, device, **qw)
        param(layer, "qzeros", (groups, out_features // PACK), torch.int32, device, **qz)
        param(layer, "scales", (groups, out_features), params_dtype, device, **sc)

    def canonical(self, layer: nn.Module):
        q = unpack_awq(layer.qweight.data)
        scales = layer.scales.data
        zeros = unpack_awq(layer.qzeros.data).to(scales.dtype)
        del layer.qweight, layer.qzeros, layer.scales
        return q, scales, zeros, None, self.config.group_size


def awq_method(config: AWQConfig, scheme: object) -> AWQLinearMethod:
    """``manylora.ops.quant``'s factory for ``AWQConfig`` layers."""
    return AWQLinearMethod(config)
