"""The INT4 checkpoint formats: our test packer against the projects' own unpacking rules,
each linear method's repack (``dense_weight``) against the dequantized weights, and the
refusals.

The unpacking formulas are written from the projects' sources, independently of manylora's:
AutoAWQ's ``awq/utils/packing_utils.py`` (``unpack_awq``, ``reverse_awq_order``,
``dequantize_gemm``) and AutoGPTQ's ``qlinear_cuda_old.py`` forward (``qzeros`` unpacked along
N, plus one; ``qweight`` along K; ``scales[g_idx] * (weight - zeros[g_idx])``).
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from manylora.config import ModelConfig
from manylora.config.quantization import (
    CompressedTensorsScheme,
    QuantizationArgs,
    QuantizationError,
    parse_quantization,
)
from manylora.model.loader import load_hf_config, load_model
from manylora.ops.quant import linear_method_for
from manylora.ops.quant.int4 import Int4LinearMethod
from manylora.testing import make_checkpoint
from manylora.testing.quant_int4 import write_ct_int4_checkpoint, write_int4_checkpoint

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64)
Q = "model.layers.0.self_attn.q_proj"
AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("formats") / "dense", "llama", seed=1, **TINY)


def _autoawq_dequantize(qweight, qzeros, scales, group_size):
    shifts = torch.arange(0, 32, 4)
    iweights = (qweight[:, :, None] >> shifts[None, None, :]).view(qweight.shape[0], -1)
    izeros = (qzeros[:, :, None] >> shifts[None, None, :]).view(qzeros.shape[0], -1)
    order = torch.arange(izeros.shape[-1]).view(-1, 8)[:, AWQ_REVERSE_ORDER].view(-1)
    iweights, izeros = iweights[:, order] & 15, izeros[:, order] & 15
    return ((iweights - izeros.repeat_interleave(group_size, 0))
            * scales.float().repeat_interleave(group_size, 0))


def _autogptq_dequantize(qweight, qzeros, scales, g_idx, plus_one):
    wf = torch.arange(0, 32, 4, dtype=torch.int32)
    zeros = (qzeros.unsqueeze(2).expand(-1, -1, 8) >> wf.unsqueeze(0)) & 15
    zeros = zeros.reshape(scales.shape) + (1 if plus_one else 0)
    weight = (qweight.unsqueeze(1).expand(-1, 8, -1) >> wf.unsqueeze(-1)) & 15
    weight = weight.reshape(weight.shape[0] * 8, weight.shape[2])
    return scales.float()[g_idx.long()] * (weight - zeros[g_idx.long()])


def test_awq_packing_follows_autoawq_unpacking(dense, tmp_path):
    quantized, dequantized = write_int4_checkpoint(dense, tmp_path, "awq", group_size=32)
    q, d = load_file(quantized / "model.safetensors"), load_file(dequantized / "model.safetensors")
    assert q[Q + ".qweight"].shape == (64, 8) and q[Q + ".qzeros"].shape == (2, 8)
    w = _autoawq_dequantize(q[Q + ".qweight"], q[Q + ".qzeros"], q[Q + ".scales"], 32)
    assert torch.equal(w.T, d[Q + ".weight"])


@pytest.mark.parametrize("kwargs", [dict(sym=True), dict(sym=False, desc_act=True),
                                    dict(sym=False, checkpoint_format="gptq_v2")])
def test_gptq_packing_follows_autogptq_unpacking(dense, tmp_path, kwargs):
    quantized, dequantized = write_int4_checkpoint(dense, tmp_path, "gptq", group_size=32,
                                                   **kwargs)
    q, d = load_file(quantized / "model.safetensors"), load_file(dequantized / "model.safetensors")
    assert q[Q + ".qweight"].shape == (8, 64) and q[Q + ".qzeros"].shape == (2, 8)
    v1 = kwargs.get("checkpoint_format", "gptq") == "gptq"
    w = _autogptq_dequantize(q[Q + ".qweight"], q[Q + ".qzeros"], q[Q + ".scales"],
                             q[Q + ".g_idx"], plus_one=v1)
    assert torch.equal(w.T, d[Q + ".weight"])
    if kwargs["sym"] and v1:     # symmetric v1 checkpoints store 7 for the zero point 8
        assert (q[Q + ".qzeros"] == 0x77777777).all()


def _dense_weights_match(quantized, dequantized):
    hf = load_hf_config(quantized)
    cfg = ModelConfig.from_hf(hf, torch.float32)
    model = load_model(quantized, cfg, torch.device("cpu"))
    ref = load_file(dequantized / "model.safetensors")
    layers = [m for m in model.modules() if isinstance(getattr(m, "linear_method", None),
                                                        Int4LinearMethod)]
    assert len(layers) == 4      # qkv, o, gate_up, down
    for layer in layers:
        prefix = [n for n, m in model.named_modules() if m is layer][0]
        parent, _ = prefix.rsplit(".", 1)
        parts = torch.cat([ref[f"{parent}.{name}.weight"] for name in layer.module_names])
        assert torch.equal(layer.linear_method.dense_weight(layer), parts), prefix
        x = torch.randn(3, parts.shape[1], dtype=torch.float32)
        torch.testing.assert_close(layer.linear_method.apply(layer, x), x @ parts.T)


@pytest.mark.parametrize("fmt, kwargs", [("gptq", dict(sym=False, desc_act=True)),
                                         ("gptq", dict(group_size=-1)),
                                         ("awq", dict())])
def test_repacked_gptq_awq_layers_dequantize_to_the_checkpoint(dense, tmp_path, fmt, kwargs):
    _dense_weights_match(*write_int4_checkpoint(dense, tmp_path, fmt, **kwargs))


@pytest.mark.parametrize("kwargs", [dict(strategy="group", sym=False),
                                    dict(strategy="channel", sym=True)])
def test_repacked_compressed_tensors_layers_dequantize_to_the_checkpoint(dense, tmp_path,
                                                                         kwargs):
    quantized, dequantized = write_ct_int4_checkpoint(dense, tmp_path, **kwargs)
    weights = load_file(quantized / "model.safetensors")
    assert weights[Q + ".weight_packed"].dtype == torch.int32
    assert weights[Q + ".weight_packed"].shape == (64, 8)
    assert (Q + ".weight_zero_point" in weights) == (not kwargs["sym"])
    _dense_weights_match(quantized, dequantized)


def test_compressed_tensors_group_act_order_with_g_idx_dequantizes_to_the_checkpoint(
        dense, tmp_path):
    """compressed-tensors 0.20 no longer writes ``actorder: "group"`` checkpoints (older
    llm-compressor releases did, with ``weight_g_idx``): an act-order GPTQ checkpoint's codes,
    scales, zeros and ``g_idx`` re-packed by compressed-tensors' own ``pack_to_int32`` into
    its ``pack-quantized`` tensors."""
    import json

    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from safetensors.torch import save_file

    from manylora.ops.quant.int4 import unpack_columns
    from manylora.ops.quant.w4a16 import unpack_rows

    quantized, dequantized = write_int4_checkpoint(dense, tmp_path, "gptq", group_size=32,
                                                   sym=False, desc_act=True,
                                                   checkpoint_format="gptq_v2")
    state = load_file(quantized / "model.safetensors")
    for name in [k[:-len(".qweight")] for k in state if k.endswith(".qweight")]:
        qweight, qzeros = state.pop(name + ".qweight"), state.pop(name + ".qzeros")
        scales, g_idx = state.pop(name + ".scales"), state.pop(name + ".g_idx")
        codes = unpack_rows(qweight, qweight.shape[0] * 8).T       # [N, K], 0..15
        zeros = unpack_columns(qzeros).T                            # [N, G]
        state[name + ".weight_packed"] = pack_to_int32((codes - 8).to(torch.int8), 4)
        state[name + ".weight_zero_point"] = pack_to_int32((zeros - 8).to(torch.int8), 4,
                                                           packed_dim=0)
        state[name + ".weight_scale"] = scales.T.float().contiguous()
        state[name + ".weight_shape"] = torch.tensor(codes.shape)
        state[name + ".weight_g_idx"] = g_idx
    save_file(state, quantized / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "quantization_status": "compressed", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None,
                                      "weights": {"num_bits": 4, "type": "int",
                                                  "symmetric": False, "strategy": "group",
                                                  "group_size": 32, "actorder": "group"}}}}
    (quantized / "config.json").write_text(json.dumps(config))
    _dense_weights_match(quantized, dequantized)


@pytest.mark.parametrize("config, message", [
    ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "gptq with bits=8"),
    ({"quant_method": "awq", "bits": 8, "group_size": 128}, "awq with bits=8"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"},
     "awq version 'gemv'"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": False},
     "awq with zero_point=false"),
])
def test_unserved_int4_options_are_refused_by_name(config, message):
    with pytest.raises(QuantizationError, match=message):
        parse_quantization(config)


def test_compressed_tensors_float_scheme_is_not_the_int4_method():
    from manylora.config.quantization import CompressedTensorsConfig
    from manylora.ops.quant.fp8 import Fp8LinearMethod

    fp8 = QuantizationArgs(num_bits=8, type="float", strategy="channel")
    scheme = CompressedTensorsScheme(("Linear",), fp8, None, "float-quantized")
    config = CompressedTensorsConfig(ignore=("lm_head",), schemes=(scheme,))
    method = linear_method_for(config, [Q])
    assert isinstance(method, Fp8LinearMethod)
    assert (method.weight_strategy, method.activations) == ("channel", None)


class _FractionalZeros(Int4LinearMethod):
    """An INT4 method whose checkpoint tensors hold a zero point no INT4 format writes."""

    def create_weights(self, layer, in_features, out_features, params_dtype, device,
                       weight_attrs):
        raise NotImplementedError("the test sets the canonical tensors directly")

    def canonical(self, layer):
        q = torch.zeros(16, 8, dtype=torch.int32)
        scales = torch.ones(1, 8)
        zeros = torch.full((1, 8), 8.0)
        zeros[0, 3] = 7.5
        return q, scales, zeros, None, 16


def test_repacking_refuses_zero_points_that_are_not_integers():
    """The kernel's exact dequantization needs integer zero points: a fractional one is
    refused at load, naming the layer."""
    layer = torch.nn.Module()
    layer.module_names, layer.w4_dtype = ("q_proj",), torch.float32
    with pytest.raises(QuantizationError, match=r"q_proj: zero points in \[7.5, 8.0\]"):
        _FractionalZeros().process_weights_after_loading(layer)
