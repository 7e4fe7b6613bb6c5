"""Tiny LLaMA-family checkpoints for tests and demos, written offline with transformers' own
``save_pretrained`` (nothing is fetched from the Hugging Face hub). Weights are
re-initialised with a wide normal distribution so that greedy decoding rarely meets
near-ties, which keeps token-by-token comparisons meaningful.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from manylora.testing.tokenizer import make_tokenizer

logger = logging.getLogger(__name__)


SUPPORTED_ARCHS = ("llama", "mistral", "qwen2", "qwen3", "olmo2", "granite", "gemma2",
                   "gemma3", "phi3", "mixtral", "qwen2_moe", "qwen3_moe")
#: Families whose norms compute ``(1 + w)``: their norm weights are drawn around 0.
_ZERO_CENTRED_NORMS = ("gemma2", "gemma3")


def _transformers_major() -> int:
    import transformers

    return int(transformers.__version__.split(".")[0])


def _config_class(arch: str) -> Any:
    from transformers import (
        Gemma2Config,
        Gemma3TextConfig,
        GraniteConfig,
        LlamaConfig,
        MistralConfig,
        MixtralConfig,
        Olmo2Config,
        Phi3Config,
        Qwen2Config,
        Qwen2MoeConfig,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    classes = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config,
               "qwen3": Qwen3Config, "olmo2": Olmo2Config, "granite": GraniteConfig,
               "gemma2": Gemma2Config, "gemma3": Gemma3TextConfig,
               "phi3": Phi3Config, "mixtral": MixtralConfig, "qwen2_moe": Qwen2MoeConfig,
               "qwen3_moe": Qwen3MoeConfig}
    if arch not in classes:
        raise ValueError(f"unsupported arch {arch!r}; expected one of {SUPPORTED_ARCHS}")
    return classes[arch]


def _rope_type_of(config: Any) -> str:
    """Return the RoPE type a loaded config declares, on transformers 4.x and 5.x."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not params:
        return "default"
    params = params.get("full_attention", params)      # Gemma 3: per layer type
    return params.get("rope_type", params.get("type", "default"))


def _rope_kwargs(
    rope_scaling: Mapping[str, Any] | None, overrides: dict[str, Any]
) -> dict[str, Any]:
    """Translate a ``rope_scaling`` dict into the config keyword(s) this transformers wants.

    transformers 5 keeps everything (including ``rope_theta``) in ``rope_parameters``;
    transformers 4 has ``rope_theta`` plus an optional ``rope_scaling`` dict.
    """
    rope_theta = float(overrides.pop("rope_theta", 10000.0))
    scaling = dict(rope_scaling) if rope_scaling else None
    if scaling is not None and "rope_type" not in scaling:
        if "type" not in scaling:
            raise ValueError(f"rope_scaling needs a 'rope_type' key, got {scaling!r}")
        scaling["rope_type"] = scaling.pop("type")
    if scaling is not None:
        scaling.pop("rope_theta", None)
    if _transformers_major() >= 5:
        params: dict[str, Any] = {"rope_type": "default", "rope_theta": rope_theta}
        if scaling is not None:
            params.update(scaling)
        return {"rope_parameters": params}
    kwargs: dict[str, Any] = {"rope_theta": rope_theta}
    if scaling is not None:
        kwargs["rope_scaling"] = scaling
    return kwargs


@torch.no_grad()
def _reinit_(model: torch.nn.Module, seed: int, init_std: float,
             norm_centre: float = 1.0) -> None:
    """Re-initialise every parameter: normal(0, init_std); norms: norm_centre + normal(0,
    0.1)."""
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
        if name.endswith("norm.weight"):
            value = norm_centre + 0.1 * noise
        else:
            value = init_std * noise
        param.copy_(value.to(param.dtype))


def _save_torch_bin(model: Any, out: Path, max_shard_size: int | str | None) -> None:
    """Write ``pytorch_model.bin`` (or shards plus an index) like transformers 4.x did."""
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    limit = _parse_size(max_shard_size) if max_shard_size is not None else None
    shards: list[dict[str, torch.Tensor]] = [{}]
    current = 0
    for key, tensor in state.items():
        size = tensor.numel() * tensor.element_size()
        if limit is not None and shards[-1] and current + size > limit:
            shards.append({})
            current = 0
        shards[-1][key] = tensor
        current += size
    if len(shards) == 1:
        torch.save(shards[0], out / "pytorch_model.bin")
        return
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards, start=1):
        fname = f"pytorch_model-{i:05d}-of-{len(shards):05d}.bin"
        torch.save(shard, out / fname)
        weight_map.update({k: fname for k in shard})
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "pytorch_model.bin.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _parse_size(size: int | str) -> int:
    if isinstance(size, int):
        return size
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    text = size.strip().upper()
    for unit in sorted(units, key=len, reverse=True):
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * units[unit])
    return int(text)


def make_checkpoint(
    out_dir: str | Path,
    arch: str = "llama",
    *,
    seed: int = 0,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    max_position_embeddings: int = 256,
    tie_word_embeddings: bool = False,
    rope_scaling: dict[str, Any] | None = None,
    dtype: torch.dtype = torch.float32,
    max_shard_size: int | str | None = None,
    safe_serialization: bool = True,
    init_std: float = 0.1,
    sliding_window: int | None = None,
    **config_overrides: Any,
) -> Path:
    """Write a tiny random LLaMA-family checkpoint (config, weights, tokenizer) to ``out_dir``.

    The directory receives what transformers' ``save_pretrained`` writes (``config.json``,
    ``generation_config.json``, ``model.safetensors`` or shards plus
    ``model.safetensors.index.json``), plus the :func:`make_tokenizer` files. With
    ``safe_serialization=False`` the weights go to ``pytorch_model.bin`` (or
    ``pytorch_model-0000i-of-0000n.bin`` shards plus ``pytorch_model.bin.index.json``) written
    with ``torch.save`` because transformers 5 no longer writes ``.bin`` files.

    The model is built with ``AutoModelForCausalLM.from_config`` under ``torch.manual_seed(seed)``
    and every parameter is then re-drawn from a generator seeded with ``seed``: normal(0,
    ``init_std``), norm weights 1 + normal(0, 0.1); qwen2's q/k/v biases are non-zero too. The
    weights are stored in ``dtype``. ``vocab_size`` is ``len(tokenizer)``; bos/eos/pad ids are
    set in the config and in the generation config (``eos_token_id`` = ``</s>``).

    Args:
        out_dir: target directory (created if missing).
        arch: one of ``SUPPORTED_ARCHS`` (``"qwen3"``: transformers' ``Qwen3Config``, whose
            ``head_dim`` may be given in ``config_overrides``; ``"olmo2"``: ``Olmo2Config``;
            ``"granite"``: ``GraniteConfig`` with Granite 3.x's ``embedding_multiplier`` 12,
            ``residual_multiplier`` 0.22, ``logits_scaling`` 8 and ``attention_multiplier``
            ``1 / head_dim``, unless ``config_overrides`` gives them);
            ``"gemma2"`` / ``"gemma3"``: ``Gemma2Config`` / ``Gemma3TextConfig``, whose norm
            weights, ``(1 + w)``, are drawn as normal(0, 0.1); their ``layer_types``,
            ``query_pre_attn_scalar``, soft caps and (gemma3) ``rope_local_base_freq`` go
            in ``config_overrides``;
            ``"phi3"``: ``Phi3Config``, fused ``qkv_proj`` / ``gate_up_proj`` weights, with
            ``partial_rotary_factor`` and ``original_max_position_embeddings`` (for a
            ``longrope`` ``rope_scaling`` with ``short_factor`` / ``long_factor``) in
            ``config_overrides``);
            ``"mixtral"`` / ``"qwen2_moe"`` / ``"qwen3_moe"``: mixture-of-experts configs
            (``num_local_experts`` or ``num_experts``, ``num_experts_per_tok``,
            ``moe_intermediate_size``, ``shared_expert_intermediate_size``,
            ``norm_topk_prob``, ``mlp_only_layers`` in ``config_overrides``); transformers
            writes their experts one ``Linear`` per expert.
        rope_scaling: e.g. ``{"rope_type": "linear", "factor": 2.0}`` or a llama3 dict
            (``factor``, ``low_freq_factor``, ``high_freq_factor``,
            ``original_max_position_embeddings``); stored as ``rope_parameters`` (with
            ``rope_theta``) on transformers 5 and as ``rope_scaling`` on transformers 4.
            ``rope_theta`` may be given in ``config_overrides`` (default 10000).
        sliding_window: Mistral's and Phi-3's (and qwen2's / qwen3's, with
            ``use_sliding_window=True`` in ``config_overrides``; gemma's sliding layers')
            attention window; ``None`` means full attention (a gemma config must have one).
        max_shard_size: passed to ``save_pretrained`` (e.g. ``"20KB"``) to force sharding.
        config_overrides: any other config attribute.

    Returns:
        ``Path(out_dir)``.

    Raises:
        ValueError: unknown ``arch`` or a ``rope_scaling`` dict without a type.
        RuntimeError: the saved config does not reload with the requested RoPE type.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config_cls = _config_class(arch)
    tokenizer = make_tokenizer(out)

    overrides = dict(config_overrides)
    rope_kwargs = _rope_kwargs(rope_scaling, overrides)
    if arch == "granite":       # Granite 3.x's scalars (attention: 1 / head_dim, not 1 / sqrt)
        overrides = {"embedding_multiplier": 12.0, "residual_multiplier": 0.22,
                     "attention_multiplier": num_attention_heads / hidden_size,
                     "logits_scaling": 8.0, **overrides}
    if arch == "gemma3":
        # RoPE per layer type: the global layers' (rope_theta, scaling), the sliding ones'
        local = float(overrides.pop("rope_local_base_freq", 10000.0))
        rope_kwargs = {"rope_parameters": {
            "full_attention": rope_kwargs["rope_parameters"],
            "sliding_attention": {"rope_type": "default", "rope_theta": local}}}
    if arch in ("mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "mixtral"):
        overrides["sliding_window"] = sliding_window
    elif sliding_window is not None:
        raise ValueError("sliding_window is only supported for mistral, qwen2, qwen3, gemma2, "
                         "gemma3, phi3 and mixtral")
    config = config_cls(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **rope_kwargs,
        **overrides,
    )

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model = model.to(torch.float32)
    _reinit_(model, seed, init_std, 0.0 if arch in _ZERO_CENTRED_NORMS else 1.0)
    if tie_word_embeddings and model.get_output_embeddings() is not None:
        model.tie_weights()
    model = model.to(dtype)
    model.eval()
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )

    save_kwargs: dict[str, Any] = {}
    if max_shard_size is not None:
        save_kwargs["max_shard_size"] = max_shard_size
    if safe_serialization:
        model.save_pretrained(str(out), **save_kwargs)
    else:
        # transformers 5 silently ignores safe_serialization=False (always safetensors).
        model.config.save_pretrained(str(out))
        model.generation_config.save_pretrained(str(out))
        _save_torch_bin(model, out, max_shard_size)
    _fix_saved_dtype(out, dtype)

    reloaded = AutoConfig.from_pretrained(str(out))
    want = rope_scaling.get("rope_type", rope_scaling.get("type")) if rope_scaling else "default"
    got = _rope_type_of(reloaded)
    if got != want:
        raise RuntimeError(f"saved config reloads with rope type {got!r}, expected {want!r}")
    logger.info("wrote %s checkpoint (%s, seed=%d) to %s", arch, dtype, seed, out)
    return out


def _fix_saved_dtype(out: Path, dtype: torch.dtype) -> None:
    """Make ``config.json`` record the stored dtype (key ``dtype`` or ``torch_dtype``)."""
    path = out / "config.json"
    cfg = json.loads(path.read_text())
    name = str(dtype).removeprefix("torch.")
    key = "dtype" if _transformers_major() >= 5 else "torch_dtype"
    if cfg.get(key) != name:
        cfg[key] = name
        path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
