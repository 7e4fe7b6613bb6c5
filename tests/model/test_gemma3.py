"""The Gemma 3 text model (``Gemma3ForCausalLM``, ``model_type`` ``gemma3_text``) against
transformers + peft on the same weights: greedy, token for token, and the generated tokens'
log-probabilities.

The tiny checkpoint is written by transformers' own ``save_pretrained``
(``make_checkpoint``, ``Gemma3TextConfig``): a sliding-window layer (window 4, shorter than
every prompt) with its own RoPE base (``rope_local_base_freq`` 100) before a global layer
with another (``rope_theta`` 1000, linear scaling × 2), per-head ``(1 + w)`` q/k norms,
``query_pre_attn_scalar`` 12, and an ``attn_logit_softcapping`` that transformers' Gemma 3
attention ignores (so must manylora). Adapters by peft: attention only, every linear layer,
DoRA, of three ranks, in one mixed batch with the base through one slot, with the prefix
cache, and under tensor parallelism 2 (gloo, CPU) as the piecewise CUDA graphs' pieces.
Tied embeddings (Gemma 3's default) are checked on the base model's log-probabilities.
"""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma3TextConfig

from manylora import LLM, SamplingParams
from manylora.config import ModelConfig
from manylora.model.gemma3 import Gemma3ForCausalLM
from manylora.model.registry import model_class
from manylora.testing import (
    FAMILY_ADAPTER_NAMES,
    FAMILY_SPECS,
    FAMILY_TEXTS,
    assert_greedy_matches,
    generate_greedy,
    generate_twice_from_prefix_cache,
    make_checkpoint,
    make_family_case,
    shutting_down,
)

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, init_std=0.3,
            sliding_window=4, layer_types=["sliding_attention", "full_attention"],
            query_pre_attn_scalar=12, rope_theta=1000.0, rope_local_base_freq=100.0,
            rope_scaling={"rope_type": "linear", "factor": 2.0})
ENGINE = dict(device="cpu", dtype="float32", max_lora_rank=8, block_size=4, num_kv_blocks=64,
              max_model_len=128)
MAX_NEW = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=0)


def _assert_matches(outputs, case):
    """Greedy tokens equal to the reference's, each token's log-probability equal to
    ``log_softmax`` of transformers' logits."""
    assert_greedy_matches(outputs, case)
    for out, ref in zip(outputs, case.reference, strict=True):
        for tok, entry, logits in zip(out.token_ids, out.logprobs, ref.logits):
            want = torch.log_softmax(logits.double(), -1)[tok].item()
            assert entry[tok].logprob == pytest.approx(want, abs=1e-4)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma3")
    base = make_checkpoint(root / "base", "gemma3", seed=0, **TINY,
                           attn_logit_softcapping=5.0)
    return make_family_case(base, root, FAMILY_SPECS, FAMILY_TEXTS, FAMILY_ADAPTER_NAMES, MAX_NEW)


def test_gemma3_text_config_resolves():
    hf = Gemma3TextConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                          num_attention_heads=4, num_key_value_heads=1, head_dim=8,
                          vocab_size=64, max_position_embeddings=64, sliding_window=8)
    cfg = ModelConfig.from_hf(hf, torch.float32)        # names only its model_type
    assert cfg.architecture == "Gemma3ForCausalLM"
    # transformers' default pattern: five sliding layers, then a global one
    assert cfg.sliding_windows == (8, 8, 8, 8, 8, None)
    assert model_class(cfg.architecture) is Gemma3ForCausalLM


def test_gemma3_refuses_bidirectional_attention():
    hf = Gemma3TextConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                          vocab_size=64, max_position_embeddings=64,
                          use_bidirectional_attention=True)
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        Gemma3ForCausalLM(ModelConfig.from_hf(hf, torch.float32), torch.device("cpu"))


def test_gemma3_mixed_batch_one_slot_prefix_cache_matches_peft(gemma3):
    llm = LLM(str(gemma3.base_dir), **ENGINE, max_loras=1, enable_prefix_caching=True)
    with shutting_down(llm):
        generate_twice_from_prefix_cache(llm, gemma3, GREEDY, _assert_matches)


def test_gemma3_tensor_parallel_2_piecewise_matches_peft(gemma3):
    """Each rank holds its heads and the whole q/k norm weights; the pieces keep the packed
    qkv static and read the normed, rotated q and k back from it."""
    llm = LLM(str(gemma3.base_dir), **ENGINE, max_loras=2, tensor_parallel_size=2,
              piecewise_cuda_graph_sizes=(8, 16, 32))
    with shutting_down(llm):
        _assert_matches(generate_greedy(llm, gemma3, GREEDY), gemma3)


def test_gemma3_tied_embeddings_base_logprobs_match(tmp_path):
    """Tied embeddings (the head reads the unscaled embedding table) with a final soft cap."""
    base = make_checkpoint(tmp_path / "tied", "gemma3", seed=1,
                           **{**TINY, "init_std": 0.2}, tie_word_embeddings=True,
                           final_logit_softcapping=4.0)
    case = make_family_case(base, tmp_path, {}, FAMILY_TEXTS[:2], [None, None], MAX_NEW)
    llm = LLM(str(base), **ENGINE, enable_lora=False)
    with shutting_down(llm):
        _assert_matches(generate_greedy(llm, case, GREEDY), case)


def test_gemma3_gguf_matches_transformers_peft(tmp_path):
    """A Gemma 3 GGUF (F32, llama.cpp's names, norms stored as ``1 + w``) against
    transformers' own GGUF loading + peft. transformers reads the global RoPE base and the
    window from a GGUF, the rest from ``Gemma3TextConfig``'s defaults (local base 10 000,
    ``query_pre_attn_scalar`` 256, five sliding layers per global one), so the checkpoint
    has those."""
    from manylora.testing.gguf import write_gguf

    tiny = {k: v for k, v in TINY.items()
            if k not in ("query_pre_attn_scalar", "rope_local_base_freq", "rope_scaling",
                         "layer_types")}
    ckpt = make_checkpoint(tmp_path / "hf", "gemma3", seed=2, **tiny)
    path = write_gguf(ckpt, tmp_path / "gemma3.gguf")
    case = make_family_case(path, tmp_path, {"all": dict(r=4, target_modules="all-linear", seed=3)},
                            [[1, 40, 41, 42, 43, 44, 45], [1, 7, 9]], ["all", None], MAX_NEW)
    llm = LLM(str(path), **ENGINE, max_loras=1, skip_tokenizer_init=True)
    with shutting_down(llm):
        _assert_matches(generate_greedy(llm, case, GREEDY), case)
