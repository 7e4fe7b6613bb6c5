"""The OLMo 2 decoder (``Olmo2ForCausalLM``): LLaMA's projections and RoPE, with the norms
moved after the sublayers and an RMSNorm over the whole q and k projections.

Per layer, as transformers' ``Olmo2DecoderLayer`` computes it (no input norm)::

    q, k, v = q_norm(q_proj(h)), k_norm(k_proj(h)), v_proj(h)     # norms before RoPE
    h = h + post_attention_layernorm(o_proj(attention(rope(q), rope(k), v)))
    h = h + post_feedforward_layernorm(mlp(h))

then the final ``norm``. The layer keeps ``LlamaDecoderLayer``'s methods and the residual
convention the piecewise CUDA graphs and the warm-up cut along (``pre_attention`` →
``self_attn.rotate`` → ``self_attn.attend`` → ``post_attention``; a layer hands on
``(x, residual)`` whose sum is the residual stream): ``pre_attention`` adds the two and
runs ``qkv_proj`` and the q/k norms, ``post_attention`` returns the normed MLP output and
the stream before it, and the inherited ``final_norm`` adds them under the final norm.

Tensor parallelism is LLaMA's (``model/llama.py``). ``q_norm`` and ``k_norm`` normalize over
the whole projection while each rank holds only its heads' rows, so their mean square is
an all-reduce of the ranks' partial sums of squares (one per norm and layer; vLLM's
``Olmo2Attention`` gathers the whole q and k instead); each rank holds its rows of the
norm weights.
"""

from __future__ import annotations

import torch
from torch import nn

from manylora.checkpoint.weights import TPSlice
from manylora.config import ModelConfig
from manylora.distributed.parallel_state import TPGroup
from manylora.lora.kernels.meta import LoRAKernelMeta
from manylora.model.layers.norm import RMSNorm
from manylora.model.layers.rotary import RotaryEmbedding
from manylora.model.llama import (
    LlamaAttention,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
    layer_prefix,
    qkv_output_ranges,
)


class ProjectionRMSNorm(nn.Module):
    """RMSNorm over a whole projection output of which this rank holds ``[start, stop)``
    (transformers' ``Olmo2RMSNorm`` rounding: normalize and scale in float32, then cast).

    Args:
        total: the whole projection's width (``total_q_size`` or ``total_kv_size``).
        part: this rank's ``(start, stop)`` of it; ``weight`` holds those entries
            (``tp_slices`` for the loader when the rank holds less than the whole).
        replicas: how many ranks hold each entry (KV heads replicated over ranks), so
            that the all-reduced sum of squares counts every entry once.
        eps: added to the mean square.
        tp: the group whose ranks hold the other parts.

    Shapes: ``x [T, stop - start]`` in the model dtype → same shape and dtype. A collective
    at ``tp.size > 1`` (every rank normalizes the same rows together).
    """

    def __init__(self, total: int, part: tuple[int, int], replicas: int, eps: float,
                 dtype: torch.dtype, device: torch.device, tp: TPGroup) -> None:
        super().__init__()
        start, stop = part
        self.weight = nn.Parameter(torch.empty(stop - start, dtype=dtype, device=device),
                                   requires_grad=False)
        if stop - start != total:
            self.weight.tp_dim = 0
            self.weight.tp_slices = (TPSlice(0, start, stop, total, stop - start),)
        self.divisor = total * replicas
        self.eps = eps
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        square_sum = xf.pow(2).sum(-1, keepdim=True)                 # [T, 1] float32
        if self.tp.size > 1:
            self.tp.all_reduce(square_sum)
        xf = xf * torch.rsqrt(square_sum / self.divisor + self.eps)
        return (self.weight * xf).to(x.dtype)


class Olmo2Attention(LlamaAttention):
    """``LlamaAttention`` with ``q_norm`` / ``k_norm`` over the whole q and k projections,
    applied by ``qk_norm`` before ``rotate``."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding,
                 device: torch.device, tp: TPGroup) -> None:
        super().__init__(cfg, layer_idx, rotary, device, tp)
        q_range, k_range, _ = qkv_output_ranges(cfg, tp.rank)
        kv_replicas = cfg.tp_size // cfg.total_num_kv_heads if cfg.kv_heads_replicated else 1
        self.q_norm = ProjectionRMSNorm(cfg.total_q_size, q_range, 1, cfg.rms_norm_eps,
                                        cfg.dtype, device, tp)
        self.k_norm = ProjectionRMSNorm(cfg.total_kv_size, k_range, kv_replicas,
                                        cfg.rms_norm_eps, cfg.dtype, device, tp)

    def qk_norm(self, qkv: torch.Tensor) -> torch.Tensor:
        """``qkv [T, q + 2 kv]`` (this rank's heads) → a new ``[T, q + 2 kv]`` with q and k
        normed."""
        cfg = self.cfg
        q, k, v = qkv.split((cfg.q_size, cfg.kv_size, cfg.kv_size), dim=-1)
        return torch.cat((self.q_norm(q), self.k_norm(k), v), dim=-1)


class Olmo2DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding,
                 device: torch.device, tp: TPGroup) -> None:
        super().__init__()
        self.self_attn = Olmo2Attention(cfg, layer_idx, rotary, device, tp)
        self.mlp = LlamaMLP(cfg, device, tp, f"{layer_prefix(layer_idx)}.mlp")
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype,
                                                device)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps,
                                                  cfg.dtype, device)

    def pre_attention(self, x: torch.Tensor, residual: torch.Tensor | None,
                      lora: LoRAKernelMeta | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, residual) → (qkv [T, q + 2 kv], h)``: the stream ``h = x + residual`` (the
        first layer: ``x``, the embedding), ``qkv_proj(h)`` (+ LoRA), the q/k norms."""
        h = x if residual is None else x + residual
        return self.self_attn.qk_norm(self.self_attn.qkv_proj(h, lora)), h

    def post_attention(self, o: torch.Tensor, residual: torch.Tensor,
                       lora: LoRAKernelMeta | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(attention output [T, q_size], h) → (post_feedforward_layernorm(mlp(h')), h')``
        with ``h' = h + post_attention_layernorm(o_proj(o))`` (``o_proj`` all-reduced);
        the next layer (or ``final_norm``) adds the two."""
        h = residual + self.post_attention_layernorm(self.self_attn.o_proj(o, lora))
        return self.post_feedforward_layernorm(self.mlp(h, lora)), h


class Olmo2Model(LlamaModel):
    layer_class = Olmo2DecoderLayer


class Olmo2ForCausalLM(LlamaForCausalLM):
    """An OLMo 2 causal LM: ``LlamaForCausalLM``'s interface, tensor parallelism, LoRA slots
    and methods (shapes, errors) over ``Olmo2Model``'s layers. Adapters target the same
    seven projections as on LLaMA (peft's names; the q/k norms are not targetable)."""

    model_class = Olmo2Model
