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
import pickle
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from manylora.config import LORA_TARGET_MODULES
from manylora.lora.adapter import (
    LoRAAdapter,
    LoRAAdapterError,
    LoRAWeights,
    all_finite,
    check_delta,
)
from manylora.lora.formats.files import MAX_CONFIG_BYTES, is_present, open_regular, read_regular
from manylora.lora.formats.patterns import MatchBudget, PatternTable
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


def _check_config_types(cfg: dict, what: str) -> None:
    """The types PEFT's ``LoraConfig`` gives its fields: ``r`` a positive integer,
    ``lora_alpha`` a finite number, ``use_rslora`` / ``use_dora`` booleans,
    ``target_modules`` a list of strings, a string (a regex) or null."""
    r = cfg.get("r", 8)
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise LoRAAdapterError(f"{what}: r = {r!r} is not a positive integer")
    alpha = cfg.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not math.isfinite(alpha):
        raise LoRAAdapterError(f"{what}: lora_alpha = {alpha!r} is not a finite number")
    for key in ("use_rslora", "use_dora"):
        if cfg.get(key) is not None and not isinstance(cfg[key], bool):
            raise LoRAAdapterError(f"{what}: {key} = {cfg[key]!r} is not true or false")
    targets = cfg.get("target_modules")
    if not (targets is None or isinstance(targets, str)
            or (isinstance(targets, list) and all(isinstance(t, str) for t in targets))):
        raise LoRAAdapterError(f"{what}: target_modules = {targets!r} is neither a list of "
                               "module names nor a regex string")


class PeftScaling:
    """peft's LoRA scaling of each module of one adapter: ``alpha / r``, or
    ``alpha / sqrt(r)`` with ``use_rslora``; alpha from ``alpha_pattern`` (else
    ``lora_alpha``), the expected rank from ``rank_pattern`` (else ``r``), matched as peft's
    ``get_pattern_key`` does with bounded work (``PatternTable``).

    Args:
        cfg: the adapter's config (``read_peft_config``: its types already checked).
        name: the adapter's name, for messages.

    Raises:
        LoRAAdapterError: a bad ``rank_pattern`` / ``alpha_pattern`` (see ``PatternTable``).
    """

    def __init__(self, cfg: dict, name: str) -> None:
        what = f"adapter {name!r}"
        budget = MatchBudget()
        self.name = name
        self.alpha = cfg.get("lora_alpha", 8)
        self.r = cfg.get("r", 8)
        self.rslora = bool(cfg.get("use_rslora"))
        self.alphas = PatternTable("alpha_pattern", cfg.get("alpha_pattern"), what, budget)
        self.ranks = PatternTable("rank_pattern", cfg.get("rank_pattern"), what, budget)

    def __call__(self, module_key: str, r: int) -> float:
        """The scaling of module ``module_key`` (e.g. ``model.layers.0.self_attn.q_proj``)
        whose stored rank is ``r`` (≥ 1); a rank that disagrees with the config's is logged
        and used.

        Raises:
            LoRAAdapterError: the pattern matching budget ran out.
        """
        alpha = self.alphas.value(module_key, self.alpha)
        expected_r = self.ranks.value(module_key, self.r)
        if int(expected_r) != r:
            logger.warning("adapter %r: %s has rank %d, its config says %d; using %d",
                           self.name, module_key, r, expected_r, r)
        return alpha / math.sqrt(r) if self.rslora else alpha / r


def read_peft_config(path: str | os.PathLike, name: str) -> dict:
    """Read and check a PEFT adapter's ``adapter_config.json`` (a regular file of at most
    ``MAX_CONFIG_BYTES``; a FIFO or device is refused without blocking).

    Returns:
        The config dict.

    Raises:
        LoRAAdapterError: a missing, unreadable or oversized file, one that is not a regular
            file, a config that is not PEFT LoRA, fields of the wrong type (``r``,
            ``lora_alpha``, ``use_rslora``, ``use_dora``, ``target_modules``),
            ``modules_to_save``, or a bias other than ``"none"`` (``name`` names the adapter).
    """
    what = f"adapter {name!r}"
    try:
        text = read_regular(Path(path) / "adapter_config.json", f"{what}: adapter_config.json",
                            MAX_CONFIG_BYTES)
    except FileNotFoundError as e:
        raise LoRAAdapterError(str(e)) from None
    try:
        cfg = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise LoRAAdapterError(f"{what}: cannot read adapter_config.json: {e}") from None
    if not isinstance(cfg, dict) or cfg.get("peft_type", "LORA") != "LORA":
        raise LoRAAdapterError(f"{what}: adapter_config.json is not a PEFT LoRA config")
    for key, why in _UNSUPPORTED_CONFIG.items():
        if cfg.get(key):
            raise LoRAAdapterError(f"{what}: {why}")
    if cfg.get("bias", "none") != "none":
        raise LoRAAdapterError(f"{what}: bias={cfg['bias']!r} is not supported "
                               "(only bias='none')")
    _check_config_types(cfg, what)
    return cfg


def read_peft_tensors(path: str | os.PathLike, name: str) -> dict[str, torch.Tensor]:
    """Read ``adapter_model.safetensors`` (or ``adapter_model.bin``, with
    ``weights_only``) of a PEFT adapter; only a regular file is opened.

    Returns:
        ``{key: tensor}`` as stored, on the CPU.

    Raises:
        LoRAAdapterError: neither file exists, the file is not a regular file, or it is
            corrupt.
    """
    path, what = Path(path), f"adapter {name!r}"
    for file in ("adapter_model.safetensors", "adapter_model.bin"):
        if not is_present(path / file):
            continue
        with open_regular(path / file, f"{what}: {file}") as f:
            try:
                if file.endswith(".safetensors"):
                    from safetensors.torch import load
                    return load(f.read())
                return torch.load(f, map_location="cpu", weights_only=True)
            except pickle.UnpicklingError:
                raise LoRAAdapterError(f"{what}: cannot read {file}: it holds Python objects "
                                       "other than tensors, which are never unpickled "
                                       "(weights_only)") from None
            except Exception as e:  # safetensors and pickle raise many types for a corrupt file
                raise LoRAAdapterError(f"{what}: cannot read {file}: "
                                       f"{_first_line(e)}") from None
    raise LoRAAdapterError(f"{what}: no adapter_model.safetensors or adapter_model.bin")


def _first_line(e: Exception) -> str:
    """An exception's message without torch's multi-line, ANSI-coloured hints."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(e)).strip()
    return text.splitlines()[0] if text else type(e).__name__


def check_peft_config(path: str | os.PathLike, name: str, target: AdapterTarget) -> dict:
    """``read_peft_config`` and the checks a config alone allows (named target modules the
    model has, ``rank_pattern`` / ``alpha_pattern`` keys that compile): at most
    ``MAX_CONFIG_BYTES`` read, no tensor.

    Returns:
        The config dict.

    Raises:
        LoRAAdapterError: as ``read_peft_config``, a named target module the base model
            lacks, or as ``PatternTable`` (a pattern key that does not compile, a value of
            the wrong type).
    """
    cfg = read_peft_config(path, name)
    _check_target_names(cfg, name, target)
    PeftScaling(cfg, name)               # its patterns checked and compiled
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
    floating-point tensors, 2-D A ``[r, in]`` and B ``[out, r]`` with ``r ≥ 1``, and only
    finite values.

    Raises:
        LoRAAdapterError: naming the adapter, the module and the problem.
    """
    if not {"A", "B"} <= set(ab):
        raise LoRAAdapterError(
            f"adapter {name!r}: {module_key} has lora_{''.join(sorted(ab))} but not both "
            "A and B")
    for label, t in ab.items():
        if not t.is_floating_point():
            raise LoRAAdapterError(
                f"adapter {name!r}: {module_key} has {_tensor_name(label)} of dtype "
                f"{t.dtype}, not a floating-point dtype")
    a, b = ab["A"], ab["B"]
    if a.dim() != 2 or b.dim() != 2:
        raise LoRAAdapterError(
            f"adapter {name!r}: {module_key} has lora_A {tuple(a.shape)} and lora_B "
            f"{tuple(b.shape)}, not 2-D [r, in] and [out, r]")
    if a.shape[0] < 1 or b.shape[1] != a.shape[0]:
        raise LoRAAdapterError(
            f"adapter {name!r}: {module_key} has lora_A {tuple(a.shape)} and lora_B "
            f"{tuple(b.shape)}: their rank must agree and be at least 1")
    if use_dora != ("M" in ab):
        raise LoRAAdapterError(
            f"adapter {name!r}: {module_key} " + (
                "has no lora_magnitude_vector, but the adapter is DoRA (use_dora)"
                if use_dora else "has a lora_magnitude_vector, but use_dora is not set"))
    for label, t in ab.items():
        if not all_finite(t):
            raise LoRAAdapterError(
                f"adapter {name!r}: {module_key} has NaN or Inf in {_tensor_name(label)}")


def _tensor_name(label: str) -> str:
    return "lora_magnitude_vector" if label == "M" else "lora_" + label


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
                    scaling: PeftScaling, target: AdapterTarget,
                    ) -> dict[tuple[int, str], LoRAWeights]:
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
    a = a.to(target.dtype).contiguous()
    b = (b.float() * scaling(module_key, r)).to(target.dtype)
    check_delta(f"adapter {name!r}: {module_key}", a, b)
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
            given both fused and on its own; a rank of 0 or above ``max_lora_rank``; NaN or
            Inf in a tensor; a delta whose size ``check_delta`` refuses; bad
            ``rank_pattern`` / ``alpha_pattern`` keys or values, or matching them over its
            time budget (``PatternTable``); a file that is not a regular file; a DoRA
            adapter (``use_dora``) without a magnitude for every module, or with no
            ``target.dora_norm`` to normalize it.
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
    scaling = PeftScaling(cfg, name)
    weights: dict[tuple[int, str], LoRAWeights] = {}
    for (layer, module_key), ab in sorted(pairs.items()):
        check_peft_pair(name, module_key, ab, use_dora)
        for key, w in _module_weights(name, layer, module_key, ab, scaling, target).items():
            if key in weights:
                raise LoRAAdapterError(
                    f"adapter {name!r}: layer {layer} has weights for {key[1]} twice (on its "
                    "own and through a fused qkv_proj / gate_up_proj)")
            weights[key] = w
    if not weights:
        raise LoRAAdapterError(f"adapter {name!r} holds no LoRA weights")
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
