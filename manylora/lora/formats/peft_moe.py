"""A PEFT adapter's LoRA on the experts of a mixture-of-experts block, stacked into
``experts.gate_proj`` / ``experts.up_proj`` (``a [E, r, H]``, ``b [E, I, r]``) and
``experts.down_proj`` (``a [E, r, I]``, ``b [E, H, r]``), the scaling folded into B.

Two sources, as peft writes them:

* one ``Linear`` per expert (transformers 4's experts, ``target_modules``):
  ``...experts.{e}.{gate_proj|up_proj|down_proj}.lora_A.weight [r, in]`` /
  ``lora_B.weight [out, r]`` (Mixtral: ``block_sparse_moe.experts.{e}.{w1|w3|w2}``). Every
  expert of a targeted module must be there, all of one rank; each expert's scaling is
  peft's for its own module path.
* peft's ``ParamWrapper`` on the stacked parameters (transformers 5's
  ``experts.gate_up_proj [E, 2I, H]`` / ``experts.down_proj [E, H, I]``,
  ``target_parameters``), nested when both are targeted (``mlp.experts`` and
  ``mlp.experts.base_layer``, which is which told here by their shapes): ``lora_A [r*E,
  in]`` is ``[E, r, in]``; ``lora_B [out, r*E]`` is ``[out, r, E]``, the expert the fast
  axis of its columns (peft's ``ParamWrapper.get_delta_weight``: ``delta[e] = B[:, :, e] @
  A[e] * scaling``, whatever the parameter's layout, since peft swaps in and out for
  ``[E, out, in]`` parameters). ``gate_up_proj`` is split as a fused ``gate_up_proj`` is:
  gate takes rows ``[:I]`` of each expert's B, up rows ``[I:]``, both the same A. Its
  scaling is peft's for the parameter's name (``model.layers.{l}.mlp.experts.gate_up_proj``).

DoRA is refused on the experts (peft refuses it for ``target_parameters``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from manylora.lora.adapter import LoRAAdapterError, LoRAWeights, check_delta
from manylora.lora.formats.moe_paths import STACKED, STACKED_EXPERT_PARAMETERS, moe_path
from manylora.lora.formats.peft_config import layer_path
from manylora.lora.formats.peft_scaling import PeftScaling
from manylora.lora.formats.peft_weights import check_peft_pair
from manylora.lora.formats.target import AdapterTarget


@dataclass(frozen=True)
class ExpertSource:
    """Where one layer's expert module(s) come from in a PEFT state dict.

    Attributes:
        layer: the decoder layer.
        modules: the modules it gives (``experts.gate_proj`` and ``experts.up_proj`` for a
            ``ParamWrapper`` on ``gate_up_proj``; else one).
        keys: the module paths of its tensors: one per expert, in expert order, or the one
            ``ParamWrapper``.
        parameter: the ``ParamWrapper``'s parameter name (``model.layers.{l}.mlp.experts.
            gate_up_proj``, what its scaling is matched by); None for per-expert modules.
        rank: ``r`` of every expert.
    """

    layer: int
    modules: tuple[str, ...]
    keys: tuple[str, ...]
    parameter: str | None
    rank: int


def is_expert_key(module_key: str) -> bool:
    """Whether a PEFT module path is on the experts (per expert or a ``ParamWrapper``)."""
    moe = moe_path(module_key)
    return moe is not None and (moe.module == STACKED or moe.expert is not None)


def plan_experts(name: str, pairs: dict[tuple[int, str], dict[str, torch.Tensor]],
                 target: AdapterTarget, use_dora: bool,
                 targets: set[str] | None) -> list[ExpertSource]:
    """Check the expert modules of a PEFT state dict from their shapes (meta tensors will
    do) and say where each stacked module comes from.

    Args:
        name: the adapter's name, for messages.
        pairs: ``{(layer, module path): {"A", "B"(, "M")}}`` of the expert modules
            (``is_expert_key``), as ``group_peft_tensors`` groups them.
        target: the base model; its ``module_shapes`` holds the ``experts.*`` modules.
        use_dora: the config's ``use_dora``.
        targets: the modules and parameters the config targets (``peft_targets``); None:
            the tensors decide.

    Returns:
        One ``ExpertSource`` per (layer, per-expert module or ``ParamWrapper``), by layer.

    Raises:
        LoRAAdapterError: naming the adapter, layer, module (and expert): DoRA; a module
            outside ``lora_target_modules`` or a layer that lacks it; a layer past the
            model; tensors as ``check_peft_pair`` refuses them; an expert index past ``E``,
            a missing expert, experts of different ranks; A/B shapes that fit no expert
            module (a ``ParamWrapper`` whose rows are not ``r * E``); a rank above
            ``max_lora_rank``; a module or parameter the config does not target; one
            module given twice (two names, or per expert and stacked).
    """
    per_expert: dict[tuple[int, str], dict[int, str]] = {}
    sources: list[ExpertSource] = []
    for (layer, key), ab in sorted(pairs.items()):
        if use_dora:
            raise LoRAAdapterError(
                f"adapter {name!r}: {key}: DoRA (use_dora) on the experts is not supported "
                "(peft refuses it for target_parameters too)")
        check_peft_pair(name, key, ab, False)
        moe = moe_path(key)
        if moe.module == STACKED:
            sources.append(_stacked_source(name, layer, key, ab, target, targets))
            continue
        if targets is not None and layer_path(key) not in targets:
            raise LoRAAdapterError(
                f"adapter {name!r} has weights for {key}, which its config's target_modules / "
                "layers_to_transform do not target (peft would not use them)")
        experts = per_expert.setdefault((layer, moe.module), {})
        if moe.expert in experts:
            raise LoRAAdapterError(f"adapter {name!r}: expert {moe.expert} of {moe.module} in "
                                   f"layer {layer} is given twice ({experts[moe.expert]} and "
                                   f"{key})")
        experts[moe.expert] = key
    for (layer, module), experts in sorted(per_expert.items()):
        sources.append(_per_expert_source(name, layer, module, experts,
                                          {e: pairs[(layer, k)] for e, k in experts.items()},
                                          target))
    given: dict[tuple[int, str], str] = {}
    for source in sources:
        _check_module(name, source.layer, source.modules, source.keys[0], target)
        for module in source.modules:
            if (source.layer, module) in given:
                raise LoRAAdapterError(
                    f"adapter {name!r}: layer {source.layer} has weights for {module} twice "
                    f"({given[(source.layer, module)]} and {source.keys[0]})")
            given[(source.layer, module)] = source.keys[0]
    return sorted(sources, key=lambda s: (s.layer, s.modules))


def _check_module(name: str, layer: int, modules: tuple[str, ...], key: str,
                  target: AdapterTarget) -> None:
    for module in modules:
        if module not in target.target_modules:
            raise LoRAAdapterError(
                f"adapter {name!r} targets {module} ({key}), which has no adapter slots: start "
                f"the engine with {module} in --lora-target-modules (lora_target_modules, now "
                f"{list(target.target_modules)})")
        if layer >= target.num_layers:
            raise LoRAAdapterError(f"adapter {name!r} has weights for layer {layer}, but the "
                                   f"base model has {target.num_layers} layers")
        target.check_layer_module(f"adapter {name!r}: {key}", layer, module)


def _check_rank(name: str, what: str, r: int, target: AdapterTarget) -> None:
    if r > target.max_lora_rank:
        raise LoRAAdapterError(f"adapter {name!r}: rank {r} of {what} exceeds max_lora_rank="
                               f"{target.max_lora_rank}")


def _per_expert_source(name: str, layer: int, module: str, experts: dict[int, str],
                       abs_: dict[int, dict[str, torch.Tensor]],
                       target: AdapterTarget) -> ExpertSource:
    n = target.num_experts
    what = f"adapter {name!r}: layer {layer} {module}"
    beyond = sorted(e for e in experts if e >= n)
    if beyond:
        raise LoRAAdapterError(f"{what}: expert {beyond[0]} ({experts[beyond[0]]}) is past the "
                               f"base model's {n} experts")
    missing = [e for e in range(n) if e not in experts]
    if missing:
        raise LoRAAdapterError(
            f"{what}: expert {missing[0]} has no LoRA weights"
            + (f" (nor experts {missing[1:]})" if len(missing) > 1 else "")
            + f", but experts {sorted(experts)} do: LoRA on the experts needs every expert")
    in_f, out_f = target.module_shapes[module]
    r = abs_[0]["A"].shape[0]
    for e in range(n):
        a, b = abs_[e]["A"], abs_[e]["B"]
        if a.shape[0] != r:
            raise LoRAAdapterError(f"{what}: expert {e} ({experts[e]}) has rank {a.shape[0]}, "
                                   f"expert 0 rank {r}: every expert of a module needs one rank")
        if a.shape[1] != in_f or b.shape[0] != out_f:
            raise LoRAAdapterError(
                f"{what}: expert {e} ({experts[e]}) has lora_A {tuple(a.shape)} and lora_B "
                f"{tuple(b.shape)}, but each expert needs [r, {in_f}] and [{out_f}, r]: the "
                "adapter was trained for another base model")
    _check_rank(name, f"{module} of layer {layer}", r, target)
    return ExpertSource(layer, (module,), tuple(experts[e] for e in range(n)), None, r)


def _stacked_source(name: str, layer: int, key: str, ab: dict[str, torch.Tensor],
                    target: AdapterTarget, targets: set[str] | None) -> ExpertSource:
    """A ``ParamWrapper``: which parameter its shapes fit, and its rank."""
    n = target.num_experts
    a, b = ab["A"], ab["B"]
    fits = []
    for param, modules in STACKED_EXPERT_PARAMETERS.items():
        if not all(m in target.module_shapes for m in modules):
            continue
        in_f = target.module_shapes[modules[0]][0]
        out_f = sum(target.module_shapes[m][1] for m in modules)
        if a.shape[1] == in_f and b.shape[0] == out_f:
            fits.append((param, modules))
    if not fits or n < 1 or a.shape[0] % n:
        raise LoRAAdapterError(
            f"adapter {name!r}: {key} (peft's ParamWrapper on the stacked experts) has lora_A "
            f"{tuple(a.shape)} and lora_B {tuple(b.shape)}, which fit neither "
            "experts.gate_up_proj (lora_A [r*E, H], lora_B [2I, r*E]) nor experts.down_proj "
            f"(lora_A [r*E, I], lora_B [H, r*E]) of the base model's {n} experts")
    param, modules = fits[0]
    parameter = f"model.layers.{layer}.mlp.experts.{param}"
    if targets is not None and parameter not in targets:
        raise LoRAAdapterError(
            f"adapter {name!r} has weights for {parameter} ({key}), which its config's "
            "target_parameters do not target (peft would not use them)")
    r = a.shape[0] // n
    _check_rank(name, f"{key} ({param})", r, target)
    return ExpertSource(layer, modules, (key,), parameter, r)


def expert_weights(name: str, source: ExpertSource,
                   tensors: dict[str, dict[str, torch.Tensor]], scaling: PeftScaling,
                   target: AdapterTarget) -> dict[tuple[int, str], LoRAWeights]:
    """The stacked weights of one ``ExpertSource`` (from ``plan_experts``).

    Args:
        name: the adapter's name, for messages.
        source: where the module(s) come from.
        tensors: ``{module path: {"A", "B"}}`` of ``source.keys``, on the CPU.
        scaling: the adapter's ``PeftScaling``.
        target: the base model.

    Returns:
        ``{(layer, module): LoRAWeights(a [E, r, in], b [E, out, r])}`` in ``target.dtype``,
        the scaling folded into b.

    Raises:
        LoRAAdapterError: NaN or Inf in a tensor, or an expert whose delta ``check_delta``
            refuses (naming the expert).
    """
    for key in source.keys:
        check_peft_pair(name, key, tensors[key], False)
    n, r = target.num_experts, source.rank
    if source.parameter is None:
        key0 = source.keys[0]
        a = torch.stack([tensors[k]["A"] for k in source.keys])
        b = torch.stack([tensors[k]["B"].float() * scaling(k, r) for k in source.keys])
        what = f"adapter {name!r}: {key0.rsplit('.experts.', 1)[0]}.experts ({source.modules[0]})"
    else:
        ab = tensors[source.keys[0]]
        a = ab["A"].reshape(n, r, ab["A"].shape[1])
        b = ab["B"].float().reshape(ab["B"].shape[0], r, n).permute(2, 0, 1)
        b = b * scaling(source.parameter, r)
        what = f"adapter {name!r}: {source.keys[0]} ({source.parameter})"
    a = a.to(target.dtype).contiguous()
    b = b.to(target.dtype)
    check_delta(what, a, b)
    widths = [target.module_shapes[m][1] for m in source.modules]
    return {(source.layer, m): LoRAWeights(a, part.contiguous())
            for m, part in zip(source.modules, b.split(widths, dim=1))}
