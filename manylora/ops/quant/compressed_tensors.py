"""The linear method of a compressed-tensors checkpoint's layer, by its scheme."""

from __future__ import annotations

from manylora.config.quantization import (
    CompressedTensorsConfig,
    CompressedTensorsScheme,
    QuantizationError,
)
from manylora.ops.linear_method import LinearMethodBase
from manylora.ops.quant.ct_int4 import CompressedTensorsW4A16


def compressed_tensors_method(config: CompressedTensorsConfig,
                              scheme: CompressedTensorsScheme) -> LinearMethodBase:
    """``manylora.ops.quant``'s factory for ``CompressedTensorsConfig`` layers: INT4
    ``pack-quantized`` weights (W4A16) → ``CompressedTensorsW4A16``.

    Raises:
        QuantizationError: a scheme with no linear method here (named).
    """
    if scheme.weights.type == "int":
        return CompressedTensorsW4A16(scheme)
    raise QuantizationError(f"compressed-tensors scheme with {scheme.weights.num_bits}-bit "
                            f"{scheme.weights.type} weights ({scheme.format}) is not served")
