"""Read a PEFT LoRA adapter (``adapter_config.json`` + ``adapter_model.safetensors``/``.bin``).

Follows peft's semantics: per module rank from ``rank_pattern`` and alpha from
``alpha_pattern`` (a key matches a module name ``m`` when ``m`` matches ``(.*\\.)?(key)$``,
as peft's ``get_pattern_key``), scaling ``alpha / r`` or, with ``use_rslora``,
``alpha / sqrt(r)``, folded into B once here (vLLM's ``optimize``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from manylora.config import LORA_TARGET_MODULES
from manylora.lora.adapter import LoRAAdapter, LoRAAdapterError, LoRAWeights
from manylora.lora.request import LoRARequest

logger = logging.getLogger(__name__)

_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?P<module>.*?(?:^|\.)layers\.(?P<layer>\d+)\."
    r"(?:self_attn|mlp)\.(?P<name>\w+))\.(?:lora_(?P<ab>[AB])(?:\.[\w-]+)?\.weight"
    r"|lora_(?P<mag>magnitude_vector)(?:\.[\w-]+)?(?:\.weight)?)$")
_UNSUPPORTED_CONFIG = {
    "modules_to_save": "modules_to_save (fully trained extra modules) is not supported",
}


@dataclass(frozen=True)
class AdapterTarget:
    """What an adapter must fit: the base model's projections and the slot limits.

    Attributes:
        module_shapes: ``{module: (in_features, out_features)}`` of the seven projections.
        num_layers: decoder layers in the base model.
        max_lora_rank: the padded rank of the slots.
        target_modules: projections that have slot buffers (``lora_target_modules``).
        dtype: the model dtype adapters are stored in.
        base_model_names: names the base model goes by (path, hub id); an adapter trained
            for another one gets a warning.
        dora_norm: ``(layer, module, a [r, in], b [out, r]) → float32 [out]``, the L2 norm of
            each output row of ``W + b @ a`` over the base weight ``W`` of that module (what
            DoRA's magnitude is normalized against); None: DoRA adapters are refused.
    """

    module_shapes: dict[str, tuple[int, int]]
    num_layers: int
    max_lora_rank: int
    target_modules: tuple[str, ...]
    dtype: torch.dtype
    base_model_names: tuple[str, ...] = ()
    dora_norm: Callable[[int, str, torch.Tensor, torch.Tensor], torch.Tensor] | None = field(
        default=None, compare=False, repr=False)


def _pattern_value(patterns: dict, module: str, default: float) -> float:
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _read_tensors(path: Path, name: str) -> dict[str, torch.Tensor]:
    st, pt = path / "adapter_model.safetensors", path / "adapter_model.bin"
    try:
        if st.is_file():
            from safetensors.torch import load_file
            return load_file(st)
        if pt.is_file():
            return torch.load(pt, map_location="cpu", weights_only=True)
    except Exception as e:  # safetensors and pickle raise many types for a corrupt file
        raise LoRAAdapterError(f"adapter {name!r}: cannot read {st if st.is_file() else pt}: "
                               f"{e}") from e
    raise LoRAAdapterError(
        f"adapter {name!r}: no adapter_model.safetensors or adapter_model.bin in {path}")


def _check_target_names(cfg: dict, name: str, target: AdapterTarget) -> None:
    targets = cfg.get("target_modules")
    if not isinstance(targets, list):
        return  # a regex or "all-linear": the tensors say what it targets
    for t in targets:
        module = t.rsplit(".", 1)[-1]
        if module not in LORA_TARGET_MODULES:
            raise LoRAAdapterError(
                f"adapter {name!r} targets module {t!r}, which the base model does not have "
                f"as a LoRA-targetable projection ({', '.join(LORA_TARGET_MODULES)})")


def load_peft_adapter(request: LoRARequest, path: str | os.PathLike,
                      target: AdapterTarget) -> LoRAAdapter:
    """Load and validate a PEFT adapter into host memory.

    Args:
        request: the adapter's identity.
        path: a local directory holding ``adapter_config.json`` and the weights.
        target: the base model and slot limits the adapter must fit.

    Returns:
        A ``LoRAAdapter`` whose B matrices carry the scaling, in ``target.dtype`` on the CPU;
        for DoRA each module's ``dora_scale = m / ||W + BA||`` (peft's ``mag_norm_scale``).

    Raises:
        LoRAAdapterError: missing or corrupt files; ``modules_to_save``, embedding or bias
            LoRA; a module the model lacks or ``lora_target_modules`` excludes; a layer index
            past the model; A/B shapes that do not fit the base projection; a rank above
            ``max_lora_rank``; NaN or Inf in a tensor; a DoRA adapter (``use_dora``) without a
            magnitude for every module, or with no ``target.dora_norm`` to normalize it.
    """
    name, path = request.lora_name, Path(path)
    cfg_path = path / "adapter_config.json"
    try:
        cfg = json.loads(cfg_path.read_text())
    except FileNotFoundError as e:
        raise LoRAAdapterError(f"adapter {name!r}: {cfg_path} is missing") from e
    except (OSError, json.JSONDecodeError) as e:
        raise LoRAAdapterError(f"adapter {name!r}: cannot read {cfg_path}: {e}") from e
    if not isinstance(cfg, dict) or cfg.get("peft_type", "LORA") != "LORA":
        raise LoRAAdapterError(f"adapter {name!r}: {cfg_path} is not a PEFT LoRA config")
    for key, why in _UNSUPPORTED_CONFIG.items():
        if cfg.get(key):
            raise LoRAAdapterError(f"adapter {name!r}: {why}")
    if cfg.get("bias", "none") != "none":
        raise LoRAAdapterError(f"adapter {name!r}: bias={cfg['bias']!r} is not supported "
                               "(only bias='none')")
    _check_target_names(cfg, name, target)
    base = cfg.get("base_model_name_or_path")
    if base and target.base_model_names and not _same_model(base, target.base_model_names):
        logger.warning("adapter %r was trained for base model %r, not %s", name, base,
                       " / ".join(target.base_model_names))

    tensors = _read_tensors(path, name)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise LoRAAdapterError(
                f"adapter {name!r}: tensor {key!r} targets a module manylora cannot adapt "
                f"(only {', '.join(LORA_TARGET_MODULES)} of the decoder layers)")
        layer, module = int(m["layer"]), m["name"]
        if module not in LORA_TARGET_MODULES:
            raise LoRAAdapterError(
                f"adapter {name!r} targets module {m['module']!r}, which the base model does "
                "not have")
        if module not in target.target_modules:
            raise LoRAAdapterError(
                f"adapter {name!r} targets {module}, but lora_target_modules is "
                f"{list(target.target_modules)}")
        if layer >= target.num_layers:
            raise LoRAAdapterError(
                f"adapter {name!r} has weights for layer {layer}, but the base model has "
                f"{target.num_layers} layers")
        pairs.setdefault((layer, m["module"]), {})[m["ab"] or "M"] = tensor

    alpha0, r0 = cfg.get("lora_alpha", 8), cfg.get("r", 8)
    use_dora = bool(cfg.get("use_dora"))
    if use_dora and target.dora_norm is None:
        raise LoRAAdapterError(f"adapter {name!r}: DoRA needs the base weights to normalize "
                               "its magnitudes, and none were given")
    weights: dict[tuple[int, str], LoRAWeights] = {}
    for (layer, module_key), ab in sorted(pairs.items()):
        module = module_key.rsplit(".", 1)[-1]
        if not {"A", "B"} <= set(ab):
            raise LoRAAdapterError(
                f"adapter {name!r}: {module_key} has lora_{''.join(sorted(ab))} but not both "
                "A and B")
        if use_dora != ("M" in ab):
            raise LoRAAdapterError(
                f"adapter {name!r}: {module_key} " + (
                    "has no lora_magnitude_vector, but the adapter is DoRA (use_dora)"
                    if use_dora else "has a lora_magnitude_vector, but use_dora is not set"))
        a, b = ab["A"], ab["B"]
        for label, t in ab.items():
            if t.is_floating_point() and not torch.isfinite(t).all():
                raise LoRAAdapterError(
                    f"adapter {name!r}: {module_key} has NaN or Inf in "
                    f"{'lora_magnitude_vector' if label == 'M' else 'lora_' + label}")
        in_f, out_f = target.module_shapes[module]
        r = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_f or b.shape != (out_f, r):
            raise LoRAAdapterError(
                f"adapter {name!r}: {module_key} has lora_A {tuple(a.shape)} and lora_B "
                f"{tuple(b.shape)}, but the base projection needs [r, {in_f}] and "
                f"[{out_f}, r]: the adapter was trained for another base model")
        if r > target.max_lora_rank:
            raise LoRAAdapterError(
                f"adapter {name!r}: rank {r} of {module_key} exceeds max_lora_rank="
                f"{target.max_lora_rank}")
        alpha = _pattern_value(cfg.get("alpha_pattern") or {}, module_key, alpha0)
        expected_r = _pattern_value(cfg.get("rank_pattern") or {}, module_key, r0)
        if int(expected_r) != r:
            logger.warning("adapter %r: %s has rank %d, its config says %d; using %d",
                           name, module_key, r, expected_r, r)
        scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
        a = a.to(target.dtype).contiguous()
        b = (b.float() * scale).to(target.dtype).contiguous()
        dora_scale = None
        if use_dora:
            magnitude = ab["M"].reshape(-1).float()
            if magnitude.shape != (out_f,):
                raise LoRAAdapterError(
                    f"adapter {name!r}: {module_key} has lora_magnitude_vector "
                    f"{tuple(ab['M'].shape)}, but the base projection has {out_f} outputs")
            dora_scale = dora_scale_from_magnitude(
                magnitude, target.dora_norm(layer, module, a, b), f"adapter {name!r}: "
                f"{module_key}")
        weights[(layer, module)] = LoRAWeights(a, b, dora_scale)
    if not weights:
        raise LoRAAdapterError(f"adapter {name!r}: {path} holds no LoRA weights")
    return LoRAAdapter(request.lora_int_id, name, weights)


def dora_scale_from_magnitude(magnitude: torch.Tensor, norm: torch.Tensor,
                              what: str) -> torch.Tensor:
    """DoRA's per-output scale ``m / ||W + BA||`` (float32 ``[out]``, on the CPU).

    Raises:
        LoRAAdapterError: a zero norm or a non-finite result (``what`` names the module).
    """
    scale = magnitude.float().cpu() / norm.float().cpu()
    if not torch.isfinite(scale).all():
        raise LoRAAdapterError(f"{what}: the DoRA scale m / ||W + BA|| is not finite (a row "
                               "of the adapted weight has norm 0)")
    return scale.contiguous()


def _same_model(base: str, names: tuple[str, ...]) -> bool:
    def norm(s: str) -> str:
        return os.path.normpath(s.rstrip("/")) if s else s

    base_n = norm(base)
    for n in names:
        n_n = norm(n)
        if base_n == n_n or os.path.basename(base_n) == os.path.basename(n_n):
            return True
    return False
