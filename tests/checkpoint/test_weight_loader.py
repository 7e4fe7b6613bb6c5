"""Tests for manylora.checkpoint.weights (ModelWeightsLoader) and manylora.checkpoint.hub.

Checkpoints are written by transformers (safetensors, single and sharded) and by torch.save
(pytorch_model.bin single/sharded/legacy, consolidated.00.pth): transformers 5 always saves
safetensors, so the pickled formats are written the way older tools wrote them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from manylora.checkpoint.hub import resolve_adapter_path, resolve_model_path
from manylora.checkpoint.weights import (
    CheckpointError,
    MissingWeightError,
    ModelWeightsLoader,
)

CFG = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, vocab_size=100, tie_word_embeddings=False)
H, INTER, HEAD_DIM, N_Q, N_KV, V = 32, 64, 8, 4, 2, 100


class TinyFusedLlama(nn.Module):
    """manylora-style parameter names: HF LLaMA names with fused qkv_proj and gate_up_proj."""

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(V, H)
        self.model.layers = nn.ModuleList()
        for _ in range(CFG["num_hidden_layers"]):
            layer = nn.Module()
            layer.self_attn = nn.Module()
            layer.self_attn.qkv_proj = nn.Linear(H, (N_Q + 2 * N_KV) * HEAD_DIM, bias=False)
            layer.self_attn.o_proj = nn.Linear(N_Q * HEAD_DIM, H, bias=False)
            layer.mlp = nn.Module()
            layer.mlp.gate_up_proj = nn.Linear(H, 2 * INTER, bias=False)
            layer.mlp.down_proj = nn.Linear(INTER, H, bias=False)
            layer.input_layernorm = nn.RMSNorm(H)
            layer.post_attention_layernorm = nn.RMSNorm(H)
            self.model.layers.append(layer)
        self.model.norm = nn.RMSNorm(H)
        self.lm_head = nn.Linear(H, V, bias=False)
        for p in self.parameters():
            nn.init.zeros_(p)


def expected_fused(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name in dict(TinyFusedLlama().named_parameters()):
        if "qkv_proj" in name:
            out[name] = torch.cat([sd[name.replace("qkv_proj", p)] for p in ("q_proj", "k_proj",
                                                                               "v_proj")])
        elif "gate_up_proj" in name:
            out[name] = torch.cat([sd[name.replace("gate_up_proj", p)] for p in ("gate_proj",
                                                                                   "up_proj")])
        else:
            out[name] = sd[name]
    return out


def save_sharded_bin(sd: dict[str, torch.Tensor], d: Path, n: int = 3) -> None:
    keys = list(sd)
    weight_map = {}
    for i in range(n):
        name = f"pytorch_model-{i + 1:05d}-of-{n:05d}.bin"
        part = {k: sd[k] for k in keys[i::n]}
        torch.save(part, d / name)
        weight_map.update(dict.fromkeys(part, name))
    (d / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CFG))
    sd = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    root = tmp_path_factory.mktemp("ckpt")
    paths = {name: root / name for name in ("safetensors", "sharded_safetensors", "bin",
                                            "sharded_bin", "legacy_bin", "pth")}
    for p in paths.values():
        p.mkdir()
    model.save_pretrained(paths["safetensors"])
    model.save_pretrained(paths["sharded_safetensors"], max_shard_size="20KB")
    torch.save(sd, paths["bin"] / "pytorch_model.bin")
    save_sharded_bin(sd, paths["sharded_bin"])
    torch.save(sd, paths["legacy_bin"] / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    torch.save(sd, paths["pth"] / "consolidated.00.pth")
    paths["single_file"] = paths["safetensors"] / "model.safetensors"
    return sd, paths


@pytest.mark.parametrize(
    "fmt, kind, n_files",
    [("safetensors", "safetensors", 1), ("sharded_safetensors", "safetensors", None),
     ("bin", "pickle", 1), ("sharded_bin", "pickle", 3), ("legacy_bin", "pickle", 1),
     ("pth", "pickle", 1), ("single_file", "safetensors", 1)],
)
def test_load_model_all_formats(hf, fmt, kind, n_files):
    sd, paths = hf
    loader = ModelWeightsLoader(paths[fmt])
    assert loader.format == kind
    if n_files is None:
        assert (paths[fmt] / "model.safetensors.index.json").is_file() and len(loader.files) > 1
    else:
        assert len(loader.files) == n_files
    assert loader.keys() == sorted(sd)
    model = TinyFusedLlama()
    loader.load_model(model)
    expected = expected_fused(sd)
    for name, param in model.named_parameters():
        assert torch.equal(param, expected[name]), name


def test_index_files_only_and_format_preference(hf, tmp_path):
    sd, paths = hf
    d = tmp_path / "ckpt"
    d.mkdir()
    for f in paths["sharded_safetensors"].iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    (d / "stray.safetensors").write_bytes(b"not in the index, must be ignored")
    torch.save({"x": torch.zeros(1)}, d / "pytorch_model.bin")  # safetensors preferred
    loader = ModelWeightsLoader(d)
    assert loader.format == "safetensors" and d / "stray.safetensors" not in loader.files
    assert loader.keys() == sorted(sd)


def test_translate_customized_dict(hf):
    _, paths = hf
    custom = {"model": "language_model.model", "lm_head": "language_model.lm_head",
              "weight": ["qweight", "scales"], "mlp": "", "gate_up_proj": "w13"}
    loader = ModelWeightsLoader(paths["bin"], custom)
    assert loader.translate("model.layers.0.mlp.gate_up_proj.scales") == [
        "language_model.model.layers.0.w13.scales"]
    assert loader.translate("model.layers.0.self_attn.qkv_proj.weight") == [
        f"language_model.model.layers.0.self_attn.{p}.{w}"
        for p in ("q_proj", "k_proj", "v_proj") for w in ("qweight", "scales")
    ]
    assert loader.translate("lm_head.bias") == ["language_model.lm_head.bias"]
    assert loader.translate("model.layers.1.mlp.down_proj.bias") == [
        "language_model.model.layers.1.down_proj.bias"]


def test_default_translate_and_llava_prefix(hf, tmp_path):
    sd, _ = hf
    torch.save({f"language_model.{k}": v for k, v in sd.items()}, tmp_path / "pytorch_model.bin")
    default = ModelWeightsLoader(tmp_path)
    assert default.translate("model.layers.0.mlp.gate_up_proj.weight") == [
        "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"]
    assert default.translate("model.norm.weight") == ["model.norm.weight"]
    llava = ModelWeightsLoader(tmp_path, {"model": "language_model.model",
                                          "lm_head": "language_model.lm_head"})
    model = TinyFusedLlama()
    llava.load_model(model)
    expected = expected_fused(sd)
    assert all(torch.equal(p, expected[n]) for n, p in model.named_parameters())


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_tp_slices_equal_chunk(hf, fmt, dim):
    sd, paths = hf
    loader = ModelWeightsLoader(paths[fmt])
    key = "model.layers.0.mlp.gate_proj.weight"
    for rank, chunk in enumerate(torch.chunk(sd[key], 2, dim=dim)):
        part = loader.load_tensor(key, tp_size=2, tp_dim=dim, tp_rank=rank)
        assert part.is_contiguous() and torch.equal(part, chunk)
    assert torch.equal(loader.load_tensor(key, tp_size=2, tp_dim=None), sd[key])
    with pytest.raises(CheckpointError, match=r"Cannot split .*gate_proj.* into 3"):
        loader.load_tensor(key, tp_size=3, tp_dim=dim, tp_rank=0)
    assert loader.load_tensor("no.such.key") is None


def test_load_model_tp_and_custom_weight_loader(hf):
    sd, paths = hf
    loader = ModelWeightsLoader(paths["sharded_safetensors"])
    pre = "model.layers.1.self_attn."
    module = nn.Module()
    module.model = nn.Module()
    module.model.layers = nn.ModuleList([nn.Module(), nn.Module()])
    attn = module.model.layers[1].self_attn = nn.Module()
    attn.qkv_proj = nn.Linear(H, (N_Q + 2 * N_KV) * HEAD_DIM // 2, bias=False)
    attn.qkv_proj.weight.tp_dim = 0
    attn.o_proj = nn.Linear(N_Q * HEAD_DIM // 2, H, bias=False)
    attn.o_proj.weight.tp_dim = 1
    calls = []
    module.model.norm = nn.RMSNorm(H)
    module.model.norm.weight.weight_loader = lambda p, ts: calls.append((p, ts))
    loader.load_model(module, tp_rank=1, tp_size=2)
    qkv = torch.cat([sd[f"{pre}{p}.weight"].chunk(2, 0)[1] for p in ("q_proj", "k_proj", "v_proj")])
    assert torch.equal(attn.qkv_proj.weight, qkv)
    assert torch.equal(attn.o_proj.weight, sd[pre + "o_proj.weight"].chunk(2, 1)[1])
    assert len(calls) == 1 and calls[0][0] is module.model.norm.weight
    assert len(calls[0][1]) == 1 and torch.equal(calls[0][1][0], sd["model.norm.weight"])


def test_dtype_converts(tmp_path):
    torch.manual_seed(1)
    model = LlamaForCausalLM(LlamaConfig(**CFG)).to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    sd = model.state_dict()
    loader = ModelWeightsLoader(tmp_path)
    assert loader.load("model.norm.weight")[0].dtype == torch.bfloat16
    target = TinyFusedLlama()
    loader.load_model(target)
    expected = expected_fused(sd)
    for name, param in target.named_parameters():
        assert param.dtype == torch.float32 and torch.equal(param, expected[name].float())


def test_no_weight_files(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"No weight files in .*looked for \*\.safetensors"):
        ModelWeightsLoader(tmp_path)


@pytest.mark.parametrize("name, match", [
    ("model.safetensors", r"Corrupt or unreadable safetensors file .*model\.safetensors"),
    ("pytorch_model.bin", r"Corrupt or unreadable weight file .*pytorch_model\.bin"),
])
def test_corrupt_file(tmp_path, name, match):
    (tmp_path / name).write_bytes(b"\x07garbage bytes, not a checkpoint" * 4)
    with pytest.raises(CheckpointError, match=match):
        ModelWeightsLoader(tmp_path)


def test_index_refers_to_missing_file(hf, tmp_path):
    _, paths = hf
    index = paths["sharded_safetensors"] / "model.safetensors.index.json"
    (tmp_path / index.name).write_text(index.read_text())
    with pytest.raises(CheckpointError, match=r"refers to missing file.*model-00001-of"):
        ModelWeightsLoader(tmp_path)


def test_missing_key(hf):
    _, paths = hf
    loader = ModelWeightsLoader(paths["safetensors"])
    with pytest.raises(MissingWeightError, match=r"model\.layers\.9\.self_attn\.k_proj") as info:
        loader.load("model.layers.9.self_attn.qkv_proj.weight")
    assert isinstance(info.value, KeyError) and isinstance(info.value, CheckpointError)
    assert str(paths["safetensors"]) in str(info.value)
    module = TinyFusedLlama()
    module.model.extra = nn.Linear(2, 2, bias=False)
    with pytest.raises(KeyError, match=r"model\.extra\.weight"):
        loader.load_model(module)


def test_shape_mismatch(hf):
    _, paths = hf
    module = TinyFusedLlama()
    module.model.layers[0].mlp.gate_up_proj = nn.Linear(H, INTER, bias=False)
    with pytest.raises(CheckpointError, match=r"Shape mismatch .*gate_up_proj.*\(128, 32\).*"
                                              r"\(64, 32\)"):
        ModelWeightsLoader(paths["safetensors"]).load_model(module)


# --------------------------------------------------------------------------------------- hub.py

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def make_hub_cache(cache: Path, repo_id: str, files: dict[str, bytes]) -> Path:
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    for name, data in files.items():
        (snapshot / name).write_bytes(data)
    return snapshot


def test_local_dir_resolves_to_itself(tmp_path):
    assert resolve_model_path(str(tmp_path)) == tmp_path
    assert resolve_adapter_path(str(tmp_path)) == tmp_path


def test_resolve_offline_from_hub_cache(hf, tmp_path, monkeypatch):
    _, paths = hf
    cache = tmp_path / "hub"
    weights = (paths["safetensors"] / "model.safetensors").read_bytes()
    snapshot = make_hub_cache(cache, "org/name", {"config.json": b"{}",
                                                  "model.safetensors": weights})
    adapter = make_hub_cache(cache, "org/lora", {"adapter_config.json": b"{}"})
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = resolve_model_path("org/name")
    assert path.resolve() == snapshot.resolve()
    assert ModelWeightsLoader(path).keys() == ModelWeightsLoader(paths["safetensors"]).keys()
    assert resolve_adapter_path("org/lora").resolve() == adapter.resolve()
    monkeypatch.delenv("HF_HUB_CACHE")
    explicit = resolve_model_path("org/name", revision=COMMIT, cache_dir=cache)
    assert explicit.resolve() == snapshot.resolve()


@pytest.mark.parametrize("name", ["org/does-not-exist", "not a valid//repo id"])
def test_unknown_repo_raises(tmp_path, monkeypatch, name):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match=f"{name!r}.*neither a local directory nor"):
        resolve_model_path(name)
    with pytest.raises(FileNotFoundError, match=f"Adapter {name!r}"):
        resolve_adapter_path(name)
