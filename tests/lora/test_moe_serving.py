"""Adapters on the mixture-of-experts block end to end against transformers + peft: greedy,
token for token, on tiny Mixtral, Qwen2-MoE and Qwen3-MoE checkpoints written by
transformers' ``save_pretrained``, with peft adapters written by peft's own
``save_pretrained``: on the stacked experts (``target_parameters``, peft's ``ParamWrapper``),
on the router (``mlp.gate.weight``), on Qwen2-MoE's shared expert and its gate, and on the
attention, of different ranks, in one batch with the base model, with fewer slots than
adapters, through the prefix cache and under tensor parallelism 2. Without slot buffers for
these modules such an adapter is refused naming the flag.
"""

from __future__ import annotations

import pytest

from manylora import LLM, LoRARequest, SamplingParams
from manylora.config import LORA_MOE_MODULES, LORA_TARGET_MODULES
from manylora.lora.adapter import LoRAAdapterError
from manylora.testing import (
    MOE_FAMILIES,
    MOE_TINY,
    assert_greedy_matches,
    generate_greedy,
    generate_twice_from_prefix_cache,
    make_checkpoint,
    make_family_case,
    shutting_down,
)

TINY, FAMILIES = MOE_TINY, MOE_FAMILIES
PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.gate.weight"]
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
SHARED = ["shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj",
          "shared_expert_gate"]
ALL_SLOTS = LORA_TARGET_MODULES + LORA_MOE_MODULES
ENGINE = dict(device="cpu", dtype="float32", max_lora_rank=8, block_size=4,
              max_model_len=128, num_kv_blocks=96, max_loras=2)
PROMPTS = [[1, 17, 40, 33, 8, 91, 54, 23, 70, 5, 61],
           [1, 17, 40, 33, 8, 91, 54, 23, 70, 12],
           [1, 88, 3, 47, 9]]
MAX_NEW = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def _specs(arch: str) -> dict[str, dict]:
    """The experts and the router with the attention's o_proj (rank 8); the same
    parameters with q_proj at rank 3 under rsLoRA (peft's ``target_parameters`` must be
    one set for all adapters of a model); the attention alone (rank 4); on Qwen2-MoE the
    shared expert and its gate with the dense layer's MLP (rank 5)."""
    specs = {
        "experts": dict(r=8, lora_alpha=16, target_modules=["o_proj"],
                        target_parameters=PARAMETERS, init_std=0.05),
        "experts_r3": dict(r=3, lora_alpha=6, use_rslora=True, target_modules=["q_proj"],
                           target_parameters=PARAMETERS, init_std=0.1),
        "attn": dict(r=4, lora_alpha=8, target_modules=ATTN),
    }
    if arch == "qwen2_moe":
        specs["shared"] = dict(r=5, lora_alpha=10, init_std=0.3,
                               target_modules=SHARED + ["gate_proj", "up_proj", "down_proj"])
    return specs


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    arch = request.param
    root = tmp_path_factory.mktemp(arch)
    base = make_checkpoint(root / "base", arch, seed=3, **TINY, **FAMILIES[arch])
    specs = _specs(arch)
    names = [None, *specs, None, "experts"]
    prompts = [PROMPTS[0]] * (1 + len(specs)) + PROMPTS[1:3]
    return make_family_case(base, root, specs, prompts, names, MAX_NEW)


def test_each_adapter_changes_the_reference(family):
    """The adapters matter: on the first prompt, which the base and every adapter share,
    each adapter's greedy answer (transformers + peft) differs from the base model's, so a
    lost delta fails the comparisons below."""
    base = family.reference[0].token_ids
    for i, name in enumerate(family.adapters, start=1):
        assert family.prompts[i] == family.prompts[0]
        assert family.reference[i].token_ids != base, name


def test_mixed_batch_with_fewer_slots_through_the_prefix_cache_matches_peft(family):
    """Two slots for three or four adapters and base rows, run twice: the second pass
    starts from cached prefixes (each adapter's own)."""
    llm = LLM(str(family.base_dir), **ENGINE, lora_target_modules=ALL_SLOTS,
              enable_prefix_caching=True, max_num_batched_tokens=32)
    with shutting_down(llm):
        generate_twice_from_prefix_cache(llm, family, GREEDY)


def test_tensor_parallel_2_matches_peft(family):
    llm = LLM(str(family.base_dir), **ENGINE, lora_target_modules=ALL_SLOTS,
              tensor_parallel_size=2)
    with shutting_down(llm):
        assert_greedy_matches(generate_greedy(llm, family, GREEDY), family)


@pytest.mark.parametrize("family", ["qwen3_moe"], indirect=True)
def test_expert_adapter_without_expert_slots_is_refused_naming_the_flag(family):
    """Default slot buffers (the seven projections): the experts' adapter fails alone,
    naming its module and ``--lora-target-modules``; the base request is served."""
    llm = LLM(str(family.base_dir), **ENGINE)
    with shutting_down(llm):
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], GREEDY,
                            lora_request=[None, LoRARequest("experts", 1,
                                                            str(family.adapters["experts"]))],
                            use_tqdm=False)
    assert isinstance(outs[1].error, LoRAAdapterError)
    assert "experts." in str(outs[1].error) and "lora-target-modules" in str(outs[1].error)
    assert outs[0].error is None
    assert list(outs[0].outputs[0].token_ids) == list(family.reference[0].token_ids)
