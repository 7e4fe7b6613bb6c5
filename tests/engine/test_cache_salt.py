"""vLLM's ``cache_salt``: a prompt's salt roots its prefix-cache hash chain, so requests
share cached blocks only with requests of the same salt (and the same adapter), end to end
through ``LLM``; outputs stay those of the unsalted engine with caching off."""

from __future__ import annotations

import pytest

from manylora import LLM, SamplingParams
from manylora.scheduler.block_pool import extend_block_hashes, root_hash
from manylora.testing import make_checkpoint

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)
ENGINE = dict(max_lora_rank=8, block_size=4, max_model_len=128, device="cpu", dtype="float32",
              skip_tokenizer_init=True, max_loras=2, num_kv_blocks=256)
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
SYSTEM = [1 + (7 * j) % 200 for j in range(21)]


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("salt") / "base", "llama", seed=0, **TINY)


def test_salt_roots_the_hash_chain():
    toks = list(range(12))
    plain = extend_block_hashes([], toks, 4, None)
    salted = extend_block_hashes([], toks, 4, None, "s1")
    assert extend_block_hashes([], toks, 4, None, "s1") == salted
    assert not set(plain) & set(salted)
    assert not set(salted) & set(extend_block_hashes([], toks, 4, None, "s2"))
    assert not set(salted) & set(extend_block_hashes([], toks, 4, "d", "s1"))
    assert root_hash(None, None) == root_hash(None)


def _run(llm, salt, suffix):
    prompt = {"prompt_token_ids": SYSTEM + suffix}
    if salt is not None:
        prompt["cache_salt"] = salt
    before = llm.llm_engine.kv_cache_stats().prefix_hits
    out = llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    return out, llm.llm_engine.kv_cache_stats().prefix_hits - before


def test_only_requests_with_the_same_salt_share_cached_blocks(base_dir):
    llm = LLM(str(base_dir), **ENGINE)
    cold = LLM(str(base_dir), **ENGINE, enable_prefix_caching=False)
    _, hits = _run(llm, "alice", [5, 6])
    assert hits == 0
    out, hits = _run(llm, "alice", [7])
    assert hits == 20                     # 5 full blocks of the shared 21 tokens
    assert out == cold.generate({"prompt_token_ids": SYSTEM + [7]}, GREEDY,
                                use_tqdm=False)[0].outputs[0].token_ids
    assert _run(llm, "bob", [7])[1] == 0
    assert _run(llm, None, [7])[1] == 0
    assert _run(llm, None, [8])[1] == 20


@pytest.mark.parametrize("salt", ["", 5, ["x"]])
def test_bad_salt_is_a_named_error(base_dir, salt):
    llm = LLM(str(base_dir), **ENGINE)
    with pytest.raises(ValueError, match="cache_salt"):
        llm.generate({"prompt_token_ids": [1, 2], "cache_salt": salt}, GREEDY, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()     # the refused request left nothing
    assert llm.generate({"prompt_token_ids": [1, 2]}, GREEDY, use_tqdm=False)[0].finished
