"""The one in-memory form of a LoRA adapter, whatever format it was read from."""

from __future__ import annotations

from dataclasses import dataclass

import torch


class LoRAAdapterError(ValueError):
    """An adapter that cannot be served; the message names the adapter and the problem."""


@dataclass(frozen=True)
class LoRAWeights:
    """One targeted module of one layer.

    Attributes:
        a: ``[r, in_features]``.
        b: ``[out_features, r]`` with the LoRA scaling (alpha/r or alpha/sqrt(r)) folded in,
            so the module's delta is ``x @ a^T @ b^T``.
    """

    a: torch.Tensor
    b: torch.Tensor

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass(frozen=True)
class LoRAAdapter:
    """A loaded adapter, kept in the host tier.

    Attributes:
        lora_int_id: the adapter's identity (``LoRARequest.lora_int_id``).
        name: ``LoRARequest.lora_name``.
        weights: ``{(layer_index, module_name): LoRAWeights}``, host tensors in the model
            dtype; module names are the seven HF projection names.
    """

    lora_int_id: int
    name: str
    weights: dict[tuple[int, str], LoRAWeights]

    @property
    def rank(self) -> int:
        """The largest rank over all targeted modules."""
        return max(w.rank for w in self.weights.values())
