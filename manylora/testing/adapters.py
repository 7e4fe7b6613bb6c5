"""Random, non-trivial LoRA adapters for tests and demos, written with peft's own
``save_pretrained``."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)


def make_peft_adapter(
    base_dir: str | Path,
    out_dir: str | Path,
    *,
    r: int = 8,
    lora_alpha: float = 16,
    target_modules: Sequence[str] | str = ("q_proj", "v_proj"),
    use_rslora: bool = False,
    layers_to_transform: Sequence[int] | int | None = None,
    rank_pattern: Mapping[str, int] | None = None,
    alpha_pattern: Mapping[str, float] | None = None,
    seed: int = 0,
    init_std: float = 0.1,
    safe_serialization: bool = True,
    use_dora: bool = False,
    bias: str = "none",
    base_model: Any = None,
    target_parameters: Sequence[str] | None = None,
    alora_invocation_tokens: Sequence[int] | None = None,
) -> Path:
    """Write a random, non-trivial peft LoRA adapter for the checkpoint in ``base_dir`` (a
    folder, or a GGUF file).

    Loads the base with ``AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)``
    (``manylora.testing.hf.hf_causal_lm``),
    wraps it with ``peft.get_peft_model`` and a ``LoraConfig(task_type="CAUSAL_LM", ...)``, then
    re-draws every ``lora_A``/``lora_B`` weight (``lora_embedding_A``/``B`` for ``embed_tokens``)
    from normal(0, ``init_std``) with a generator
    seeded by ``seed`` (peft initialises B to zero, which would make the adapter a no-op). With
    ``use_dora`` the magnitude vectors are scaled by 1 + normal(0, 0.1) so that they matter.
    peft's own ``save_pretrained`` writes ``adapter_config.json`` (whose
    ``base_model_name_or_path`` is ``base_dir``) and ``adapter_model.safetensors``
    (or ``adapter_model.bin`` with ``safe_serialization=False``); weights are float32.

    Args:
        target_modules: module names (list/tuple) or a regex string matched by peft.
        layers_to_transform / rank_pattern / alpha_pattern / use_rslora / use_dora / bias:
            passed to ``LoraConfig`` unchanged.
        target_parameters: peft's parameter targets (``ParamWrapper``), e.g. a MoE block's
            stacked ``mlp.experts.gate_up_proj``; ``target_modules`` may then be empty.
        base_model: the base already loaded by transformers from ``base_dir`` (a copy is
            wrapped), to skip loading it again.
        alora_invocation_tokens: an activated LoRA's invocation token ids (peft's aLoRA),
            passed to ``LoraConfig``.

    Returns:
        ``Path(out_dir)``.

    Raises:
        ValueError: from peft, e.g. when ``target_modules`` matches nothing.
    """
    from peft import LoraConfig, get_peft_model

    from manylora.testing.hf import hf_causal_lm

    out = Path(out_dir)
    if base_model is not None:              # peft wraps in place: keep the caller's intact
        import copy

        model = copy.deepcopy(base_model).to(torch.float32)
    else:
        model = hf_causal_lm(base_dir, dtype=torch.float32)
    targets: list[str] | str = (
        target_modules if isinstance(target_modules, str) else list(target_modules)
    )
    layers: list[int] | int | None = (
        list(layers_to_transform)
        if layers_to_transform is not None and not isinstance(layers_to_transform, int)
        else layers_to_transform
    )
    lora_config = LoraConfig(
        task_type="CAUSAL_LM",
        r=r,
        lora_alpha=lora_alpha,
        target_modules=targets,
        lora_dropout=0.0,
        use_rslora=use_rslora,
        layers_to_transform=layers,
        rank_pattern=dict(rank_pattern or {}),
        alpha_pattern=dict(alpha_pattern or {}),
        use_dora=use_dora,
        bias=bias,
        target_parameters=None if target_parameters is None else list(target_parameters),
        alora_invocation_tokens=(None if alora_invocation_tokens is None
                                 else list(alora_invocation_tokens)),
    )
    peft_model = get_peft_model(model, lora_config)
    gen = torch.Generator().manual_seed(seed)
    n_lora = 0
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if any(f".lora_{t}." in name for t in ("A", "B", "embedding_A", "embedding_B")):
                noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
                param.copy_((init_std * noise).to(param.dtype))
                n_lora += 1
            elif "lora_magnitude_vector" in name:
                noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
                param.mul_((1.0 + 0.1 * noise).to(param.dtype))
    if n_lora == 0:
        raise ValueError(f"no LoRA weights were created for target_modules={target_modules!r}")
    peft_model.save_pretrained(str(out), safe_serialization=safe_serialization)
    logger.info("wrote LoRA adapter (r=%d, %d tensors) to %s", r, n_lora, out)
    return out
