"""Phi-3 / Phi-4 (``Phi3ForCausalLM``: fused ``qkv_proj`` and ``gate_up_proj`` in the
checkpoint, RoPE on the first ``partial_rotary_factor`` of each head, ``longrope``) against
transformers + peft on the same weights, greedy, token for token.

The checkpoints are written by transformers' own ``save_pretrained`` (``make_checkpoint``),
the adapters by peft's (``make_peft_adapter``) on Phi-3's own module names: attention only
(``qkv_proj`` and ``o_proj`` of different ranks), every linear layer, and a DoRA one over
the fused ``qkv_proj``. manylora runs them as one mixed batch with the base model, through
a single slot (fewer slots than adapters), twice so that the second pass reads the prefix
cache, and under tensor parallelism 2 (gloo, CPU) with 6 query / 3 KV heads, which split
unevenly. The reference runs each prompt alone (``hf_greedy_reference``).
"""

from __future__ import annotations

import pytest
import torch
from transformers import Phi3Config

from manylora import LLM, LoRARequest, SamplingParams
from manylora.config import ModelConfig
from manylora.model.phi3 import Phi3ForCausalLM
from manylora.model.registry import model_class
from manylora.testing import (
    compare_greedy,
    hf_greedy_reference,
    make_checkpoint,
    make_peft_adapter,
)

# head_dim 16, rotary on its first 12 (Phi-4-mini's factor)
TINY = dict(hidden_size=96, intermediate_size=96, num_hidden_layers=2, num_attention_heads=6,
            num_key_value_heads=3, max_position_embeddings=256, partial_rotary_factor=0.75)
ENGINE = dict(device="cpu", dtype="float32", max_lora_rank=8, block_size=4, num_kv_blocks=64,
              max_model_len=128)
MAX_NEW = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
# a shared 9-token prefix (two full blocks of 4) under the same adapter
TEXTS = ["The quick brown fox jumps over the lazy dog", "SELECT name FROM users WHERE",
         "The quick brown fox jumps over the lazy cat", "def add(a, b):",
         "Low-rank adaptation"]
ADAPTERS = ["attn", None, "attn", "all", "dora"]
SPECS = {"attn": dict(r=4, target_modules=["qkv_proj", "o_proj"], rank_pattern={"o_proj": 2}),
         "all": dict(r=8, target_modules="all-linear"),
         "dora": dict(r=2, target_modules=["qkv_proj", "down_proj"], use_dora=True)}


def test_phi3_resolves_by_transformers_name():
    hf = Phi3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                    num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                    max_position_embeddings=64)
    cfg = ModelConfig.from_hf(hf, torch.float32)
    assert cfg.architecture == "Phi3ForCausalLM"
    assert (cfg.qkv_bias, cfg.o_bias, cfg.mlp_bias) == (False, False, False)
    assert model_class(cfg.architecture) is Phi3ForCausalLM


def _family(root, prompts_of, adapters_of, specs, max_new, **checkpoint_kwargs):
    """``(base_dir, {name: adapter_dir}, prompts, reference)`` for one tiny checkpoint."""
    from transformers import AutoTokenizer

    from manylora.testing.hf import hf_causal_lm

    base = make_checkpoint(root / "base", "phi3", seed=0, **checkpoint_kwargs)
    model = hf_causal_lm(base, attn_implementation="eager")
    adapters = {name: make_peft_adapter(base, root / name, seed=i + 1, base_model=model,
                                        **spec)
                for i, (name, spec) in enumerate(specs.items())}
    prompts = prompts_of(AutoTokenizer.from_pretrained(base))
    reference = hf_greedy_reference(base, adapters, prompts, adapters_of, max_new,
                                    base_model=model)
    return base, adapters, prompts, reference


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    return _family(tmp_path_factory.mktemp("phi3"), lambda tok: [tok(t).input_ids
                                                                 for t in TEXTS],
                   ADAPTERS, SPECS, MAX_NEW, **TINY)


def _generate(llm, adapters, prompts, names=ADAPTERS, params=GREEDY):
    ids = {name: i + 1 for i, name in enumerate(adapters)}
    requests = [None if n is None else LoRARequest(n, ids[n], str(adapters[n]))
                for n in names]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                        lora_request=requests, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _assert_matches(tokens, reference, names=ADAPTERS):
    for i, (ours, ref) in enumerate(zip(tokens, reference, strict=True)):
        ok, pos = compare_greedy(ours, ref)
        assert ok, (f"prompt {i} (adapter {names[i]}): diverges at token {pos}: "
                    f"ours {ours} ref {ref.token_ids}")


def test_phi3_mixed_batch_one_slot_prefix_cache_matches_peft(phi3):
    base, adapters, prompts, reference = phi3
    llm = LLM(str(base), **ENGINE, max_loras=1, enable_prefix_caching=True)
    try:
        engine = llm.llm_engine
        _assert_matches(_generate(llm, adapters, prompts), reference)
        hits, misses = engine.kv_cache_stats().prefix_hits, engine.lora_cache_stats().device_misses
        assert misses >= len(adapters)
        _assert_matches(_generate(llm, adapters, prompts), reference)
        assert engine.kv_cache_stats().prefix_hits > hits
        assert engine.lora_cache_stats().device_misses >= misses + len(adapters) - 1
    finally:
        llm.llm_engine.shutdown()


def test_phi3_tensor_parallel_2_uneven_heads_matches_peft(phi3):
    """3 KV heads over 2 ranks: rank 0 takes rows of KV heads 0-1 and query heads 0-3 out
    of each fused ``qkv_proj``, rank 1 the rest; each rank its half of ``gate`` and of
    ``up`` out of ``gate_up_proj``. The steps run as the piecewise CUDA graphs' pieces
    (eager on CPU)."""
    base, adapters, prompts, reference = phi3
    llm = LLM(str(base), **ENGINE, max_loras=2, tensor_parallel_size=2,
              piecewise_cuda_graph_sizes=(8, 16, 32))
    try:
        _assert_matches(_generate(llm, adapters, prompts), reference)
    finally:
        llm.llm_engine.shutdown()
