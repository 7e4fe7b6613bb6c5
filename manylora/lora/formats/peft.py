"""Read a PEFT LoRA adapter (``adapter_config.json`` + ``adapter_model.safetensors``/``.bin``)
into a ``LoRAAdapter``.

Follows peft's semantics (the config: ``peft_config``): the LoRA scaling is folded into B
once here (vLLM's ``optimize``); DoRA's magnitude becomes the scale ``m / ||W + BA||``
(peft's ``mag_norm_scale``). Adapters trained on fused projections (``self_attn.qkv_proj``,
``mlp.gate_up_proj``, as Phi-3-style checkpoints have them) are split into their component
modules: each component shares A and takes its rows of B (and of DoRA's magnitude), which
computes the same delta.

``embed_tokens`` and ``lm_head`` LoRA (``lora_embedding_A`` / ``lora_embedding_B``, and
``lm_head.lora_A`` / ``lora_B``) are read under the layer ``MODEL_LAYER``. peft's
``save_pretrained`` also writes the whole base table of each (``base_layer.weight``;
``save_embedding_layers``, on by default when ``target_modules`` names them), which peft
loads over the base model's: it is served only when it equals the engine's base weight
(``AdapterTarget.base_weight_equal``), else refused, as is a table wider than the base
vocabulary (added tokens).

The mixture-of-experts block's modules (``LORA_MOE_MODULES``) are read for a target whose
``module_shapes`` holds them: the router and Qwen2-MoE's shared expert and its gate as any
projection, keyed by their whole path (``mlp.shared_expert.gate_proj`` is not the dense
``mlp.gate_proj``); the experts stacked by ``peft_moe``.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

import torch

from manylora.config import (
    LORA_EXPERT_MODULES,
    LORA_MOE_MODULES,
    LORA_TARGET_MODULES,
    LORA_VOCAB_MODULES,
    MODEL_LAYER,
)
from manylora.lora.adapter import (
    LoRAAdapter,
    LoRAAdapterError,
    LoRAWeights,
    all_finite,
    check_delta,
)
from manylora.lora.formats.moe_paths import STACKED, moe_path
from manylora.lora.formats.patterns import MatchBudget
from manylora.lora.formats.peft_config import (
    FUSED_PEFT_MODULES,
    all_module_names,
    check_peft_config,
    layer_path,
    module_parts,
    peft_targets,
)
from manylora.lora.formats.peft_moe import expert_weights, is_expert_key, plan_experts
from manylora.lora.formats.peft_scaling import PeftScaling
from manylora.lora.formats.peft_vocab import check_base_copy, check_vocab_module
from manylora.lora.formats.peft_weights import check_peft_pair, open_peft_weights
from manylora.lora.formats.target import AdapterTarget
from manylora.lora.loader_pool import report_progress
from manylora.lora_request import LoRARequest

logger = logging.getLogger(__name__)


_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?P<module>.*?(?:^|\.)layers\.(?P<layer>\d+)\."
    r"(?:self_attn|mlp)\.(?P<name>\w+))\.(?:lora_(?P<ab>[AB])(?:\.[\w-]+)?\.weight"
    r"|lora_(?P<mag>magnitude_vector)(?:\.[\w-]+)?(?:\.weight)?)$")


#: A tensor of a mixture-of-experts block's module (``moe_paths.moe_path`` tells which).
_MOE_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?P<module>.*?(?:^|\.)layers\.\d+\.(?:mlp|block_sparse_moe)"
    r"\.[\w.]+?)\.(?:lora_(?P<ab>[AB])(?:\.[\w-]+)?\.weight"
    r"|lora_(?P<mag>magnitude_vector)(?:\.[\w-]+)?(?:\.weight)?)$")


#: A whole embedding or head table with no LoRA on it (peft's ``save_embedding_layers`` or
#: ``modules_to_save`` copy of a trained or resized table).
_VOCAB_TABLE_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?:[\w.]*\.)?(?P<module>embed_tokens|lm_head)\.weight$")

_VOCAB_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?P<module>(?:[\w.]*\.)?(?:embed_tokens|lm_head))\."
    r"(?:lora_(?:embedding_)?(?P<ab>[AB])(?:\.[\w-]+)?(?:\.weight)?"
    r"|(?P<base>base_layer)\.weight"
    r"|lora_(?P<mag>magnitude_vector)(?:\.[\w-]+)?(?:\.weight)?)$")


#: ``{(layer, module path): {"A": lora_A, "B": lora_B, "M": magnitude, "W": the base table
#: peft saved (embed_tokens / lm_head)}}`` of one adapter.
PeftPairs = dict[tuple[int, str], dict[str, torch.Tensor]]


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
        MoE modules: ``experts.gate_proj`` / ``experts.up_proj`` ``a [E, r, H]``, ``b [E, I,
        r]``, ``experts.down_proj`` ``a [E, r, I]``, ``b [E, H, r]``, ``router`` ``b [E,
        r]``, ``shared_expert.*`` and ``shared_expert_gate`` (``b [1, r]``) 2-D.

    The weights file's structure (keys, dtypes, shapes, the A/B pairs, ranks, the modules
    the config targets) is checked from its header before any tensor data is read; then each
    module's tensors are read in turn.

    Raises:
        LoRAAdapterError: missing or corrupt files, a header that does not fit its file
            (``open_peft_weights``); ``modules_to_save``, ``trainable_token_indices`` or bias
            LoRA; DoRA on ``embed_tokens`` / ``lm_head``, a vocabulary larger than the base
            model's there, or a saved base table that is not the model's; a module
            the model lacks or ``lora_target_modules`` excludes; a layer index past the
            model; targets, ``layers_to_transform`` / ``layers_pattern`` or ``rank_pattern``
            / ``alpha_pattern`` keys that match no module of the model (``peft_targets``,
            ``PeftScaling.check_keys``); weights for a module the config does not target;
            ``r`` or a ``rank_pattern`` rank above ``max_lora_rank``; A/B shapes that do
            not fit the base projection (for a fused module: a B whose height is not the
            sum of its components' widths); a module given both fused and on its own; a
            rank of 0 or above ``max_lora_rank``; NaN or Inf in a tensor; a delta whose
            size ``check_delta`` refuses; bad ``rank_pattern`` / ``alpha_pattern`` keys or
            values, or matching them over its time budget (``PatternTable``); a file that
            is not a regular file; a DoRA adapter (``use_dora``) without a magnitude for
            every module, or with no ``target.dora_norm`` to normalize it; a module on a
            layer that lacks it (``AdapterTarget.layer_modules``); on the experts, what
            ``plan_experts`` refuses (DoRA, a missing expert, mixed ranks, ...).
    """
    name, path = request.lora_name, Path(path)
    cfg = check_peft_config(path, name, target)
    base = cfg.get("base_model_name_or_path")
    if base and target.base_model_names and not _same_model(base, target.base_model_names):
        logger.warning("adapter %r was trained for base model %r, not %s", name, base,
                       " / ".join(target.base_model_names))
    use_dora = bool(cfg.get("use_dora"))
    if use_dora and target.dora_norm is None:
        raise LoRAAdapterError(f"adapter {name!r}: DoRA needs the base weights to normalize "
                               "its magnitudes, and none were given")
    budget = MatchBudget()
    targets = peft_targets(cfg, name, target.num_layers, budget, moe=target)
    scaling = PeftScaling(cfg, name, budget)
    scaling.check_keys(sorted(targets) if targets is not None else all_module_names(target))
    weights: dict[tuple[int, str], LoRAWeights] = {}
    with open_peft_weights(path, name) as stored:
        # the structure, from the header alone: no tensor data is read before it passes
        keys = group_peft_tensors({k: k for k in stored.meta}, name, target)
        expert_keys = {m: ab for m, ab in keys.items() if is_expert_key(m[1])}
        keys = {m: ab for m, ab in keys.items() if m not in expert_keys}
        experts = plan_experts(name, {m: {label: stored.meta[k] for label, k in ab.items()}
                                      for m, ab in expert_keys.items()},
                               target, use_dora, targets)
        metas = {m: {label: stored.meta[k] for label, k in ab.items()}
                 for m, ab in keys.items()}
        _check_against_target(name, metas, target)
        _check_targeted(name, metas, targets)
        for (layer, module_key), ab in sorted(metas.items()):
            if layer == MODEL_LAYER:
                check_vocab_module(name, module_key, ab, use_dora, target)
                ab = {label: t for label, t in ab.items() if label != "W"}
            check_peft_pair(name, module_key, ab, use_dora)
            _check_shapes(name, module_key, ab, target)
        report_progress()
        for (layer, module_key), ab in sorted(keys.items()):
            ab = {label: stored.read(k) for label, k in ab.items()}
            report_progress()
            if "W" in ab:
                check_base_copy(name, module_key, ab.pop("W"), target)
            check_peft_pair(name, module_key, ab, use_dora)
            for key, w in _module_weights(name, layer, module_key, ab, scaling,
                                          target).items():
                if key in weights:
                    raise LoRAAdapterError(
                        f"adapter {name!r}: layer {layer} has weights for {key[1]} twice (on "
                        "its own and through a fused qkv_proj / gate_up_proj)")
                weights[key] = w
        for source in experts:
            tensors = {k: {label: stored.read(t) for label, t in expert_keys[(source.layer,
                                                                              k)].items()}
                       for k in source.keys}
            report_progress()
            weights.update(expert_weights(name, source, tensors, scaling, target))
    if not weights:
        raise LoRAAdapterError(f"adapter {name!r} holds no LoRA weights")
    invocation = cfg.get("alora_invocation_tokens")
    if invocation is not None:
        if any(m == "embed_tokens" for _, m in weights):
            raise LoRAAdapterError(
                f"adapter {name!r}: an activated LoRA (alora_invocation_tokens) on "
                "embed_tokens is not supported (peft activates only Linear layers)")
        invocation = tuple(invocation)
    return LoRAAdapter(request.lora_int_id, name, weights, invocation_tokens=invocation)


def group_peft_tensors(tensors: dict[str, torch.Tensor], name: str,
                       target: AdapterTarget | None = None) -> PeftPairs:
    """Group a PEFT state dict by ``(layer, module path)`` into ``{"A", "B", "M"}`` tensors
    (any values: the keys alone decide).

    The mixture-of-experts block's modules (``moe_paths``: per-expert ``Linear`` modules,
    peft's ``ParamWrapper`` on ``mlp.experts``, the router, the shared expert and its gate)
    group so only for a ``target`` whose ``module_shapes`` holds them (as
    ``LORA_MOE_MODULES`` names them); without, they are refused as any other module.

    The module path is the key without peft's ``base_model.model.`` prefix and suffixes,
    e.g. ``model.layers.0.self_attn.q_proj``; ``"M"`` is DoRA's ``lora_magnitude_vector``.

    ``embed_tokens`` / ``lm_head`` tensors group under ``(MODEL_LAYER, module path)``, with
    ``"W"`` the base table peft saved with them.

    Raises:
        LoRAAdapterError: a key that is not a decoder layer's LoRA tensor nor one of
            ``embed_tokens`` / ``lm_head`` (a whole table of theirs without LoRA named as
            such), or one whose projection is neither one of
            ``LORA_TARGET_MODULES`` nor a fused ``qkv_proj`` / ``gate_up_proj``.
    """
    pairs: PeftPairs = {}
    for key, tensor in tensors.items():
        moe = _moe_key(key, target)
        if moe is not None:
            pairs.setdefault((moe[0], moe[1]), {})[moe[2]] = tensor
            continue
        m = _KEY.match(key)
        v = _VOCAB_KEY.match(key) if m is None else None
        if v is not None:
            label = v["ab"] or ("W" if v["base"] else "M")
            pairs.setdefault((MODEL_LAYER, v["module"]), {})[label] = tensor
            continue
        table = _VOCAB_TABLE_KEY.match(key) if m is None else None
        if table is not None:
            raise LoRAAdapterError(
                f"adapter {name!r}: tensor {key!r} is a whole {table['module']} table, not "
                "LoRA weights (peft's save_embedding_layers or modules_to_save: trained or "
                "resized embeddings); manylora serves adapters over the base model's own "
                f"tables: put LoRA on {table['module']} instead")
        if m is None:
            raise LoRAAdapterError(
                f"adapter {name!r}: tensor {key!r} targets a module manylora cannot adapt "
                f"on this model (only {', '.join(LORA_TARGET_MODULES)} of the decoder layers, "
                "embed_tokens, lm_head and, on a mixture-of-experts model, its experts, "
                "router and shared expert)")
        if m["name"] not in LORA_TARGET_MODULES and m["name"] not in FUSED_PEFT_MODULES:
            raise LoRAAdapterError(
                f"adapter {name!r} targets module {m['module']!r}, which the base model does "
                "not have")
        pairs.setdefault((int(m["layer"]), m["module"]), {})[m["ab"] or "M"] = tensor
    return pairs


def _moe_key(key: str, target: AdapterTarget | None) -> tuple[int, str, str] | None:
    """``(layer, module path, label)`` of a MoE module's tensor whose module ``target``
    has (``moe_paths``); None for any other key."""
    if target is None:
        return None
    m = _MOE_KEY.match(key)
    moe = moe_path(m["module"]) if m is not None else None
    if moe is None:
        return None
    modules = LORA_EXPERT_MODULES if moe.module == STACKED else (moe.module,)
    if not any(mod in target.module_shapes for mod in modules):
        return None
    return moe.layer, m["module"], m["ab"] or "M"


def _check_against_target(name: str, pairs: PeftPairs, target: AdapterTarget) -> None:
    for layer, module_key in pairs:
        module = module_key.rsplit(".", 1)[-1]
        for part in module_parts(module_key):
            if (part in LORA_VOCAB_MODULES or part in LORA_MOE_MODULES) \
                    and part not in target.target_modules:
                raise LoRAAdapterError(
                    f"adapter {name!r} targets {part}, which has no adapter slots: start the "
                    f"engine with {part} in --lora-target-modules (lora_target_modules, now "
                    f"{list(target.target_modules)})")
            if part not in target.target_modules:
                raise LoRAAdapterError(
                    f"adapter {name!r} targets {part}"
                    + (f" (through {module})" if part != module else "")
                    + f", but lora_target_modules is {list(target.target_modules)}")
        if layer >= target.num_layers:
            raise LoRAAdapterError(
                f"adapter {name!r} has weights for layer {layer}, but the base model has "
                f"{target.num_layers} layers")
        for part in module_parts(module_key):
            target.check_layer_module(f"adapter {name!r}: {module_key}", layer, part)


def _check_targeted(name: str, pairs: PeftPairs, targets: set[str] | None) -> None:
    """Every module with weights is one the config targets, or whose ``weight`` its
    ``target_parameters`` reach (peft would leave the weights of any other unused)."""
    if targets is None:
        return
    for _, module_key in sorted(pairs):
        path = layer_path(module_key)
        if path not in targets and f"{path}.weight" not in targets:
            raise LoRAAdapterError(
                f"adapter {name!r} has weights for {module_key}, which its config's "
                "target_modules / layers_to_transform do not target (peft would not use them)")


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


def _check_shapes(name: str, module_key: str, ab: dict[str, torch.Tensor],
                  target: AdapterTarget) -> tuple[list[int], int]:
    """A and B (and DoRA's magnitude) of one module against its base projection and
    ``max_lora_rank`` (meta tensors will do); the component widths and the rank."""
    parts = module_parts(module_key)
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
    if "M" in ab and ab["M"].numel() != out_f:
        raise LoRAAdapterError(
            f"adapter {name!r}: {module_key} has lora_magnitude_vector "
            f"{tuple(ab['M'].shape)}, but the base projection has {out_f} outputs")
    return widths, r


def _module_weights(name: str, layer: int, module_key: str, ab: dict[str, torch.Tensor],
                    scaling: PeftScaling, target: AdapterTarget,
                    ) -> dict[tuple[int, str], LoRAWeights]:
    """One PEFT module (or fused module) → ``{(layer, module): LoRAWeights}``."""
    parts = module_parts(module_key)
    widths, r = _check_shapes(name, module_key, ab, target)
    a, b = ab["A"], ab["B"]
    a = a.to(target.dtype).contiguous()
    b = (b.float() * scaling(module_key, r)).to(target.dtype)
    check_delta(f"adapter {name!r}: {module_key}", a, b)
    magnitudes: tuple[torch.Tensor | None, ...] = (None,) * len(parts)
    if "M" in ab:
        magnitude = ab["M"].reshape(-1).float()
        magnitudes = magnitude.split(widths)
    out = {}
    for part, b_part, m_part in zip(parts, b.split(widths), magnitudes):
        b_part = b_part.contiguous()
        dora_scale = None if m_part is None else dora_scale_from_magnitude(
            m_part, target.dora_norm(layer, part, a, b_part),
            f"adapter {name!r}: {module_key}" + (f" ({part})" if len(parts) > 1 else ""))
        out[(layer, part)] = LoRAWeights(a, b_part, dora_scale)
    return out


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
