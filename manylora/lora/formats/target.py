"""What an adapter must fit, whatever its format: the base model's projections and the slot
limits (``AdapterTarget``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from manylora.lora.adapter import LoRAAdapterError


@dataclass(frozen=True)
class AdapterTarget:
    """What an adapter must fit: the base model's projections and the slot limits.

    Attributes:
        module_shapes: ``{module: (in_features, out_features)}`` of the targetable modules
            (``ModelConfig.module_shapes``); for the stacked experts (``experts.gate_proj``,
            ``experts.up_proj``, ``experts.down_proj``) one expert's ``(in, out)``. An
            adapter module whose name is not here is refused.
        num_layers: decoder layers in the base model.
        max_lora_rank: the padded rank of the slots.
        target_modules: projections that have slot buffers (``lora_target_modules``).
        dtype: the model dtype adapters are stored in.
        base_model_names: names the base model goes by (path, hub id); an adapter trained
            for another one gets a warning.
        dora_norm: ``(layer, module, a [r, in], b [out, r]) → float32 [out]``, the L2 norm of
            each output row of ``W + b @ a`` over the base weight ``W`` of that module (what
            DoRA's magnitude is normalized against); None: DoRA adapters are refused.
        base_weight_equal: ``(module, weight [vocab, hidden]) → bool``, whether a table an
            adapter carries equals the base model's ``embed_tokens`` / ``lm_head`` weight
            (cast to the model dtype); None: adapters carrying one are refused.
        num_experts: ``E``, the experts of each mixture-of-experts block (0: none).
        layer_modules: per decoder layer, the names of the modules that layer has (a MoE
            layer has ``experts.*`` / ``router`` (/ ``shared_expert*``) and not the dense
            ``gate_proj`` / ``up_proj`` / ``down_proj``; Qwen2-MoE's ``mlp_only_layers`` the
            other way round); None: every module of ``module_shapes`` on every layer.
    """

    module_shapes: dict[str, tuple[int, int]]
    num_layers: int
    max_lora_rank: int
    target_modules: tuple[str, ...]
    dtype: torch.dtype
    base_model_names: tuple[str, ...] = ()
    dora_norm: Callable[[int, str, torch.Tensor, torch.Tensor], torch.Tensor] | None = field(
        default=None, compare=False, repr=False)
    base_weight_equal: Callable[[str, torch.Tensor], bool] | None = field(
        default=None, compare=False, repr=False)
    num_experts: int = 0
    layer_modules: tuple[frozenset[str], ...] | None = None

    def layer_has(self, layer: int, module: str) -> bool:
        """Whether decoder layer ``layer`` has ``module`` (``layer_modules``; any layer index
        outside them, such as ``MODEL_LAYER``, has every module)."""
        if self.layer_modules is None or not 0 <= layer < len(self.layer_modules):
            return True
        return module in self.layer_modules[layer]

    def check_layer_module(self, what: str, layer: int, module: str) -> None:
        """Refuse ``module`` on a layer that lacks it.

        Raises:
            LoRAAdapterError: ``what`` (naming the adapter and tensor), the layer and module.
        """
        if not self.layer_has(layer, module):
            present = sorted(self.layer_modules[layer]) if self.layer_modules else []
            raise LoRAAdapterError(
                f"{what}: layer {layer} of the base model has no {module} (it has "
                f"{', '.join(present)})")

