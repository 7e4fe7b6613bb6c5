"""TensorRT-LLM's LoRA tensor format: parsing, writing, round trips and every refusal.

Tensors are built by hand (numpy / torch) from TensorRT-LLM's documented layout: a row per
(module, layer) holding ``A [D, Hi]`` then ``B [Ho, D]`` flattened (then ``Ho`` DoRA scales),
zero padded; config rows ``[module_id, layer_idx, D(, is_dora)]``.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from manylora.lora.adapter import LoRAAdapter, LoRAAdapterError, LoRAWeights
from manylora.lora.formats.loader import adapter_from_request, load_adapter_dir
from manylora.lora.formats.target import AdapterTarget
from manylora.lora.formats.trtllm import adapter_from_trtllm, adapter_to_trtllm
from manylora.lora.formats.trtllm_modules import HF_TO_TRTLLM, LoraModuleType
from manylora.lora.formats.trtllm_npy import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    read_trtllm_dir,
    write_trtllm_dir,
)
from manylora.lora_request import LoRARequest

ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The reference's example: 4 layers, hidden size 4 (q and k both 4 x 4).
EXAMPLE_SHAPES = {"q_proj": (4, 4), "k_proj": (4, 4), "v_proj": (4, 4), "o_proj": (4, 4),
                  "gate_proj": (4, 8), "up_proj": (4, 8), "down_proj": (8, 4)}
# GQA-like widths, so that fused rows split unevenly: q 8, k/v 4, gate/up 12.
GQA_SHAPES = {"q_proj": (8, 8), "k_proj": (8, 4), "v_proj": (8, 4), "o_proj": (8, 8),
              "gate_proj": (8, 12), "up_proj": (8, 12), "down_proj": (12, 8)}


def target(shapes=EXAMPLE_SHAPES, num_layers=4, max_lora_rank=8, modules=ALL_MODULES,
           dtype=torch.float32) -> AdapterTarget:
    return AdapterTarget(dict(shapes), num_layers, max_lora_rank, tuple(modules), dtype)


def pack_row(a: np.ndarray, b: np.ndarray, width: int, scales: np.ndarray | None = None,
             pad: float = 0.0) -> np.ndarray:
    """TensorRT-LLM's row: A flattened, B flattened, DoRA scales, then padding."""
    parts = [a.reshape(-1), b.reshape(-1)] + ([] if scales is None else [scales])
    row = np.concatenate(parts).astype(np.float32)
    return np.concatenate([row, np.full(width - row.size, pad, np.float32)])


def rng_matrix(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


# ---------------------------------------------------------------------------------------------
# The reference's worked example


@pytest.fixture
def example():
    """The documented example: q rank 2 / k rank 4 in layers 0-1, q rank 2 in layer 2,
    q rank 8 in layer 3; rows padded to the rank-8 row's 8*4 + 4*8 = 64 values."""
    rng = np.random.default_rng(0)
    config = np.array([[1, 0, 2], [2, 0, 4], [1, 1, 2], [2, 1, 4], [1, 2, 2], [1, 3, 8]],
                      dtype=np.int32)
    width = 8 * 4 + 4 * 8
    expected, rows = {}, []
    for module_id, layer, rank in config.tolist():
        a, b = rng_matrix(rng, rank, 4), rng_matrix(rng, 4, rank)
        expected[(layer, {1: "q_proj", 2: "k_proj"}[module_id])] = (a, b)
        rows.append(pack_row(a, b, width))
    return np.stack(rows), config, expected


def test_reference_example_parses(example):
    weights, config, expected = example
    assert weights.shape == (6, 64)
    adapter = adapter_from_trtllm(7, "example", weights, config, target())
    assert adapter.lora_int_id == 7 and adapter.name == "example"
    assert set(adapter.weights) == set(expected)
    for key, (a, b) in expected.items():
        w = adapter.weights[key]
        assert w.rank == a.shape[0]
        assert w.a.dtype == w.b.dtype == torch.float32
        assert w.a.is_contiguous() and w.b.is_contiguous()
        assert w.dora_scale is None
        torch.testing.assert_close(w.a, torch.from_numpy(a), rtol=0, atol=0)
        torch.testing.assert_close(w.b, torch.from_numpy(b), rtol=0, atol=0)
    assert adapter.rank == 8
    assert not adapter.has_dora


def test_reference_example_with_batch_dim_and_torch_inputs(example):
    weights, config, expected = example
    adapter = adapter_from_trtllm(1, "t", torch.from_numpy(weights)[None],
                                  torch.from_numpy(config).long()[None], target())
    ref = adapter_from_trtllm(1, "t", weights, config, target())
    assert adapter.digest == ref.digest


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_weights_are_cast_to_target_dtype(example, dtype):
    weights, config, expected = example
    adapter = adapter_from_trtllm(1, "t", torch.from_numpy(weights).to(dtype), config,
                                  target(dtype=torch.float32))
    a, b = expected[(3, "q_proj")]
    w = adapter.weights[(3, "q_proj")]
    assert w.a.dtype == torch.float32
    torch.testing.assert_close(w.a, torch.from_numpy(a).to(dtype).float(), rtol=0, atol=0)
    half = adapter_from_trtllm(1, "t", weights, config, target(dtype=dtype))
    assert half.weights[(3, "q_proj")].b.dtype == dtype


def test_adapter_does_not_alias_the_input(example):
    weights, config, expected = example
    t = torch.from_numpy(weights.copy())
    adapter = adapter_from_trtllm(1, "t", t, config, target())
    t.zero_()
    a, b = expected[(0, "q_proj")]
    assert torch.equal(adapter.weights[(0, "q_proj")].a, torch.from_numpy(a))
    assert torch.equal(adapter.weights[(0, "q_proj")].b, torch.from_numpy(b))


def test_padding_is_ignored(example):
    weights, config, _ = example
    noisy = weights.copy()
    noisy[0, 16:] = np.nan  # row 0 (rank 2) uses only 2*4 + 4*2 = 16 values
    assert adapter_from_trtllm(1, "t", noisy, config, target()).digest == \
        adapter_from_trtllm(1, "t", weights, config, target()).digest


def test_float_config_with_integral_values_is_accepted(example):
    weights, config, _ = example
    ref = adapter_from_trtllm(1, "t", weights, config, target())
    assert adapter_from_trtllm(1, "t", weights, config.astype(np.float32), target()).digest \
        == ref.digest


# ---------------------------------------------------------------------------------------------
# Module ids


def test_module_ids_and_names():
    assert [m.value for m in LoraModuleType] == list(range(19))
    assert LoraModuleType.ATTN_QKV == 0 and LoraModuleType.MLP_GATE_UP == 18
    assert LoraModuleType.CROSS_ATTN_QKV == 8 and LoraModuleType.MLP_ROUTER == 17
    assert LoraModuleType.ATTN_Q.trtllm_name == "attn_q"
    assert LoraModuleType(4).trtllm_name == "attn_dense"
    assert LoraModuleType.from_trtllm_name("mlp_gate_up") is LoraModuleType.MLP_GATE_UP
    with pytest.raises(ValueError, match="attn_qkvx"):
        LoraModuleType.from_trtllm_name("attn_qkvx")
    assert {k: int(v) for k, v in HF_TO_TRTLLM.items()} == {
        "q_proj": 1, "k_proj": 2, "v_proj": 3, "o_proj": 4, "gate_proj": 5, "down_proj": 6,
        "up_proj": 7, "qkv_proj": 0, "gate_up_proj": 18}


def test_fused_qkv_and_gate_up_rows_split_into_components():
    rng = np.random.default_rng(1)
    a_qkv, b_qkv = rng_matrix(rng, 3, 8), rng_matrix(rng, 16, 3)      # q 8 + k 4 + v 4
    a_gu, b_gu = rng_matrix(rng, 2, 8), rng_matrix(rng, 24, 2)        # gate 12 + up 12
    width = 3 * 8 + 16 * 3
    weights = np.stack([pack_row(a_qkv, b_qkv, width), pack_row(a_gu, b_gu, width)])
    config = np.array([[0, 1, 3], [18, 0, 2]], dtype=np.int32)
    adapter = adapter_from_trtllm(1, "fused", weights, config, target(GQA_SHAPES, num_layers=2))
    assert set(adapter.weights) == {(1, "q_proj"), (1, "k_proj"), (1, "v_proj"),
                                    (0, "gate_proj"), (0, "up_proj")}
    for module, rows in (("q_proj", slice(0, 8)), ("k_proj", slice(8, 12)),
                         ("v_proj", slice(12, 16))):
        w = adapter.weights[(1, module)]
        assert torch.equal(w.a, torch.from_numpy(a_qkv))
        assert torch.equal(w.b, torch.from_numpy(b_qkv[rows]))
        assert w.b.is_contiguous()
    assert torch.equal(adapter.weights[(0, "gate_proj")].b, torch.from_numpy(b_gu[:12]))
    assert torch.equal(adapter.weights[(0, "up_proj")].b, torch.from_numpy(b_gu[12:]))
    assert torch.equal(adapter.weights[(0, "up_proj")].a, torch.from_numpy(a_gu))


def test_fused_dora_row_splits_scales():
    rng = np.random.default_rng(2)
    a, b, s = rng_matrix(rng, 2, 8), rng_matrix(rng, 16, 2), rng_matrix(rng, 16) + 2
    weights = pack_row(a, b, 2 * 8 + 16 * 2 + 16 + 3, s)[None]
    adapter = adapter_from_trtllm(1, "d", weights, np.array([[0, 0, 2, 1]]),
                                  target(GQA_SHAPES, num_layers=1))
    scales = {m: adapter.weights[(0, m)].dora_scale for m in ("q_proj", "k_proj", "v_proj")}
    assert all(t.dtype == torch.float32 for t in scales.values())
    assert torch.equal(torch.cat(list(scales.values())), torch.from_numpy(s))


@pytest.mark.parametrize("module_id", range(8, 18))
def test_ids_without_a_layer_are_refused_by_name(module_id):
    weights = np.zeros((1, 64), np.float32)
    name = LoraModuleType(module_id).trtllm_name
    with pytest.raises(LoRAAdapterError,
                       match=rf"'x': row 0 .*module id {module_id} \({name}\) has no layer"):
        adapter_from_trtllm(1, "x", weights, np.array([[module_id, 0, 2]]), target())


# ---------------------------------------------------------------------------------------------
# Round trips


def make_adapter(rng: torch.Generator, shapes=GQA_SHAPES, dora=False, dtype=torch.float32,
                 layers=2) -> LoRAAdapter:
    """Mixed ranks over all seven modules; DoRA scales on some modules when ``dora``."""
    weights = {}
    for layer in range(layers):
        for k, module in enumerate(ALL_MODULES):
            if (layer + k) % 3 == 2:
                continue
            in_f, out_f = shapes[module]
            rank = 1 + (layer * 7 + k) % 8
            a = torch.randn(rank, in_f, generator=rng).to(dtype)
            b = torch.randn(out_f, rank, generator=rng).to(dtype)
            scale = (torch.rand(out_f, generator=rng) + 0.5) if dora and k % 2 else None
            weights[(layer, module)] = LoRAWeights(a, b, scale)
    return LoRAAdapter(3, "mixed", weights)


@pytest.mark.parametrize("dora", [False, True])
def test_round_trip_tensors(dora):
    adapter = make_adapter(torch.Generator().manual_seed(0), dora=dora)
    weights, config = adapter_to_trtllm(adapter, torch.float32)
    assert weights.dtype == torch.float32 and config.dtype == torch.int32
    assert config.shape == (len(adapter.weights), 4 if dora else 3)
    assert weights.shape[0] == len(adapter.weights)
    order = [(layer, module_id) for module_id, layer in config[:, :2].tolist()]
    assert order == sorted(order)
    if dora:
        assert set(config[:, 3].tolist()) == {0, 1}
    back = adapter_from_trtllm(3, "mixed", weights, config, target(GQA_SHAPES, num_layers=2))
    assert back.digest == adapter.digest
    assert {k: w.rank for k, w in back.weights.items()} == \
        {k: w.rank for k, w in adapter.weights.items()}


def test_to_trtllm_row_layout():
    a, b = torch.arange(8.0).reshape(1, 8), torch.arange(4.0).reshape(4, 1) + 100
    adapter = LoRAAdapter(1, "one", {(0, "k_proj"): LoRAWeights(a, b),
                                     (0, "q_proj"): LoRAWeights(torch.ones(2, 8),
                                                                torch.ones(8, 2))})
    weights, config = adapter_to_trtllm(adapter, torch.float16)
    assert config.tolist() == [[1, 0, 2], [2, 0, 1]]
    assert weights.dtype == torch.float16 and weights.shape == (2, 2 * 8 + 8 * 2)
    assert weights[1].tolist() == list(range(8)) + [100, 101, 102, 103] + [0] * 20


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("dora", [False, True])
def test_round_trip_through_npy_files(tmp_path, dtype, dora):
    adapter = make_adapter(torch.Generator().manual_seed(1), dora=dora, dtype=dtype)
    weights, config = adapter_to_trtllm(adapter, dtype)
    out = write_trtllm_dir(tmp_path / "trt", weights, config)
    raw_w, raw_c = np.load(out / WEIGHTS_FILE), np.load(out / CONFIG_FILE)
    assert raw_w.shape == (1, *weights.shape) and raw_c.shape == (1, *config.shape)
    assert raw_c.dtype == np.int32
    assert raw_w.dtype.str == {torch.bfloat16: "|V2", torch.float16: "<f2",
                               torch.float32: "<f4"}[dtype]
    w2, c2 = read_trtllm_dir(out)
    assert w2.dtype == dtype and w2.shape == (1, *weights.shape)
    assert torch.equal(w2[0], weights) and torch.equal(c2[0], config)
    back = adapter_from_trtllm(3, "mixed", w2, c2, target(GQA_SHAPES, num_layers=2,
                                                           dtype=dtype))
    for key, w in adapter.weights.items():
        assert torch.equal(back.weights[key].a, w.a) and torch.equal(back.weights[key].b, w.b)
        if w.dora_scale is not None:
            # the scales went through the storage dtype
            assert torch.equal(back.weights[key].dora_scale, w.dora_scale.to(dtype).float())


def test_bf16_v2_numpy_input_is_read_as_bfloat16():
    adapter = make_adapter(torch.Generator().manual_seed(2), dtype=torch.bfloat16)
    weights, config = adapter_to_trtllm(adapter, torch.bfloat16)
    as_v2 = weights.view(torch.int16).numpy().view(np.dtype("V2"))
    back = adapter_from_trtllm(3, "mixed", as_v2, config.numpy(),
                               target(GQA_SHAPES, num_layers=2, dtype=torch.bfloat16))
    assert back.digest == adapter.digest


def test_load_adapter_dir_and_request_forms(tmp_path):
    adapter = make_adapter(torch.Generator().manual_seed(3), dora=True)
    weights, config = adapter_to_trtllm(adapter, torch.float32)
    tgt = target(GQA_SHAPES, num_layers=2)
    out = write_trtllm_dir(tmp_path / "trt", weights, config)
    from_dir = load_adapter_dir(LoRARequest("mixed", 3, str(out)), out, tgt)
    from_req = adapter_from_request(LoRARequest(task_id=3, lora_name="mixed", weights=weights,
                                                config=config), tgt)
    assert from_dir.digest == from_req.digest == adapter.digest
    assert from_req.lora_int_id == 3
    with pytest.raises(LoRAAdapterError, match="carries no weights/config"):
        adapter_from_request(LoRARequest("p", 4, str(out)), tgt)


def test_read_dir_errors(tmp_path):
    weights, config = adapter_to_trtllm(make_adapter(torch.Generator().manual_seed(4)),
                                        torch.float16)
    out = write_trtllm_dir(tmp_path / "trt", weights, config)
    (out / CONFIG_FILE).unlink()
    with pytest.raises(LoRAAdapterError, match=re.escape(CONFIG_FILE) + " is missing"):
        read_trtllm_dir(out)
    with pytest.raises(LoRAAdapterError, match="'named'.*is missing"):
        load_adapter_dir(LoRARequest("named", 1, str(out)), out, target(GQA_SHAPES, 2))
    (out / CONFIG_FILE).write_bytes(b"not a numpy file")
    with pytest.raises(LoRAAdapterError, match="cannot read .*" + re.escape(CONFIG_FILE)):
        read_trtllm_dir(out)


def test_write_refuses_bad_shapes(tmp_path):
    with pytest.raises(ValueError, match=r"\[2, 1, 4, 3\]"):
        write_trtllm_dir(tmp_path, torch.zeros(2, 1, 4, 3), torch.zeros(1, 3, dtype=torch.int32))


# ---------------------------------------------------------------------------------------------
# Bad input: each refusal names the adapter, the row and the problem


def good_tensors():
    """Two rows: q rank 2 in layer 0, k rank 4 in layer 1 (hidden 4)."""
    rng = np.random.default_rng(5)
    width = 4 * 4 + 4 * 4
    rows = [pack_row(rng_matrix(rng, 2, 4), rng_matrix(rng, 4, 2), width),
            pack_row(rng_matrix(rng, 4, 4), rng_matrix(rng, 4, 4), width)]
    return np.stack(rows), np.array([[1, 0, 2], [2, 1, 4]], np.int32)


BAD_CASES = {
    "row counts differ": (lambda w, c: (w, c[:1]), r"weights have 2 rows but config has 1"),
    "weights 1-D": (lambda w, c: (w[0], c), r"weights has shape \[32\], not \[N, W\]"),
    "weights batch of 2": (lambda w, c: (np.stack([w, w]), c),
                           r"weights has shape \[2, 2, 32\]"),
    "config 2 columns": (lambda w, c: (w, c[:, :2]), r"config has 2 columns"),
    "config 5 columns": (lambda w, c: (w, np.pad(c, ((0, 0), (0, 2)))), r"config has 5 columns"),
    "config non-integer": (lambda w, c: (w, c.astype(np.float32) + [0, 0, 0.5]),
                           r"config row 0 \[1.0, 0.0, 2.5\] holds non-integer values"),
    "config bool": (lambda w, c: (w, c.astype(bool)), r"config has dtype torch.bool"),
    "weights integer": (lambda w, c: (w.astype(np.int32), c), r"weights have dtype torch.int32"),
    "weights float64": (lambda w, c: (w.astype(np.float64), c),
                        r"weights have dtype torch.float64"),
    "weights a list": (lambda w, c: (w.tolist(), c), r"weights must be a torch tensor or a numpy"),
    "no rows": (lambda w, c: (w[:0], c[:0]), r"hold no rows"),
    "row too narrow": (lambda w, c: (w[:, :31], c),
                       r"row 1 \(.*= \[2, 1, 4\]\): the row holds 31 values, but .* = 32"),
    "rank 0": (lambda w, c: (w, np.array([[1, 0, 0], [2, 1, 4]])),
               r"row 0 .*adapter size D=0 is not in 1..max_lora_rank=8"),
    "rank above max": (lambda w, c: (w, np.array([[1, 0, 2], [2, 1, 9]])),
                       r"row 1 .*D=9 is not in 1..max_lora_rank=8"),
    "layer negative": (lambda w, c: (w, np.array([[1, -1, 2], [2, 1, 4]])),
                       r"row 0 .*layer index -1 is out of range \(the base model has 4 layers\)"),
    "layer past the model": (lambda w, c: (w, np.array([[1, 0, 2], [2, 4, 4]])),
                             r"row 1 .*layer index 4 is out of range"),
    "unknown id": (lambda w, c: (w, np.array([[19, 0, 2], [2, 1, 4]])),
                   r"row 0 .*unknown module id 19"),
    "negative id": (lambda w, c: (w, np.array([[1, 0, 2], [-1, 1, 4]])),
                    r"row 1 .*unknown module id -1"),
    "same module twice": (lambda w, c: (w, np.array([[2, 1, 2], [2, 1, 4]])),
                          r"row 1 .*k_proj of layer 1 is already given by row 0"),
    "fused and component": (lambda w, c: (np.pad(w, ((0, 0), (0, 32))),
                                          np.array([[3, 1, 2], [0, 1, 4]])),
                            r"row 1 .*v_proj of layer 1 is already given by row 0"),
    "nan in weights": (lambda w, c: (np.where(np.arange(32) == 20, np.nan, w), c),
                       r"row 1 .*NaN or Inf in its in/out weights"),
    "inf in a": (lambda w, c: (np.where(np.arange(32) == 3, np.inf, w), c),
                 r"row 0 .*NaN or Inf"),
    "is_dora 2": (lambda w, c: (w, np.pad(c, ((0, 0), (0, 1)), constant_values=2)),
                  r"row 0 \(\[module_id, layer_idx, D, is_dora\] = \[1, 0, 2, 2\]\): is_dora "
                  r"is 2"),
    "dora row too narrow": (lambda w, c: (w, np.array([[1, 0, 2, 0], [2, 1, 4, 1]])),
                            r"row 1 .*32 values, but D x Hi \+ Ho x D \+ Ho = 36"),
}


@pytest.mark.parametrize("case", list(BAD_CASES))
def test_bad_input_is_refused(case):
    change, pattern = BAD_CASES[case]
    weights, config = change(*good_tensors())
    with pytest.raises(LoRAAdapterError, match=r"adapter 'bad'.*" + pattern):
        adapter_from_trtllm(1, "bad", weights, config, target())


def test_dora_scales_not_finite():
    rng = np.random.default_rng(6)
    scales = np.array([1.0, np.inf, 1.0, 1.0], np.float32)
    weights = pack_row(rng_matrix(rng, 2, 4), rng_matrix(rng, 4, 2), 20, scales)[None]
    with pytest.raises(LoRAAdapterError, match=r"'d': row 0 .*DoRA scales are not all finite"):
        adapter_from_trtllm(1, "d", weights, np.array([[1, 0, 2, 1]]), target())


def test_module_outside_target_modules():
    weights, config = good_tensors()
    with pytest.raises(LoRAAdapterError,
                       match=r"row 1 .*attn_k adapts k_proj, but lora_target_modules is "
                             r"\['q_proj', 'v_proj'\]"):
        adapter_from_trtllm(1, "bad", weights, config, target(modules=("q_proj", "v_proj")))
    fused = np.zeros((1, 4 * 4 + 12 * 4), np.float32)
    with pytest.raises(LoRAAdapterError, match=r"attn_qkv adapts k_proj, but"):
        adapter_from_trtllm(1, "bad", fused, np.array([[0, 0, 4]]),
                            target(modules=("q_proj", "v_proj")))


def test_to_trtllm_refuses_bad_dtype():
    with pytest.raises(ValueError, match="float64"):
        adapter_to_trtllm(make_adapter(torch.Generator().manual_seed(7)), torch.float64)
