"""The Llama-3-8B shape the benchmarks use, with random bf16 weights (no checkpoint needed)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

#: Llama-3-8B's config.json fields that set the shape (transformers' LlamaConfig names).
LLAMA3_8B = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096,
    intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
    max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=False,
    torch_dtype="bfloat16", bos_token_id=128000, eos_token_id=128001)

#: A tiny model of the same family, for smoke runs on CPU.
TINY = dict(LLAMA3_8B, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
            max_position_embeddings=2048, torch_dtype="float32")


def write_config(directory: Path, config: dict) -> Path:
    """A checkpoint directory holding only ``config.json`` (load it with load_format="dummy")."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def module_dims(config: dict) -> dict[str, tuple[int, int]]:
    """``{module: (in_features, out_features)}`` of the seven LoRA-targetable projections
    (the config's ``head_dim`` when it has one, as Qwen3's and Gemma 2's do, else hidden /
    heads)."""
    h, i = config["hidden_size"], config["intermediate_size"]
    head = config.get("head_dim") or h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head, config["num_key_value_heads"] * head
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def write_peft_adapters(directory: Path, config: dict, count: int, rank: int,
                        targets: tuple[str, ...], device: torch.device,
                        dtype: torch.dtype = torch.bfloat16) -> list[Path]:
    """``count`` distinct random LoRA adapters in PEFT's on-disk format (adapter_config.json
    and adapter_model.safetensors with PEFT's key names), lora_alpha = 2 * rank.

    Weights are drawn on ``device`` (fast) with A ~ N(0, 1/in) and B ~ N(0, 0.01), so each
    adapter changes the output. Returns the adapter directories.
    """
    from safetensors.torch import save_file

    dims = module_dims(config)
    layers = config["num_hidden_layers"]
    gen = torch.Generator(device).manual_seed(1234)
    paths = []
    for n in range(count):
        tensors = {}
        for layer in range(layers):
            for module in targets:
                fan_in, fan_out = dims[module]
                part = "self_attn" if module.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) \
                    else "mlp"
                key = f"base_model.model.model.layers.{layer}.{part}.{module}"
                a = torch.randn(rank, fan_in, generator=gen, device=device) * fan_in ** -0.5
                b = torch.randn(fan_out, rank, generator=gen, device=device) * 0.01
                tensors[f"{key}.lora_A.weight"] = a.to(dtype).cpu()
                tensors[f"{key}.lora_B.weight"] = b.to(dtype).cpu()
        path = directory / f"adapter{n}"
        path.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path / "adapter_model.safetensors"))
        (path / "adapter_config.json").write_text(json.dumps(dict(
            peft_type="LORA", r=rank, lora_alpha=2 * rank, target_modules=list(targets),
            bias="none", base_model_name_or_path=None, task_type="CAUSAL_LM")))
        paths.append(path)
    return paths
