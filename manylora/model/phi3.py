"""The Phi-3 decoder (``Phi3ForCausalLM``: Phi-3, Phi-3.5, Phi-4 and Phi-4-mini), which is
LLaMA's layer with the projections fused in the checkpoint.

transformers' ``Phi3DecoderLayer`` computes what ``LlamaDecoderLayer`` does (pre-norm
RMSNorm, SiLU-gated MLP, the residual dropouts training-only); its ``qkv_proj.weight``
``[q + k + v, hidden]`` and ``gate_up_proj.weight`` ``[2 * intermediate, hidden]`` are the
parts manylora packs anyway, in the same order, and the weights loader cuts each rank's
rows of each part out of them (``ModelWeightsLoader.fused_key``). RoPE may rotate only the
first ``partial_rotary_factor`` of each head (Phi-4-mini: 0.75) and may be ``longrope``
(Phi-3-mini-128k, Phi-3.5, Phi-4-mini; ``su`` in older configs), whose short or long
factors each token takes by its own sequence's length (``RotaryEmbedding``, ``rope_rows``).
``sliding_window``, when set, applies to every layer, as in transformers.

Adapters: peft's ``qkv_proj`` / ``gate_up_proj`` targets are split onto the q/k/v and
gate/up slices (``lora.formats.peft_config``), TensorRT-LLM's ``attn_qkv`` (id 0) and
``mlp_gate_up`` (id 18) likewise; ``o_proj`` and ``down_proj`` are LLaMA's.
"""

from __future__ import annotations

from manylora.model.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    """A Phi-3 causal LM: ``LlamaForCausalLM`` (its layers, interface, tensor parallelism,
    LoRA slots and methods; transformers' ``Phi3DecoderLayer`` computes what
    ``LlamaDecoderLayer`` does), read from a checkpoint whose ``qkv_proj`` and
    ``gate_up_proj`` are fused."""
