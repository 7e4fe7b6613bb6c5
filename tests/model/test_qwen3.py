"""Qwen3 (per-head q/k RMSNorm before RoPE, a ``head_dim`` other than hidden / heads) and
Qwen2.5 (a Qwen2 config as its small checkpoints write it: tied embeddings, q/k/v biases,
``rope_theta`` 1e6) against transformers + peft on the same weights, greedy, token for token.

The checkpoints are written by transformers' own ``save_pretrained`` (``make_checkpoint``),
the adapters by peft's (``make_peft_adapter``): attention only, every linear layer, and a
DoRA one, of three ranks. manylora runs them as one mixed batch with the base model, through
a single slot (fewer slots than adapters), twice so that the second pass reads the prefix
cache, and under tensor parallelism 2 (gloo, CPU). The reference runs each prompt alone
(``hf_greedy_reference``).
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import Qwen3Config

from manylora import LLM, SamplingParams
from manylora.config import ModelConfig
from manylora.model.qwen3 import Qwen3ForCausalLM
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
            num_key_value_heads=2, max_position_embeddings=256)
ENGINE = dict(device="cpu", dtype="float32", max_lora_rank=8, block_size=4, num_kv_blocks=64,
              max_model_len=128)
MAX_NEW = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)


def test_qwen3_resolves_by_transformers_name_and_reads_head_dim():
    hf = Qwen3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=64,
                     max_position_embeddings=64)
    cfg = ModelConfig.from_hf(hf, torch.float32)        # names only its model_type
    assert cfg.architecture == "Qwen3ForCausalLM"
    assert (cfg.head_dim, cfg.qkv_bias, cfg.o_bias) == (16, False, False)
    assert model_class(cfg.architecture) is Qwen3ForCausalLM


def _family(root, arch, **checkpoint_kwargs):
    base = make_checkpoint(root / "base", arch, seed=0, **TINY, **checkpoint_kwargs)
    return make_family_case(base, root, FAMILY_SPECS, FAMILY_TEXTS, FAMILY_ADAPTER_NAMES, MAX_NEW)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    # head_dim 24 ≠ 64 / 4; tied embeddings as Qwen3-0.6B to 4B have them
    return _family(tmp_path_factory.mktemp("qwen3"), "qwen3", head_dim=24,
                   tie_word_embeddings=True)


def test_qwen3_mixed_batch_one_slot_prefix_cache_matches_peft(qwen3):
    llm = LLM(str(qwen3.base_dir), **ENGINE, max_loras=1, enable_prefix_caching=True)
    with shutting_down(llm):
        first, second = generate_twice_from_prefix_cache(llm, qwen3, GREEDY)
        assert first >= len(qwen3.adapters)
        # three adapters through one slot: at most one of them was still there
        assert second >= first + len(qwen3.adapters) - 1


def test_qwen3_tensor_parallel_2_piecewise_matches_peft(qwen3):
    """Each rank holds its heads' q/k/v rows and the whole (replicated) q/k norm weights.
    The steps run as the piecewise CUDA graphs' pieces (eager on CPU), which keep the
    packed qkv static and read the normalized, rotated q and k back from it."""
    llm = LLM(str(qwen3.base_dir), **ENGINE, max_loras=2, tensor_parallel_size=2,
              piecewise_cuda_graph_sizes=(8, 16, 32))
    with shutting_down(llm):
        assert_greedy_matches(generate_greedy(llm, qwen3, GREEDY), qwen3)


def test_qwen2_5_config_runs_as_qwen2_and_matches_peft(tmp_path):
    """Qwen2.5-0.5B's config shape: ``Qwen2ForCausalLM``, tied embeddings, q/k/v biases,
    ``rope_theta`` 1e6, no sliding window."""
    case = _family(tmp_path, "qwen2", tie_word_embeddings=True, rope_theta=1000000.0,
                   use_sliding_window=False, max_window_layers=2)
    llm = LLM(str(case.base_dir), **ENGINE, max_loras=3)
    with shutting_down(llm):
        assert json.loads((case.base_dir / "config.json").read_text())["architectures"] == [
            "Qwen2ForCausalLM"]
        assert_greedy_matches(generate_greedy(llm, case, GREEDY), case)


def test_qwen3_gguf_matches_transformers_peft(tmp_path):
    """A Qwen3 GGUF (F32, llama.cpp's names, ``attn_q_norm`` / ``attn_k_norm``) against
    transformers' own GGUF loading + peft. transformers reads no head width from a GGUF, so
    the checkpoint has Qwen3's real one, 128."""
    from manylora.testing.gguf import write_gguf

    ckpt = make_checkpoint(tmp_path / "hf", "qwen3", seed=2, **TINY, head_dim=128)
    path = write_gguf(ckpt, tmp_path / "qwen3.gguf")
    case = make_family_case(path, tmp_path, {"all": dict(r=4, target_modules="all-linear", seed=3)},
                            [[1, 40, 41, 42, 43], [1, 7, 9]], ["all", None], MAX_NEW)
    llm = LLM(str(path), **ENGINE, max_loras=1, skip_tokenizer_init=True)
    with shutting_down(llm):
        assert_greedy_matches(generate_greedy(llm, case, GREEDY), case)
