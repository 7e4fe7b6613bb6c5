"""Quantized KV cache (``kv_cache_dtype`` int8 / fp8_e4m3) end to end, against the same
engine with an unquantized cache.

The checkpoint is trained (``manylora.testing.trained``) on sequences that repeat with a
fixed period, so each next token must be read back through attention from the cache: a
wrong key, value or scale changes the output. The measured agreement and mean
log-probability difference are logged.
"""

from __future__ import annotations

import logging

import pytest
import torch

from manylora import LLM, SamplingParams
from manylora.scheduler_output import PreemptionCost
from manylora.testing.trained import make_trained_checkpoint, periodic_batch

logger = logging.getLogger(__name__)

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)
ENGINE = dict(device="cpu", dtype="float32", skip_tokenizer_init=True, block_size=4,
              max_model_len=128, enable_lora=False)
PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0)
PERIOD = 5


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return make_trained_checkpoint(tmp_path_factory.mktemp("kvq") / "base", period=PERIOD,
                                   **TINY)


def _prompts(n=16):
    gen = torch.Generator().manual_seed(99)
    return [{"prompt_token_ids": periodic_batch(gen, 1, 7 + i % 9, PERIOD, 3, 200)[0].tolist()}
            for i in range(n)]


def _agreement(ref_outs, outs):
    """(tokens equal before the first divergence / all tokens, mean |Δ logprob| there)."""
    matched = total = 0
    diffs = []
    for a, b in zip(ref_outs, outs):
        x, y = a.outputs[0], b.outputs[0]
        n = 0
        while n < len(x.token_ids) and x.token_ids[n] == y.token_ids[n]:
            tok = x.token_ids[n]
            diffs.append(abs(x.logprobs[n][tok].logprob - y.logprobs[n][tok].logprob))
            n += 1
        matched += n
        total += len(x.token_ids)
    return matched / total, sum(diffs) / len(diffs)


@pytest.fixture(scope="module")
def unquantized(trained):
    llm = LLM(str(trained), **ENGINE, num_kv_blocks=256)
    outs = llm.generate(_prompts(), PARAMS, use_tqdm=False)
    # the model learned the task: every generated token repeats the one a period back
    for o in outs:
        full = o.prompt_token_ids + o.outputs[0].token_ids
        assert all(full[i] == full[i - PERIOD] for i in range(len(o.prompt_token_ids), len(full)))
    return outs


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3"])
def test_quantized_kv_agrees_with_unquantized(trained, unquantized, kv_dtype):
    llm = LLM(str(trained), **ENGINE, num_kv_blocks=256, kv_cache_dtype=kv_dtype)
    cache = llm.llm_engine.engine_core.executor.runner.kv_caches[0]
    assert cache.data.dtype == {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}[kv_dtype]
    outs = llm.generate(_prompts(), PARAMS, use_tqdm=False)
    agree, mean_diff = _agreement(unquantized, outs)
    logger.info("%s KV: %.1f%% of tokens agree before the first divergence, mean |Δ logprob| "
                "%.5f", kv_dtype, 100 * agree, mean_diff)
    assert agree >= 0.95
    assert 0 < mean_diff < 0.05          # quantized (not bit-equal), yet close


def test_quantized_kv_swaps_out_and_back(trained):
    prompts = _prompts(6)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    big = LLM(str(trained), **ENGINE, num_kv_blocks=256, kv_cache_dtype="int8")
    small = LLM(str(trained), **ENGINE, num_kv_blocks=14, kv_cache_dtype="int8",
                enable_prefix_caching=False, swap_space=0.01)
    small.llm_engine.engine_core.scheduler.kv.cost = PreemptionCost(1.0, 0.0, 0.0)     # always swap
    outs = small.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [
        o.outputs[0].token_ids for o in big.generate(prompts, params, use_tqdm=False)]
    s = small.llm_engine.kv_cache_stats()
    assert s.swapped_in_blocks > 0 and s.used_blocks == 0
