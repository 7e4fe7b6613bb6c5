"""Fixtures for the adapter-format tests: one tiny llama base, peft adapters, and adapters in
the fused ``qkv_proj`` / ``gate_up_proj`` PEFT layout built by hand from them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from manylora.config import LORA_TARGET_MODULES, ModelConfig
from manylora.lora.dora import dora_row_norm
from manylora.lora.formats.target import AdapterTarget
from manylora.testing import make_checkpoint, make_peft_adapter

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128)
MAX_LORA_RANK = 16
PREFIX = "base_model.model.model.layers"
FUSED = {"qkv_proj": ("self_attn", ("q_proj", "k_proj", "v_proj")),
         "gate_up_proj": ("mlp", ("gate_proj", "up_proj"))}


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def lora_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("lora_formats")


@pytest.fixture(scope="session")
def tiny_config() -> dict:
    """``make_checkpoint`` arguments of the tiny base."""
    return dict(TINY)


@pytest.fixture(scope="session")
def base_dir(lora_root) -> Path:
    return make_checkpoint(lora_root / "base", "llama", seed=0, **TINY)


@pytest.fixture(scope="session")
def base_state(base_dir) -> dict[str, torch.Tensor]:
    return load_file(base_dir / "model.safetensors")


def base_weight(state: dict[str, torch.Tensor], layer: int, module: str) -> torch.Tensor:
    block = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
    return state[f"model.layers.{layer}.{block}.{module}.weight"]


@pytest.fixture(scope="session")
def adapter_target(base_dir, base_state) -> AdapterTarget:
    """What the engine would build for the base (float32, all seven modules, DoRA norms)."""
    cfg = ModelConfig.from_hf(AutoConfig.from_pretrained(base_dir), torch.float32)
    return AdapterTarget(
        cfg.module_shapes(), cfg.num_layers, MAX_LORA_RANK, LORA_TARGET_MODULES, torch.float32,
        dora_norm=lambda layer, module, a, b: dora_row_norm(
            base_weight(base_state, layer, module), a, b))


def share_and_fuse(src: Path, shared_dir: Path, fused_dir: Path) -> tuple[Path, Path]:
    """From a peft adapter over q/k/v (and/or gate/up): ``shared_dir``, the same adapter with
    k/v (up) using q's (gate's) A, and ``fused_dir``, its fused ``qkv_proj`` /
    ``gate_up_proj`` form (one A, B and DoRA magnitudes concatenated in HF's order)."""
    tensors = load_file(src / "adapter_model.safetensors")
    cfg = json.loads((src / "adapter_config.json").read_text())
    layers = sorted({int(k.split(".")[4]) for k in tensors})
    shared, fused = dict(tensors), {}
    fused_targets = []
    for fused_name, (block, parts) in FUSED.items():
        keys = {p: f"{block}.{p}" for p in parts}
        if not any(f".{keys[parts[0]]}." in k for k in tensors):
            continue
        fused_targets.append(fused_name)
        for layer in layers:
            def key(part, suffix, layer=layer, block=block):
                return f"{PREFIX}.{layer}.{block}.{part}.{suffix}"
            a = tensors[key(parts[0], "lora_A.weight")]
            for p in parts:
                shared[key(p, "lora_A.weight")] = a.clone()
            fused[key(fused_name, "lora_A.weight")] = a.clone()
            fused[key(fused_name, "lora_B.weight")] = torch.cat(
                [tensors[key(p, "lora_B.weight")] for p in parts])
            if key(parts[0], "lora_magnitude_vector") in tensors:
                fused[key(fused_name, "lora_magnitude_vector")] = torch.cat(
                    [tensors[key(p, "lora_magnitude_vector")] for p in parts])
    used = {p for name in fused_targets for p in FUSED[name][1]}
    fused.update({k: v for k, v in tensors.items() if k.split(".")[6] not in used})
    for out, state, targets in ((shared_dir, shared, cfg["target_modules"]),
                                (fused_dir, fused, fused_targets + sorted(
                                    set(cfg["target_modules"]) - used))):
        out.mkdir(parents=True)
        save_file(state, out / "adapter_model.safetensors")
        (out / "adapter_config.json").write_text(json.dumps(dict(cfg, target_modules=targets)))
    return shared_dir, fused_dir


@pytest.fixture(scope="session")
def fused_adapters(base_dir, lora_root) -> dict[str, tuple[Path, Path]]:
    """``{"lora" | "dora": (shared-A unfused adapter, fused adapter)}`` over q/k/v/gate/up
    (and o_proj, left unfused)."""
    out = {}
    for kind in ("lora", "dora"):
        src = make_peft_adapter(base_dir, lora_root / f"src_{kind}", r=4, lora_alpha=8,
                                target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                "gate_proj", "up_proj"],
                                seed=21, use_dora=kind == "dora")
        out[kind] = share_and_fuse(src, lora_root / f"shared_{kind}",
                                   lora_root / f"fused_{kind}")
    return out
