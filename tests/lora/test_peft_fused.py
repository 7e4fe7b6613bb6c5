"""PEFT adapters trained on fused projections (``qkv_proj``, ``gate_up_proj``) load as their
component modules: shared A, rows of B (and of DoRA's magnitude) split by the base widths."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from manylora.lora.adapter import LoRAAdapterError
from manylora.lora.formats.peft import load_peft_adapter
from manylora.lora_request import LoRARequest


def copy_adapter(src, dst):
    shutil.copytree(src, dst)
    return dst


def load(path, target, name="a"):
    return load_peft_adapter(LoRARequest(name, 1, str(path)), path, target)


@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_fused_adapter_equals_unfused_with_shared_a(fused_adapters, adapter_target, kind):
    shared_dir, fused_dir = fused_adapters[kind]
    shared, fused = load(shared_dir, adapter_target), load(fused_dir, adapter_target)
    assert set(fused.weights) == set(shared.weights)
    assert {m for _, m in fused.weights} == {"q_proj", "k_proj", "v_proj", "o_proj",
                                            "gate_proj", "up_proj"}
    assert fused.digest == shared.digest
    assert fused.has_dora == (kind == "dora")
    q, k = fused.weights[(0, "q_proj")], fused.weights[(0, "k_proj")]
    assert torch.equal(q.a, k.a)
    assert q.b.shape == (32, 4) and k.b.shape == (16, 4) and k.b.is_contiguous()


def test_fused_names_accepted_in_target_modules(fused_adapters, adapter_target):
    cfg = json.loads((fused_adapters["lora"][1] / "adapter_config.json").read_text())
    assert {"qkv_proj", "gate_up_proj"} <= set(cfg["target_modules"])
    assert load(fused_adapters["lora"][1], adapter_target).rank == 4


def _edit_tensors(path, edit):
    file = path / "adapter_model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file)


def test_fused_b_of_wrong_height(fused_adapters, adapter_target, tmp_path):
    bad = copy_adapter(fused_adapters["lora"][1], tmp_path / "short_b")
    key = "base_model.model.model.layers.1.self_attn.qkv_proj.lora_B.weight"
    _edit_tensors(bad, lambda t: t.update({key: t[key][:-8]}))
    with pytest.raises(LoRAAdapterError,
                       match=r"'a': .*layers\.1\.self_attn\.qkv_proj has lora_B \(56, 4\), but "
                             r"its rows must stack q_proj \+ k_proj \+ v_proj = 32 \+ 16 \+ 16 "
                             r"= 64"):
        load(bad, adapter_target)


def test_fused_magnitude_of_wrong_length(fused_adapters, adapter_target, tmp_path):
    bad = copy_adapter(fused_adapters["dora"][1], tmp_path / "short_m")
    key = "base_model.model.model.layers.0.mlp.gate_up_proj.lora_magnitude_vector"
    _edit_tensors(bad, lambda t: t.update({key: t[key][:-1]}))
    with pytest.raises(LoRAAdapterError, match=r"gate_up_proj has lora_magnitude_vector "
                                               r"\(127,\), but the base projection has 128"):
        load(bad, adapter_target)


def test_fused_and_component_module_together(fused_adapters, adapter_target, tmp_path):
    bad = copy_adapter(fused_adapters["lora"][1], tmp_path / "both")
    src = load_file(fused_adapters["lora"][0] / "adapter_model.safetensors")
    extra = {k: v for k, v in src.items() if ".layers.0.self_attn.k_proj." in k}
    _edit_tensors(bad, lambda t: t.update(extra))
    with pytest.raises(LoRAAdapterError, match=r"has weights for model.layers.0.self_attn.k_proj"
                                               r", which its config's target_modules"):
        load(bad, adapter_target)
    cfg = json.loads((bad / "adapter_config.json").read_text())
    cfg["target_modules"] = [*cfg["target_modules"], "k_proj"]
    (bad / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(LoRAAdapterError, match=r"layer 0 has weights for k_proj twice"):
        load(bad, adapter_target)


def test_fused_module_outside_lora_target_modules(fused_adapters, adapter_target):
    from dataclasses import replace

    restricted = replace(adapter_target, target_modules=("q_proj", "v_proj", "o_proj",
                                                         "gate_proj", "up_proj"))
    with pytest.raises(LoRAAdapterError, match=r"targets k_proj \(through qkv_proj\), but "
                                               r"lora_target_modules is"):
        load(fused_adapters["lora"][1], restricted)
