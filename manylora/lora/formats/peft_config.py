"""A PEFT LoRA adapter's ``adapter_config.json``: read, checked, and what it targets.

Follows peft's ``LoraConfig`` and its matching: ``target_modules`` as peft's
``check_target_module_exists`` (a list of names, a regex, ``"all-linear"``, narrowed by
``layers_to_transform`` / ``layers_pattern``), per module rank from ``rank_pattern`` and
alpha from ``alpha_pattern`` (a key matches a module name ``m`` when ``m`` matches
``(.*\\.)?(key)$``, as peft's ``get_pattern_key``), and the scaling ``alpha / r`` or, with
``use_rslora``, ``alpha / sqrt(r)``. Fused projections (``qkv_proj``, ``gate_up_proj``, as
Phi-3-style checkpoints have them) stand for their component modules.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from pathlib import Path

from manylora.config import LORA_ALL_MODULES, LORA_VOCAB_MODULES
from manylora.lora.adapter import LoRAAdapterError
from manylora.lora.formats.files import MAX_CONFIG_BYTES, read_regular
from manylora.lora.formats.moe_paths import (
    STACKED,
    moe_module_names,
    moe_parameter_names,
    moe_path,
    moe_target_names,
    parameter_targeted,
)
from manylora.lora.formats.patterns import MatchBudget, compile_bounded
from manylora.lora.formats.peft_scaling import PeftScaling
from manylora.lora.formats.target import AdapterTarget
from manylora.lora_request import invocation_tokens

logger = logging.getLogger(__name__)


_UNSUPPORTED_CONFIG = {
    "modules_to_save": "modules_to_save (fully trained extra modules) is not supported",
    "trainable_token_indices": ("trainable_token_indices (peft's TrainableTokens: trained "
                                "rows of the embedding) is not supported"),
}


#: The longest regex ``target_modules`` accepted (characters; compiling holds the GIL).
MAX_TARGET_REGEX_CHARS = 2048


#: The projections of a decoder layer by block, as HF's LLaMA-family models name them (the
#: fused ones too), for matching a config's ``target_modules`` as peft matches it.
_BLOCK_MODULES = (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj")),
                  ("mlp", ("gate_proj", "up_proj", "down_proj", "gate_up_proj")))


#: Fused projections an adapter may be trained on → the modules they stack (rows of B, in
#: order), as HF's ``qkv_proj`` ([q; k; v]) and ``gate_up_proj`` ([gate; up]) stack them.
FUSED_PEFT_MODULES: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


#: The paths of the vocabulary-wide modules in HF's LLaMA-family models.
_VOCAB_PATHS = ("model.embed_tokens", "lm_head")


#: The module path of a decoder layer's projection (or MoE module), from ``layers.`` on.
_LAYER_PATH = re.compile(r"(?:^|\.)(layers\.\d+\.(?:self_attn|mlp|block_sparse_moe)\.[\w.]+)$")


def component_modules(module: str) -> tuple[str, ...]:
    """The projections a PEFT module name stands for: itself, or a fused module's parts."""
    return FUSED_PEFT_MODULES.get(module, (module,))


def module_parts(module_key: str) -> tuple[str, ...]:
    """The modules a PEFT module path stands for, by its whole path: a MoE module's name
    (``moe_paths``: ``mlp.shared_expert.gate_proj`` → ``shared_expert.gate_proj``,
    ``mlp.gate`` → ``router``, ``experts.{e}.w1`` → ``experts.gate_proj``), else
    ``component_modules`` of its last component."""
    moe = moe_path(module_key)
    if moe is not None and moe.module != STACKED:
        return (moe.module,)
    return component_modules(module_key.rsplit(".", 1)[-1])


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
    params = cfg.get("target_parameters")
    if not (params is None
            or (isinstance(params, list) and all(isinstance(t, str) for t in params))):
        raise LoRAAdapterError(f"{what}: target_parameters = {params!r} is not a list of "
                               "parameter names")
    if cfg.get("alora_invocation_tokens") is not None:
        try:
            invocation_tokens(cfg["alora_invocation_tokens"], what)
        except ValueError as e:
            raise LoRAAdapterError(str(e)) from None
        for key, why in (("use_dora", "DoRA"), ("target_parameters", "target_parameters")):
            if cfg.get(key):
                raise LoRAAdapterError(f"{what}: an activated LoRA (alora_invocation_tokens) "
                                       f"with {why} is not supported (peft has no such "
                                       "variant)")
        if isinstance(targets, list) and any(t.rsplit(".", 1)[-1] == "embed_tokens"
                                             for t in targets):
            raise LoRAAdapterError(f"{what}: an activated LoRA (alora_invocation_tokens) on "
                                   "embed_tokens is not supported (peft activates only "
                                   "Linear layers)")


def read_peft_config(path: str | os.PathLike, name: str) -> dict:
    """Read and check a PEFT adapter's ``adapter_config.json`` (a regular file of at most
    ``MAX_CONFIG_BYTES``; a FIFO or device is refused without blocking).

    Returns:
        The config dict.

    Raises:
        LoRAAdapterError: a missing, unreadable or oversized file, one that is not a regular
            file, a config that is not PEFT LoRA, fields of the wrong type (``r``,
            ``lora_alpha``, ``use_rslora``, ``use_dora``, ``target_modules``),
            ``modules_to_save``, ``trainable_token_indices``, or a bias other than ``"none"``
            (``name`` names the adapter).
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


def check_peft_config(path: str | os.PathLike, name: str, target: AdapterTarget) -> dict:
    """``read_peft_config`` and the checks a config alone allows cheaply (named target
    modules the model has, ``layers_to_transform`` / ``layers_pattern`` as ``peft_targets``
    without matching a regex ``target_modules``, ``rank_pattern`` / ``alpha_pattern`` keys
    that compile, ranks within ``max_lora_rank``): at most ``MAX_CONFIG_BYTES`` read, no
    tensor.

    Returns:
        The config dict.

    Raises:
        LoRAAdapterError: as ``read_peft_config``, a named target module the base model
            lacks, as ``peft_targets``, as ``PatternTable`` (a pattern key that does not
            compile, a value of the wrong type), or ``r`` / a ``rank_pattern`` rank above
            ``max_lora_rank``.
    """
    cfg = read_peft_config(path, name)
    _check_target_names(cfg, name, target)
    budget = MatchBudget()
    peft_targets(cfg, name, target.num_layers, budget, match_regex=False, moe=target)
    PeftScaling(cfg, name, budget).check_ranks(target.max_lora_rank)
    return cfg


def _check_target_names(cfg: dict, name: str, target: AdapterTarget) -> None:
    targets = cfg.get("target_modules")
    if not isinstance(targets, list):
        return  # a regex or "all-linear": the tensors say what it targets
    allowed = {*LORA_ALL_MODULES, *FUSED_PEFT_MODULES, *moe_target_names(target)}
    for t in targets:
        module = t.rsplit(".", 1)[-1]
        if module not in allowed:
            raise LoRAAdapterError(
                f"adapter {name!r} targets module {t!r}, which the base model does not have "
                f"as a LoRA-targetable module ({', '.join(LORA_ALL_MODULES)})")


def model_module_names(num_layers: int, vocab: bool = True) -> list[str]:
    """The names peft matches ``target_modules`` against for the base model's adaptable
    modules: ``model.layers.{i}.{self_attn|mlp}.{projection}`` (HF's LLaMA-family names,
    fused ``qkv_proj`` / ``gate_up_proj`` included), then, with ``vocab``,
    ``model.embed_tokens`` and ``lm_head``."""
    names = [f"model.layers.{i}.{block}.{m}" for i in range(num_layers)
             for block, modules in _BLOCK_MODULES for m in modules]
    return names + list(_VOCAB_PATHS) if vocab else names


def _layer_filter(cfg: dict, what: str, num_layers: int
                  ) -> tuple[set[int] | None, list[str] | None]:
    """``layers_to_transform`` (None: every layer) and ``layers_pattern`` (None: peft's
    default) of a config, checked as peft's ``LoraConfig`` checks them, every index within
    the base model."""
    layers, pattern = cfg.get("layers_to_transform"), cfg.get("layers_pattern")
    if isinstance(cfg.get("target_modules"), str) and (layers is not None
                                                       or pattern is not None):
        raise LoRAAdapterError(f"{what}: layers_to_transform / layers_pattern cannot be used "
                               "when target_modules is a regex string (as peft's LoraConfig)")
    if pattern and layers is None:
        raise LoRAAdapterError(f"{what}: layers_pattern needs layers_to_transform (as peft's "
                               "LoraConfig)")
    if pattern is not None and not (isinstance(pattern, str) or (
            isinstance(pattern, list) and all(isinstance(p, str) for p in pattern))):
        raise LoRAAdapterError(f"{what}: layers_pattern = {pattern!r} is neither a string nor "
                               "a list of strings")
    if layers is None:
        return None, None
    indexes = [layers] if isinstance(layers, int) else layers
    if not isinstance(indexes, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in indexes):
        raise LoRAAdapterError(f"{what}: layers_to_transform = {layers!r} is neither a layer "
                               "index nor a list of them")
    if not indexes:                          # peft: an empty list filters nothing
        return None, None
    missing = sorted({i for i in indexes if not 0 <= i < num_layers})
    if missing:
        raise LoRAAdapterError(f"{what}: layers_to_transform names layers {missing}, which the "
                               f"base model does not have (it has {num_layers} layers)")
    patterns = None if not pattern else [pattern] if isinstance(pattern, str) else pattern
    return set(indexes), patterns


def _layer_index(module: str, patterns: list[str] | None, compiled: dict,
                 budget: MatchBudget, what: str) -> int | None:
    """The layer index of ``module`` as peft's ``check_target_module_exists`` finds it."""
    if patterns is None:
        m = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", module)
        return None if m is None else int(m["idx"])
    for p in patterns:
        if p not in compiled:
            compiled[p] = compile_bounded(rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.",
                                          f"{what}: layers_pattern {p!r}")
        m = budget.match(compiled[p], module, f"{what}: matching layers_pattern {p!r}")
        if m is not None:
            return int(m["idx"])
    return None


def peft_targets(cfg: dict, name: str, num_layers: int, budget: MatchBudget,
                 match_regex: bool = True, moe: AdapterTarget | None = None,
                 ) -> set[str] | None:
    """The base model's modules (``model_module_names``, and with ``moe`` its MoE modules,
    ``moe_module_names``) and parameters an adapter's config targets, as peft's
    ``check_target_module_exists`` decides: a list of names matches a module named so or
    ending in ``.name``, then ``layers_to_transform`` (with ``layers_pattern``) keeps the
    modules of those layers; a string is a regex the whole name must match
    (``"all-linear"``: every projection, neither ``lm_head`` nor ``embed_tokens``, as peft).
    ``target_parameters`` (peft's ``ParamWrapper``) add the parameters they reach
    (``moe_parameter_names``, e.g. ``model.layers.0.mlp.experts.gate_up_proj``), matched as
    peft's ``_inject_parameters`` matches; ``target_modules`` may then be empty.

    Args:
        cfg: the config (``read_peft_config``).
        name: the adapter's name, for messages.
        num_layers: decoder layers in the base model.
        budget: the adapter's regex matching budget.
        match_regex: False: a regex ``target_modules`` is compiled only (None returned).
        moe: the target, whose MoE modules are matched too; None: none.

    Returns:
        The targeted module (and parameter) names; None when the config names no
        ``target_modules`` nor ``target_parameters`` (the tensors say what it targets) or,
        without ``match_regex``, a regex.

    Raises:
        LoRAAdapterError: what peft's ``inject_adapter`` refuses (no module matches:
            "Target modules ... not found in the base model", naming ``layers_to_transform``
            and ``layers_pattern`` when given; ``target_parameters`` that match no
            parameter) and ``LoraConfig`` refuses (layer options with a regex), an index of
            ``layers_to_transform`` past the model's layers, an invalid regex, or matching
            over the budget.
    """
    what = f"adapter {name!r}"
    targets = cfg.get("target_modules")
    params = cfg.get("target_parameters") or []
    layers, patterns = _layer_filter(cfg, what, num_layers)
    found_params = set()
    if params:
        found_params = {n for n in (moe_parameter_names(moe) if moe is not None else [])
                        if parameter_targeted(n, params)}
        if not found_params:
            raise LoRAAdapterError(f"{what}: target_parameters {params!r} match no parameter "
                                   "of the base model manylora can adapt (as peft refuses)")
        if not targets:
            return found_params
    if targets is None:
        return None
    names = model_module_names(num_layers) + (moe_module_names(moe) if moe is not None
                                              else [])
    if isinstance(targets, str):
        if targets.lower() == "all-linear":
            return {n for n in names if n not in _VOCAB_PATHS} | found_params
        if len(targets) > MAX_TARGET_REGEX_CHARS:
            raise LoRAAdapterError(f"{what}: the target_modules regex is {len(targets)} "
                                   f"characters long, more than {MAX_TARGET_REGEX_CHARS}")
        pattern = compile_bounded(targets, f"{what}: target_modules {targets!r}")
        if not match_regex:
            return None
        found = {n for n in names
                 if budget.match(pattern, n, f"{what}: matching target_modules {targets!r}",
                                 full=True)}
    else:
        wanted, compiled = set(targets), {}
        found = set()
        for n in names:
            parts = n.split(".")
            if not any(".".join(parts[i:]) in wanted for i in range(len(parts))):
                continue
            if layers is not None and _layer_index(n, patterns, compiled, budget,
                                                   what) not in layers:
                continue
            found.add(n)
    if not found:
        message = (f"{what}: target modules {targets!r} not found in the base model (as peft's "
                   "inject_adapter refuses)")
        if layers is not None:
            message += f"; layers_to_transform is {cfg['layers_to_transform']!r}"
        if patterns is not None:
            message += f", layers_pattern {cfg['layers_pattern']!r}"
        raise LoRAAdapterError(message)
    return found | found_params


def all_module_names(target: AdapterTarget) -> list[str]:
    """Every module and parameter name of the base model an adapter may target
    (``model_module_names``, ``moe_module_names``, ``moe_parameter_names``)."""
    return (model_module_names(target.num_layers) + moe_module_names(target)
            + moe_parameter_names(target))


def may_target_vocab(cfg: dict) -> bool:
    """Whether a config's ``target_modules`` may reach ``embed_tokens`` or ``lm_head``: a
    list naming one, a regex matching ``model.embed_tokens`` or ``lm_head`` whole (as
    ``peft_targets`` matches; not ``"all-linear"``), or none (the tensors decide). The
    config's types are already checked (``read_peft_config``).

    Raises:
        LoRAAdapterError: a regex that does not compile, or matching over its budget.
    """
    targets = cfg.get("target_modules")
    if isinstance(targets, list):
        return any(t.rsplit(".", 1)[-1] in LORA_VOCAB_MODULES for t in targets)
    if targets is None:
        return True
    if targets.lower() == "all-linear":
        return False
    what = f"target_modules {targets!r}"
    pattern, budget = compile_bounded(targets, what), MatchBudget()
    return any(budget.match(pattern, n, what, full=True) for n in _VOCAB_PATHS)


def layer_path(module_key: str) -> str:
    """The name peft gives a tensor's module in the base model,
    ``model.layers.{i}.{block}.{projection}`` (``module_key`` from ``layers.`` on)."""
    m = _LAYER_PATH.search(module_key)
    return module_key if m is None else "model." + m[1]
