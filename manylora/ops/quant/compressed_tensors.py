"""The linear method of a compressed-tensors checkpoint's layer, by its scheme."""

from __future__ import annotations

from manylora.config.quantization import (
    CompressedTensorsConfig,
    CompressedTensorsScheme,
    QuantizationError,
)
from manylora.ops.linear_method import LinearMethodBase
from manylora.ops.quant.ct_int4 import CompressedTensorsW4A16
from manylora.ops.quant.fp8 import compressed_tensors_fp8_method


def compressed_tensors_method(config: CompressedTensorsConfig,
                              scheme: CompressedTensorsScheme) -> LinearMethodBase:
    """``manylora.ops.quant``'s factory for ``CompressedTensorsConfig`` layers: INT4
    ``pack-quantized`` weights (W4A16) → ``CompressedTensorsW4A16``; FP8
    ``float-quantized`` weights → ``compressed_tensors_fp8_method``'s ``Fp8LinearMethod``.

    Raises:
        QuantizationError: a scheme with no linear method here (named).
    """
    if scheme.weights.type == "int":
        return CompressedTensorsW4A16(scheme)
    if scheme.weights.type == "float":
        return compressed_tensors_fp8_method(config, scheme)
    raise QuantizationError(f"compressed-tensors scheme with {scheme.weights.num_bits}-bit "
                            f"{scheme.weights.type} weights ({scheme.format}) is not served")
