"""How a projection's base product is computed and its weights laid out (vLLM's
``LinearMethodBase`` / ``UnquantizedLinearMethod``).

A linear layer (``LoRALinear``, the LM head) owns one method object, chosen when the model
is built. The method registers the layer's weight parameters (``create_weights``: their
shapes, dtypes and the attributes the weights loader reads), may rework them once the
checkpoint is in (``process_weights_after_loading``), and computes ``y = x Wᵀ (+ b)``
(``apply``). The layer keeps the bias and the tensor-parallel split; ``LoRALinear`` adds its
adapters' shrink/expand on top of whatever ``apply`` returned, so FP8, INT4 or
GGUF-quantized base weights are another method, not another LoRA path.

Here: ``UnquantizedLinearMethod``, a dense ``weight [out, in]`` in the model's 16- or 32-bit
dtype. The quantized formats' methods are ``manylora.ops.quant``'s.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from manylora.ops.triton_skinny import skinny_eligible, skinny_linear


def applied_bias(layer: nn.Module) -> torch.Tensor | None:
    """The bias the layer's forward passes to ``apply``: its ``bias`` unless it is row
    parallel (there the bias is added after the all-reduce), so that a warm-up compiles the
    kernels the forward will launch."""
    return None if getattr(layer, "parallel", None) == "row" else getattr(layer, "bias", None)


class LinearMethodBase(ABC):
    """One way of storing and multiplying a linear layer's base weight.

    The weight loader (``manylora.checkpoint.weights.ModelWeightsLoader``) fills the
    parameters ``create_weights`` registered, by name, reading for each the rows or
    columns its ``tp_slices`` name (or handing the tensors to its ``weight_loader``), so a
    method that stores another layout (packed INT4, FP8 with scales) sets those attributes
    for it.
    """

    @abstractmethod
    def create_weights(self, layer: nn.Module, in_features: int, out_features: int,
                       params_dtype: torch.dtype, device: torch.device,
                       weight_attrs: Mapping[str, Any]) -> None:
        """Register ``layer``'s weight parameter(s), uninitialised, for the loader to fill.

        Args:
            layer: the module the parameters go on.
            in_features, out_features: this rank's dense shape ``[out, in]`` (packed
                modules concatenated along ``out``).
            params_dtype: the model's (activation) dtype.
            device: where the parameters live.
            weight_attrs: attributes of the dense weight for the loader (``tp_dim``,
                ``tp_slices``: the rank's part of each checkpoint tensor, in the dense
                ``[out, in]`` layout); a method storing another layout translates them.

        The layer's split is set before this is called and a method may read it:
        ``module_names``, ``output_sizes`` (this rank's rows of each packed module),
        ``full_output_sizes``, ``output_ranges`` (the rank's ``[start, stop)`` rows of
        each), ``full_in_features`` and ``in_range`` (the rank's input columns), ``parallel``
        (``"column"``, ``"row"`` or None).
        """

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Rework ``layer``'s parameters once the checkpoint (or dummy weights) filled them,
        e.g. repack for a kernel; the model loader calls it once per layer. Default:
        nothing."""
        return None

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x [T, in] → x Wᵀ (+ bias) [T, out]`` in x's dtype (``bias [out]`` or None).
        Called on every forward of the layer, inside CUDA-graph capture too: no host
        sync."""

    @abstractmethod
    def dense_weight(self, layer: nn.Module) -> torch.Tensor:
        """The base weight as a dense ``[out, in]`` matrix in ``params_dtype`` (what DoRA's
        column norms and the LoRA formats' base lookups read); not on the hot path."""

    def warm_up(self, layer: nn.Module) -> int:
        """Compile (or load) every kernel specialization ``apply`` may launch for
        ``layer`` (the worker's warm-up calls it once per distinct layout, before any
        CUDA graph is captured); returns the number of launches. Default: none."""
        return 0


class UnquantizedLinearMethod(LinearMethodBase):
    """A dense ``weight [out, in]`` (float32, bfloat16 or float16: the model's dtype).

    ``apply``: the skinny Triton kernel (``manylora.ops.triton_skinny``) where a CUDA graph
    is being captured and ``skinny_eligible`` (the decode graphs: a replay pays no launch
    cost), cuBLAS (``torch.nn.functional.linear``) otherwise, including eager steps, where
    launching a Triton kernel from Python costs more host time than cuBLAS's launch.
    """

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int,
                       params_dtype: torch.dtype, device: torch.device,
                       weight_attrs: Mapping[str, Any]) -> None:
        weight = nn.Parameter(torch.empty(out_features, in_features, dtype=params_dtype,
                                          device=device), requires_grad=False)
        for name, value in weight_attrs.items():
            setattr(weight, name, value)
        layer.weight = weight

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        weight = layer.weight
        if x.is_cuda and torch.cuda.is_current_stream_capturing() \
                and skinny_eligible(x, weight):
            return skinny_linear(x, weight, bias)
        return torch.nn.functional.linear(x, weight, bias)

    def dense_weight(self, layer: nn.Module) -> torch.Tensor:
        return layer.weight
