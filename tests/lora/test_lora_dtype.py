"""``lora_dtype`` (vLLM's ``--lora-dtype``): the slots' dtype end to end on a bfloat16 model,
against transformers + peft, which keeps adapter weights in float32 on a 16-bit base
(``autocast_adapter_dtype``) and adds their float32 delta to the bfloat16 base output.

With ``lora_dtype="float32"`` the engine does the same (activations cast up exactly, the
delta computed in float32, one rounding to bfloat16), so its log-probabilities are within
bfloat16's rounding of peft's; with ``"auto"`` (bfloat16 slots) the adapter weights
themselves are rounded and the distance grows. The PyTorch reference ops and the Triton
kernels (CPU: the interpreter) are both run.
"""

from __future__ import annotations

import pytest
import torch

from manylora import LLM, LoRARequest, SamplingParams
from manylora.config import resolve_lora_dtype
from manylora.engine.arg_utils import EngineArgs
from manylora.lora.slots import LoRASlots
from manylora.testing import (
    compare_greedy,
    hf_greedy_reference,
    make_checkpoint,
    make_peft_adapter,
)

PROMPTS = [[1, 5, 6, 7, 8, 9], [1, 20, 21, 22], [1, 30, 31, 32, 33, 34, 35]]
NAMES = ["plain", "dora", None]
MAX_NEW = 8
# peft's float32 adapters on a bfloat16 base vs ours: bfloat16 rounding of the activations
# (about 2^-8 relative) through two layers
FLOAT32_TOL = 0.03


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-dtype")
    base = make_checkpoint(root / "base", seed=7)
    adapters = {
        "plain": make_peft_adapter(base, root / "plain", r=8, seed=3, init_std=0.2,
                                   target_modules=["q_proj", "v_proj", "gate_proj",
                                                   "down_proj"]),
        "dora": make_peft_adapter(base, root / "dora", r=4, seed=4, init_std=0.2,
                                  target_modules=["q_proj", "o_proj"], use_dora=True)}
    refs = hf_greedy_reference(base, adapters, PROMPTS, NAMES, MAX_NEW, dtype=torch.bfloat16)
    return base, adapters, refs


def _run(base, adapters, lora_dtype, device="cpu"):
    llm = LLM(str(base), device=device, dtype="bfloat16", lora_dtype=lora_dtype, max_loras=2,
              max_lora_rank=8, num_kv_blocks=64, block_size=4)
    reqs = [None if n is None else LoRARequest(n, i + 1, str(adapters[n]))
            for i, n in enumerate(NAMES)]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=0),
                        lora_request=reqs, use_tqdm=False)
    model = llm.llm_engine.engine_core.executor.model
    slots = [m for m in model.modules() if isinstance(m, LoRASlots)]
    return outs, slots


def _logprob_distance(out, ref) -> float:
    """The largest |our logprob - peft's log_softmax| over the tokens both generated."""
    ours = out.outputs[0]
    n = min(len(ours.token_ids), len(ref.logits))
    return max(abs(ours.logprobs[i][t].logprob
                   - torch.log_softmax(ref.logits[i].double(), -1)[t].item())
               for i, t in enumerate(ours.token_ids[:n]))


@pytest.mark.parametrize("kernels", ["reference", "triton"])
def test_float32_slots_on_a_bfloat16_model_match_peft(setup, kernels, monkeypatch):
    base, adapters, refs = setup
    if kernels == "triton":
        from manylora.lora import slots as lora_slots
        from manylora.lora.kernels import triton_lora

        monkeypatch.setattr(lora_slots, "lora_shrink", triton_lora.lora_shrink_triton)
        monkeypatch.setattr(lora_slots, "lora_expand", triton_lora.lora_expand_triton)
    outs, slots = _run(base, adapters, "float32")
    assert slots and all(s.lora_a_0.dtype == s.lora_b_0.dtype == torch.float32 for s in slots)
    for name, out, ref in zip(NAMES, outs, refs):
        ok, pos = compare_greedy(out.outputs[0].token_ids, ref, tie_tol=FLOAT32_TOL)
        assert ok, (name, pos, out.outputs[0].token_ids, ref.token_ids)
        assert _logprob_distance(out, ref) < FLOAT32_TOL, name


@pytest.mark.gpu
def test_float32_slots_on_cuda_with_graphs_match_peft(setup):
    """The Triton kernels on the GPU, decode steps replayed as CUDA graphs captured with the
    float32 casts inside."""
    base, adapters, refs = setup
    outs, slots = _run(base, adapters, "float32", device="cuda")
    assert all(s.lora_a_0.dtype == torch.float32 and s.lora_a_0.is_cuda for s in slots)
    for name, out, ref in zip(NAMES, outs, refs):
        ok, pos = compare_greedy(out.outputs[0].token_ids, ref, tie_tol=FLOAT32_TOL)
        assert ok, (name, pos, out.outputs[0].token_ids, ref.token_ids)
        assert _logprob_distance(out, ref) < FLOAT32_TOL, name


def test_auto_is_the_model_dtype_and_further_from_peft(setup):
    base, adapters, refs = setup
    outs, slots = _run(base, adapters, "auto")
    assert all(s.lora_a_0.dtype == torch.bfloat16 for s in slots)
    # bfloat16 adapter weights: the adapter rows move away from peft's float32 deltas
    assert _logprob_distance(outs[0], refs[0]) > FLOAT32_TOL


def test_lora_dtype_values():
    bf16, fp32 = torch.bfloat16, torch.float32
    assert resolve_lora_dtype("auto", bf16) is bf16
    assert resolve_lora_dtype("float32", bf16) is fp32
    assert resolve_lora_dtype("bfloat16", bf16) is bf16
    assert resolve_lora_dtype("float32", fp32) is fp32
    with pytest.raises(ValueError, match="model's dtype or float32"):
        resolve_lora_dtype("bfloat16", fp32)
    with pytest.raises(ValueError, match="model's dtype or float32"):
        resolve_lora_dtype("float16", bf16)
    with pytest.raises(ValueError, match="lora_dtype must be one of"):
        resolve_lora_dtype("int8", bf16)
    with pytest.raises(ValueError, match="lora_dtype must be one of"):
        EngineArgs("m", lora_dtype="fp32")
