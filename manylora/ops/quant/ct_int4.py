"""compressed-tensors ``pack-quantized`` INT4 base weights, weight-only (W4A16; vLLM's
``CompressedTensorsWNA16``), as compressed-tensors' ``PackedQuantizationCompressor``
writes them.

A quantized module's checkpoint tensors (``K`` inputs, ``N`` outputs, ``G`` groups: ``K /
group_size``, or 1 with the ``channel`` strategy):

* ``weight_packed`` int32 ``[N, K/8]``: packed along K, low nibble first, each code the
  signed value plus 8 (``0 .. 15``);
* ``weight_scale`` ``[N, G]``;
* ``weight_zero_point`` int32 ``[N/8, G]`` (asymmetric only): the signed zero points plus 8,
  packed along N, low nibble first; symmetric: the zero is 0 (8 unsigned);
* ``weight_shape`` ``[2]``: ``(N, K)``; ``weight_g_idx`` int32 ``[K]`` with ``actorder:
  "group"`` (or its alias ``"dynamic"``): each input row's group.

``w = s[g(k)] · (q − z[g(k)])`` on the unsigned codes. Tensor parallelism: column-parallel
layers take their output rows (dim 0; ``weight_zero_point`` in words of 8); row-parallel
ones their input columns of ``weight_packed`` (dim 1, words of 8) and ``weight_g_idx``, and
those columns' groups of ``weight_scale`` / ``weight_zero_point`` (dim 1), except with
activation order or one group, where every rank keeps all groups. A rank's rows that cut a
word or a group are refused (``QuantizationError``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from manylora.config.quantization import CompressedTensorsScheme, QuantizationError
from manylora.ops.quant.int4 import (
    PACK,
    Int4LinearMethod,
    column_slices,
    param,
    raise_shape,
    row_slice,
    same_tensors,
    unpack_columns,
)
from manylora.ops.quant.w4a16 import unpack_rows

#: The unsigned code of a signed zero (compressed-tensors' packing offset for 4 bits).
OFFSET = 8
#: ``actorder`` values whose checkpoints store ``weight_g_idx`` ("dynamic": compressed-tensors'
#: alias of "group"; "weight" / "static" reorder only during calibration).
GROUP_ORDERS = ("group", "dynamic")


def _check_shape(layer: nn.Module):
    """A ``weight_loader`` for ``weight_shape``: each part's ``(N, K)`` must be the layer's
    whole module.

    Raises:
        QuantizationError: a shape other than the model's.
    """
    def load(p: nn.Parameter, tensors: list[torch.Tensor]) -> None:
        for name, n, t in zip(layer.module_names, layer.full_output_sizes, tensors):
            if [int(v) for v in t.tolist()] != [n, layer.full_in_features]:
                raise QuantizationError(f"{name}: weight_shape {t.tolist()} in the checkpoint, "
                                        f"the model has [{n}, {layer.full_in_features}]")
        p.data.copy_(tensors[0])
    return load


class CompressedTensorsW4A16(Int4LinearMethod):
    """A compressed-tensors ``pack-quantized`` INT4 layer (module docstring), repacked for
    ``w4a16`` at load."""

    def __init__(self, scheme: CompressedTensorsScheme) -> None:
        self.scheme = scheme
        self.args = scheme.weights

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int,
                       params_dtype: torch.dtype, device: torch.device,
                       weight_attrs: Mapping[str, Any]) -> None:
        args = self.args
        full_k = layer.full_in_features
        group = args.group_size if args.strategy == "group" else full_k
        groups = -(-full_k // group)
        act_order = args.actorder in GROUP_ORDERS
        all_groups = act_order or groups == 1
        local_groups = groups
        wp, sc, zp, gi = {}, {}, {}, {}
        if layer.parallel == "column":
            wp = sc = {"tp_slices": column_slices(layer, weight_attrs, 0)}
            zp = {"tp_slices": column_slices(layer, weight_attrs, 0, PACK)}
        elif layer.parallel == "row":
            wp = {"tp_slices": row_slice(layer, weight_attrs, 1, PACK)}
            gi = {"tp_slices": row_slice(layer, weight_attrs, 0, 1)}
            if not all_groups:
                sc = zp = {"tp_slices": row_slice(layer, weight_attrs, 1, group)}
                local_groups = sc["tp_slices"][0].size
        if in_features % PACK or out_features % PACK:
            raise_shape(layer, in_features, out_features)
        layer.w4_dtype = params_dtype
        layer.w4_group = group
        param(layer, "weight_packed", (out_features, in_features // PACK), torch.int32,
              device, **wp)
        param(layer, "weight_scale", (out_features, local_groups), params_dtype, device, **sc)
        if not args.symmetric:
            param(layer, "weight_zero_point", (out_features // PACK, local_groups),
                  torch.int32, device, **zp)
        param(layer, "weight_shape", (2,), torch.int64, device,
              weight_loader=_check_shape(layer))
        if act_order:
            param(layer, "weight_g_idx", (in_features,), torch.int32, device,
                  **(gi or {"weight_loader": same_tensors("weight_g_idx")}))

    def canonical(self, layer: nn.Module):
        k = layer.weight_packed.shape[1] * PACK
        q = unpack_rows(layer.weight_packed.data.T.contiguous(), k)
        scales = layer.weight_scale.data.T
        if self.args.symmetric:
            zeros = torch.full_like(scales, OFFSET)
        else:
            zeros = unpack_columns(layer.weight_zero_point.data.T.contiguous()).to(scales.dtype)
            del layer.weight_zero_point
        g_idx = None
        if self.args.actorder in GROUP_ORDERS:
            g_idx = layer.weight_g_idx.data.long()
            del layer.weight_g_idx
        del layer.weight_packed, layer.weight_scale, layer.weight_shape
        return q, scales, zeros, g_idx, layer.w4_group
