"""``manylora convert-lora``: PEFT adapters → TensorRT-LLM's ``.npy`` files, checked value by
value against the PEFT tensors, then served by the engine (from the directory and as tensors in
the request) with the same greedy tokens as the PEFT adapter and as transformers + peft."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from manylora import LLM, LoRARequest, SamplingParams
from manylora.entrypoints.cli import main
from manylora.lora.formats.loader import adapter_from_request, load_adapter_dir
from manylora.lora.formats.peft import load_peft_adapter
from manylora.lora.formats.trtllm_npy import CONFIG_FILE, WEIGHTS_FILE, read_trtllm_dir
from manylora.testing import compare_greedy, hf_greedy_reference, make_checkpoint
from manylora.testing import make_peft_adapter as _make_peft_adapter

MODULE_IDS = {"q_proj": 1, "k_proj": 2, "v_proj": 3, "o_proj": 4, "gate_proj": 5,
              "down_proj": 6, "up_proj": 7, "qkv_proj": 0, "gate_up_proj": 18}
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ENGINE = dict(max_loras=2, max_lora_rank=16, num_kv_blocks=64, block_size=4, max_model_len=64,
              device="cpu", dtype="float32")
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
TEXTS = ["The quick brown fox", "Once upon a time", "SELECT name FROM users WHERE"]
ADAPTER_SPECS = {
    "plain": dict(r=8, lora_alpha=16, target_modules=ALL, seed=11),
    "rslora": dict(r=8, lora_alpha=16, target_modules=ALL, use_rslora=True,
                   rank_pattern={"o_proj": 4, "down_proj": 2}, alpha_pattern={"q_proj": 32},
                   seed=12),
    "dora": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                 use_dora=True, seed=13),
}


@pytest.fixture(scope="module")
def peft_adapters(base_dir, lora_root):
    return {name: _make_peft_adapter(base_dir, lora_root / f"peft_{name}", **spec)
            for name, spec in ADAPTER_SPECS.items()}


def convert(src, out, storage="float32", base=None) -> int:
    argv = ["convert-lora", "-i", str(src), "-o", str(out), "--storage-type", storage]
    return main(argv + (["--base-model", str(base)] if base is not None else []))


@pytest.fixture(scope="module")
def converted(peft_adapters, base_dir, lora_root):
    """Every adapter converted with float32 storage (DoRA with --base-model)."""
    out = {}
    for name, src in peft_adapters.items():
        out[name] = lora_root / f"trt_{name}"
        assert convert(src, out[name], base=base_dir if name == "dora" else None) == 0
    return out


def expected_rows(peft_dir, base_state=None):
    """``{(layer, module id): (A, scaled B, DoRA scale | None)}`` from the PEFT files alone."""
    import json

    cfg = json.loads((peft_dir / "adapter_config.json").read_text())
    tensors = load_file(peft_dir / "adapter_model.safetensors")
    rows = {}
    for key, a in tensors.items():
        if ".lora_A." not in key:
            continue
        parts = key.split(".")
        layer, block, module = int(parts[4]), parts[5], parts[6]
        b = tensors[key.replace("lora_A", "lora_B")]
        r = a.shape[0]
        assert r == cfg["rank_pattern"].get(module, cfg["r"])
        alpha = cfg["alpha_pattern"].get(module, cfg["lora_alpha"])
        b = b * (alpha / math.sqrt(r) if cfg["use_rslora"] else alpha / r)
        scale = None
        if cfg["use_dora"]:
            w = base_state[f"model.layers.{layer}.{block}.{module}.weight"] + b @ a
            m = tensors[key.replace("lora_A.weight", "lora_magnitude_vector")]
            scale = m / torch.linalg.norm(w, dim=1)
        rows[(layer, MODULE_IDS[module])] = (a, b, scale)
    return rows


@pytest.mark.parametrize("name", list(ADAPTER_SPECS))
def test_npy_files_hold_the_peft_tensors(name, converted, peft_adapters, base_state):
    weights = np.load(converted[name] / WEIGHTS_FILE)
    config = np.load(converted[name] / CONFIG_FILE)
    expected = expected_rows(peft_adapters[name], base_state)
    dora = name == "dora"
    assert weights.dtype == np.float32 and config.dtype == np.int32
    assert config.shape == (1, len(expected), 4 if dora else 3)
    assert weights.shape[:2] == (1, len(expected))
    keys = [(layer, mid) for mid, layer in config[0, :, :2].tolist()]
    assert keys == sorted(expected)
    widths = []
    for row, (mid, layer, rank, *flag) in zip(weights[0], config[0].tolist()):
        a, b, scale = expected[(layer, mid)]
        assert rank == a.shape[0] and flag == ([1] if dora else [])
        n_a, n_b = a.numel(), b.numel()
        np.testing.assert_array_equal(row[:n_a], a.reshape(-1).numpy())
        np.testing.assert_allclose(row[n_a: n_a + n_b], b.reshape(-1).numpy(), rtol=1e-6)
        used = n_a + n_b
        if dora:
            np.testing.assert_allclose(row[used: used + b.shape[0]], scale.numpy(), rtol=1e-5)
            used += b.shape[0]
        assert not row[used:].any()
        widths.append(used)
    assert weights.shape[2] == max(widths)


@pytest.mark.parametrize("storage", ["float16", "bfloat16"])
def test_storage_types(storage, peft_adapters, converted, tmp_path):
    out = tmp_path / storage
    assert convert(peft_adapters["rslora"], out, storage) == 0
    raw = np.load(out / WEIGHTS_FILE)
    assert raw.dtype.str == {"float16": "<f2", "bfloat16": "|V2"}[storage]
    weights, config = read_trtllm_dir(out)
    ref, ref_config = read_trtllm_dir(converted["rslora"])
    dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16}[storage]
    assert weights.dtype == dtype and torch.equal(config, ref_config)
    assert torch.equal(weights, ref.to(dtype))


def test_dora_against_a_sharded_base(peft_adapters, converted, lora_root, tmp_path,
                                     tiny_config):
    sharded = make_checkpoint(lora_root / "base_sharded", "llama", seed=0,
                              max_shard_size="20KB", **tiny_config)
    assert (sharded / "model.safetensors.index.json").is_file()
    assert convert(peft_adapters["dora"], tmp_path / "d", base=sharded) == 0
    w1, c1 = read_trtllm_dir(tmp_path / "d")
    w2, c2 = read_trtllm_dir(converted["dora"])
    assert torch.equal(c1, c2) and torch.equal(w1, w2)


@pytest.mark.parametrize("name", list(ADAPTER_SPECS))
def test_converted_adapter_loads_as_the_peft_adapter(name, converted, peft_adapters,
                                                     adapter_target):
    request = LoRARequest(name, 1, str(converted[name]))
    trt = load_adapter_dir(request, converted[name], adapter_target)
    peft = load_peft_adapter(request, peft_adapters[name], adapter_target)
    assert set(trt.weights) == set(peft.weights)
    if name == "dora":  # the scales come from two float32 computations of the same norm
        for key, w in peft.weights.items():
            assert torch.equal(trt.weights[key].a, w.a) and torch.equal(trt.weights[key].b, w.b)
            torch.testing.assert_close(trt.weights[key].dora_scale, w.dora_scale)
    else:
        assert trt.digest == peft.digest
    weights, config = read_trtllm_dir(converted[name])
    tensors = adapter_from_request(LoRARequest(task_id=5, weights=weights, config=config),
                                   adapter_target)
    assert tensors.digest == trt.digest


def test_fused_adapter_converts_to_fused_rows(fused_adapters, adapter_target, lora_root):
    shared, fused = fused_adapters["lora"]
    out = lora_root / "trt_fused"
    assert convert(fused, out) == 0
    _, config = read_trtllm_dir(out)
    assert sorted({mid for mid, _, _ in config[0].tolist()}) == [0, 4, 18]
    trt = load_adapter_dir(LoRARequest("f", 1, str(out)), out, adapter_target)
    ref = load_peft_adapter(LoRARequest("f", 1, str(shared)), shared, adapter_target)
    assert trt.digest == ref.digest


def test_fused_dora_adapter_converts(fused_adapters, adapter_target, base_dir, lora_root):
    shared, fused = fused_adapters["dora"]
    out = lora_root / "trt_fused_dora"
    assert convert(fused, out, base=base_dir) == 0
    trt = load_adapter_dir(LoRARequest("f", 1, str(out)), out, adapter_target)
    ref = load_peft_adapter(LoRARequest("f", 1, str(shared)), shared, adapter_target)
    for key, w in ref.weights.items():
        assert torch.equal(trt.weights[key].b, w.b)
        torch.testing.assert_close(trt.weights[key].dora_scale, w.dora_scale)


# ---------------------------------------------------------------------------------------------
# CLI errors: a message naming the problem, no traceback


def test_dora_without_base_model(peft_adapters, tmp_path):
    with pytest.raises(SystemExit, match=r"convert-lora: error: .* is DoRA: .*--base-model"):
        convert(peft_adapters["dora"], tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_missing_input_dir(tmp_path):
    with pytest.raises(SystemExit, match=r"error: .*no_such_adapter is not a directory"):
        convert(tmp_path / "no_such_adapter", tmp_path / "out")


def test_base_model_without_the_weight(peft_adapters, tmp_path):
    (tmp_path / "empty_base").mkdir()
    with pytest.raises(SystemExit, match=r"error: base model .*empty_base: No weight files"):
        convert(peft_adapters["dora"], tmp_path / "out", base=tmp_path / "empty_base")


def test_bad_adapter_config(peft_adapters, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(peft_adapters["plain"], bad)
    (bad / "adapter_config.json").write_text("{not json")
    with pytest.raises(SystemExit, match=r"error: adapter .*cannot read .*adapter_config.json"):
        convert(bad, tmp_path / "out")


def test_fused_and_component_module_together(fused_adapters, tmp_path):
    import shutil

    from safetensors.torch import save_file

    shared, fused = fused_adapters["lora"]
    bad = tmp_path / "both"
    shutil.copytree(fused, bad)
    tensors = load_file(bad / "adapter_model.safetensors")
    tensors.update({k: v for k, v in load_file(shared / "adapter_model.safetensors").items()
                    if ".layers.1.mlp.up_proj." in k})
    save_file(tensors, bad / "adapter_model.safetensors")
    with pytest.raises(SystemExit, match=r"error: .*up_proj of layer 1 is given by both "
                                         r".*gate_up_proj and .*up_proj"):
        convert(bad, tmp_path / "out")


def test_bad_storage_type(peft_adapters, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        convert(peft_adapters["plain"], tmp_path / "out", storage="int8")
    assert e.value.code == 2
    assert "invalid choice: 'int8'" in capsys.readouterr().err


def test_cli_process_exit_status(peft_adapters, tmp_path):
    ok = subprocess.run([sys.executable, "-m", "manylora.entrypoints.cli", "convert-lora",
                         "-i", str(peft_adapters["plain"]), "-o", str(tmp_path / "ok")],
                        capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr
    assert "module-layer rows (float16)" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "manylora.entrypoints.cli", "convert-lora",
                          "-i", str(peft_adapters["dora"]), "-o", str(tmp_path / "bad")],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0
    assert "--base-model" in bad.stderr and "Traceback" not in bad.stderr


# ---------------------------------------------------------------------------------------------
# The engine serves converted adapters with the PEFT adapter's tokens


@pytest.fixture(scope="module")
def llm(base_dir):
    return LLM(str(base_dir), **ENGINE)


@pytest.fixture(scope="module")
def prompts(llm):
    tok = llm.get_tokenizer()
    return [tok(t).input_ids for t in TEXTS]


_ids = iter(range(1, 1000))


def generate(llm, prompts, request):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY,
                        lora_request=request, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def assert_matches_reference(tokens, base_dir, adapter_dir, prompts):
    refs = hf_greedy_reference(base_dir, {"a": adapter_dir}, prompts, ["a"] * len(prompts), 8)
    for i, (ours, ref) in enumerate(zip(tokens, refs)):
        ok, pos = compare_greedy(ours, ref)
        assert ok, f"prompt {i}: diverges at token {pos}: ours {ours} ref {ref.token_ids}"


@pytest.mark.parametrize("name", list(ADAPTER_SPECS))
def test_engine_serves_converted_adapter(name, llm, prompts, base_dir, peft_adapters,
                                         converted):
    from_peft = generate(llm, prompts, LoRARequest(f"peft_{name}", next(_ids),
                                                   str(peft_adapters[name])))
    from_dir = generate(llm, prompts, LoRARequest(f"trt_{name}", next(_ids),
                                                  str(converted[name])))
    weights, config = read_trtllm_dir(converted[name])
    from_tensors = generate(llm, prompts, LoRARequest(task_id=next(_ids), weights=weights,
                                                      config=config))
    assert from_dir == from_peft
    assert from_tensors == from_peft
    assert_matches_reference(from_peft, base_dir, peft_adapters[name], prompts)
    base = generate(llm, prompts, None)
    assert base != from_peft


@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_engine_fused_adapter_matches_unfused(kind, llm, prompts, base_dir, fused_adapters,
                                              lora_root):
    shared, fused = fused_adapters[kind]
    from_shared = generate(llm, prompts, LoRARequest(f"shared_{kind}", next(_ids), str(shared)))
    from_fused = generate(llm, prompts, LoRARequest(f"fused_{kind}", next(_ids), str(fused)))
    assert from_fused == from_shared
    out = lora_root / f"trt_engine_fused_{kind}"
    assert convert(fused, out, base=base_dir if kind == "dora" else None) == 0
    from_trt = generate(llm, prompts, LoRARequest(f"trt_fused_{kind}", next(_ids), str(out)))
    assert from_trt == from_shared
    assert_matches_reference(from_shared, base_dir, shared, prompts)
