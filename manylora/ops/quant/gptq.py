"""GPTQ INT4 base weights (AutoGPTQ / GPTQModel checkpoints; vLLM's ``GPTQLinearMethod``).

A quantized module's checkpoint tensors (``K`` inputs, ``N`` outputs, ``G`` groups):

* ``qweight`` int32 ``[K/8, N]``: packed along K, low nibble first (nibble ``j`` of word
  ``i`` is input row ``8i + j``), unsigned codes ``0 .. 15``;
* ``qzeros`` int32 ``[G, N/8]``: packed along N, low nibble first; checkpoint_format
  ``"gptq"`` (AutoGPTQ's v1) stores ``z − 1`` (the zero is the stored nibble plus one, 8 for
  a symmetric checkpoint's 7s), ``"gptq_v2"`` stores ``z``;
* ``scales`` float16 ``[G, N]``; ``g_idx`` int32 ``[K]``, each input row's group (read only
  with ``desc_act``: otherwise row ``k``'s group is ``k // group_size``; ``group_size`` -1:
  one group over K).

``w = s[g(k)] · (q − z[g(k)])``. Tensor parallelism: column-parallel layers take their
output columns of ``qweight``, ``scales`` (dim 1) and ``qzeros`` (dim 1, in words of 8
columns); row-parallel ones their input rows of ``qweight`` (dim 0, words of 8 rows) and
``g_idx``, and the groups of those rows of ``scales`` / ``qzeros``, except with activation
order or one group (-1), where every rank keeps all groups (vLLM's way). A rank's rows that
cut a word or a group are refused (``QuantizationError``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from manylora.config.quantization import GPTQConfig
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


class GPTQLinearMethod(Int4LinearMethod):
    """A GPTQ checkpoint's layer (module docstring), repacked for ``w4a16`` at load."""

    def __init__(self, config: GPTQConfig) -> None:
        self.config = config

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int,
                       params_dtype: torch.dtype, device: torch.device,
                       weight_attrs: Mapping[str, Any]) -> None:
        cfg = self.config
        full_k = layer.full_in_features
        group = full_k if cfg.group_size == -1 else cfg.group_size
        groups = -(-full_k // group)
        # every rank keeps all groups where they are spread over K (act order) or one
        all_groups = cfg.desc_act or groups == 1
        local_groups = groups
        # the fused modules' tensors lie side by side along N (dim 1)
        qw, qz, sc, gi = {"pack_dim": 1}, {"pack_dim": 1}, {"pack_dim": 1}, {}
        if layer.parallel == "column":
            qw["tp_slices"] = sc["tp_slices"] = column_slices(layer, weight_attrs, 1)
            qz["tp_slices"] = column_slices(layer, weight_attrs, 1, PACK)
        elif layer.parallel == "row":
            qw["tp_slices"] = row_slice(layer, weight_attrs, 0, PACK)
            gi["tp_slices"] = row_slice(layer, weight_attrs, 0, 1)
            if not all_groups:
                qz["tp_slices"] = sc["tp_slices"] = row_slice(layer, weight_attrs, 0, group)
                local_groups = qz["tp_slices"][0].size
        layer.w4_dtype = params_dtype
        layer.w4_group = group
        if in_features % PACK or out_features % PACK:
            raise_shape(layer, in_features, out_features)
        param(layer, "qweight", (in_features // PACK, out_features), torch.int32, device, **qw)
        param(layer, "qzeros", (local_groups, out_features // PACK), torch.int32, device, **qz)
        param(layer, "scales", (local_groups, out_features), params_dtype, device, **sc)
        if cfg.desc_act:
            param(layer, "g_idx", (in_features,), torch.int32, device,
                  **(gi or {"weight_loader": same_tensors("g_idx")}))

    def canonical(self, layer: nn.Module):
        k = layer.qweight.shape[0] * PACK
        q = unpack_rows(layer.qweight.data, k)
        zeros = unpack_columns(layer.qzeros.data)
        if self.config.checkpoint_format == "gptq":
            zeros = zeros + 1
        scales = layer.scales.data
        if self.config.desc_act:
            g_idx = layer.g_idx.data.long()
            del layer.g_idx
        else:
            g_idx = None
        del layer.qweight, layer.qzeros, layer.scales
        return q, scales, zeros.to(scales.dtype), g_idx, layer.w4_group


def gptq_method(config: GPTQConfig, scheme: object) -> GPTQLinearMethod:
    """``manylora.ops.quant``'s factory for ``GPTQConfig`` layers."""
    return GPTQLinearMethod(config)
