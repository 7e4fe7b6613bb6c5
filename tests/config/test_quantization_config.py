"""Reading a quantized checkpoint's ``quantization_config``: the formats as their writers
write them (compressed-tensors' own ``QuantizationConfig`` for llm-compressor checkpoints,
the published configs of transformers' fine-grained FP8, AutoGPTQ / GPTQModel and AutoAWQ),
which modules each quantizes, and every option manylora cannot serve refused by name."""

from __future__ import annotations

import json

import pytest
from compressed_tensors.quantization import QuantizationConfig as CTQuantizationConfig
from compressed_tensors.quantization import QuantizationScheme, preset_name_to_scheme

from manylora.config import QuantizationError, parse_quantization
from manylora.config.quantization import (
    AWQConfig,
    CompressedTensorsConfig,
    Fp8Config,
    GPTQConfig,
)

Q_PROJ = "model.layers.0.self_attn.q_proj"
QKV = [f"model.layers.0.self_attn.{m}_proj" for m in "qkv"]

# as Qwen3-8B-FP8's and DeepSeek-V3's config.json hold it (transformers' fine-grained FP8)
FINE_GRAINED_FP8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                    "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head"]}
# AutoGPTQ / GPTQModel
GPTQ = {"bits": 4, "group_size": 128, "damp_percent": 0.01, "desc_act": True, "sym": False,
        "true_sequential": True, "quant_method": "gptq", "checkpoint_format": "gptq",
        "static_groups": False, "model_name_or_path": None, "model_file_base_name": "model"}
# AutoAWQ
AWQ = {"quant_method": "awq", "zero_point": True, "group_size": 128, "bits": 4,
       "version": "gemm", "modules_to_not_convert": None}


def compressed_tensors(preset: str, fmt: str, ignore=("lm_head",), **extra) -> dict:
    """A ``quantization_config`` as compressed-tensors serializes it for ``preset``."""
    config = CTQuantizationConfig(
        config_groups={"group_0": preset_name_to_scheme(preset, ["Linear"])},
        ignore=list(ignore), format=fmt, quantization_status="compressed", **extra)
    return {**json.loads(config.model_dump_json()), "quant_method": "compressed-tensors"}


def test_a_16_bit_checkpoint_has_none_and_fp8_quantizes_it_online():
    assert parse_quantization(None) is None
    assert parse_quantization(None, "auto") is None
    online = parse_quantization(None, "fp8")
    assert isinstance(online, Fp8Config) and not online.serialized
    assert online.weight_block_size is None
    assert online.scheme_for(Q_PROJ) is online and online.scheme_for("lm_head") is None


def test_fine_grained_fp8():
    cfg = parse_quantization(FINE_GRAINED_FP8)
    assert cfg == Fp8Config(ignore=("lm_head",), weight_block_size=(128, 128),
                            activation_scheme="dynamic", serialized=True)
    assert cfg.scheme_for(Q_PROJ) is cfg and cfg.scheme_for("lm_head") is None
    assert parse_quantization(FINE_GRAINED_FP8, "fp8") == cfg


def test_gptq_and_awq():
    gptq = parse_quantization(GPTQ)
    assert isinstance(gptq, GPTQConfig)
    assert (gptq.group_size, gptq.desc_act, gptq.sym, gptq.checkpoint_format) == (
        128, True, False, "gptq")
    assert gptq.scheme_for(Q_PROJ) is gptq
    only_attention = parse_quantization(
        {**GPTQ, "modules_in_block_to_quantize": [["self_attn.q_proj", "self_attn.k_proj"],
                                                  ["self_attn.o_proj"]]})
    assert only_attention.scheme_for(Q_PROJ) is only_attention
    assert only_attention.scheme_for("model.layers.3.mlp.down_proj") is None
    awq = parse_quantization(AWQ)
    assert awq == AWQConfig(ignore=(), group_size=128, zero_point=True)


@pytest.mark.parametrize("preset, fmt, weight_type, activations", [
    ("W4A16", "pack-quantized", "int", False),
    ("W4A16_ASYM", "pack-quantized", "int", False),
    ("FP8", "float-quantized", "float", True),
    ("FP8_DYNAMIC", "float-quantized", "float", True),
    ("FP8_BLOCK", "float-quantized", "float", True),
])
def test_compressed_tensors_presets(preset, fmt, weight_type, activations):
    raw = compressed_tensors(preset, fmt)
    cfg = parse_quantization(raw)
    assert isinstance(cfg, CompressedTensorsConfig)
    scheme = cfg.scheme_for(Q_PROJ)
    expected = raw["config_groups"]["group_0"]["weights"]
    assert scheme.weights.type == weight_type == expected["type"]
    assert scheme.weights.strategy == expected["strategy"]
    assert scheme.weights.symmetric == expected["symmetric"]
    assert (scheme.input_activations is not None) == activations
    assert cfg.scheme_for_parts(QKV) is scheme
    assert cfg.scheme_for("lm_head") is None


def test_compressed_tensors_targets_and_ignore_patterns():
    w4 = preset_name_to_scheme("W4A16", ["re:.*mlp.*"])
    fp8 = QuantizationScheme(targets=["re:.*self_attn.(q|k|v|o)_proj$"],
                             **preset_name_to_scheme("FP8_DYNAMIC", ["Linear"]).model_dump(
                                 exclude={"targets"}))
    config = CTQuantizationConfig(config_groups={"mlp": w4, "attn": fp8},
                                  ignore=["lm_head", "re:.*layers.1.mlp.down_proj"],
                                  format="mixed-precision", quantization_status="compressed")
    raw = {**json.loads(config.model_dump_json()), "quant_method": "compressed-tensors"}
    raw["config_groups"]["mlp"]["format"] = "pack-quantized"
    raw["config_groups"]["attn"]["format"] = "float-quantized"
    cfg = parse_quantization(raw)
    assert cfg.scheme_for("model.layers.0.mlp.down_proj").weights.type == "int"
    assert cfg.scheme_for("model.layers.1.mlp.down_proj") is None
    assert cfg.scheme_for(Q_PROJ).weights.type == "float"
    with pytest.raises(QuantizationError, match="quantized differently"):
        cfg.scheme_for_parts(["model.layers.1.mlp.gate_proj", "model.layers.1.mlp.down_proj"])


@pytest.mark.parametrize("raw, quantization, message", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, None,
     "unsupported quant_method 'bitsandbytes'"),
    ({**GPTQ, "bits": 8}, None, "gptq with bits=8"),
    ({**GPTQ, "checkpoint_format": "marlin"}, None, "gptq checkpoint_format 'marlin'"),
    ({**GPTQ, "lm_head": True}, None, "gptq with lm_head=true"),
    ({**AWQ, "version": "gemv"}, None, "awq version 'gemv'"),
    ({**AWQ, "bits": 3}, None, "awq with bits=3"),
    ({**FINE_GRAINED_FP8, "fmt": "e5m2"}, None, "fp8 with fmt='e5m2'"),
    ({**FINE_GRAINED_FP8, "activation_scheme": "static"}, None, "activation_scheme 'static'"),
    ({**FINE_GRAINED_FP8, "weight_block_size": [128]}, None, "weight_block_size"),
    (GPTQ, "awq", "quantization='awq' but the checkpoint is quantized with 'gptq'"),
    (None, "gptq", "quantization='gptq' needs a checkpoint in that format"),
    (None, "int3", "unknown quantization 'int3'"),
])
def test_refused_formats_are_named(raw, quantization, message):
    with pytest.raises(QuantizationError, match=message.replace("(", r"\(").replace("[", r"\[")):
        parse_quantization(raw, quantization)


@pytest.mark.parametrize("preset, fmt, message", [
    ("W8A8", "int-quantized", "8-bit int weights in format 'int-quantized'"),
    ("W8A16", "pack-quantized", "8-bit int weights"),
    ("NVFP4", "nvfp4-pack-quantized", "4-bit float weights"),
    ("W4A16", "fakequant", "format 'fakequant'"),
])
def test_compressed_tensors_schemes_manylora_does_not_serve(preset, fmt, message):
    with pytest.raises(QuantizationError, match=message):
        parse_quantization(compressed_tensors(preset, fmt))


def test_compressed_tensors_options_manylora_does_not_serve():
    with pytest.raises(QuantizationError, match="quantizes lm_head"):
        parse_quantization(compressed_tensors("W4A16", "pack-quantized", ignore=()))
    raw = compressed_tensors("FP8_DYNAMIC", "float-quantized")
    with pytest.raises(QuantizationError, match="kv_cache_scheme"):
        parse_quantization({**raw, "kv_cache_scheme": {"num_bits": 8, "type": "float"}})
    with pytest.raises(QuantizationError, match="quantization_status 'initialized'"):
        parse_quantization({**raw, "quantization_status": "initialized"})
