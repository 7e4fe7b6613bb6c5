"""The mixture-of-experts block's modules as HF checkpoints and peft name them, and the
names manylora gives them (``LORA_MOE_MODULES``).

Paths, from ``layers.{l}.`` on (Mixtral's block is ``block_sparse_moe`` under transformers 4,
``mlp`` under transformers 5; Qwen2-MoE's and Qwen3-MoE's ``mlp``):

* ``{mlp|block_sparse_moe}.experts.{e}.{gate_proj|up_proj|down_proj|w1|w3|w2}``: one
  ``Linear`` per expert (transformers 4; Mixtral's ``w1`` / ``w3`` / ``w2`` are gate, up and
  down) → ``experts.gate_proj`` / ``experts.up_proj`` / ``experts.down_proj``;
* ``mlp.experts`` (``.base_layer`` repeated once per nesting level): peft's ``ParamWrapper``
  on the stacked ``experts.gate_up_proj`` / ``experts.down_proj`` parameters
  (``target_parameters``, transformers 5);
* ``{mlp|block_sparse_moe}.gate`` → ``router``;
* ``mlp.shared_expert.{gate_proj|up_proj|down_proj}`` → ``shared_expert.*`` (Qwen2-MoE; not
  the dense MLP's ``mlp.gate_proj``), ``mlp.shared_expert_gate`` → ``shared_expert_gate``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from manylora.lora.formats.target import AdapterTarget

#: Per-expert projection names (transformers 4: Qwen's, then Mixtral's) → manylora's module.
PER_EXPERT_PROJECTIONS: dict[str, str] = {
    "gate_proj": "experts.gate_proj", "up_proj": "experts.up_proj",
    "down_proj": "experts.down_proj",
    "w1": "experts.gate_proj", "w3": "experts.up_proj", "w2": "experts.down_proj",
}

#: The stacked expert parameters peft's ``target_parameters`` reaches (transformers 5's
#: ``experts.gate_up_proj [E, 2I, H]``, ``experts.down_proj [E, H, I]``) → the modules.
STACKED_EXPERT_PARAMETERS: dict[str, tuple[str, ...]] = {
    "gate_up_proj": ("experts.gate_proj", "experts.up_proj"),
    "down_proj": ("experts.down_proj",),
}

#: The marker ``MoEPath.module`` holds for a ``ParamWrapper`` (its parameter is told by its
#: shapes).
STACKED = "experts"

_MOE_PATH = re.compile(
    r"(?:^|\.)layers\.(?P<layer>\d+)\.(?:"
    r"(?P<block>mlp|block_sparse_moe)\.experts\.(?P<expert>\d+)\."
    r"(?P<proj>gate_proj|up_proj|down_proj|w1|w2|w3)"
    r"|mlp\.experts(?P<wrapped>(?:\.base_layer)*)"
    r"|(?:mlp|block_sparse_moe)\.(?P<router>gate)"
    r"|mlp\.shared_expert\.(?P<shared>gate_proj|up_proj|down_proj)"
    r"|mlp\.(?P<shared_gate>shared_expert_gate))$")


@dataclass(frozen=True)
class MoEPath:
    """One MoE module path, parsed.

    Attributes:
        layer: the decoder layer.
        module: manylora's module name (``LORA_MOE_MODULES``), or ``STACKED`` for a peft
            ``ParamWrapper`` on the stacked experts.
        expert: the expert index of a per-expert ``Linear``; None otherwise.
        depth: a ``ParamWrapper``'s nesting level (the ``.base_layer`` count); 0 otherwise.
    """

    layer: int
    module: str
    expert: int | None = None
    depth: int = 0


def moe_path(module_path: str) -> MoEPath | None:
    """The MoE module ``module_path`` (e.g. ``model.layers.0.block_sparse_moe.experts.3.w1``)
    names; None when it is no MoE module."""
    m = _MOE_PATH.search(module_path)
    if m is None:
        return None
    layer = int(m["layer"])
    if m["proj"]:
        return MoEPath(layer, PER_EXPERT_PROJECTIONS[m["proj"]], int(m["expert"]))
    if m["wrapped"] is not None:
        return MoEPath(layer, STACKED, depth=m["wrapped"].count(".base_layer"))
    if m["router"]:
        return MoEPath(layer, "router")
    if m["shared"]:
        return MoEPath(layer, f"shared_expert.{m['shared']}")
    return MoEPath(layer, "shared_expert_gate")


def moe_target_names(target: AdapterTarget) -> set[str]:
    """The last path components a config's ``target_modules`` may name for the MoE modules
    ``target.module_shapes`` holds (``w1``, ``gate``, ``shared_expert_gate``, ...)."""
    names = {proj for proj, module in PER_EXPERT_PROJECTIONS.items()
             if module in target.module_shapes}
    if "router" in target.module_shapes:
        names.add("gate")
    if "shared_expert_gate" in target.module_shapes:
        names.add("shared_expert_gate")
    return names


def moe_module_names(target: AdapterTarget) -> list[str]:
    """The names peft matches ``target_modules`` against for the MoE modules of the base
    model (those ``target.module_shapes`` holds, on every layer: a layer without one is refused
    by name when an adapter has weights for it):
    ``model.layers.{l}.mlp.experts.{e}.{gate_proj|up_proj|down_proj}`` and Mixtral's
    ``model.layers.{l}.block_sparse_moe.experts.{e}.{w1|w3|w2}``, the router as
    ``mlp.gate`` and ``block_sparse_moe.gate``, ``mlp.shared_expert.*``,
    ``mlp.shared_expert_gate``."""
    names = []
    for layer in range(target.num_layers):
        prefix = f"model.layers.{layer}."
        for proj, module in PER_EXPERT_PROJECTIONS.items():
            if module in target.module_shapes:
                block = "block_sparse_moe" if proj.startswith("w") else "mlp"
                names += [f"{prefix}{block}.experts.{e}.{proj}"
                          for e in range(target.num_experts)]
        if "router" in target.module_shapes:
            names += [f"{prefix}mlp.gate", f"{prefix}block_sparse_moe.gate"]
        for module in ("shared_expert.gate_proj", "shared_expert.up_proj",
                       "shared_expert.down_proj", "shared_expert_gate"):
            if module in target.module_shapes:
                names.append(f"{prefix}mlp.{module}")
    return names


def moe_parameter_names(target: AdapterTarget) -> list[str]:
    """The names peft matches ``target_parameters`` against (``{module}.{parameter}``) for
    the MoE parameters of the base model: ``model.layers.{l}.mlp.experts.gate_up_proj``,
    ``...mlp.experts.down_proj`` and the router's ``...mlp.gate.weight`` (those whose
    modules ``target.module_shapes`` holds, on every layer)."""
    names = []
    for layer in range(target.num_layers):
        prefix = f"model.layers.{layer}.mlp."
        for param, modules in STACKED_EXPERT_PARAMETERS.items():
            if all(m in target.module_shapes for m in modules):
                names.append(f"{prefix}experts.{param}")
        if "router" in target.module_shapes:
            names.append(f"{prefix}gate.weight")
    return names


def parameter_targeted(name: str, target_parameters: list[str]) -> bool:
    """Whether peft's ``target_parameters`` reach parameter ``name`` (equal, or ending in
    ``.`` + an entry, as peft's ``_inject_parameters`` matches)."""
    return any(name == t or name.endswith(f".{t}") for t in target_parameters)
