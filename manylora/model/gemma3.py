"""The Gemma 3 text decoder (``Gemma3ForCausalLM``, ``model_type`` ``gemma3_text``): Gemma 2's
layers with a per-head q/k norm, RoPE bases per layer type, and no attention soft cap.

Against ``model/gemma2.py``, as transformers' ``Gemma3TextModel`` computes it:

* ``q_norm`` / ``k_norm``: a ``(1 + w)`` RMSNorm of width ``head_dim`` over every query and
  key head after the projection, before RoPE (one weight shared by the heads, replicated
  on every tensor-parallel rank); it runs inside ``rotate``, writing into the packed
  ``qkv``, as Qwen3's does.
* RoPE per layer type: ``rope_parameters["sliding_attention"]`` (``rope_local_base_freq``,
  10 000 by default) for the sliding-window layers, ``rope_parameters["full_attention"]``
  (``rope_theta`` with its scaling, e.g. linear × 8) for the global ones; one shared table
  each (``model.rotary`` the global layers', ``model.rotary_local`` the sliding ones').
* No attention soft-capping: transformers' ``Gemma3Attention`` does not pass
  ``attn_logit_softcapping`` to its attention, so neither does this.

Checkpoints with ``use_bidirectional_attention`` (EmbeddingGemma) are refused: they are not
causal LMs.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch

from manylora.config import ModelConfig
from manylora.distributed.parallel_state import TPGroup
from manylora.model.gemma2 import (
    Gemma2Attention,
    Gemma2DecoderLayer,
    Gemma2ForCausalLM,
    Gemma2Model,
)
from manylora.model.layers.norm import GemmaRMSNorm
from manylora.model.layers.rotary import RotaryEmbedding

_LAYER_TYPES = ("full_attention", "sliding_attention")


def rope_config(hf_config: Any, layer_type: str) -> Any:
    """A shallow copy of ``hf_config`` whose ``rope_parameters`` are those of ``layer_type``
    (``"full_attention"`` or ``"sliding_attention"``), for ``RotaryEmbedding``; the config
    itself when its RoPE parameters are not per layer type."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    if layer_type not in params:
        return hf_config
    view = copy.copy(hf_config)
    view.rope_parameters = dict(params[layer_type])
    return view


class Gemma3Attention(Gemma2Attention):
    """``Gemma2Attention`` without the soft cap and with ``q_norm`` / ``k_norm``
    (``GemmaRMSNorm`` of width ``head_dim``, the checkpoint's ``self_attn.q_norm.weight`` /
    ``self_attn.k_norm.weight``) on each query and key head before RoPE (with this layer
    type's RoPE table)."""

    qk_norm_class = GemmaRMSNorm

    @staticmethod
    def logit_softcap(hf_config) -> float | None:
        """None: transformers' Gemma 3 attention ignores ``attn_logit_softcapping``."""
        return None


class Gemma3DecoderLayer(Gemma2DecoderLayer):
    attention_class = Gemma3Attention


class Gemma3Model(Gemma2Model):
    """``Gemma2Model`` over ``Gemma3DecoderLayer``s; ``rotary`` holds the global layers' RoPE
    table, ``rotary_local`` the sliding-window layers'."""

    layer_class = Gemma3DecoderLayer

    def __init__(self, cfg: ModelConfig, device: torch.device, tp: TPGroup) -> None:
        hf = cfg.hf_config
        super().__init__(dataclasses.replace(cfg, hf_config=rope_config(hf, "full_attention")),
                         device, tp)
        self.rotary_local = RotaryEmbedding(rope_config(hf, "sliding_attention"),
                                            cfg.head_dim, cfg.max_model_len).to(device)
        for layer, layer_type in zip(self.layers, hf.layer_types, strict=True):
            if layer_type not in _LAYER_TYPES:
                raise ValueError(f"layer type {layer_type!r} is not supported; Gemma 3 layers "
                                 f"are {', '.join(_LAYER_TYPES)}")
            if layer_type == "sliding_attention":
                layer.self_attn.rotary = [self.rotary_local]


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """A Gemma 3 text causal LM: ``Gemma2ForCausalLM`` (its arguments, forward, scaled
    embedding, final soft cap, LoRA slots and tensor parallelism) over ``Gemma3Model``.

    Raises:
        ValueError: as ``Gemma2ForCausalLM``; a config with ``use_bidirectional_attention``
            or a layer type other than ``full_attention`` / ``sliding_attention``.
    """

    model_class = Gemma3Model

    def __init__(self, cfg: ModelConfig, device: torch.device, tp: TPGroup | None = None) -> None:
        if getattr(cfg.hf_config, "use_bidirectional_attention", False):
            raise ValueError("use_bidirectional_attention is set: this Gemma 3 checkpoint is "
                             "an embedding model, not a causal LM; manylora serves causal LMs")
        super().__init__(cfg, device, tp)
