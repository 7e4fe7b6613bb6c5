"""Granite (``GraniteForCausalLM``: embedding, residual, attention and logits multipliers)
against transformers + peft on the same weights, greedy, token for token.

The checkpoint is written by transformers' own ``save_pretrained`` (``make_checkpoint``) with
Granite 3.x's multipliers, none of them 1 (``attention_multiplier`` 1 / head_dim, not
1 / sqrt(head_dim)); the adapters by peft's (``make_peft_adapter``): attention only, every
linear layer with one module of its own rank (``rank_pattern``), and a DoRA one, of three
ranks. manylora runs them as one mixed batch with the base model, through a single slot
(fewer slots than adapters), twice so that the second pass reads the prefix cache, and under
tensor parallelism 2 (gloo, CPU) as the piecewise CUDA graphs' pieces. The reference runs
each prompt alone (``hf_greedy_reference``); the log-probabilities of the sampled tokens
are checked against the log-softmax of its logits, which ``logits_scaling`` divides.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import GraniteConfig

from manylora import LLM, SamplingParams
from manylora.config import ModelConfig
from manylora.model.granite import GraniteForCausalLM
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
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=1)
# the mix, with one module of its own rank in the all-linear adapter
SPECS = {**FAMILY_SPECS,
         "all": dict(r=8, target_modules="all-linear", rank_pattern={"down_proj": 3})}
MULTIPLIERS = ("embedding_multiplier", "residual_multiplier", "attention_multiplier",
               "logits_scaling")


def test_granite_resolves_by_transformers_name():
    hf = GraniteConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                       max_position_embeddings=64)
    cfg = ModelConfig.from_hf(hf, torch.float32)        # names only its model_type
    assert cfg.architecture == "GraniteForCausalLM"
    assert model_class(cfg.architecture) is GraniteForCausalLM


@pytest.fixture(scope="module")
def granite(tmp_path_factory):
    root = tmp_path_factory.mktemp("granite")
    base = make_checkpoint(root / "base", "granite", seed=0, **TINY)
    return make_family_case(base, root, SPECS, FAMILY_TEXTS, FAMILY_ADAPTER_NAMES, MAX_NEW)


def test_checkpoint_has_granite_multipliers(granite):
    config = json.loads((granite.base_dir / "config.json").read_text())
    assert config["architectures"] == ["GraniteForCausalLM"]
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    assert all(config[m] != 1 for m in MULTIPLIERS)
    assert config["attention_multiplier"] != head_dim ** -0.5


def _assert_matches(outputs, case):
    """Tokens equal to the reference's (up to a near-tie), and each equal token's
    log-probability the log-softmax of the reference's logits at that step."""
    positions = assert_greedy_matches(outputs, case)
    for i, (out, ref, pos) in enumerate(zip(outputs, case.reference, positions, strict=True)):
        for step in range(pos):
            tok = out.token_ids[step]
            want = torch.log_softmax(ref.logits[step], dim=-1)[tok].item()
            assert out.logprobs[step][tok].logprob == pytest.approx(want, abs=1e-4), (i, step)


def test_granite_mixed_batch_one_slot_prefix_cache_matches_peft(granite):
    llm = LLM(str(granite.base_dir), **ENGINE, max_loras=1, enable_prefix_caching=True)
    with shutting_down(llm):
        first, second = generate_twice_from_prefix_cache(llm, granite, GREEDY, _assert_matches)
        assert first >= len(granite.adapters)
        # three adapters through one slot: at most one of them was still there
        assert second >= first + len(granite.adapters) - 1


def test_granite_tensor_parallel_2_piecewise_matches_peft(granite):
    """Each rank holds its heads; the multipliers are scalars every rank applies to the
    all-reduced sublayer outputs and the all-gathered logits. The steps run as the piecewise
    CUDA graphs' pieces (eager on CPU), whose cut sits between the layers' methods."""
    llm = LLM(str(granite.base_dir), **ENGINE, max_loras=2, tensor_parallel_size=2,
              piecewise_cuda_graph_sizes=(8, 16, 32))
    with shutting_down(llm):
        _assert_matches(generate_greedy(llm, granite, GREEDY), granite)
