"""The linear methods of quantized base weights (``manylora.ops.linear_method``'s seam):
one ``LinearMethodBase`` per format of ``manylora.config.quantization``, chosen per layer
by ``linear_method_for`` (vLLM's ``QuantizationConfig.get_quant_method``).

The LoRA shrink/expand (``manylora.lora.linear``) runs on the layer's 16-bit input and adds
to whatever the method's ``apply`` returned, so an adapter over a quantized base is the
same kernels as over a dense one; DoRA and the adapter formats read the base through the
method's ``dense_weight`` (dequantized).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from manylora.config.quantization import (
    AWQConfig,
    CompressedTensorsConfig,
    Fp8Config,
    GPTQConfig,
    QuantizationConfig,
    QuantizationError,
)
from manylora.ops.linear_method import LinearMethodBase, UnquantizedLinearMethod
from manylora.ops.quant.awq import awq_method
from manylora.ops.quant.compressed_tensors import compressed_tensors_method
from manylora.ops.quant.fp8 import fp8_method
from manylora.ops.quant.gptq import gptq_method

#: config class → (config, the layer's scheme) → its linear method; one entry per format.
_METHODS: dict[type, Callable[[QuantizationConfig, object], LinearMethodBase]] = {
    GPTQConfig: gptq_method, AWQConfig: awq_method, Fp8Config: fp8_method,
    CompressedTensorsConfig: compressed_tensors_method}


def linear_method_for(quantization: QuantizationConfig | None,
                      modules: Sequence[str]) -> LinearMethodBase:
    """The linear method of a layer whose Hugging Face module names are ``modules`` (one,
    or a fused projection's parts: ``model.layers.0.self_attn.q_proj``, ``…k_proj``,
    ``…v_proj``) under ``quantization`` (None: a 16/32-bit model).

    Raises:
        QuantizationError: the parts are quantized differently, or the format has no
            linear method here.
    """
    if quantization is None:
        return UnquantizedLinearMethod()
    scheme = quantization.scheme_for_parts(modules)
    if scheme is None:
        return UnquantizedLinearMethod()
    make = _METHODS.get(type(quantization))
    if make is None:
        raise QuantizationError(f"{quantization.name} base weights are not served")
    return make(quantization, scheme)
