"""The LLaMA-family decoder (Llama 2/3, Mistral, Qwen2) over a flat batch of tokens.

No padding: the step's tokens of every sequence are concatenated into ``[T]`` rows, and
attention finds each sequence's keys through its block table. Parameter names match
Hugging Face's except the fused ``qkv_proj`` and ``gate_up_proj`` (the weight loader
translates them).
"""

from __future__ import annotations

import torch
from torch import nn

from manylora.config import LoRAConfig, ModelConfig
from manylora.lora.layers import LoRALinear, LoRASlots
from manylora.lora.punica import LoRAMapping
from manylora.model.layers.activation import silu_and_mul
from manylora.model.layers.embedding import Embedding
from manylora.model.layers.norm import RMSNorm
from manylora.model.layers.rotary import RotaryEmbedding
from manylora.ops.attention import AttentionMetadata, KVCache, paged_attention, write_kv


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding,
                 device: torch.device) -> None:
        super().__init__()
        self.cfg = cfg
        self.rotary = [rotary]  # shared table; a list keeps it out of this module's buffers
        self.sliding_window = cfg.sliding_windows[layer_idx]
        self.qkv_proj = LoRALinear(cfg.hidden_size, (cfg.q_size, cfg.kv_size, cfg.kv_size),
                                   ("q_proj", "k_proj", "v_proj"), cfg.qkv_bias, cfg.dtype,
                                   device)
        self.o_proj = LoRALinear(cfg.q_size, (cfg.hidden_size,), ("o_proj",), cfg.o_bias,
                                 cfg.dtype, device)
        self.scale = cfg.head_dim ** -0.5

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: KVCache,
                attn: AttentionMetadata, lora: LoRAMapping | None) -> torch.Tensor:
        """``x [T, hidden]`` → ``[T, hidden]``: qkv, RoPE, ``write_kv`` into this layer's
        ``KVCache`` (quantized there when it is), ``paged_attention``, o_proj."""
        cfg = self.cfg
        qkv = self.qkv_proj(x, lora)                                   # [T, q + 2 kv]
        q, k, v = qkv.split((cfg.q_size, cfg.kv_size, cfg.kv_size), dim=-1)
        q = q.view(-1, cfg.num_heads, cfg.head_dim)
        k = k.view(-1, cfg.num_kv_heads, cfg.head_dim)
        v = v.reshape(-1, cfg.num_kv_heads, cfg.head_dim)
        q, k = self.rotary[0](positions, q, k)
        write_kv(k, v, kv_cache, attn.slot_mapping)
        o = paged_attention(q, kv_cache, attn, self.scale, self.sliding_window)   # [T, q]
        return self.o_proj(o, lora)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, device: torch.device) -> None:
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = LoRALinear(cfg.hidden_size, (self.inter, self.inter),
                                       ("gate_proj", "up_proj"), cfg.mlp_bias, cfg.dtype, device)
        self.down_proj = LoRALinear(self.inter, (cfg.hidden_size,), ("down_proj",),
                                    cfg.mlp_bias, cfg.dtype, device)

    def forward(self, x: torch.Tensor, lora: LoRAMapping | None) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x, lora)), lora)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding,
                 device: torch.device) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_idx, rotary, device)
        self.mlp = LlamaMLP(cfg, device)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype,
                                                device)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: KVCache, attn: AttentionMetadata,
                lora: LoRAMapping | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, residual) → (mlp output, residual stream before it)``; the caller adds them.

        Each residual add is fused into the next RMSNorm (vLLM's ``fused_add_rms_norm``):
        ``h = x + residual; x = norm(h); residual = h``.
        """
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, kv_cache, attn, lora)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x, lora), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, device: torch.device) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, cfg.dtype, device)
        self.rotary = RotaryEmbedding(cfg.hf_config, cfg.head_dim, cfg.max_model_len).to(device)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, i, self.rotary, device) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype, device)


class LlamaForCausalLM(nn.Module):
    """A LLaMA-family causal LM whose projections all run through ``LoRALinear``.

    Args:
        cfg: the model shape and dtype.
        device: where parameters are allocated (uninitialised; the weight loader fills them).

    Forward: ``input_ids`` and ``positions`` int64 ``[T]``, one ``KVCache`` per layer
    (``data [2, num_blocks, block_size, num_kv_heads, head_dim]`` in the model dtype, or int8 /
    float8_e4m3fn with float32 ``scale [2, num_blocks, block_size, num_kv_heads]``), the
    step's attention metadata and LoRA mapping → hidden states ``[T, hidden_size]`` in the
    model dtype.
    ``compute_logits(hidden [N, hidden]) → float32 [N, vocab]``.
    """

    def __init__(self, cfg: ModelConfig, device: torch.device) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = LlamaModel(cfg, device)
        self.lm_head = None if cfg.tie_word_embeddings else Embedding(
            cfg.vocab_size, cfg.hidden_size, cfg.dtype, device)

    def create_lora_slots(self, lora_config: LoRAConfig) -> dict[tuple[int, str], LoRASlots]:
        """Allocate every layer's slot buffers once; ``{(layer, module): slots}``."""
        slots: dict[tuple[int, str], LoRASlots] = {}
        for i, layer in enumerate(self.model.layers):
            for proj in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                         layer.mlp.gate_up_proj, layer.mlp.down_proj):
                lora = proj.create_lora_slots(lora_config.target_modules, lora_config.max_loras,
                                              lora_config.max_lora_rank)
                if lora is not None:
                    slots.update({(i, name): lora for name in lora.module_names})
        return slots

    def lora_module_weight(self, layer: int, module: str) -> torch.Tensor:
        """The base weight ``[out, in]`` of one LoRA-targetable projection (a view into the
        packed weight), e.g. ``(3, "k_proj")``."""
        layer_mod = self.model.layers[layer]
        for proj in (layer_mod.self_attn.qkv_proj, layer_mod.self_attn.o_proj,
                     layer_mod.mlp.gate_up_proj, layer_mod.mlp.down_proj):
            if module in proj.module_names:
                return proj.module_weight(module)
        raise ValueError(f"no projection {module!r} in layer {layer}")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], attn: AttentionMetadata,
                lora: LoRAMapping | None) -> torch.Tensor:
        x, residual = self.model.embed_tokens(input_ids), None          # [T, H]
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            x, residual = layer(positions, x, residual, kv_cache, attn, lora)
        return self.model.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return nn.functional.linear(hidden, weight).float()
