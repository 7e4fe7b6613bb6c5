"""Mixtral, Qwen2-MoE and Qwen3-MoE end to end against transformers + peft: greedy, token
for token, on tiny checkpoints written by transformers' own ``save_pretrained`` (one
``Linear`` per expert), and on the same weights stacked as ``experts.gate_up_proj`` /
``experts.down_proj``. Adapters reach the attention (two ranks, one slot, base rows); the
MoE block's modules are refused by name by a reader given no MoE target, and a shared
expert's adapter on the default slot buffers names the flag; a quantized MoE base is
refused. The routing and expert ops are checked against a float64 reference. Adapters on
the MoE block itself: ``tests/lora/test_moe_serving.py``.
"""

from __future__ import annotations

import dataclasses
import re
import shutil
import types

import pytest
import torch
from safetensors.torch import load_file, save_file

from manylora import LLM, SamplingParams
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
ENGINE = dict(device="cpu", dtype="float32", max_lora_rank=8, block_size=4,
              max_model_len=128, num_kv_blocks=96, max_loras=1)
PROMPTS = [[1, 17, 40, 33, 8, 91, 54, 23, 70, 5, 61],
           [1, 17, 40, 33, 8, 91, 54, 23, 70, 12],
           [1, 88, 3, 47]]
NAMES = [None, "r4", "r8"]
MAX_NEW = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
SPECS = {"r4": dict(r=4, lora_alpha=8, target_modules=ATTN, seed=1),
         "r8": dict(r=8, lora_alpha=16, target_modules=ATTN, seed=2)}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    arch = request.param
    root = tmp_path_factory.mktemp(arch)
    base = make_checkpoint(root / "base", arch, seed=3, **TINY, **FAMILIES[arch])
    return make_family_case(base, root, SPECS, PROMPTS, NAMES, MAX_NEW)


def _stack_experts(src, dst):
    """Copy checkpoint ``src`` to ``dst`` with each layer's per-expert tensors stacked as
    transformers holds them in memory: ``mlp.experts.gate_up_proj [E, 2I, H]`` (gate rows,
    then up rows) and ``mlp.experts.down_proj [E, H, I]``."""
    shutil.copytree(src, dst)
    state = load_file(dst / "model.safetensors")
    per_expert = {}
    out = {}
    for key, tensor in state.items():
        parts = key.split(".experts.")
        if len(parts) == 2 and parts[1].split(".")[0].isdigit():
            e, proj = parts[1].split(".")[:2]
            block = parts[0].replace("block_sparse_moe", "mlp")
            name = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}.get(proj, proj)
            per_expert.setdefault(block, {}).setdefault(name, {})[int(e)] = tensor
        else:
            out[key.replace("block_sparse_moe", "mlp")] = tensor
    for block, projs in per_expert.items():
        n = len(projs["gate_proj"])
        out[f"{block}.experts.gate_up_proj"] = torch.stack(
            [torch.cat([projs["gate_proj"][e], projs["up_proj"][e]]) for e in range(n)])
        out[f"{block}.experts.down_proj"] = torch.stack([projs["down_proj"][e]
                                                         for e in range(n)])
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_routing_and_experts_match_a_float64_reference(activation):
    from manylora.ops.fused_moe import fused_experts, select_experts

    act = {"silu": torch.nn.functional.silu,
           "gelu_tanh": lambda g: torch.nn.functional.gelu(g, approximate="tanh")}[activation]
    gen = torch.Generator().manual_seed(0)
    t, e, h, i, k = 7, 5, 16, 12, 2
    logits = torch.randn(t, e, generator=gen)
    x = torch.randn(t, h, generator=gen)
    w13 = torch.randn(e, 2 * i, h, generator=gen)
    w2 = torch.randn(e, h, i, generator=gen)
    for renorm in (False, True):
        weights, ids = select_experts(logits, k, renorm)
        p = torch.softmax(logits.double(), -1)
        ref_ids = p.argsort(-1, descending=True)[:, :k]
        ref_w = p.gather(1, ref_ids)
        if renorm:
            ref_w = ref_w / ref_w.sum(-1, keepdim=True)
        assert ids.dtype == torch.int32 and weights.dtype == torch.float32
        assert torch.equal(ids.long(), ref_ids)
        torch.testing.assert_close(weights.double(), ref_w)
        ref = torch.zeros(t, h, dtype=torch.float64)
        for row in range(t):
            for j in range(k):
                ex = int(ref_ids[row, j])
                gate, up = (w13[ex].double() @ x[row].double()).chunk(2)
                ref[row] += ref_w[row, j] * (w2[ex].double() @ (act(gate) * up))
        got = fused_experts(x, w13, w2, weights, ids, activation)
        torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-4)


def test_bad_moe_arguments_are_refused_by_name():
    from manylora.ops.fused_moe import fused_experts, select_experts

    x, w13, w2 = torch.zeros(2, 4), torch.zeros(3, 6, 4), torch.zeros(3, 4, 3)
    weights, ids = torch.ones(2, 1), torch.zeros(2, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="top_k=4 is outside"):
        select_experts(torch.zeros(2, 3), 4, True)
    with pytest.raises(ValueError, match="unknown MoE activation 'relu'"):
        fused_experts(x, w13, w2, weights, ids, "relu")
    with pytest.raises(ValueError, match=r"w2 \(3, 3, 4\)"):
        fused_experts(x, w13, w2.transpose(1, 2), weights, ids)


def test_mixed_batch_with_prefix_caching_and_pieces_matches_peft(family):
    """One slot for two adapters and base rows, steps padded to piece buckets and run
    piece by piece (on the CPU eagerly); the second run starts from cached prefixes."""
    llm = LLM(str(family.base_dir), **ENGINE, enable_prefix_caching=True,
              max_num_batched_tokens=32, piecewise_cuda_graph_sizes=(8, 32))
    with shutting_down(llm):
        generate_twice_from_prefix_cache(llm, family, GREEDY)


def test_stacked_expert_checkpoint_matches_peft(family, tmp_path):
    stacked = _stack_experts(family.base_dir, tmp_path / "stacked")
    llm = LLM(str(stacked), **ENGINE)
    with shutting_down(llm):
        assert_greedy_matches(generate_greedy(llm, dataclasses.replace(
            family, base_dir=stacked), GREEDY), family)


def test_tensor_parallel_2_matches_peft(family):
    llm = LLM(str(family.base_dir), **{**ENGINE, "max_loras": 2}, tensor_parallel_size=2)
    with shutting_down(llm):
        assert_greedy_matches(generate_greedy(llm, family, GREEDY), family)


@pytest.mark.parametrize("key", [
    "base_model.model.model.layers.0.mlp.experts.0.gate_proj.lora_A.weight",
    "base_model.model.model.layers.0.block_sparse_moe.experts.1.w2.lora_B.weight",
    "base_model.model.model.layers.0.mlp.shared_expert.up_proj.lora_A.weight",
    "base_model.model.model.layers.0.mlp.gate.lora_A.weight",
    "base_model.model.model.layers.0.mlp.experts.lora_A.weight"])
def test_an_adapter_on_the_moe_block_is_refused_by_name(key):
    from manylora.lora.adapter import LoRAAdapterError
    from manylora.lora.formats.peft import group_peft_tensors

    module = key.removeprefix("base_model.model.").split(".lora_")[0]
    with pytest.raises(LoRAAdapterError, match=module.replace(".", r"\.")):
        group_peft_tensors({key: torch.zeros(2, 4)}, "moe")


@pytest.mark.parametrize("module_id, name", [(13, "moe_h_to_4h"), (14, "moe_4h_to_h"),
                                             (15, "moe_gate"), (16, "moe_router"),
                                             (17, "mlp_router")])
def test_a_tensorrt_llm_moe_module_is_refused_by_name(module_id, name):
    from manylora.lora.adapter import LoRAAdapterError
    from manylora.lora.formats.trtllm import _row_module

    with pytest.raises(LoRAAdapterError, match=rf"module id {module_id} \({name}\)"):
        _row_module("moe", 0, [module_id, 0, 4], None)


def test_a_quantized_moe_base_is_refused_by_name(family):
    """Online FP8 (``quantization="fp8"`` on a 16/32-bit checkpoint) would quantize the
    experts, which the MoE block does not support yet."""
    from transformers import AutoConfig

    from manylora.config.quantization import QuantizationError

    name = AutoConfig.from_pretrained(family.base_dir).architectures[0]
    with pytest.raises(QuantizationError, match=rf"{name}.*fp8"):
        LLM(str(family.base_dir), **ENGINE, quantization="fp8")


def test_dummy_weights_under_tensor_parallelism_are_the_one_rank_experts_cut():
    """``load_format="dummy"`` draws each rank's experts as its columns of the one-rank
    model's (``fill_dummy_weights`` over the experts' ``tp_slices``)."""
    from manylora.config import MoEShape
    from manylora.distributed.parallel_state import TPGroup
    from manylora.model.layers.moe import FusedMoE
    from manylora.model.loader import fill_dummy_weights

    def experts(rank, size):
        tp = types.SimpleNamespace(rank=rank, size=size)
        block = FusedMoE(8, MoEShape(3, 2, 6, (0,)), torch.float32, torch.device("cpu"),
                         TPGroup.single() if size == 1 else tp)
        fill_dummy_weights(block.experts, torch.device("cpu"))
        return block.experts.w13, block.experts.w2

    w13, w2 = experts(0, 1)
    for rank in range(2):
        part13, part2 = experts(rank, 2)
        cols = slice(3 * rank, 3 * rank + 3)
        assert torch.equal(part13, torch.cat([w13[:, :6][:, cols], w13[:, 6:][:, cols]], 1))
        assert torch.equal(part2, w2[:, :, cols])


@pytest.mark.parametrize("family", ["qwen2_moe"], indirect=True)
def test_a_peft_adapter_reaching_the_shared_expert_needs_its_slots(family, tmp_path):
    """peft's ``target_modules=[gate_proj, up_proj, down_proj]`` on Qwen2-MoE wraps the
    dense layer's MLP and every shared expert: on the default slot buffers that request
    ends with an error naming the shared expert's module and ``--lora-target-modules``, and
    the base request of the same batch is served (with the shared expert's slots it is
    served as peft serves it: ``tests/lora/test_moe_serving.py``)."""
    from manylora import LoRARequest
    from manylora.lora.adapter import LoRAAdapterError
    from manylora.testing import make_peft_adapter

    adapter = make_peft_adapter(family.base_dir, tmp_path / "mlp", r=4,
                                target_modules=["gate_proj", "up_proj", "down_proj"])
    llm = LLM(str(family.base_dir), **ENGINE)
    with shutting_down(llm):
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], GREEDY,
                            lora_request=[None, LoRARequest("mlp", 1, str(adapter))],
                            use_tqdm=False)
    assert isinstance(outs[1].error, LoRAAdapterError)
    assert re.search(r"shared_expert\.\w+_proj.*--lora-target-modules", str(outs[1].error))
    assert outs[0].error is None
    assert list(outs[0].outputs[0].token_ids) == list(family.reference[0].token_ids)


@pytest.mark.parametrize("family", ["qwen2_moe"], indirect=True)
def test_an_adapter_on_the_dense_layers_mlp_matches_peft(family, tmp_path):
    """Qwen2-MoE's dense layer (``mlp_only_layers``) is a LLaMA MLP: an adapter on its
    gate/up/down projections (peft's ``layers_to_transform``) applies as peft applies it,
    with and without tensor parallelism."""
    case = make_family_case(family.base_dir, tmp_path, {"dense": dict(
        r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"],
        layers_to_transform=[1], seed=5)}, PROMPTS[:1] * 2, [None, "dense"], MAX_NEW)
    assert case.reference[1].token_ids != case.reference[0].token_ids
    for tp in (1, 2):
        llm = LLM(str(case.base_dir), **ENGINE, tensor_parallel_size=tp)
        with shutting_down(llm):
            assert_greedy_matches(generate_greedy(llm, case, GREEDY), case)


@pytest.mark.parametrize("family", ["mixtral"], indirect=True)
def test_a_missing_or_misshaped_expert_is_named(family, tmp_path):
    from transformers import AutoConfig

    from manylora.checkpoint.weights import CheckpointError, MissingWeightError
    from manylora.config import ModelConfig
    from manylora.model.loader import load_model

    cfg = ModelConfig.from_hf(AutoConfig.from_pretrained(family.base_dir), torch.float32)
    state = load_file(family.base_dir / "model.safetensors")
    missing, bad = (tmp_path / "missing", tmp_path / "bad")
    for folder, key, change in (
            (missing, "model.layers.1.block_sparse_moe.experts.3.w3.weight", None),
            (bad, "model.layers.0.block_sparse_moe.experts.2.w2.weight", lambda w: w[:, :-1])):
        shutil.copytree(family.base_dir, folder)
        edited = dict(state)
        tensor = edited.pop(key)
        if change is not None:
            edited[key] = change(tensor).contiguous()
        save_file(edited, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(MissingWeightError, match=r"experts\.3\.w3\.weight"):
        load_model(missing, cfg, torch.device("cpu"))
    with pytest.raises(CheckpointError, match=r"experts\.2\.w2\.weight"):
        load_model(bad, cfg, torch.device("cpu"))
