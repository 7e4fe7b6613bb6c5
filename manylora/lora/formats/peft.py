"""Read a PEFT LoRA adapter (``adapter_config.json`` + ``adapter_model.safetensors``/``.bin``).

Follows peft's semantics: per module rank from ``rank_pattern`` and alpha from
``alpha_pattern`` (a key matches a module name ``m`` when ``m`` matches ``(.*\\.)?(key)$``,
as peft's ``get_pattern_key``), scaling ``alpha / r`` or, with ``use_rslora``,
``alpha / sqrt(r)``, folded into B once here (vLLM's ``optimize``).

Adapters trained on fused projections (``self_attn.qkv_proj``, ``mlp.gate_up_proj``, as
Phi-3-style checkpoints have them) are split into their component modules: each component
shares A and takes its rows of B (and of DoRA's magnitude), which computes the same delta.
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
from manylora.lora.adapter import LoRAAdapter, LoRAAdapterError, LoRAWeights, all_finite
from manylora.lora.request import LoRARequest

logger = logging.getLogger(__name__)

_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?P<module>.*?(?:^|\.)layers\.(?P<layer>\d+)\."
    r"(?:self_attn|mlp)\.(?P<name>\w+))\.(?:lora_(?P<ab>[AB])(?:\.[\w-]+)?\.weight"
    r"|lora_(?P<mag>magnitude_vector)(?:\.[\w-]+)?(?:\.weight)?)$")
_UNSUPPORTED_CONFIG = {
    "modules_to_save": "modules_to_save (fully trained extra modules) is not supported",
}

#: Fused projections an adapter may be trained on → the modules they stack (rows of B, in
#: order), as HF's ``qkv_proj`` ([q; k; v]) and ``gate_up_proj`` ([gate; up]) stack them.
FUSED_PEFT_MODULES: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}

#: ``{(layer, module path): {"A": lora_A, "B": lora_B, "M": magnitude}}`` of one adapter.
PeftPairs = dict[tuple[int, str], dict[str, torch.Tensor]]


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


def component_modules(module: str) -> tuple[str, ...]:
    """The projections a PEFT module name stands for: itself, or a fused module's parts."""
    return FUSED_PEFT_MODULES.get(module, (module,))


def _pattern_value(patterns: dict, module: str, default: float) -> float:
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def read_peft_config(path: str | os.PathLike, name: str) -> dict:
    """Read and check a PEFT adapter's ``adapter_config.json``.

    Returns:
        The config dict.

    Raises:
        LoRAAdapterError: a missing or unreadable file, a config that is not PEFT LoRA,
            ``modules_to_save``, or a bias other than ``"none"`` (``name`` names the adapter).
    """
    cfg_path = Path(path) / "adapter_config.json"
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
    return cfg


def read_peft_tensors(path: str | os.PathLike, name: str) -> dict[str, torch.Tensor]:
    """Read ``adapter_model.safetensors`` (or ``adapter_model.bin``) of a PEFT adapter.

    Returns:
        ``{key: tensor}`` as stored, on the CPU.

    Raises:
        LoRAAdapterError: neither file exists, or the file is corrupt.
    """
    path = Path(path)
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


def check_peft_config(path: str | os.PathLike, name: str, target: AdapterTarget) -> dict:
    """``read_peft_config`` and the checks a config alone allows (named target modules the
    model has): a few hundred bytes read, no tensor.

    Returns:
        The config dict.

    Raises:
        LoRAAdapterError: as ``read_peft_config``, or a named target module the base model
            lacks.
    """
    cfg = read_peft_config(path, name)
    _check_target_names(cfg, name, target)
    return cfg


def _check_target_names(cfg: dict, name: str, target: AdapterTarget) -> None:
    targets = cfg.get("target_modules")
    if not isinstance(targets, list):
        return  # a regex or "all-linear": the tensors say what it targets
    for t in targets:
        module = t.rsplit(".", 1)[-1]
        if module not in LORA_TARGET_MODULES and module not in FUSED_PEFT_MODULES:
            raise LoRAAdapterError(
                f"adapter {name!r} targets module {t!r}, which the base model does not have "
                f"as a LoRA-targetable projection ({', '.join(LORA_TARGET_MODULES)})")


def group_peft_tensors(tensors: dict[str, torch.Tensor], name: str) -> PeftPairs:
    """Group a PEFT state dict by ``(layer, module path)`` into ``{"A", "B", "M"}`` tensors.

    The module path is the key without peft's ``base_model.model.`` prefix and suffixes,
    e.g. ``model.layers.0.self_attn.q_proj``; ``"M"`` is DoRA's ``lora_magnitude_vector``.

    Raises:
        LoRAAdapterError: a key that is not a decoder layer's LoRA tensor, or one whose
            projection is neither one of ``LORA_TARGET_MODULES`` nor a fused ``qkv_proj`` /
            ``gate_up_proj``.
    """
    pairs: PeftPairs = {}
    for key, tensor in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise LoRAAdapterError(
                f"adapter {name!r}: tensor {key!r} targets a module manylora cannot adapt "
                f"(only {', '.join(LORA_TARGET_MODULES)} of the decoder layers)")
        if m["name"] not in LORA_TARGET_MODULES and m["name"] not in FUSED_PEFT_MODULES:
            raise LoRAAdapterError(
                f"adapter {name!r} targets module {m['module']!r}, which the base model does "
                "not have")
        pairs.setdefault((int(m["layer"]), m["module"]), {})[m["ab"] or "M"] = tensor
    return pairs


def check_peft_pair(name: str, module_key: str, ab: dict[str, torch.Tensor],
                    use_dora: bool) -> None:
    """Check that one module has both A and B, a magnitude exactly when the adapter is DoRA,
    2-D A/B of one rank, and only finite values.

    Raises:
        LoRAAdapterError: naming the adapter, the module and the problem.
    """
    if not {"A", "B"} <= set(ab):
        raise LoRAAdapterError(
            f"adapter {name!r}: {module_key} has lora_{''.join(sorted(ab))} but not both "
            "A and B")
    if use_dora != ("M" in ab):
        raise LoRAAdapterError(
            f"adapter {name!r}: {module_key} " + (
                "has no lora_magnitude_vector, but the adapter is DoRA (use_dora)"
                if use_dora else "has a lora_magnitude_vector, but use_dora is not set"))
    for label, t in ab.items():
        if not all_finite(t):
            raise LoRAAdapterError(
                f"adapter {name!r}: {module_key} has NaN or Inf in "
                f"{'lora_magnitude_vector' if label == 'M' else 'lora_' + label}")


def peft_scaling(cfg: dict, module_key: str, r: int, name: str) -> float:
    """peft's LoRA scaling of one module: ``alpha / r``, or ``alpha / sqrt(r)`` with
    ``use_rslora``; alpha from ``alpha_pattern`` (else ``lora_alpha``). ``r`` is the stored
    rank; one that disagrees with ``rank_pattern`` / ``r`` is logged and used."""
    alpha = _pattern_value(cfg.get("alpha_pattern") or {}, module_key, cfg.get("lora_alpha", 8))
    expected_r = _pattern_value(cfg.get("rank_pattern") or {}, module_key, cfg.get("r", 8))
    if int(expected_r) != r:
        logger.warning("adapter %r: %s has rank %d, its config says %d; using %d",
                       name, module_key, r, expected_r, r)
    return alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r


def _check_against_target(name: str, pairs: PeftPairs, target: AdapterTarget) -> None:
    for layer, module_key in pairs:
        module = module_key.rsplit(".", 1)[-1]
        for part in component_modules(module):
            if part not in target.target_modules:
                raise LoRAAdapterError(
                    f"adapter {name!r} targets {part}"
                    + (f" (through {module})" if part != module else "")
                    + f", but lora_target_modules is {list(target.target_modules)}")
        if layer >= target.num_layers:
            raise LoRAAdapterError(
                f"adapter {name!r} has weights for layer {layer}, but the base model has "
                f"{target.num_layers} layers")


def _split_rows(name: str, module_key: str, b: torch.Tensor, parts: tuple[str, ...],
                target: AdapterTarget) -> tuple[int, list[int]]:
    """Input width and per-component output widths of a (fused) module; checks B's height."""
    in_f = target.module_shapes[parts[0]][0]
    widths = [target.module_shapes[p][1] for p in parts]
    if len(parts) > 1 and b.dim() == 2 and b.shape[0] != sum(widths):
        raise LoRAAdapterError(
            f"adapter {name!r}: {module_key} has lora_B {tuple(b.shape)}, but its rows must "
            f"stack {' + '.join(parts)} = {' + '.join(map(str, widths))} = {sum(widths)} "
            "outputs of the base model")
    return in_f, widths


def _module_weights(name: str, layer: int, module_key: str, ab: dict[str, torch.Tensor],
                    cfg: dict, target: AdapterTarget) -> dict[tuple[int, str], LoRAWeights]:
    """One PEFT module (or fused module) → ``{(layer, module): LoRAWeights}``."""
    parts = component_modules(module_key.rsplit(".", 1)[-1])
    a, b = ab["A"], ab["B"]
    in_f, widths = _split_rows(name, module_key, b, parts, target)
    out_f = sum(widths)
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
    scale = peft_scaling(cfg, module_key, r, name)
    a = a.to(target.dtype).contiguous()
    b = (b.float() * scale).to(target.dtype)
    magnitudes: tuple[torch.Tensor | None, ...] = (None,) * len(parts)
    if "M" in ab:
        magnitude = ab["M"].reshape(-1).float()
        if magnitude.shape != (out_f,):
            raise LoRAAdapterError(
                f"adapter {name!r}: {module_key} has lora_magnitude_vector "
                f"{tuple(ab['M'].shape)}, but the base projection has {out_f} outputs")
        magnitudes = magnitude.split(widths)
    out = {}
    for part, b_part, m_part in zip(parts, b.split(widths), magnitudes):
        b_part = b_part.contiguous()
        dora_scale = None if m_part is None else dora_scale_from_magnitude(
            m_part, target.dora_norm(layer, part, a, b_part),
            f"adapter {name!r}: {module_key}" + (f" ({part})" if len(parts) > 1 else ""))
        out[(layer, part)] = LoRAWeights(a, b_part, dora_scale)
    return out


def load_peft_adapter(request: LoRARequest, path: str | os.PathLike,
                      target: AdapterTarget) -> LoRAAdapter:
    """Load and validate a PEFT adapter into host memory.

    Fused ``qkv_proj`` / ``gate_up_proj`` modules are split into ``q_proj``/``k_proj``/
    ``v_proj`` (``gate_proj``/``up_proj``), which share A and each take their rows of B (and
    of the DoRA magnitude, normalized against that component's base weight).

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
            past the model; A/B shapes that do not fit the base projection (for a fused
            module: a B whose height is not the sum of its components' widths); a module
            given both fused and on its own; a rank above ``max_lora_rank``; NaN or Inf in a
            tensor; a DoRA adapter (``use_dora``) without a magnitude for every module, or
            with no ``target.dora_norm`` to normalize it.
    """
    name, path = request.lora_name, Path(path)
    cfg = check_peft_config(path, name, target)
    base = cfg.get("base_model_name_or_path")
    if base and target.base_model_names and not _same_model(base, target.base_model_names):
        logger.warning("adapter %r was trained for base model %r, not %s", name, base,
                       " / ".join(target.base_model_names))

    pairs = group_peft_tensors(read_peft_tensors(path, name), name)
    _check_against_target(name, pairs, target)
    use_dora = bool(cfg.get("use_dora"))
    if use_dora and target.dora_norm is None:
        raise LoRAAdapterError(f"adapter {name!r}: DoRA needs the base weights to normalize "
                               "its magnitudes, and none were given")
    weights: dict[tuple[int, str], LoRAWeights] = {}
    for (layer, module_key), ab in sorted(pairs.items()):
        check_peft_pair(name, module_key, ab, use_dora)
        for key, w in _module_weights(name, layer, module_key, ab, cfg, target).items():
            if key in weights:
                raise LoRAAdapterError(
                    f"adapter {name!r}: layer {layer} has weights for {key[1]} twice (on its "
                    "own and through a fused qkv_proj / gate_up_proj)")
            weights[key] = w
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
    if not all_finite(scale):
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
