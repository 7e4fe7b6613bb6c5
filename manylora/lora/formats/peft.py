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
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

import torch

from manylora.config import LORA_TARGET_MODULES, LORA_VOCAB_MODULES, MODEL_LAYER
from manylora.lora.adapter import (
    LoRAAdapter,
    LoRAAdapterError,
    LoRAWeights,
    all_finite,
    check_delta,
)
from manylora.lora.formats.patterns import MatchBudget
from manylora.lora.formats.peft_config import (
    FUSED_PEFT_MODULES,
    PeftScaling,
    check_peft_config,
    component_modules,
    layer_path,
    model_module_names,
    peft_targets,
)
from manylora.lora.formats.peft_weights import open_peft_weights
from manylora.lora.formats.target import AdapterTarget
from manylora.lora.loader_pool import report_progress
from manylora.lora_request import LoRARequest

logger = logging.getLogger(__name__)


_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?P<module>.*?(?:^|\.)layers\.(?P<layer>\d+)\."
    r"(?:self_attn|mlp)\.(?P<name>\w+))\.(?:lora_(?P<ab>[AB])(?:\.[\w-]+)?\.weight"
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
            every module, or with no ``target.dora_norm`` to normalize it.
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
    targets = peft_targets(cfg, name, target.num_layers, budget)
    scaling = PeftScaling(cfg, name, budget)
    scaling.check_keys(sorted(targets) if targets is not None
                       else model_module_names(target.num_layers))
    weights: dict[tuple[int, str], LoRAWeights] = {}
    with open_peft_weights(path, name) as stored:
        # the structure, from the header alone: no tensor data is read before it passes
        keys = group_peft_tensors({k: k for k in stored.meta}, name)
        metas = {m: {label: stored.meta[k] for label, k in ab.items()}
                 for m, ab in keys.items()}
        _check_against_target(name, metas, target)
        _check_targeted(name, metas, targets)
        for (layer, module_key), ab in sorted(metas.items()):
            if layer == MODEL_LAYER:
                _check_vocab_module(name, module_key, ab, use_dora, target)
                ab = {label: t for label, t in ab.items() if label != "W"}
            check_peft_pair(name, module_key, ab, use_dora)
            _check_shapes(name, module_key, ab, target)
        report_progress()
        for (layer, module_key), ab in sorted(keys.items()):
            ab = {label: stored.read(k) for label, k in ab.items()}
            report_progress()
            if "W" in ab:
                _check_base_copy(name, module_key, ab.pop("W"), target)
            check_peft_pair(name, module_key, ab, use_dora)
            for key, w in _module_weights(name, layer, module_key, ab, scaling,
                                          target).items():
                if key in weights:
                    raise LoRAAdapterError(
                        f"adapter {name!r}: layer {layer} has weights for {key[1]} twice (on "
                        "its own and through a fused qkv_proj / gate_up_proj)")
                weights[key] = w
    if not weights:
        raise LoRAAdapterError(f"adapter {name!r} holds no LoRA weights")
    return LoRAAdapter(request.lora_int_id, name, weights)


def group_peft_tensors(tensors: dict[str, torch.Tensor], name: str) -> PeftPairs:
    """Group a PEFT state dict by ``(layer, module path)`` into ``{"A", "B", "M"}`` tensors
    (any values: the keys alone decide).

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
                f"(only {', '.join(LORA_TARGET_MODULES)} of the decoder layers, "
                "embed_tokens and lm_head)")
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
    finite values (tensors on the meta device: all but the values).

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
        if not t.is_meta and not all_finite(t):
            raise LoRAAdapterError(
                f"adapter {name!r}: {module_key} has NaN or Inf in {_tensor_name(label)}")


def _tensor_name(label: str) -> str:
    return "lora_magnitude_vector" if label == "M" else "lora_" + label


def _check_against_target(name: str, pairs: PeftPairs, target: AdapterTarget) -> None:
    for layer, module_key in pairs:
        module = module_key.rsplit(".", 1)[-1]
        for part in component_modules(module):
            if part in LORA_VOCAB_MODULES and part not in target.target_modules:
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


def _check_vocab_module(name: str, module_key: str, ab: dict[str, torch.Tensor],
                        use_dora: bool, target: AdapterTarget) -> None:
    """What ``embed_tokens`` / ``lm_head`` LoRA must be beyond a projection's (meta tensors
    will do): no DoRA, and a vocabulary no larger than the base model's, in the LoRA
    tensors and in the saved base table.

    Raises:
        LoRAAdapterError: naming the module, the tensor and its shape.
    """
    module = module_key.rsplit(".", 1)[-1]
    what = f"adapter {name!r}: {module_key}"
    if use_dora:
        raise LoRAAdapterError(f"{what}: DoRA (use_dora) on {module} is not supported; "
                               "DoRA adapters may target the decoder layers' projections")
    hidden, vocab = target.module_shapes["lm_head"]
    label, dim, field = (("A", 1, "lora_embedding_A") if module == "embed_tokens"
                         else ("B", 0, "lora_B"))
    wide = [(field, ab[label])] if label in ab and ab[label].dim() == 2 else []
    if "W" in ab:
        wide.append(("base_layer.weight", ab["W"]))
        if tuple(ab["W"].shape[1:]) != (hidden,):
            raise LoRAAdapterError(f"{what}: base_layer.weight {tuple(ab['W'].shape)} is not "
                                   f"[vocab, {hidden}]: the adapter was trained for another "
                                   "base model")
    for field, t in wide:
        size = t.shape[0] if field == "base_layer.weight" else t.shape[dim]
        if size > vocab:
            raise LoRAAdapterError(
                f"{what}: {field} {tuple(t.shape)} covers a vocabulary of {size} tokens, "
                f"more than the base model's {vocab} (tokens added to the vocabulary are not "
                "supported)")


def _check_base_copy(name: str, module_key: str, weight: torch.Tensor,
                     target: AdapterTarget) -> None:
    """The base table peft saved with an ``embed_tokens`` / ``lm_head`` adapter
    (``base_layer.weight``; peft loads it over the model's) must be the engine's own.

    Raises:
        LoRAAdapterError: it differs (a fine-tuned table: ``modules_to_save`` in effect),
            or the engine cannot compare it.
    """
    module = module_key.rsplit(".", 1)[-1]
    what = f"adapter {name!r}: {module_key}.base_layer.weight"
    if target.base_weight_equal is None:
        raise LoRAAdapterError(f"{what}: a saved copy of the base {module} cannot be "
                               "compared with the base model here")
    if tuple(weight.shape) != target.module_shapes["lm_head"][::-1]:
        raise LoRAAdapterError(f"{what} is {tuple(weight.shape)}, the base model's "
                               f"{module} {target.module_shapes['lm_head'][::-1]}")
    if not target.base_weight_equal(module, weight):
        raise LoRAAdapterError(
            f"{what} differs from the base model's {module}: the adapter changes the "
            "table itself (a trained or resized embedding), which manylora cannot serve per "
            "adapter")


def _check_targeted(name: str, pairs: PeftPairs, targets: set[str] | None) -> None:
    """Every module with weights is one the config targets (peft would leave the weights of
    any other unused)."""
    if targets is None:
        return
    for _, module_key in sorted(pairs):
        if layer_path(module_key) not in targets:
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
    if "M" in ab and ab["M"].numel() != out_f:
        raise LoRAAdapterError(
            f"adapter {name!r}: {module_key} has lora_magnitude_vector "
            f"{tuple(ab['M'].shape)}, but the base projection has {out_f} outputs")
    return widths, r


def _module_weights(name: str, layer: int, module_key: str, ab: dict[str, torch.Tensor],
                    scaling: PeftScaling, target: AdapterTarget,
                    ) -> dict[tuple[int, str], LoRAWeights]:
    """One PEFT module (or fused module) → ``{(layer, module): LoRAWeights}``."""
    parts = component_modules(module_key.rsplit(".", 1)[-1])
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
