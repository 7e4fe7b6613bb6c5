"""PEFT LoRA on the mixture-of-experts block (Mixtral, Qwen2-MoE, Qwen3-MoE) read into
stacked ``experts.*`` / ``router`` / ``shared_expert*`` modules, checked against peft's own
``get_delta_weight`` (adapters written by peft's ``save_pretrained`` on transformers 5's
stacked experts) or per-expert ``B_e @ A_e * scaling`` (per-expert ``Linear`` adapters as
transformers 4 held them, written by hand in peft's key format); and what is refused."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoConfig

from manylora.config import LORA_MOE_MODULES, LORA_TARGET_MODULES, ModelConfig
from manylora.lora.adapter import LoRAAdapter, LoRAAdapterError, LoRAWeights, check_delta
from manylora.lora.formats.peft import load_peft_adapter
from manylora.lora.formats.target import AdapterTarget
from manylora.lora_request import LoRARequest
from manylora.testing import MOE_FAMILIES, MOE_TINY, make_checkpoint

TINY, FAMILIES = MOE_TINY, MOE_FAMILIES
STACKED = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_bases")
    return {arch: make_checkpoint(root / arch, arch, seed=3, **TINY, **kw)
            for arch, kw in FAMILIES.items()}


def _dims(base):
    hf = AutoConfig.from_pretrained(base)
    e = getattr(hf, "num_local_experts", None) or hf.num_experts
    i = getattr(hf, "moe_intermediate_size", None) or hf.intermediate_size
    return hf, e, i


def _target(base, target_modules=LORA_TARGET_MODULES + LORA_MOE_MODULES, layer_modules=None,
            dora_norm=None):
    hf, e, _ = _dims(base)
    cfg = ModelConfig.from_hf(hf, torch.float32)
    return AdapterTarget(cfg.module_shapes(), cfg.num_layers, 16, tuple(target_modules),
                         torch.float32,
                         num_experts=e, layer_modules=layer_modules, dora_norm=dora_norm)


def _peft_model(base, seed=0, **lora_kwargs):
    """peft's model over ``base``, every LoRA weight redrawn (B is zero at init)."""
    from peft import LoraConfig, get_peft_model

    from manylora.testing.hf import hf_causal_lm

    model = get_peft_model(hf_causal_lm(base, dtype=torch.float32),
                           LoraConfig(lora_alpha=8, **lora_kwargs))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return model


def _load(path, target):
    return load_peft_adapter(LoRARequest("moe", 1, str(path)), path, target)


def _layer(name):
    return int(name.split(".layers.")[1].split(".")[0])


def _peft_deltas(model):
    """``{(layer, manylora module): delta [out, in] or [E, out, in]}`` from peft's own
    ``get_delta_weight`` of every LoRA layer of the MoE block."""
    from peft.tuners.lora.layer import LoraLayer, ParamWrapper

    out = {}
    for n, mod in model.named_modules():
        if not isinstance(mod, LoraLayer) or ".mlp." not in n:
            continue
        delta = mod.get_delta_weight("default").detach()
        layer = _layer(n)
        if isinstance(mod, ParamWrapper) and mod.parameter_name == "gate_up_proj":
            half = delta.shape[1] // 2
            out[(layer, "experts.gate_proj")] = delta[:, :half]
            out[(layer, "experts.up_proj")] = delta[:, half:]
        elif isinstance(mod, ParamWrapper) and mod.parameter_name == "down_proj":
            out[(layer, "experts.down_proj")] = delta
        else:
            tail = n.split(".mlp.")[1].removesuffix(".base_layer")
            out[(layer, {"gate": "router"}.get(tail, tail))] = delta
    return out


def _assert_matches(adapter: LoRAAdapter, reference):
    assert set(adapter.weights) == set(reference)
    for key, delta in reference.items():
        w = adapter.weights[key]
        torch.testing.assert_close((w.b.double() @ w.a.double()).float(), delta.float(),
                                   rtol=1e-5, atol=1e-6, msg=str(key))


@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_target_parameters_on_the_stacked_experts_match_peft(bases, tmp_path, arch):
    """peft's nested ParamWrapper (``mlp.experts`` on down_proj, ``mlp.experts.base_layer``
    on gate_up_proj), with a rank_pattern and an alpha_pattern on one parameter each."""
    _, e, i = _dims(bases[arch])
    model = _peft_model(bases[arch], r=4, target_modules=[], target_parameters=STACKED,
                        rank_pattern={"experts.down_proj": 2},
                        alpha_pattern={"layers.1.mlp.experts.gate_up_proj": 3})
    model.save_pretrained(tmp_path)
    adapter = _load(tmp_path, _target(bases[arch]))
    _assert_matches(adapter, _peft_deltas(model))
    h = TINY["hidden_size"]
    gate, down = adapter.weights[(0, "experts.gate_proj")], adapter.weights[(0,
                                                                             "experts.down_proj")]
    assert (gate.a.shape, gate.b.shape) == ((e, 4, h), (e, i, 4))
    assert (down.a.shape, down.b.shape) == ((e, 2, i), (e, h, 2))
    assert gate.rank == 4 and down.rank == 2 and gate.num_experts == e
    assert gate.a is adapter.weights[(0, "experts.up_proj")].a


def test_rslora_on_one_stacked_parameter_matches_peft(bases, tmp_path):
    model = _peft_model(bases["qwen3_moe"], r=4, target_parameters=["mlp.experts.down_proj"],
                        target_modules=["q_proj"], use_rslora=True)
    model.save_pretrained(tmp_path)
    adapter = _load(tmp_path, _target(bases["qwen3_moe"]))
    assert {m for _, m in adapter.weights} == {"experts.down_proj", "q_proj"}
    _assert_matches(LoRAAdapter(1, "x", {k: w for k, w in adapter.weights.items()
                                         if k[1] != "q_proj"}), _peft_deltas(model))


def test_router_shared_expert_and_its_gate_match_peft(bases, tmp_path):
    """Qwen2-MoE: the shared expert's projections are ``mlp.shared_expert.*`` (not the
    dense layer's ``mlp.gate_proj``, which ``gate_proj`` reaches on the dense layer 1), the
    router (not a Linear under transformers 5) through ``target_parameters``."""
    model = _peft_model(bases["qwen2_moe"], r=4, target_parameters=["mlp.gate.weight"],
                        target_modules=["gate_proj", "up_proj", "down_proj",
                                        "shared_expert_gate"], rank_pattern={"gate.weight": 2})
    model.save_pretrained(tmp_path)
    adapter = _load(tmp_path, _target(bases["qwen2_moe"]))
    assert set(adapter.weights) == {
        (0, "router"), (0, "shared_expert.gate_proj"), (0, "shared_expert.up_proj"),
        (0, "shared_expert.down_proj"), (0, "shared_expert_gate"),
        (1, "gate_proj"), (1, "up_proj"), (1, "down_proj")}
    _assert_matches(adapter, _peft_deltas(model))
    shapes = {m: (tuple(w.a.shape), tuple(w.b.shape))
              for (layer, m), w in adapter.weights.items() if layer == 0}
    assert shapes == {"router": ((2, 64), (4, 2)), "shared_expert.gate_proj": ((4, 64), (64, 4)),
                      "shared_expert.up_proj": ((4, 64), (64, 4)),
                      "shared_expert.down_proj": ((4, 64), (64, 4)),
                      "shared_expert_gate": ((4, 64), (1, 4))}


def test_mixtral_router_as_a_linear_matches_peft(bases, tmp_path):
    model = _peft_model(bases["mixtral"], r=4, target_modules=["gate"])
    model.save_pretrained(tmp_path)
    adapter = _load(tmp_path, _target(bases["mixtral"]))
    _assert_matches(adapter, _peft_deltas(model))
    assert adapter.weights[(1, "router")].b.shape == (4, 4)


def _per_expert_adapter(path, arch, e, h, i, ranks=None, skip=(), cfg=None, seed=0):
    """A per-expert ``Linear`` adapter in peft's key format (transformers 4's experts), and
    its per-expert reference ``B_e @ A_e * scaling``."""
    gen = torch.Generator().manual_seed(seed)
    block, names = (("block_sparse_moe", {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"})
                    if arch == "mixtral" else
                    ("mlp", {p: p for p in ("gate_proj", "up_proj", "down_proj")}))
    config = dict(peft_type="LORA", r=4, lora_alpha=8, target_modules=sorted(names),
                  alpha_pattern={f"experts.1.{sorted(names)[0]}": 2}, **(cfg or {}))
    tensors, reference = {}, {}
    for layer in range(2):
        for proj, hf in names.items():
            fan_in, fan_out = (i, h) if hf == "down_proj" else (h, i)
            deltas = []
            for x in range(e):
                r = (ranks or {}).get((layer, proj, x), 4)
                a = torch.randn(r, fan_in, generator=gen)
                b = torch.randn(fan_out, r, generator=gen)
                alpha = 2 if (x == 1 and proj == sorted(names)[0]) else 8
                deltas.append(b.double() @ a.double() * (alpha / r))
                if (layer, proj, x) in skip:
                    continue
                key = f"base_model.model.model.layers.{layer}.{block}.experts.{x}.{proj}"
                tensors[f"{key}.lora_A.weight"] = a
                tensors[f"{key}.lora_B.weight"] = b
            reference[(layer, f"experts.{hf}")] = torch.stack(deltas)
    path.mkdir(exist_ok=True)
    save_file(tensors, path / "adapter_model.safetensors", metadata={"format": "pt"})
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path, reference


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_per_expert_linear_adapters_stack_per_expert(bases, tmp_path, arch):
    _, e, i = _dims(bases[arch])
    path, reference = _per_expert_adapter(tmp_path, arch, e, 64, i)
    adapter = _load(path, _target(bases[arch]))
    _assert_matches(adapter, reference)


def test_a_missing_expert_or_mixed_ranks_are_named(bases, tmp_path):
    _, e, i = _dims(bases["mixtral"])
    target = _target(bases["mixtral"])
    path, _ = _per_expert_adapter(tmp_path / "missing", "mixtral", e, 64, i,
                                  skip={(1, "w3", 2)})
    with pytest.raises(LoRAAdapterError, match=r"layer 1 experts\.up_proj: expert 2 has no"):
        _load(path, target)
    path, _ = _per_expert_adapter(tmp_path / "ranks", "mixtral", e, 64, i,
                                  ranks={(0, "w2", 3): 2})
    with pytest.raises(LoRAAdapterError, match=r"layer 0 experts\.down_proj: expert 3 .*"
                       r"experts\.3\.w2\) has rank 2, expert 0 rank 4"):
        _load(path, target)


def test_dora_on_the_experts_is_refused_by_name(bases, tmp_path):
    _, e, i = _dims(bases["qwen3_moe"])
    path, _ = _per_expert_adapter(tmp_path, "qwen3_moe", e, 64, i, cfg={"use_dora": True})
    target = _target(bases["qwen3_moe"], dora_norm=lambda *args: torch.ones(1))
    with pytest.raises(LoRAAdapterError, match=r"experts\.0\.down_proj: DoRA .* experts"):
        _load(path, target)


def test_moe_modules_are_gated_by_the_target(bases, tmp_path):
    """Not in ``module_shapes``: refused as today, naming the module; not in
    ``target_modules``: naming ``--lora-target-modules``; on a layer without it (Qwen2-MoE's
    dense layer): naming the layer and module."""
    model = _peft_model(bases["qwen2_moe"], r=4, target_modules=["shared_expert_gate"],
                        target_parameters=STACKED)
    model.save_pretrained(tmp_path)
    hf, _, _ = _dims(bases["qwen2_moe"])
    cfg = ModelConfig.from_hf(hf, torch.float32)
    no_moe = {m: shape for m, shape in cfg.module_shapes().items()
              if m not in LORA_MOE_MODULES}
    today = AdapterTarget(no_moe, cfg.num_layers, 16, LORA_TARGET_MODULES, torch.float32)
    with pytest.raises(LoRAAdapterError, match=r"target_parameters .* match no parameter"):
        _load(tmp_path, today)
    with pytest.raises(LoRAAdapterError, match=r"experts\.\w+_proj.*--lora-target-modules"):
        _load(tmp_path, _target(bases["qwen2_moe"], target_modules=LORA_TARGET_MODULES
                                + ("shared_expert_gate",)))
    dense = frozenset(LORA_TARGET_MODULES)
    with pytest.raises(LoRAAdapterError, match=r"layer 0 of the base model has no experts\."):
        _load(tmp_path, _target(bases["qwen2_moe"], layer_modules=(dense, dense)))
    sparse = frozenset(LORA_MOE_MODULES) | {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert len(_load(tmp_path, _target(bases["qwen2_moe"],
                                       layer_modules=(sparse, dense))).weights) == 4


def test_a_stacked_wrapper_of_another_shape_is_refused(bases, tmp_path):
    model = _peft_model(bases["qwen3_moe"], r=4, target_parameters=["mlp.experts.down_proj"])
    model.save_pretrained(tmp_path)
    # against Mixtral's experts (I = 96, not 48)
    target = _target(bases["mixtral"])
    with pytest.raises(LoRAAdapterError, match=r"ParamWrapper .* fit neither"):
        _load(tmp_path, target)


def test_stacked_weights_rank_digest_and_check_delta():
    a, b = torch.ones(3, 2, 5), torch.ones(3, 4, 2)
    w = LoRAWeights(a, b)
    assert (w.rank, w.num_experts, w.nbytes) == (2, 3, (30 + 24) * 4)
    assert LoRAAdapter(1, "x", {(0, "experts.gate_proj"): w}).digest != LoRAAdapter(
        1, "x", {(0, "experts.gate_proj"): LoRAWeights(a, b * 2)}).digest
    b[2, 0, 0] = math.inf
    with pytest.raises(LoRAAdapterError, match=r"m \(expert 2\): lora_B overflows"):
        check_delta("m", a, b)
