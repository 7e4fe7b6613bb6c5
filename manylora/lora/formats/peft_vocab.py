"""What peft's ``embed_tokens`` / ``lm_head`` LoRA must be beyond a projection's: no DoRA,
a vocabulary no larger than the base model's, and a saved base table (peft's
``save_embedding_layers``) equal to the base model's own."""

from __future__ import annotations

import torch

from manylora.lora.adapter import LoRAAdapterError
from manylora.lora.formats.target import AdapterTarget


def check_vocab_module(name: str, module_key: str, ab: dict[str, torch.Tensor],
                        use_dora: bool, target: AdapterTarget) -> None:
    """What ``embed_tokens`` / ``lm_head`` LoRA must be beyond a projection's (meta tensors
    will do): no DoRA, and a vocabulary no larger than the base model's, in the LoRA
    tensors and in the saved base table.

    Raises:
        LoRAAdapterError: naming the module, the tensor and its shape.
    """
    module = module_key.rsplit(".", 1)[-1]
    what = f"adapter {name!r}: {module_key}"
    if use_dora:
        raise LoRAAdapterError(f"{what}: DoRA (use_dora) on {module} is not supported; "
                               "DoRA adapters may target the decoder layers' projections")
    hidden, vocab = target.module_shapes["lm_head"]
    label, dim, field = (("A", 1, "lora_embedding_A") if module == "embed_tokens"
                         else ("B", 0, "lora_B"))
    wide = [(field, ab[label])] if label in ab and ab[label].dim() == 2 else []
    if "W" in ab:
        wide.append(("base_layer.weight", ab["W"]))
        if tuple(ab["W"].shape[1:]) != (hidden,):
            raise LoRAAdapterError(f"{what}: base_layer.weight {tuple(ab['W'].shape)} is not "
                                   f"[vocab, {hidden}]: the adapter was trained for another "
                                   "base model")
    for field, t in wide:
        size = t.shape[0] if field == "base_layer.weight" else t.shape[dim]
        if size > vocab:
            raise LoRAAdapterError(
                f"{what}: {field} {tuple(t.shape)} covers a vocabulary of {size} tokens, "
                f"more than the base model's {vocab} (tokens added to the vocabulary are not "
                "supported)")


def check_base_copy(name: str, module_key: str, weight: torch.Tensor,
                     target: AdapterTarget) -> None:
    """The base table peft saved with an ``embed_tokens`` / ``lm_head`` adapter
    (``base_layer.weight``; peft loads it over the model's) must be the engine's own.

    Raises:
        LoRAAdapterError: it differs (a fine-tuned table: ``modules_to_save`` in effect),
            or the engine cannot compare it.
    """
    module = module_key.rsplit(".", 1)[-1]
    what = f"adapter {name!r}: {module_key}.base_layer.weight"
    if target.base_weight_equal is None:
        raise LoRAAdapterError(f"{what}: a saved copy of the base {module} cannot be "
                               "compared with the base model here")
    if tuple(weight.shape) != target.module_shapes["lm_head"][::-1]:
        raise LoRAAdapterError(f"{what} is {tuple(weight.shape)}, the base model's "
                               f"{module} {target.module_shapes['lm_head'][::-1]}")
    if not target.base_weight_equal(module, weight):
        raise LoRAAdapterError(
            f"{what} differs from the base model's {module}: the adapter changes the "
            "table itself (a trained or resized embedding), which manylora cannot serve per "
            "adapter")
