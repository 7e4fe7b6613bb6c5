"""The model registry's table: each Hugging Face architecture manylora serves, and the
class that builds it (vLLM's ``_TEXT_GENERATION_MODELS``).

A new decoder family is a new file under ``manylora/model/`` and one line in
``MODEL_ARCHITECTURES``. The classes are named, not imported: the table sits at the bottom
of the package, where ``ModelConfig.from_hf`` checks a checkpoint against it, and
``manylora.model.registry`` imports the named module when a model is built (vLLM's lazy
registry entries).
"""

from __future__ import annotations

from typing import Any

#: Architecture (``config.json``'s ``architectures``) → ``"module:Class"`` under
#: ``manylora.model``.
MODEL_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama:LlamaForCausalLM",
    "MistralForCausalLM": "llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "llama:LlamaForCausalLM",
    "Qwen3ForCausalLM": "qwen3:Qwen3ForCausalLM",
    "Olmo2ForCausalLM": "olmo2:Olmo2ForCausalLM",
    "GraniteForCausalLM": "granite:GraniteForCausalLM",
    "Gemma2ForCausalLM": "gemma2:Gemma2ForCausalLM",
    "Gemma3ForCausalLM": "gemma3:Gemma3ForCausalLM",
    "Phi3ForCausalLM": "phi3:Phi3ForCausalLM",
    "MixtralForCausalLM": "mixtral:MixtralForCausalLM",
    "Qwen2MoeForCausalLM": "qwen2_moe:Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM": "qwen3_moe:Qwen3MoeForCausalLM",
}

#: Architecture of a config that names only its ``model_type``.
MODEL_TYPE_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM", "olmo2": "Olmo2ForCausalLM",
    "granite": "GraniteForCausalLM",
    "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}


def resolve_architecture(hf_config: Any) -> str:
    """The first of ``hf_config.architectures`` that ``MODEL_ARCHITECTURES`` holds (a
    config without ``architectures``: the one of its ``model_type``), as vLLM picks it.

    Raises:
        ValueError: ``unsupported architecture [...]: manylora serves ...``, naming the
            config's architectures (or its ``model_type``) and the served ones.
    """
    model_type = getattr(hf_config, "model_type", "?")
    archs = list(getattr(hf_config, "architectures", None) or [])
    if not archs and model_type in MODEL_TYPE_ARCHITECTURES:
        archs = [MODEL_TYPE_ARCHITECTURES[model_type]]
    arch = next((a for a in archs if a in MODEL_ARCHITECTURES), None)
    if arch is None:
        raise unsupported_architecture(archs or model_type)
    return arch


def unsupported_architecture(named: Any) -> ValueError:
    """The error for a checkpoint of ``named`` architecture(s) the registry does not hold."""
    return ValueError(f"unsupported architecture {named!r}: manylora serves "
                      f"{', '.join(MODEL_ARCHITECTURES)}")
