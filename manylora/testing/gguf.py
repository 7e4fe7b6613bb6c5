"""Tiny GGUF files for tests, written with the ``gguf`` package's ``GGUFWriter`` from a tiny
Hugging Face checkpoint (:func:`~manylora.testing.checkpoint.make_checkpoint`).

Only what llama.cpp's ``convert_hf_to_gguf.py`` does for LLaMA, Qwen2, Qwen3, Phi-3, Gemma 2
and Gemma 3 checkpoints, reduced to the metadata transformers reads: llama.cpp's tensor
names, reversed shapes, for ``llama`` the Q/K row permutation of ``LlamaModel.permute``
(the Qwen, Phi-3 and Gemma converters permute nothing), Phi-3's fused ``qkv_proj`` and
``gate_up_proj`` kept fused (``attn_qkv``, ``ffn_up``), for Gemma the norm weights stored
as ``1 + w`` (its ``Gemma2Model.modify_tensors``) and the head width and window in the
metadata. No tokenizer is written: engines on these files run with ``skip_tokenizer_init``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import load_file

#: Hugging Face name (without ``model.`` and the layer prefix) -> llama.cpp's name.
_NAMES = {
    "embed_tokens": "token_embd", "norm": "output_norm", "lm_head": "output",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",
}


#: Phi-3's vocabulary (transformers' ``Phi3Config`` pads with id 32000).
_PHI3_VOCAB = 32064


def llama_cpp_permute(weights: np.ndarray, n_head: int, n_head_kv: int | None = None
                      ) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute`` of Q/K rows (``convert_hf_to_gguf.py``)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


#: ``model_type`` → llama.cpp's architecture, for the families whose converter stores norm
#: weights as ``1 + w`` and whose tensor names come from gguf's own name map.
_GEMMA = {"gemma2": "gemma2", "gemma3_text": "gemma3"}


def _gguf_name(hf_name: str) -> str:
    parts = hf_name.removeprefix("model.").split(".")
    suffix = parts[-1]
    if parts[0] == "layers":
        return f"blk.{parts[1]}.{_NAMES['.'.join(parts[2:-1])]}.{suffix}"
    return f"{_NAMES['.'.join(parts[:-1])]}.{suffix}"


def write_gguf(checkpoint_dir: str | os.PathLike, out: str | os.PathLike,
               qtype: Any = None, architecture: str | None = None,
               metadata: dict[str, Any] | None = None,
               float64: tuple[str, ...] = ()) -> Path:
    """Write ``checkpoint_dir`` (a llama, qwen2, qwen3, phi3, gemma2 or gemma3
    :func:`make_checkpoint`, one safetensors file) as the GGUF file ``out``. transformers
    reads no head width from a qwen3 GGUF (its ``Qwen3Config`` default, 128, holds), so a
    qwen3 checkpoint needs ``head_dim`` 128; nor a ``partial_rotary_factor`` or RoPE scaling
    for phi3, whose ``pad_token_id`` is ``Phi3Config``'s default, 32000: a smaller phi3
    vocabulary is padded to Phi-3's 32064 with zero rows of the embedding and LM head.

    Args:
        checkpoint_dir: the Hugging Face checkpoint.
        out: the ``.gguf`` path written.
        qtype: the ``gguf.GGMLQuantizationType`` of 2-D weights (quantized with
            ``gguf.quantize``); default F32. Norms and biases stay F32, as llama.cpp keeps
            1-D tensors.
        architecture: ``general.architecture`` written (default the checkpoint's
            ``model_type``), e.g. one manylora or transformers does not serve.
        metadata: extra ``{key: int}`` metadata (e.g. ``{"split.count": 2}``).
        float64: Hugging Face names of tensors stored as F64 (a type gguf-py 0.19 cannot
            dequantize).

    Returns:
        ``out`` as a Path.
    """
    import gguf

    checkpoint_dir, out = Path(checkpoint_dir), Path(out)
    config = json.loads((checkpoint_dir / "config.json").read_text())
    arch = architecture or config["model_type"]
    gemma = config["model_type"] in _GEMMA
    if gemma:
        gguf_arch = _GEMMA[config["model_type"]]
        arch = architecture or gguf_arch
        names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, gguf_arch.upper()),
                                         config["num_hidden_layers"])
    qtype = gguf.GGMLQuantizationType.F32 if qtype is None else qtype
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    vocab = max(config["vocab_size"], _PHI3_VOCAB) if arch == "phi3" else config["vocab_size"]
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_name(f"tiny {arch}")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(float(config.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    writer.add_vocab_size(vocab)
    writer.add_rope_dimension_count(config.get("head_dim") or config["hidden_size"] // heads)
    if gemma:
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
        writer.add_sliding_window(config["sliding_window"])
    for key, value in (metadata or {}).items():
        writer.add_uint32(key, value)
    tensors = load_file(str(checkpoint_dir / "model.safetensors"))
    for name in sorted(tensors):
        data = tensors[name].astype(np.float32)
        if name in ("model.embed_tokens.weight", "lm_head.weight") and len(data) < vocab:
            data = np.concatenate([data, np.zeros((vocab - len(data), data.shape[1]),
                                                  np.float32)])
        if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            data = llama_cpp_permute(data, heads, heads)
        elif arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            data = llama_cpp_permute(data, heads, kv_heads)
        if gemma and name.endswith("norm.weight"):
            data = data + 1.0
        if gemma:
            base, suffix = name.rsplit(".", 1)
            gguf_name = f"{names.get_name(base)}.{suffix}"
        else:
            gguf_name = _gguf_name(name)
        if name in float64:
            writer.add_tensor(gguf_name, data.astype(np.float64))
        elif data.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name, gguf.quantize(data, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
