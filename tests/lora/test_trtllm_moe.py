"""TensorRT-LLM's MoE LoRA ids (13 moe_h_to_4h, 14 moe_4h_to_h, 15 moe_gate, 16 moe_router,
17 mlp_router) read into the stacked experts, the router and the shared expert's gate,
written back, and refused where the target has no such module."""

from __future__ import annotations

import pytest
import torch

from manylora.config import LORA_MOE_MODULES, LORA_TARGET_MODULES
from manylora.lora.adapter import LoRAAdapter, LoRAAdapterError, LoRAWeights
from manylora.lora.formats.target import AdapterTarget
from manylora.lora.formats.trtllm import adapter_from_trtllm, adapter_to_trtllm
from manylora.lora.formats.trtllm_npy import read_trtllm_dir, write_trtllm_dir

H, E, INTER, INTER_S, R = 16, 3, 8, 12, 2
ATTN = {"q_proj": (H, H), "k_proj": (H, 8), "v_proj": (H, 8), "o_proj": (H, H),
        "gate_proj": (H, 24), "up_proj": (H, 24), "down_proj": (24, H)}
MOE = {"experts.gate_proj": (H, INTER), "experts.up_proj": (H, INTER),
       "experts.down_proj": (INTER, H), "router": (H, E),
       "shared_expert.gate_proj": (H, INTER_S), "shared_expert.up_proj": (H, INTER_S),
       "shared_expert.down_proj": (INTER_S, H), "shared_expert_gate": (H, 1)}
DENSE = frozenset(LORA_TARGET_MODULES)
SPARSE = frozenset(LORA_MOE_MODULES) | {"q_proj", "k_proj", "v_proj", "o_proj"}


def _target(moe=True, target_modules=LORA_TARGET_MODULES + LORA_MOE_MODULES,
            layer_modules=(SPARSE, DENSE)):
    shapes = {**ATTN, **(MOE if moe else {})}
    return AdapterTarget(shapes, 2, 8, tuple(target_modules), torch.float32,
                         num_experts=E if moe else 0, layer_modules=layer_modules)


def _moe_adapter(seed=0):
    gen = torch.Generator().manual_seed(seed)

    def w(*shape):
        return torch.randn(*shape, generator=gen)

    return LoRAAdapter(1, "moe", {
        (0, "experts.gate_proj"): LoRAWeights(w(E, R, H), w(E, INTER, R)),
        (0, "experts.up_proj"): LoRAWeights(w(E, R, H), w(E, INTER, R)),
        (0, "experts.down_proj"): LoRAWeights(w(E, R, INTER), w(E, H, R)),
        (0, "router"): LoRAWeights(w(R, H), w(E, R)),
        (0, "shared_expert.gate_proj"): LoRAWeights(w(R, H), w(INTER_S, R)),
        (0, "shared_expert.down_proj"): LoRAWeights(w(R, INTER_S), w(H, R)),
        (0, "shared_expert_gate"): LoRAWeights(w(R, H), w(1, R)),
        (1, "gate_proj"): LoRAWeights(w(R, H), w(24, R)),
    })


def test_moe_rows_round_trip_in_tensorrt_llms_layout(tmp_path):
    adapter = _moe_adapter()
    weights, config = adapter_to_trtllm(adapter, torch.float32)
    rows = {(c[1], c[0]): i for i, c in enumerate(config.tolist())}
    assert sorted(rows) == [(0, 5), (0, 6), (0, 13), (0, 14), (0, 15), (0, 16), (0, 17),
                            (1, 5)]
    gate = adapter.weights[(0, "experts.gate_proj")]
    row = weights[rows[(0, 13)]]
    n_a = E * R * H
    assert torch.equal(row[:n_a].reshape(E, R, H), gate.a)                      # A [E, D, Hi]
    assert torch.equal(row[n_a:n_a + E * INTER * R].reshape(E, INTER, R), gate.b)  # B [E, Ho, D]
    write_trtllm_dir(tmp_path, weights, config)
    for w, c in (read_trtllm_dir(tmp_path, "moe", _target()), (weights, config)):
        back = adapter_from_trtllm(1, "moe", w, c, _target())
        assert back.weights.keys() == adapter.weights.keys()
        for key, lw in adapter.weights.items():
            assert torch.equal(back.weights[key].a, lw.a), key
            assert torch.equal(back.weights[key].b, lw.b), key


def test_gate_and_up_ids_are_tensorrt_llms():
    """13 moe_h_to_4h is the gate (HF ``w1``), 15 moe_gate the up projection (``w3``)."""
    a, b = torch.ones(E, R, H), torch.arange(E * INTER * R, dtype=torch.float32)
    row = torch.cat([a.reshape(-1), b])
    got = adapter_from_trtllm(1, "x", torch.stack([row, row * 2]),
                              torch.tensor([[13, 0, R], [15, 0, R]]), _target())
    assert torch.equal(got.weights[(0, "experts.gate_proj")].b, b.reshape(E, INTER, R))
    assert torch.equal(got.weights[(0, "experts.up_proj")].b, 2 * b.reshape(E, INTER, R))


def test_the_dense_ids_are_the_shared_expert_on_a_sparse_layer():
    row = torch.randn(R * H + INTER_S * R)
    got = adapter_from_trtllm(1, "x", row[None], torch.tensor([[5, 0, R]]), _target())
    assert set(got.weights) == {(0, "shared_expert.gate_proj")}
    row = torch.randn(R * H + 24 * R)
    got = adapter_from_trtllm(1, "x", row[None], torch.tensor([[5, 1, R]]), _target())
    assert set(got.weights) == {(1, "gate_proj")}


@pytest.mark.parametrize("target, match", [
    (_target(moe=False, layer_modules=None), r"module id 14 \(moe_4h_to_h\) has no layer"),
    (_target(target_modules=LORA_TARGET_MODULES), r"experts\.down_proj.*--lora-target-modules"),
    (_target(layer_modules=(DENSE, DENSE)), r"experts\.down_proj, which layer 0 .* not have"),
])
def test_moe_rows_are_gated_by_the_target(target, match):
    row = torch.zeros(E * (R * INTER + H * R))
    with pytest.raises(LoRAAdapterError, match=match):
        adapter_from_trtllm(1, "x", row[None], torch.tensor([[14, 0, R]]), target)


def test_short_or_dora_expert_rows_are_refused():
    row = torch.zeros(E * (R * INTER + H * R) - 1)
    with pytest.raises(LoRAAdapterError, match=r"E x \(D x Hi \+ Ho x D\) = 144"):
        adapter_from_trtllm(1, "x", row[None], torch.tensor([[14, 0, R]]), _target())
    with pytest.raises(LoRAAdapterError, match=r"DoRA on the experts"):
        adapter_from_trtllm(1, "x", torch.zeros(1, 400), torch.tensor([[14, 0, R, 1]]),
                            _target())
