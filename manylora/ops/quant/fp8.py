"""FP8 (e4m3) base weights: the linear methods of ``Fp8Config`` (transformers' fine-grained
block FP8, serialized per-tensor FP8, online FP8) and of compressed-tensors'
``float-quantized`` schemes (vLLM's ``Fp8LinearMethod`` / ``CompressedTensorsW8A8Fp8`` /
``CompressedTensorsW8A16Fp8``).

Parameters (checkpoint names, filled by the weights loader; ``N`` this rank's output rows,
``K`` its input columns):

* ``weight [N, K]`` float8_e4m3fn (online FP8: the 16-bit ``weight``, quantized per output
  row after loading);
* block scales: ``weight_scale_inv`` (transformers) / ``weight_scale`` (compressed-tensors)
  ``[Σ ceil(rows / bn), ceil(K / bk)]`` float32, the blocks of each packed part stacked;
  expanded after loading to one scale per output row and K block ``[N, ceil(K / bk)]``,
  so parts whose rows are not a multiple of ``bn`` pack without re-blocking;
* per-tensor scales: ``weight_scale`` one per packed part (``[]`` or ``[1]`` each), kept
  exact as one scale per output row (no requantization to the parts' max, unlike vLLM's
  ``requantize_with_max_scale``: the same product, no rounding added);
* per-channel scales: ``weight_scale [N, 1]``;
* static activations: ``input_scale``, one per part; the activations are quantized with
  their max (vLLM's rule: one input, one scale).

Activations: dynamic per token (``s_t = max|x_t| / 448``), per (token, ``bk`` columns) with
block weights, per tensor (dynamic or static), or not at all (W8A16: the weight is
dequantized and multiplied in the activations' dtype). On CUDA one Triton launch quantizes
the activations (``fp8_act_quant``), and up to ``fp8_skinny.FP8_SKINNY_MAX_ROWS`` rows
(decode) the W8A8 product is ``fp8_skinny``'s skinny FP8 GEMM. The other products are
``manylora.ops.quant.fp8_kernels``'s; on CPU, on a GPU without FP8 tensor cores (before
compute capability 8.9), and past the skinny kernel's rows for K or N not multiples of 16
(``_scaled_mm``'s alignment) or a K block Triton cannot tile, the float32 emulation
(quantize → dequantize → matmul). W8A16 dequantizes the weight on each product (a transient
``[N, K]`` in the activations' dtype).

Tensor parallelism: the weight and per-channel scales are cut with their rows (column
parallel) or columns (row parallel); block scales with their blocks, and a split that cuts
through a block is refused (vLLM's rule for block FP8); per-tensor scales are whole on every
rank.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from manylora.config.quantization import (
    CompressedTensorsScheme,
    Fp8Config,
    QuantizationConfig,
    QuantizationError,
)
from manylora.ops.linear_method import LinearMethodBase, applied_bias
from manylora.ops.quant.fp8_act_quant import quantize_activations
from manylora.ops.quant.fp8_kernels import (
    FP8_DTYPE,
    FP8_MAX,
    MIN_SCALE,
    block_matmul,
    block_matmul_reference,
    dequantize_rows,
    fp8_gpu,
    quantize_per_token,
    quantize_per_token_group,
    quantize_static,
    quantize_weight_per_channel,
    scaled_mm,
)
from manylora.ops.quant.fp8_skinny import fp8_skinny_eligible, fp8_skinny_linear

#: Weight scale layouts.
WEIGHT_STRATEGIES = ("tensor", "channel", "block", "online")
#: Activation quantization: per token, per (token, K block), per tensor computed at run
#: time, per tensor from the checkpoint, or none (weight-only).
ACTIVATION_SCHEMES = ("token", "group", "tensor", "static", None)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Fp8LinearMethod(LinearMethodBase):
    """FP8 weights ``[N, K]`` with per-tensor, per-channel or ``block``-wise scales.

    Args:
        weight_strategy: one of ``WEIGHT_STRATEGIES`` (``"online"``: a 16-bit checkpoint
            quantized per output row after loading).
        activations: one of ``ACTIVATION_SCHEMES``.
        block: ``(bn, bk)`` rows and columns of a weight-scale block (``"block"`` only).
        scale_name: the checkpoint name of the weight scales (``weight_scale_inv`` in
            transformers' fine-grained FP8, ``weight_scale`` otherwise).

    Raises:
        QuantizationError: at ``create_weights``, a tensor-parallel split through a block
            (naming the layer and the sizes).
    """

    def __init__(self, weight_strategy: str, activations: str | None,
                 block: tuple[int, int] | None = None,
                 scale_name: str = "weight_scale") -> None:
        if weight_strategy not in WEIGHT_STRATEGIES or activations not in ACTIVATION_SCHEMES:
            raise ValueError(f"unknown FP8 scheme {weight_strategy!r}/{activations!r}")
        if (weight_strategy == "block") != (block is not None):
            raise ValueError("block is for (and needed by) block-wise weight scales")
        if (activations == "group") != (weight_strategy == "block" and activations is not None):
            raise ValueError("block-wise weights take per-token-group activations")
        self.weight_strategy = weight_strategy
        self.activations = activations
        self.block = block
        self.scale_name = scale_name

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int,
                       params_dtype: torch.dtype, device: torch.device,
                       weight_attrs: Mapping[str, Any]) -> None:
        online = self.weight_strategy == "online"
        weight = _param(torch.empty(out_features, in_features, device=device,
                                    dtype=params_dtype if online else FP8_DTYPE))
        for name, value in weight_attrs.items():
            setattr(weight, name, value)
        layer.weight = weight
        parts = len(layer.module_names)
        if self.weight_strategy == "tensor":
            layer.weight_scale = _scalars(parts, device)
        elif self.weight_strategy == "channel":
            scale = _param(torch.empty(out_features, 1, dtype=torch.float32, device=device))
            if layer.parallel == "column":
                scale.tp_slices = weight_attrs["tp_slices"]
            layer.weight_scale = scale
        elif self.weight_strategy == "block":
            self._create_block_scales(layer, device, weight_attrs)
        if self.activations == "static":
            layer.input_scale = _scalars(parts, device)

    def _create_block_scales(self, layer: nn.Module, device: torch.device,
                             weight_attrs: Mapping[str, Any]) -> None:
        bn, bk = self.block
        names = "/".join(layer.module_names)
        full_k = layer.full_in_features
        k_lo, k_hi = layer.in_range
        if layer.parallel == "row" and (k_lo % bk or (k_hi % bk and k_hi != full_k)):
            raise QuantizationError(
                f"{names}: the tensor-parallel input columns [{k_lo}, {k_hi}) of {full_k} "
                f"cut through a {bk}-column FP8 weight block; use a tensor_parallel_size "
                f"that splits the input at multiples of {bk}")
        dense_slices = weight_attrs.get("tp_slices", ())
        slices = []
        rows = 0
        for i, ((lo, hi), n) in enumerate(zip(layer.output_ranges, layer.full_output_sizes)):
            if layer.parallel == "column" and (lo % bn or (hi % bn and hi != n)):
                raise QuantizationError(
                    f"{names}: the tensor-parallel output rows [{lo}, {hi}) of {n} cut "
                    f"through a {bn}-row FP8 weight block; use a tensor_parallel_size that "
                    f"splits the output at multiples of {bn}")
            start, stop = lo // bn, _cdiv(hi, bn)
            if layer.parallel == "column":
                slices.append(dataclasses.replace(dense_slices[i], start=start, stop=stop,
                                                  full=_cdiv(n, bn), size=stop - start))
            rows += stop - start
        k_start, k_stop = k_lo // bk, _cdiv(k_hi, bk)
        scale = _param(torch.empty(rows, k_stop - k_start, dtype=torch.float32,
                                   device=device))
        if layer.parallel == "column":
            scale.tp_slices = tuple(slices)
        elif layer.parallel == "row":
            scale.tp_slices = (dataclasses.replace(dense_slices[0], start=k_start,
                                                   stop=k_stop, full=_cdiv(full_k, bk),
                                                   size=k_stop - k_start),)
        setattr(layer, self.scale_name, scale)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Quantize an online weight per row; expand the scales to the row-wise (``[N]``)
        or row-and-K-block (``[N, ceil(K / bk)]``) form the products read; reduce static
        input scales to their max."""
        with torch.no_grad():
            if self.weight_strategy == "online":
                q, s = quantize_weight_per_channel(layer.weight.data)
                layer.weight = _param(q)
                layer.weight_scale = _param(s)
            elif self.weight_strategy == "tensor":
                sizes = torch.tensor(layer.output_sizes, device=layer.weight.device)
                layer.weight_scale = _param(
                    layer.weight_scale.data.repeat_interleave(sizes))
            elif self.weight_strategy == "channel":
                layer.weight_scale = _param(layer.weight_scale.data.reshape(-1).float())
            else:
                bn = self.block[0]
                blocks = getattr(layer, self.scale_name).data
                parts, first = [], 0
                for lo, hi in layer.output_ranges:
                    count = _cdiv(hi, bn) - lo // bn
                    rows = blocks[first:first + count].repeat_interleave(bn, dim=0)
                    offset = lo - (lo // bn) * bn
                    parts.append(rows[offset:offset + hi - lo])
                    first += count
                setattr(layer, self.scale_name, _param(torch.cat(parts).float()))
            if self.activations == "static":
                layer.input_scale = _param(layer.input_scale.data.amax().reshape(1))

    def _row_scale(self, layer: nn.Module) -> torch.Tensor:
        return getattr(layer, self.scale_name)

    def _block_k(self) -> int | None:
        return self.block[1] if self.block is not None else None

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        wq, sw = layer.weight, self._row_scale(layer)
        if self.activations is None:
            w = dequantize_rows(wq, sw, self._block_k()).to(x.dtype)
            return torch.nn.functional.linear(x, w, bias)
        # on CUDA one Triton launch quantizes (fp8_act_quant), elsewhere the torch ops
        fused = x.is_cuda and x.stride(-1) == 1
        if self.activations == "group":
            bk = self._block_k()
            xq, sx = quantize_activations(x, bk) if fused else quantize_per_token_group(x, bk)
            if fp8_skinny_eligible(x, wq.shape[0], wq.shape[1], bk):
                return fp8_skinny_linear(xq, sx, wq, sw, x.dtype, bk, bias)
            if fp8_gpu(x) and bk >= 16 and bk & (bk - 1) == 0:
                y = block_matmul(xq, sx, wq, sw, bk, x.dtype)
            else:
                y = block_matmul_reference(xq, sx, wq, sw, bk, torch.float32).to(x.dtype)
        else:
            if self.activations == "token":
                xq, sx = quantize_activations(x) if fused else quantize_per_token(x)
            else:
                scale = (layer.input_scale if self.activations == "static" else
                         (x.abs().amax().float() / FP8_MAX).clamp_min(MIN_SCALE))
                if fused:
                    xq, sx = quantize_activations(x, scale=scale)
                else:
                    xq = quantize_static(x, scale)
                    sx = scale.reshape(1, 1).float().expand(x.shape[0], 1)
            if fp8_skinny_eligible(x, wq.shape[0], wq.shape[1], None):
                return fp8_skinny_linear(xq, sx, wq, sw, x.dtype, None, bias)
            y = scaled_mm(xq, sx, wq, sw, x.dtype)
        return y if bias is None else y + bias

    def dense_weight(self, layer: nn.Module) -> torch.Tensor:
        return dequantize_rows(layer.weight, self._row_scale(layer),
                               self._block_k()).to(layer.params_dtype)

    def warm_up(self, layer: nn.Module) -> int:
        """On CUDA, one product per Triton launch class: the skinny FP8 kernel's three row
        buckets (1, 17, 33 rows) and 65 rows (the block kernel's prefill tiles; per-row
        scales take cuBLASLt), each also compiling the activation quantizer. None on
        CPU."""
        weight = layer.weight
        if not weight.is_cuda:
            return 0
        for rows in (1, 17, 33, 65):
            x = torch.zeros(rows, weight.shape[1], dtype=layer.params_dtype,
                            device=weight.device)
            self.apply(layer, x, applied_bias(layer))
        return 4


def _param(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor, requires_grad=False)


def _scalars(parts: int, device: torch.device) -> nn.Parameter:
    """One float32 scale per packed part; each checkpoint tensor is ``[]`` or ``[1]``."""
    param = _param(torch.empty(parts, dtype=torch.float32, device=device))

    def load(param: nn.Parameter, tensors: list[torch.Tensor]) -> None:
        param.data.copy_(torch.stack([t.reshape(()).float() for t in tensors]))

    param.weight_loader = load
    return param


def fp8_method(config: QuantizationConfig, scheme: object) -> Fp8LinearMethod:
    """The method of an ``Fp8Config`` layer: block-wise weights with per-token-group
    activations (transformers' fine-grained FP8), a per-tensor ``weight_scale`` with
    dynamic per-token or static ``input_scale`` activations (serialized FP8), or online
    per-channel weights with per-token activations (``quantization="fp8"``)."""
    assert isinstance(config, Fp8Config)
    if not config.serialized:
        return Fp8LinearMethod("online", "token")
    if config.weight_block_size is not None:
        return Fp8LinearMethod("block", "group", config.weight_block_size,
                               scale_name="weight_scale_inv")
    activations = "static" if config.activation_scheme == "static" else "token"
    return Fp8LinearMethod("tensor", activations)


def compressed_tensors_fp8_method(config: QuantizationConfig,
                                  scheme: CompressedTensorsScheme) -> Fp8LinearMethod:
    """The method of a compressed-tensors ``float-quantized`` scheme: FP8 weights per
    tensor, channel or block; input activations none (W8A16), dynamic per token, dynamic
    per group (block weights, groups of the block's columns), dynamic or static per tensor.

    Raises:
        QuantizationError: activations that the weights' layout cannot take (named).
    """
    weights, inputs = scheme.weights, scheme.input_activations
    block = weights.block_structure if weights.strategy == "block" else None
    if inputs is None:
        return Fp8LinearMethod(weights.strategy, None, block)
    if block is not None:
        if not (inputs.dynamic and inputs.strategy == "group"
                and inputs.group_size == block[1]):
            raise QuantizationError(
                f"compressed-tensors FP8 block weights {list(block)} with {inputs.strategy} "
                f"input activations (dynamic={inputs.dynamic}, group_size="
                f"{inputs.group_size}): block-wise weights take dynamic per-group "
                f"activations of the block's {block[1]} columns")
        return Fp8LinearMethod("block", "group", block)
    if inputs.strategy == "group":
        raise QuantizationError("compressed-tensors FP8 per-group input activations need "
                                "block-wise weights")
    if inputs.strategy == "token":
        if not inputs.dynamic:
            raise QuantizationError("compressed-tensors FP8 static per-token input "
                                    "activations are not served: use dynamic")
        return Fp8LinearMethod(weights.strategy, "token")
    return Fp8LinearMethod(weights.strategy, "tensor" if inputs.dynamic else "static")
