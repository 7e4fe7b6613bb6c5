"""The model registry: architecture name → the class that builds it (vLLM's
``ModelRegistry``).

The table is ``manylora.config.architectures.MODEL_ARCHITECTURES`` (``"module:Class"``
under ``manylora.model``; ``ModelConfig.from_hf`` checks checkpoints against it); this
module imports the named family module when a model is built. A registered class takes
``(cfg: ModelConfig, device, tp: TPGroup | None)`` and offers what the worker reaches,
as ``LlamaForCausalLM`` does: ``cfg`` (the rank's), ``forward``, ``embed(ids, lora)``,
``final_norm``, ``compute_logits(hidden, rows)`` (an override passes ``lora`` / ``rows`` on
to Llama's, which adds the ``embed_tokens`` / ``lm_head`` adapters), ``create_lora_slots`` /
``slot_table`` / ``embed_lora`` / ``head_lora``, ``lora_module_weight``, ``lora_dora_norm``,
``lora_base_weight_equal``, and for the piecewise CUDA graphs and the warm-up ``model.layers[i]``
with ``pre_attention``, ``self_attn.rotate`` / ``self_attn.attend`` and
``post_attention``, ``model.embed_tokens``, ``model.rotary`` and ``lm_head``.
"""

from __future__ import annotations

import importlib

from torch import nn

from manylora.config.architectures import MODEL_ARCHITECTURES, unsupported_architecture


def model_class(architecture: str) -> type[nn.Module]:
    """The class registered for ``architecture`` (``ModelConfig.architecture``, e.g.
    ``"Qwen2ForCausalLM"`` → ``LlamaForCausalLM``), its module imported on first use.

    Raises:
        ValueError: an architecture the registry does not hold.
    """
    target = MODEL_ARCHITECTURES.get(architecture)
    if target is None:
        raise unsupported_architecture([architecture])
    module, name = target.split(":")
    return getattr(importlib.import_module(f"{__package__}.{module}"), name)
