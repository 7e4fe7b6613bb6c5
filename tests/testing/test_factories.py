"""Tests for manylora.testing: offline tokenizer/checkpoint/adapter factories and HF references."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

peft = pytest.importorskip("peft")
pytest.importorskip("tokenizers")

from safetensors.torch import load_file  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from manylora.testing import (  # noqa: E402
    DemoSet,
    ReferenceOutput,
    agreement,
    compare_greedy,
    hf_greedy_reference,
    make_checkpoint,
    make_demo_set,
    make_peft_adapter,
    make_tokenizer,
)
from manylora.testing import tokenizer as tokenizer_mod  # noqa: E402

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces, tabs\tand\nnewlines  ",
    "Unicode: café, naïve, 日本語, русский, emoji 🙂🚀 — done…",
    "SELECT name FROM users WHERE id = 42;",
    "",
]


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> DemoSet:
    return make_demo_set(tmp_path_factory.mktemp("demo"))


@pytest.fixture(scope="module")
def llama_dir(demo: DemoSet) -> Path:
    return demo.base_dir


def _logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


# ---------------------------------------------------------------- tokenizer


def test_tokenizer_round_trip_and_reload(tmp_path: Path) -> None:
    tok = make_tokenizer(tmp_path / "tok")
    assert 300 < len(tok) <= 512
    assert (tok.bos_token_id, tok.eos_token_id, tok.unk_token_id, tok.pad_token_id) == (0, 1, 2, 3)
    reloaded = AutoTokenizer.from_pretrained(tmp_path / "tok")
    assert len(reloaded) == len(tok)
    for text in TEXTS:
        ids = tok(text)["input_ids"]
        assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
        assert reloaded(text)["input_ids"] == ids
        assert tok.decode(ids, skip_special_tokens=True) == text
        assert reloaded.decode(ids, skip_special_tokens=True) == text
    # Real merges happened: common English compresses well below one token per byte.
    text = TEXTS[0]
    assert len(tok(text)["input_ids"]) < 0.6 * len(text.encode())
    # Deterministic: a second training run gives the same vocabulary.
    tokenizer_mod._train_backend_tokenizer_json.cache_clear()
    assert make_tokenizer().get_vocab() == tok.get_vocab()


def test_tokenizer_chat_template(tmp_path: Path) -> None:
    make_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    messages = [{"role": "user", "content": "hi there"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<s><|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1


# ---------------------------------------------------------------- checkpoints


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_checkpoint_reloads_with_expected_config(tmp_path: Path, arch: str) -> None:
    out = make_checkpoint(tmp_path / arch, arch, seed=3)
    assert out == tmp_path / arch and (out / "model.safetensors").exists()
    tok = AutoTokenizer.from_pretrained(out)
    cfg = AutoConfig.from_pretrained(out)
    assert cfg.model_type == arch
    assert cfg.vocab_size == len(tok)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (4, 2)
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (0, 1, 3)
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == tok.eos_token_id
    if arch == "mistral":
        assert cfg.sliding_window is None

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    attn = model.model.layers[0].self_attn
    assert attn.k_proj.weight.shape == (2 * 16, 64)  # GQA: 2 kv heads of head_dim 16
    assert attn.q_proj.weight.shape == (4 * 16, 64)
    if arch == "qwen2":
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
            assert proj.bias is not None and proj.bias.abs().min() > 0
    norm = model.model.layers[0].input_layernorm.weight
    assert not torch.allclose(norm, torch.ones_like(norm))
    assert 0.05 < model.model.embed_tokens.weight.std().item() < 0.15
    logits = _logits(model, tok("The capital of France")["input_ids"])[-1]
    top2 = logits.topk(2).values
    assert (top2[0] - top2[1]).item() > 1e-4  # no exact greedy tie


def test_checkpoint_rope_scaling_survives_reload(tmp_path: Path) -> None:
    llama3 = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    plain = make_checkpoint(tmp_path / "plain")
    scaled = make_checkpoint(tmp_path / "llama3", rope_scaling=llama3)
    linear = make_checkpoint(tmp_path / "linear", rope_scaling={"type": "linear", "factor": 2.0})

    cfg = AutoConfig.from_pretrained(scaled)
    params = getattr(cfg, "rope_parameters", None) or cfg.rope_scaling
    assert params["rope_type"] == "llama3" and params["factor"] == 8.0
    assert params["original_max_position_embeddings"] == 64

    inv = {}
    for name, path in [("plain", plain), ("llama3", scaled), ("linear", linear)]:
        model = AutoModelForCausalLM.from_pretrained(path)
        assert model.model.rotary_emb.rope_type == ("default" if name == "plain" else name)
        inv[name] = model.model.rotary_emb.inv_freq.clone()
    assert torch.allclose(inv["linear"], inv["plain"] / 2.0)
    assert not torch.allclose(inv["llama3"], inv["plain"])
    assert torch.allclose(inv["llama3"][0], inv["plain"][0])  # high frequencies untouched


def test_checkpoint_bin_shards_tied_and_dtype(tmp_path: Path) -> None:
    ids = [0, 5, 6, 7, 8]
    ref = make_checkpoint(tmp_path / "ref")
    sharded = make_checkpoint(tmp_path / "sharded", max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").exists()
    bin_dir = make_checkpoint(tmp_path / "bin", safe_serialization=False, max_shard_size="40KB")
    assert (bin_dir / "pytorch_model.bin.index.json").exists()
    assert not list(bin_dir.glob("*.safetensors"))
    expected = _logits(AutoModelForCausalLM.from_pretrained(ref), ids)
    for path in (sharded, bin_dir):
        got = _logits(AutoModelForCausalLM.from_pretrained(path), ids)
        assert torch.equal(got, expected)

    tied = make_checkpoint(tmp_path / "tied", tie_word_embeddings=True, safe_serialization=False)
    assert (tied / "pytorch_model.bin").exists()
    model = AutoModelForCausalLM.from_pretrained(tied)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()

    bf16 = make_checkpoint(tmp_path / "bf16", dtype=torch.bfloat16)
    assert json.loads((bf16 / "config.json").read_text()).get("dtype", "bfloat16") == "bfloat16"
    tensors = load_file(bf16 / "model.safetensors")
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}


# ---------------------------------------------------------------- adapters


def test_demo_set_adapter_configs(demo: DemoSet) -> None:
    assert set(demo.adapters) == {"sql", "chat", "code", "math"}
    cfgs = {
        n: json.loads((p / "adapter_config.json").read_text()) for n, p in demo.adapters.items()
    }
    for cfg in cfgs.values():
        assert Path(cfg["base_model_name_or_path"]) == demo.base_dir
        assert cfg["peft_type"] == "LORA"
    assert cfgs["sql"]["r"] == 8 and set(cfgs["sql"]["target_modules"]) == {"q_proj", "v_proj"}
    assert cfgs["chat"]["r"] == 16 and cfgs["chat"]["use_rslora"] is True
    assert len(cfgs["chat"]["target_modules"]) == 7
    assert cfgs["code"]["layers_to_transform"] == [1]
    assert cfgs["math"]["rank_pattern"] == {"o_proj": 8}
    assert cfgs["math"]["alpha_pattern"] == {"q_proj": 64}

    code = load_file(demo.adapters["code"] / "adapter_model.safetensors")
    assert code and all(".layers.1." in k for k in code)
    math_w = load_file(demo.adapters["math"] / "adapter_model.safetensors")
    o_a = next(v for k, v in math_w.items() if "o_proj.lora_A" in k)
    assert o_a.shape == (8, 64)
    for weights in (code, math_w):
        assert all(v.abs().max() > 0 for k, v in weights.items() if "lora_B" in k)

    # Reuse: the DONE marker short-circuits a second build.
    marker_mtime = (demo.base_dir.parent / "DONE").stat().st_mtime_ns
    again = make_demo_set(demo.base_dir.parent)
    assert again == demo
    assert (demo.base_dir.parent / "DONE").stat().st_mtime_ns == marker_mtime


def test_adapter_changes_logits(demo: DemoSet) -> None:
    from peft import PeftModel

    ids = [0, 10, 20, 30, 40]
    base = AutoModelForCausalLM.from_pretrained(demo.base_dir)
    base_logits = _logits(base, ids)
    model = PeftModel.from_pretrained(base, demo.adapters["sql"])
    lora_logits = _logits(model, ids)
    assert (lora_logits - base_logits).abs().max() > 1e-2


def _merged_logits(base_dir: Path, adapter_dir: Path, ids: list[int]) -> torch.Tensor:
    """Merge an adapter by hand with the documented LoRA scaling and return logits."""
    cfg = json.loads((adapter_dir / "adapter_config.json").read_text())
    weights = load_file(adapter_dir / "adapter_model.safetensors")
    model = AutoModelForCausalLM.from_pretrained(base_dir)
    modules = dict(model.named_modules())
    prefix = "base_model.model."
    for key, a in weights.items():
        if ".lora_A." not in key:
            continue
        b = weights[key.replace(".lora_A.", ".lora_B.")]
        name = key[len(prefix) :].split(".lora_A.")[0]
        short = name.rsplit(".", 1)[-1]
        r = cfg["rank_pattern"].get(short, cfg["r"])
        alpha = cfg["alpha_pattern"].get(short, cfg["lora_alpha"])
        assert a.shape[0] == r
        scale = alpha / math.sqrt(r) if cfg["use_rslora"] else alpha / r
        with torch.no_grad():
            modules[name].weight += scale * (b @ a)
    return _logits(model, ids)


def test_reference_matches_hand_merged_adapters(demo: DemoSet) -> None:
    ids = [0, 11, 22, 33, 44, 55]
    names = ["sql", "chat", "code", "math", None]
    refs = hf_greedy_reference(demo.base_dir, demo.adapters, [ids] * 5, names, max_new_tokens=1)
    plain = _logits(AutoModelForCausalLM.from_pretrained(demo.base_dir), ids)[-1]
    for name, ref in zip(names, refs, strict=True):
        want = (
            plain if name is None else _merged_logits(demo.base_dir, demo.adapters[name], ids)[-1]
        )
        torch.testing.assert_close(ref.logits[0], want, atol=1e-4, rtol=1e-4)
        if name is not None:
            assert (ref.logits[0] - plain).abs().max() > 1e-2, name


def test_make_peft_adapter_variants(tmp_path: Path, llama_dir: Path) -> None:
    pattern = r".*\.0\.self_attn\.(q|k)_proj"
    regex = make_peft_adapter(llama_dir, tmp_path / "regex", target_modules=pattern, r=2)
    keys = load_file(regex / "adapter_model.safetensors").keys()
    assert {k.split(".")[-3] for k in keys} == {"q_proj", "k_proj"}
    assert all(".layers.0." in k for k in keys)

    as_bin = make_peft_adapter(llama_dir, tmp_path / "bin", safe_serialization=False, seed=5)
    assert (as_bin / "adapter_model.bin").exists()

    dora = make_peft_adapter(llama_dir, tmp_path / "dora", use_dora=True)
    assert any("lora_magnitude_vector" in k for k in load_file(dora / "adapter_model.safetensors"))
    assert json.loads((dora / "adapter_config.json").read_text())["use_dora"] is True

    # Same seed, same adapter; different seed, different adapter.
    again = make_peft_adapter(llama_dir, tmp_path / "again", target_modules=pattern, r=2)
    other = make_peft_adapter(llama_dir, tmp_path / "other", target_modules=pattern, r=2, seed=9)
    a, b, c = (load_file(d / "adapter_model.safetensors") for d in (regex, again, other))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not any(torch.equal(a[k], c[k]) for k in a)


# ---------------------------------------------------------------- reference + comparison


def test_hf_greedy_reference_lengths_and_eos(demo: DemoSet, tmp_path: Path) -> None:
    tok = AutoTokenizer.from_pretrained(demo.base_dir)
    prompts = [tok("The capital of France")["input_ids"], tok("SELECT name")["input_ids"]]
    refs = hf_greedy_reference(demo.base_dir, demo.adapters, prompts, ["math", None], 6)
    for ref in refs:
        assert isinstance(ref, ReferenceOutput)
        assert len(ref.token_ids) == len(ref.logits)
        assert len(ref.token_ids) == 6 or ref.token_ids[-1] == tok.eos_token_id
        for token, logits in zip(ref.token_ids, ref.logits, strict=True):
            assert logits.shape == (len(tok),) and logits.dtype == torch.float32
            assert logits.device.type == "cpu"
            assert int(logits.argmax()) == token
        assert compare_greedy(ref.token_ids, ref) == (True, len(ref.token_ids))

    # Base-only (no adapters at all) matches the disable_adapter() path.
    (base_ref,) = hf_greedy_reference(demo.base_dir, {}, prompts[1:], [None], 6)
    assert base_ref.token_ids == refs[1].token_ids

    # Stops on EOS: declare the 3rd generated token to be EOS in a copy of the checkpoint.
    stop_tok = refs[0].token_ids[2]
    stop_at = refs[0].token_ids.index(stop_tok)
    eos_dir = tmp_path / "eos"
    shutil.copytree(demo.base_dir, eos_dir)
    gen_path = eos_dir / "generation_config.json"
    gen = json.loads(gen_path.read_text())
    gen["eos_token_id"] = stop_tok
    gen_path.write_text(json.dumps(gen))
    (stopped,) = hf_greedy_reference(eos_dir, demo.adapters, prompts[:1], ["math"], 6)
    assert stopped.token_ids == refs[0].token_ids[: stop_at + 1]

    with pytest.raises(ValueError):
        hf_greedy_reference(demo.base_dir, demo.adapters, prompts, ["nope", None], 2)


def _ref(tokens: list[int], rows: list[list[float]]) -> ReferenceOutput:
    return ReferenceOutput(tokens, [torch.tensor(r, dtype=torch.float32) for r in rows])


def test_compare_greedy_cases() -> None:
    ref = _ref([2, 0, 1], [[0.0, 1.0, 3.0], [5.0, 1.0, 5.0], [0.0, 9.0, 1.0]])
    assert compare_greedy([2, 0, 1], ref) == (True, 3)
    # Position 1 is an exact tie between tokens 0 and 2: diverging there is legitimate.
    assert compare_greedy([2, 2, 7, 7], ref) == (True, 1)
    # Near tie within tolerance, and outside of it.
    near = _ref([0, 1], [[1.0, 1.0 - 5e-6], [0.0, 1.0]])
    assert compare_greedy([1, 0], near) == (True, 0)
    assert compare_greedy([1, 0], near, tie_tol=1e-6) == (False, 0)
    # Real mismatches.
    assert compare_greedy([2, 1, 1], ref) == (False, 1)
    assert compare_greedy([2, 0, 0], ref) == (False, 2)
    # Length mismatch without a tie.
    assert compare_greedy([2, 0], ref) == (False, 2)
    assert compare_greedy([2, 0, 1, 1], ref) == (False, 3)
    assert compare_greedy([], _ref([], [])) == (True, 0)


def test_agreement() -> None:
    ref = _ref([2, 0, 1], [[0.0, 1.0, 3.0], [5.0, 1.0, 5.0], [0.0, 9.0, 1.0]])
    other = _ref([1, 1], [[0.0, 2.0], [0.0, 2.0]])
    assert agreement([[2, 0, 1], [1, 1]], [ref, other]) == 1.0
    assert agreement([[2, 2, 5], [1, 1]], [ref, other]) == 1.0  # tie at 1 counts as agreeing
    assert agreement([[2, 0, 0], [0, 1]], [ref, other]) == pytest.approx(2 / 5)
    assert agreement([], []) == 1.0
    with pytest.raises(ValueError):
        agreement([[1]], [])
