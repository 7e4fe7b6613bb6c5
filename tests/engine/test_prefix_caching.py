"""Adapter-aware prefix caching, preemption with recompute or swap, multi-turn sessions,
end to end through ``LLM``.

References: transformers + peft on the same tiny checkpoint and peft adapters (written by
their own ``save_pretrained``), and the same engine with prefix caching off. Every test
ends with the block accounting: used + cached + free = total, nothing used.
"""

from __future__ import annotations

import pytest

from manylora import LLM, LoRARequest, SamplingParams
from manylora.scheduler_output import PreemptionCost
from manylora.testing import compare_greedy, hf_greedy_reference, make_checkpoint, make_peft_adapter

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)
ENGINE = dict(max_lora_rank=8, block_size=4, max_model_len=128, device="cpu", dtype="float32",
              skip_tokenizer_init=True, max_loras=4)
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
SYSTEM = [1 + (11 * j) % 200 for j in range(21)]            # a shared 21-token "system prompt"


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("prefix")


@pytest.fixture(scope="module")
def base_dir(root):
    return make_checkpoint(root / "base", "llama", seed=0, **TINY)


@pytest.fixture(scope="module")
def adapters(base_dir, root):
    targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
    return {"a1": make_peft_adapter(base_dir, root / "a1", r=8, target_modules=targets, seed=1),
            "a2": make_peft_adapter(base_dir, root / "a2", r=4, target_modules=targets, seed=2),
            # the same name as a1 later, other weights
            "a1-retrained": make_peft_adapter(base_dir, root / "a1b", r=8,
                                              target_modules=targets, seed=3)}


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def _check_no_leak(llm: LLM) -> None:
    s = llm.llm_engine.kv_cache_stats()
    assert s.used_blocks == 0
    assert s.used_blocks + s.cached_blocks + s.free_blocks == s.num_blocks


def _prompt(suffix):
    return {"prompt_token_ids": SYSTEM + list(suffix)}


def test_same_prefix_same_adapter_hits_and_matches_caching_off(base_dir, adapters):
    a1 = LoRARequest("a1", 1, str(adapters["a1"]))
    llm = LLM(str(base_dir), **ENGINE, num_kv_blocks=256)
    eng = llm.llm_engine
    first = llm.generate(_prompt([5, 6, 7]), GREEDY, a1, use_tqdm=False)
    before = eng.kv_cache_stats()
    second = llm.generate(_prompt([9, 8]), GREEDY, a1, use_tqdm=False)
    after = eng.kv_cache_stats()
    assert after.prefix_hits - before.prefix_hits == 20     # 5 full blocks of the 21 tokens

    cold = LLM(str(base_dir), **ENGINE, num_kv_blocks=256, enable_prefix_caching=False)
    assert _ids(first + second) == _ids(cold.generate([_prompt([5, 6, 7]), _prompt([9, 8])],
                                                      GREEDY, a1, use_tqdm=False))
    assert cold.llm_engine.kv_cache_stats().prefix_hits == 0
    refs = hf_greedy_reference(base_dir, {"a1": adapters["a1"]},
                               [SYSTEM + [5, 6, 7], SYSTEM + [9, 8]], ["a1", "a1"], 6)
    for out, ref in zip(first + second, refs):
        assert compare_greedy(out.outputs[0].token_ids, ref)[0]
    _check_no_leak(llm)


def test_other_adapter_base_and_same_name_other_weights_do_not_hit(base_dir, adapters):
    llm = LLM(str(base_dir), **ENGINE, num_kv_blocks=256)
    eng = llm.llm_engine
    a1 = LoRARequest("a1", 1, str(adapters["a1"]))
    llm.generate(_prompt([5]), GREEDY, a1, use_tqdm=False)
    others = [LoRARequest("a2", 2, str(adapters["a2"])), None,
              LoRARequest("a1", 3, str(adapters["a1-retrained"]))]
    outs = []
    for lora in others:
        before = eng.kv_cache_stats().prefix_hits
        outs += llm.generate(_prompt([5]), GREEDY, lora, use_tqdm=False)
        assert eng.kv_cache_stats().prefix_hits == before, lora
    names = ["a2", None, "a1-retrained"]
    refs = hf_greedy_reference(base_dir, adapters, [SYSTEM + [5]] * 3, names, 6)
    for out, ref, name in zip(outs, refs, names):
        assert compare_greedy(out.outputs[0].token_ids, ref)[0], name
    # the same weights under another id share the KV (the digest is the identity)
    before = eng.kv_cache_stats().prefix_hits
    llm.generate(_prompt([5]), GREEDY, LoRARequest("a1-copy", 4, str(adapters["a1"])),
                 use_tqdm=False)
    assert eng.kv_cache_stats().prefix_hits - before == 20
    _check_no_leak(llm)


def _preemption_workload():
    prompts = [_prompt([3 + i] * (2 + i)) for i in range(6)]
    return prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.mark.parametrize("caching", [True, False])
def test_preempted_requests_resume_with_identical_greedy_output(base_dir, adapters, caching):
    prompts, params = _preemption_workload()
    a1 = LoRARequest("a1", 1, str(adapters["a1"]))
    small = LLM(str(base_dir), **ENGINE, num_kv_blocks=24, enable_prefix_caching=caching)
    outs = small.generate(prompts, params, a1, use_tqdm=False)
    big = LLM(str(base_dir), **ENGINE, num_kv_blocks=512, enable_prefix_caching=False)
    assert _ids(outs) == _ids(big.generate(prompts, params, a1, use_tqdm=False))
    s = small.llm_engine.kv_cache_stats()
    assert s.preemptions > 0 and s.recomputed_tokens > 0
    _check_no_leak(small)


def test_preempted_requests_swap_out_and_back(base_dir, adapters):
    prompts, params = _preemption_workload()
    a1 = LoRARequest("a1", 1, str(adapters["a1"]))
    small = LLM(str(base_dir), **ENGINE, num_kv_blocks=24, enable_prefix_caching=False,
                swap_space=0.01)
    kv = small.llm_engine.engine_core.scheduler.kv
    assert kv.host.num_blocks > 0 and kv.cost.per_block > 0 and kv.cost.per_token > 0
    kv.cost = PreemptionCost(per_token=1.0, per_token_pair=0.0, per_block=0.0)  # always swap
    outs = small.generate(prompts, params, a1, use_tqdm=False)
    big = LLM(str(base_dir), **ENGINE, num_kv_blocks=512, enable_prefix_caching=False)
    assert _ids(outs) == _ids(big.generate(prompts, params, a1, use_tqdm=False))
    s = small.llm_engine.kv_cache_stats()
    assert s.preemptions > 0 and s.swapped_out_blocks > 0 and s.swapped_in_blocks > 0
    _check_no_leak(small)


def test_three_turn_session_prefills_only_the_new_turn(base_dir, adapters):
    a2 = LoRARequest("a2", 2, str(adapters["a2"]))
    llm = LLM(str(base_dir), **ENGINE, num_kv_blocks=256)
    cold = LLM(str(base_dir), **ENGINE, num_kv_blocks=256, enable_prefix_caching=False)
    eng = llm.llm_engine
    turns = [SYSTEM[:7], [40, 41, 42], [50, 51, 52, 53, 54]]
    history: list[int] = []
    for i, turn in enumerate(turns):
        before = eng.kv_cache_stats()
        (out,) = llm.generate({"prompt_token_ids": turn}, GREEDY, a2, use_tqdm=False,
                              session_id="chat")
        after = eng.kv_cache_stats()
        prefilled = ((after.prefix_queries - before.prefix_queries)
                     - (after.prefix_hits - before.prefix_hits))
        # the new turn, plus the previous reply's last token (sampled, never fed back)
        assert prefilled == len(turn) + (1 if i else 0), i
        assert out.prompt_token_ids == history + turn
        (ref,) = cold.generate({"prompt_token_ids": history + turn}, GREEDY, a2,
                               use_tqdm=False)
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids, i
        history = history + turn + out.outputs[0].token_ids
    assert eng.kv_cache_stats().used_blocks > 0                # the idle session holds its KV
    assert llm.end_session("chat") and not llm.end_session("chat")
    _check_no_leak(llm)


def test_session_errors_name_the_problem(base_dir):
    llm = LLM(str(base_dir), **ENGINE, num_kv_blocks=256)
    eng = llm.llm_engine
    with pytest.raises(ValueError, match="session_id"):
        eng.add_request(None, {"prompt_token_ids": [1, 2]}, GREEDY, None, 7)
    eng.add_request("t1", {"prompt_token_ids": [1, 2]}, GREEDY, None, "s")
    with pytest.raises(ValueError, match="in flight"):
        eng.add_request("t2", {"prompt_token_ids": [3]}, GREEDY, None, "s")
    eng.generate_all()
    with pytest.raises(ValueError, match="history"):
        eng.add_request("t3", {"prompt_token_ids": [5] * 125}, GREEDY, None, "s")
    llm.end_session("s")
    _check_no_leak(llm)
