"""A quantized base model's format (``QuantizationConfig``), read from the checkpoint's
``quantization_config`` (``config.json``) or asked for online (``quantization="fp8"``).

The formats are those the Hugging Face hub holds and vLLM serves:

* ``Fp8Config``: transformers' fine-grained FP8 (``quant_method: "fp8"``, float8_e4m3fn
  ``weight`` with a 128x128-block ``weight_scale_inv``, as Qwen3-FP8 and DeepSeek-V3 publish),
  vLLM's / AutoFP8's serialized FP8 (the same ``quant_method`` without ``weight_block_size``:
  a per-tensor ``weight_scale`` and, with ``activation_scheme: "static"``, ``input_scale``),
  and online FP8 of a 16-bit checkpoint (per-channel weight scales, dynamic per-token
  activation scales: vLLM's ``--quantization fp8``).
* ``GPTQConfig``: AutoGPTQ / GPTQModel INT4 (``qweight`` / ``qzeros`` / ``scales`` /
  ``g_idx``).
* ``AWQConfig``: AutoAWQ's GEMM packing (``qweight`` / ``qzeros`` / ``scales``).
* ``CompressedTensorsConfig``: llm-compressor's ``compressed-tensors`` checkpoints,
  ``float-quantized`` (FP8 W8A8 / W8A16) and ``pack-quantized`` (INT4 W4A16).

Which linear layers a config quantizes: ``QuantizationConfig.scheme_for(name)`` with the
Hugging Face module name (``model.layers.0.self_attn.q_proj``); None keeps the layer in the
model's 16/32-bit dtype. The linear methods that store and multiply each format are
``manylora.ops.quant``'s. Anything a format allows that manylora cannot serve is refused
here, naming it (``QuantizationError``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

#: ``quantization=`` values: the checkpoint's own format (None / ``"auto"``: whatever
#: ``quantization_config`` says), or online FP8 of a 16-bit checkpoint.
QUANTIZATION_METHODS = ("fp8", "gptq", "awq", "compressed-tensors")

#: transformers' class name of a linear layer, as compressed-tensors' ``targets`` name it.
LINEAR_CLASS = "Linear"


class QuantizationError(ValueError):
    """A quantized checkpoint, or an option of its format, that manylora cannot serve."""


@dataclass(frozen=True)
class QuantizationArgs:
    """How one tensor is quantized (compressed-tensors' ``QuantizationArgs``).

    Attributes:
        num_bits: 4 or 8.
        type: ``"int"`` or ``"float"``.
        strategy: ``"tensor"``, ``"channel"`` (one scale per output row), ``"group"``
            (``group_size`` input columns per scale), ``"block"`` (``block_structure``
            ``[rows, cols]``) or ``"token"`` (activations: one scale per row).
        symmetric: no zero point.
        dynamic: scales computed at run time (activations) instead of read.
        group_size: input columns per scale (``"group"``), or None.
        block_structure: ``(rows, cols)`` of a weight block (``"block"``), or None.
        actorder: GPTQ's activation order (``"group"``, ``"weight"``) or None; ``"group"``
            stores a ``g_idx``.
    """

    num_bits: int
    type: str
    strategy: str
    symmetric: bool = True
    dynamic: bool = False
    group_size: int | None = None
    block_structure: tuple[int, int] | None = None
    actorder: str | None = None


@dataclass(frozen=True)
class QuantizationConfig:
    """A base model's quantization format.

    Attributes:
        ignore: module names kept in 16 bits, exact Hugging Face names, their last part
            (``lm_head``) or ``re:`` regular expressions (compressed-tensors' ``ignore``,
            transformers' ``modules_to_not_convert``).
    """

    ignore: tuple[str, ...] = ()

    #: The ``quant_method`` name.
    name = ""

    def scheme_for(self, module: str) -> Any | None:
        """The scheme that quantizes Hugging Face module ``module``
        (``model.layers.0.mlp.down_proj``), or None when it stays in 16 bits."""
        return None if _matches(module, self.ignore) else self

    def scheme_for_parts(self, modules: Sequence[str]) -> Any | None:
        """The one scheme of a fused projection's parts (``q_proj``, ``k_proj``,
        ``v_proj``).

        Raises:
            QuantizationError: the parts are quantized differently.
        """
        schemes = [self.scheme_for(m) for m in modules]
        if any(s != schemes[0] for s in schemes):
            raise QuantizationError(f"{', '.join(modules)} are quantized differently "
                                    f"({schemes}); manylora computes them in one product")
        return schemes[0]


@dataclass(frozen=True)
class Fp8Config(QuantizationConfig):
    """FP8 (e4m3) weights and activations.

    Attributes:
        weight_block_size: ``(rows, cols)`` of a ``weight_scale_inv`` block (transformers'
            fine-grained FP8), or None: a per-tensor ``weight_scale`` (a serialized
            checkpoint) or per-output-channel scales (online).
        activation_scheme: ``"dynamic"`` (per-token scales computed at run time; per
            ``(token, block column)`` group with blocks) or ``"static"`` (a checkpoint
            ``input_scale`` per tensor).
        serialized: the checkpoint holds FP8 weights; False: a 16-bit checkpoint quantized
            as it loads (``quantization="fp8"``).
    """

    weight_block_size: tuple[int, int] | None = None
    activation_scheme: str = "dynamic"
    serialized: bool = True

    name = "fp8"


@dataclass(frozen=True)
class GPTQConfig(QuantizationConfig):
    """GPTQ INT4 weights (AutoGPTQ / GPTQModel layout).

    Attributes:
        group_size: input rows per scale; the whole input when the checkpoint says -1.
        desc_act: activation order: ``g_idx`` gives each input row's group.
        sym: symmetric (the zero points are all the midpoint).
        checkpoint_format: ``"gptq"`` (zero points stored minus one, AutoGPTQ's v1) or
            ``"gptq_v2"``.
        quantized_modules: GPTQ's ``modules_in_block_to_quantize`` flattened (the module
            names inside a decoder layer, e.g. ``self_attn.q_proj``), or None: all.
    """

    group_size: int = 128
    desc_act: bool = False
    sym: bool = True
    checkpoint_format: str = "gptq"
    quantized_modules: tuple[str, ...] | None = None

    name = "gptq"

    def scheme_for(self, module: str) -> Any | None:
        if self.quantized_modules is not None and not any(
                module.endswith("." + m) for m in self.quantized_modules):
            return None
        return super().scheme_for(module)


@dataclass(frozen=True)
class AWQConfig(QuantizationConfig):
    """AWQ INT4 weights in AutoAWQ's GEMM packing.

    Attributes:
        group_size: input rows per scale.
        zero_point: asymmetric (``qzeros`` stored); False: symmetric.
    """

    group_size: int = 128
    zero_point: bool = True

    name = "awq"


@dataclass(frozen=True)
class CompressedTensorsScheme:
    """One ``config_groups`` entry: which modules, and how their weights and inputs are
    quantized (``input_activations`` None: weight-only).

    Attributes:
        targets: module names, ``re:`` patterns or ``"Linear"`` (every linear layer).
        weights: the weights' ``QuantizationArgs``.
        input_activations: the inputs' ``QuantizationArgs``, or None.
        format: ``"float-quantized"`` or ``"pack-quantized"``.
    """

    targets: tuple[str, ...]
    weights: QuantizationArgs
    input_activations: QuantizationArgs | None
    format: str


@dataclass(frozen=True)
class CompressedTensorsConfig(QuantizationConfig):
    """A compressed-tensors checkpoint (llm-compressor's): its schemes in order; a module
    takes the first whose ``targets`` match it."""

    schemes: tuple[CompressedTensorsScheme, ...] = field(default=())

    name = "compressed-tensors"

    def scheme_for(self, module: str) -> CompressedTensorsScheme | None:
        if _matches(module, self.ignore):
            return None
        for scheme in self.schemes:
            if LINEAR_CLASS in scheme.targets or _matches(module, scheme.targets):
                return scheme
        return None


def _matches(module: str, patterns: Sequence[str]) -> bool:
    """Whether ``module`` is one of ``patterns``: an exact name, a name's last parts
    (``lm_head``, ``mlp.down_proj``) or a ``re:`` pattern matched against the whole name
    (compressed-tensors' rules)."""
    for pattern in patterns:
        if pattern.startswith("re:"):
            if re.match(pattern[3:], module):
                return True
        elif module == pattern or module.endswith("." + pattern):
            return True
    return False


def parse_quantization(quantization_config: Mapping[str, Any] | None,
                       quantization: str | None = None) -> QuantizationConfig | None:
    """The format of a checkpoint whose ``config.json`` holds ``quantization_config``
    (None: a 16/32-bit checkpoint), with the engine's ``quantization`` setting (None or
    ``"auto"``: the checkpoint's; ``"fp8"`` on a 16-bit checkpoint: online FP8; another
    name: must be the checkpoint's).

    Returns:
        The config, or None for a 16/32-bit model.

    Raises:
        QuantizationError: an unknown ``quant_method`` or ``quantization``, a bit width,
            strategy, packing or option of a format that manylora cannot serve (named), or
            a ``quantization`` that differs from the checkpoint's.
    """
    if quantization == "auto":
        quantization = None
    if quantization is not None and quantization not in QUANTIZATION_METHODS:
        raise QuantizationError(f"unknown quantization {quantization!r}: use one of "
                                f"{', '.join(QUANTIZATION_METHODS)}")
    if quantization_config is None:
        if quantization is None:
            return None
        if quantization != "fp8":
            raise QuantizationError(f"quantization={quantization!r} needs a checkpoint in "
                                    "that format (its config.json has no "
                                    "quantization_config); only 'fp8' quantizes a 16-bit "
                                    "checkpoint as it loads")
        return Fp8Config(ignore=("lm_head",), weight_block_size=None,
                         activation_scheme="dynamic", serialized=False)
    if not isinstance(quantization_config, Mapping):
        raise QuantizationError(f"quantization_config must be a JSON object, got "
                                f"{type(quantization_config).__name__}")
    method = str(quantization_config.get("quant_method", "")).lower()
    if method not in _PARSERS:
        raise QuantizationError(f"unsupported quant_method {method!r} in quantization_config: "
                                f"manylora reads {', '.join(QUANTIZATION_METHODS)}")
    if quantization is not None and quantization != method:
        raise QuantizationError(f"quantization={quantization!r} but the checkpoint is "
                                f"quantized with {method!r}")
    return _PARSERS[method](quantization_config)


def _ignore(cfg: Mapping[str, Any], key: str) -> tuple[str, ...]:
    value = cfg.get(key) or ()
    if isinstance(value, str) or not all(isinstance(v, str) for v in value):
        raise QuantizationError(f"quantization_config.{key} must be a list of module names, "
                                f"got {value!r}")
    return tuple(value)


def _bits(cfg: Mapping[str, Any], method: str) -> None:
    bits = cfg.get("bits", 4)
    if bits != 4:
        raise QuantizationError(f"{method} with bits={bits!r}: manylora serves 4-bit {method}")


def _fp8(cfg: Mapping[str, Any]) -> Fp8Config:
    fmt = cfg.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise QuantizationError(f"fp8 with fmt={fmt!r}: manylora serves float8_e4m3fn "
                                "weights")
    scheme = cfg.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise QuantizationError(f"fp8 activation_scheme {scheme!r}: use 'dynamic' or "
                                "'static'")
    block = cfg.get("weight_block_size")
    if block is not None:
        if (not isinstance(block, Sequence) or len(block) != 2
                or not all(isinstance(b, int) and b > 0 for b in block)):
            raise QuantizationError(f"fp8 weight_block_size must be two positive ints, got "
                                    f"{block!r}")
        if scheme != "dynamic":
            raise QuantizationError("fp8 with weight_block_size and activation_scheme "
                                    "'static': block-wise FP8 quantizes activations "
                                    "dynamically")
        block = (int(block[0]), int(block[1]))
    return Fp8Config(ignore=_ignore(cfg, "modules_to_not_convert"), weight_block_size=block,
                     activation_scheme=scheme, serialized=True)


def _group_size(cfg: Mapping[str, Any], method: str) -> int:
    size = cfg.get("group_size", 128)
    if not isinstance(size, int) or (size <= 0 and size != -1):
        raise QuantizationError(f"{method} group_size must be a positive int or -1, got "
                                f"{size!r}")
    return size


def _gptq(cfg: Mapping[str, Any]) -> GPTQConfig:
    _bits(cfg, "gptq")
    fmt = cfg.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise QuantizationError(f"gptq checkpoint_format {fmt!r}: manylora reads 'gptq' and "
                                "'gptq_v2'")
    if cfg.get("lm_head"):
        raise QuantizationError("gptq with lm_head=true: a quantized lm_head is not served "
                                "(the head and its adapters run in 16 bits)")
    if cfg.get("dynamic"):
        raise QuantizationError("gptq with per-module 'dynamic' overrides is not served")
    blocks = cfg.get("modules_in_block_to_quantize")
    modules = None
    if blocks:
        modules = tuple(m for group in blocks for m in
                        ([group] if isinstance(group, str) else group))
    return GPTQConfig(ignore=_ignore(cfg, "modules_to_not_convert"),
                      group_size=_group_size(cfg, "gptq"), desc_act=bool(cfg.get("desc_act")),
                      sym=bool(cfg.get("sym", True)), checkpoint_format=fmt,
                      quantized_modules=modules)


def _awq(cfg: Mapping[str, Any]) -> AWQConfig:
    _bits(cfg, "awq")
    version = str(cfg.get("version", "gemm")).lower()
    if version != "gemm":
        raise QuantizationError(f"awq version {version!r}: manylora reads AutoAWQ's 'gemm' "
                                "packing")
    size = _group_size(cfg, "awq")
    if size == -1:
        raise QuantizationError("awq group_size -1: AWQ stores one scale per group")
    if not cfg.get("zero_point", True):
        raise QuantizationError("awq with zero_point=false: AutoAWQ's GEMM packing stores "
                                "qzeros (its writer refuses a layer without them), so such a "
                                "checkpoint is not one manylora can read")
    return AWQConfig(ignore=_ignore(cfg, "modules_to_not_convert"), group_size=size,
                     zero_point=True)


#: compressed-tensors keys that change what a checkpoint holds and that manylora does not
#: serve when set.
_CT_REFUSED = ("kv_cache_scheme", "sparsity_config", "transform_config")


def _compressed_tensors(cfg: Mapping[str, Any]) -> CompressedTensorsConfig:
    for key in _CT_REFUSED:
        if cfg.get(key):
            raise QuantizationError(f"compressed-tensors {key} is not served: manylora "
                                    "reads quantized linear weights only")
    status = cfg.get("quantization_status", "compressed")
    if status not in ("compressed", "frozen"):
        raise QuantizationError(f"compressed-tensors quantization_status {status!r}: "
                                "manylora reads compressed checkpoints")
    groups = cfg.get("config_groups") or {}
    if not isinstance(groups, Mapping) or not groups:
        raise QuantizationError("compressed-tensors quantization_config has no "
                                "config_groups")
    top_format = cfg.get("format")
    schemes = tuple(_ct_scheme(name, group, top_format) for name, group in groups.items())
    config = CompressedTensorsConfig(ignore=_ignore(cfg, "ignore"), schemes=schemes)
    if config.scheme_for("lm_head") is not None:
        raise QuantizationError("compressed-tensors quantizes lm_head (not in 'ignore'): a "
                                "quantized lm_head is not served (the head and its adapters "
                                "run in 16 bits)")
    return config


def _ct_args(where: str, raw: Mapping[str, Any]) -> QuantizationArgs:
    if raw.get("dynamic", False) not in (True, False):
        raise QuantizationError(f"compressed-tensors {where}: dynamic={raw.get('dynamic')!r} "
                                "is not served")
    block = raw.get("block_structure")
    if block is not None:
        if isinstance(block, str):        # older writers: "128x128"
            block = [int(b) for b in block.lower().split("x")]
        block = (int(block[0]), int(block[1]))
    args = QuantizationArgs(
        num_bits=int(raw.get("num_bits", 8)), type=str(raw.get("type", "int")),
        strategy=str(raw.get("strategy", "tensor")), symmetric=bool(raw.get("symmetric", True)),
        dynamic=bool(raw.get("dynamic", False)), group_size=raw.get("group_size"),
        block_structure=block, actorder=raw.get("actorder"))
    return args


def _ct_scheme(name: str, group: Mapping[str, Any],
               top_format: str | None) -> CompressedTensorsScheme:
    where = f"config_groups.{name}"
    if not isinstance(group, Mapping) or not group.get("weights"):
        raise QuantizationError(f"compressed-tensors {where} quantizes no weights: manylora "
                                "serves weight-quantized linear layers")
    if group.get("output_activations"):
        raise QuantizationError(f"compressed-tensors {where}.output_activations is not "
                                "served")
    targets = group.get("targets") or ()
    if isinstance(targets, str):
        targets = (targets,)
    fmt = group.get("format") or top_format
    raw_weights = group["weights"]
    if (raw_weights.get("type"), raw_weights.get("num_bits"), fmt) not in (
            ("float", 8, "float-quantized"), ("int", 4, "pack-quantized")):
        raise QuantizationError(f"compressed-tensors {where}: {raw_weights.get('num_bits')}-bit "
                                f"{raw_weights.get('type')} weights in format {fmt!r}; "
                                "manylora serves FP8 'float-quantized' and 4-bit int "
                                "'pack-quantized' (W4A16)")
    weights = _ct_args(f"{where}.weights", raw_weights)
    inputs = group.get("input_activations")
    inputs = _ct_args(f"{where}.input_activations", inputs) if inputs else None
    if weights.type == "float":
        if weights.strategy not in ("tensor", "channel", "block") or weights.dynamic:
            raise QuantizationError(f"compressed-tensors {where}: FP8 weight strategy "
                                    f"{weights.strategy!r} (dynamic={weights.dynamic}) is not "
                                    "served: use tensor, channel or block")
        if weights.strategy == "block" and weights.block_structure is None:
            raise QuantizationError(f"compressed-tensors {where}: block strategy without "
                                    "block_structure")
        if inputs is not None and (inputs.type != "float" or inputs.num_bits != 8 or
                                   inputs.strategy not in ("tensor", "token", "group")):
            raise QuantizationError(f"compressed-tensors {where}: input activations "
                                    f"{inputs.num_bits}-bit {inputs.type} per "
                                    f"{inputs.strategy} with FP8 weights are not served")
    else:
        if inputs is not None:
            raise QuantizationError(f"compressed-tensors {where}: INT4 weights with quantized "
                                    "input activations are not served (W4A16 only)")
        if weights.strategy not in ("group", "channel"):
            raise QuantizationError(f"compressed-tensors {where}: INT4 weight strategy "
                                    f"{weights.strategy!r} is not served: use group or channel")
        if weights.strategy == "group" and not (isinstance(weights.group_size, int)
                                                and weights.group_size > 0):
            raise QuantizationError(f"compressed-tensors {where}: group strategy needs a "
                                    f"positive group_size, got {weights.group_size!r}")
        if weights.actorder not in (None, "group", "weight", "static", "dynamic"):
            raise QuantizationError(f"compressed-tensors {where}: actorder "
                                    f"{weights.actorder!r} is not served")
    return CompressedTensorsScheme(tuple(targets), weights, inputs, fmt)


_PARSERS = {"fp8": _fp8, "gptq": _gptq, "awq": _awq,
            "compressed-tensors": _compressed_tensors}
