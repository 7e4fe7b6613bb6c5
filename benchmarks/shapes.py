"""The model shapes the benchmarks run with random weights (``load_format="dummy"``, only a
``config.json`` on disk): Llama-3-8B's, Qwen3-8B's, Gemma-2-9B's and Granite-3.1-8B's, and
a tiny model of each family for smoke runs on CPU (``--arch`` of ``bench_lora``).

Each shape is the Hugging Face ``config.json`` fields that set it (transformers' names), as
the published checkpoints' configs give them.
"""

from __future__ import annotations

from typing import NamedTuple

from benchmarks.llama3_8b import LLAMA3_8B
from benchmarks.llama3_8b import TINY as LLAMA_TINY

#: Qwen3-8B: head_dim 128 given (not hidden / heads), per-head q/k RMSNorm, no biases.
QWEN3_8B = dict(
    architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=4096,
    intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, vocab_size=151936, rope_theta=1000000.0,
    max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=False,
    attention_bias=False, use_sliding_window=False, torch_dtype="bfloat16",
    bos_token_id=151643, eos_token_id=151645)

#: Gemma-2-9B: head_dim 256 (16 heads over hidden 3584), a 4096-token window on every
#: other layer from the first, attention logits soft-capped at 50 and final logits at 30,
#: scale query_pre_attn_scalar ** -0.5, tied embeddings.
GEMMA2_9B = dict(
    architectures=["Gemma2ForCausalLM"], model_type="gemma2", hidden_size=3584,
    intermediate_size=14336, num_hidden_layers=42, num_attention_heads=16,
    num_key_value_heads=8, head_dim=256, vocab_size=256000, rope_theta=10000.0,
    max_position_embeddings=8192, rms_norm_eps=1e-6, tie_word_embeddings=True,
    attention_bias=False, hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=256,
    sliding_window=4096, layer_types=["sliding_attention", "full_attention"] * 21,
    attn_logit_softcapping=50.0, final_logit_softcapping=30.0, torch_dtype="bfloat16",
    bos_token_id=2, eos_token_id=1, pad_token_id=0)

#: Granite-3.1-8B: Llama's layout with its embedding, residual, attention and logits
#: multipliers, tied embeddings.
GRANITE3_8B = dict(
    architectures=["GraniteForCausalLM"], model_type="granite", hidden_size=4096,
    intermediate_size=12800, num_hidden_layers=40, num_attention_heads=32,
    num_key_value_heads=8, vocab_size=49155, rope_theta=10000000.0,
    max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=True,
    attention_bias=False, embedding_multiplier=12.0, residual_multiplier=0.22,
    attention_multiplier=0.0078125, logits_scaling=16.0, torch_dtype="bfloat16",
    bos_token_id=0, eos_token_id=0, pad_token_id=0)


def tiny(config: dict, **override) -> dict:
    """``config`` shrunk for a CPU smoke run: 2 layers, hidden 64, 4 heads over 2 KV heads,
    intermediate 128, vocabulary 512 (bos 1, eos 2), float32, with ``override`` on top
    (e.g. a ``head_dim`` other than hidden / heads)."""
    return dict(config, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                max_position_embeddings=2048, torch_dtype="float32", bos_token_id=1,
                eos_token_id=2, **override)


class Shape(NamedTuple):
    """A benchmark model: its name in tables, the full config, the tiny one."""

    name: str
    full: dict
    tiny: dict


#: ``--arch`` → the shape.
SHAPES: dict[str, Shape] = {
    "llama": Shape("Llama-3-8B", LLAMA3_8B, LLAMA_TINY),
    "qwen3": Shape("Qwen3-8B", QWEN3_8B, tiny(QWEN3_8B, head_dim=32)),
    "gemma2": Shape("Gemma-2-9B", GEMMA2_9B, tiny(
        GEMMA2_9B, head_dim=32, query_pre_attn_scalar=32, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"])),
    "granite": Shape("Granite-3.1-8B", GRANITE3_8B, tiny(GRANITE3_8B,
                                                         attention_multiplier=1 / 16)),
}
