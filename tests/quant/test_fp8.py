"""FP8 base weights under LoRA adapters, end to end, against transformers + peft on the
DEQUANTIZED weights (each FP8 checkpoint's float32 twin, ``manylora.testing.quant_fp8``).

The base is a tiny checkpoint trained to continue periodic sequences
(``make_trained_checkpoint``: random weights give near-uniform next-token distributions
that any FP8 rounding of the activations flips). The adapters (attention only, every linear
layer, DoRA) are peft's, made on the twin; the batch mixes them with base rows
(``FAMILY_ADAPTER_NAMES``). Weight-only FP8 (W8A16) must be token-exact with the reference's
log-probabilities (the float32 product of the same dequantized weights). With FP8
activations (W8A8) the greedy tokens must agree on ≥ 98 %: per sequence, the positions up
to its first divergence from the reference count as agreeing (a whole sequence where the
reference itself is a near-tie there, as ``compare_greedy`` forgives), over all reference
tokens; and the log-probabilities of the agreeing tokens stay within FP8 rounding.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from manylora import LLM, SamplingParams
from manylora.config.quantization import QuantizationError
from manylora.testing import (
    FAMILY_ADAPTER_NAMES,
    FAMILY_SPECS,
    assert_greedy_matches,
    generate_greedy,
    generate_twice_from_prefix_cache,
    make_family_case,
    shutting_down,
)
from manylora.testing.quant_fp8 import write_compressed_tensors_fp8, write_fp8_checkpoint
from manylora.testing.reference import compare_greedy
from manylora.testing.trained import make_trained_checkpoint, periodic_batch

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)
ENGINE = dict(device="cpu", dtype="float32", max_lora_rank=8, block_size=4, num_kv_blocks=64,
              max_model_len=128)
MAX_NEW = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=0)
AGREEMENT = 0.98
LOGPROB_ERROR = 0.05
#: Periodic token prompts the trained checkpoint continues with confident margins (random
#: weights give near-uniform next-token distributions that any FP8 rounding flips); the
#: third repeats the first one's prefix under the same adapter (a prefix-cache hit).
_PATTERNS = periodic_batch(torch.Generator().manual_seed(3), 5, 14, 5, 3, 200).tolist()
#: ``FAMILY_SPECS`` with adapters that shift the trained model's outputs without drowning
#: its margins (peft's weights drawn from normal(0, 0.03)).
SPECS = {name: {**spec, "init_std": 0.03} for name, spec in FAMILY_SPECS.items()}
PROMPTS = [_PATTERNS[0], _PATTERNS[1], (_PATTERNS[0] * 2)[:19], _PATTERNS[3], _PATTERNS[4]]


def agreement(outputs, case) -> float:
    """The share of reference tokens matched, per sequence up to its first divergence."""
    agreed = total = 0
    for out, ref in zip(outputs, case.reference, strict=True):
        ok, pos = compare_greedy(out.token_ids, ref)
        agreed += len(ref.token_ids) if ok else pos
        total += len(ref.token_ids)
    return agreed / total


def logprob_errors(outputs, case, positions) -> list[float]:
    """|our log-probability - log-softmax of the reference's logits| of each token up to
    each sequence's position in ``positions`` (the adapters move these by ~1: a lost
    adapter shows here even where the greedy tokens stay)."""
    errors = []
    for out, ref, pos in zip(outputs, case.reference, positions, strict=True):
        for step in range(pos):
            tok = out.token_ids[step]
            want = torch.log_softmax(torch.as_tensor(ref.logits[step]), dim=-1)[tok].item()
            errors.append(abs(out.logprobs[step][tok].logprob - want))
    return errors


def assert_exact(outputs, case) -> None:
    """Greedy tokens and their log-probabilities those of the reference (float32)."""
    assert max(logprob_errors(outputs, case, assert_greedy_matches(outputs, case))) < 1e-4


def assert_agrees(outputs, case) -> None:
    """≥ 98 % of the greedy tokens, and log-probabilities within FP8 rounding (mean error
    ≤ 0.05 nats)."""
    share = agreement(outputs, case)
    assert share >= AGREEMENT, (share, [o.token_ids for o in outputs],
                                [r.token_ids for r in case.reference])
    positions = [compare_greedy(o.token_ids, r)[1] for o, r in zip(outputs, case.reference)]
    errors = logprob_errors(outputs, case, positions)
    assert sum(errors) / len(errors) <= LOGPROB_ERROR, errors


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    return root, make_trained_checkpoint(root / "dense", **TINY)


def _case(root, quantized, reference):
    case = make_family_case(reference, root / (quantized.name + "-adapters"), SPECS,
                            PROMPTS, FAMILY_ADAPTER_NAMES, MAX_NEW)
    return dataclasses.replace(case, base_dir=quantized)


@pytest.fixture(scope="module")
def block16(dense):
    root, base = dense
    return _case(root, *write_fp8_checkpoint(base, root / "block16", block=(16, 16)))


@pytest.fixture(scope="module")
def weight_only(dense):
    root, base = dense
    return _case(root, *write_compressed_tensors_fp8(base, root / "ct-w8a16",
                                                      weights="channel", activations=None))


def test_weight_only_fp8_is_token_exact_mixed_batch_one_slot_prefix_cache(weight_only):
    """compressed-tensors W8A16 (per-channel scales): the product of the dequantized
    weights, the same as the reference's, through fewer slots than adapters and twice."""
    llm = LLM(str(weight_only.base_dir), **ENGINE, max_loras=2, enable_prefix_caching=True)
    with shutting_down(llm):
        generate_twice_from_prefix_cache(llm, weight_only, GREEDY, check=assert_exact)


def test_weight_only_fp8_tensor_parallel_2_is_token_exact(weight_only):
    """Per-channel scales cut with their rows (column parallel), whole (row parallel)."""
    llm = LLM(str(weight_only.base_dir), **ENGINE, max_loras=2, tensor_parallel_size=2)
    with shutting_down(llm):
        assert_exact(generate_greedy(llm, weight_only, GREEDY), weight_only)


@pytest.mark.parametrize("block", [(16, 16), (128, 128)])
def test_dense_weight_is_what_transformers_dequantizes(dense, block):
    """transformers 5 loads a fine-grained FP8 checkpoint on CPU with
    ``FineGrainedFP8Config(dequantize=True)``: each packed projection's ``dense_weight`` is
    its parts' weights as transformers dequantizes them (128x128: partial blocks)."""
    import transformers
    from transformers import FineGrainedFP8Config

    from manylora.lora.linear import LoRALinear

    root, base = dense
    quantized, _ = write_fp8_checkpoint(base, root / f"hf-{block[0]}", block=block)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        quantized, dtype=torch.float32,
        quantization_config=FineGrainedFP8Config(weight_block_size=block, dequantize=True))
    hf_weights = {name: module.weight for name, module in hf.named_modules()
                  if isinstance(module, torch.nn.Linear)}
    llm = LLM(str(quantized), **ENGINE, max_loras=1)
    with shutting_down(llm):
        model = llm.llm_engine.engine_core.executor.model
        layers = [(name, m) for name, m in model.named_modules() if isinstance(m, LoRALinear)]
        assert layers
        for name, layer in layers:
            prefix = name.rsplit(".", 1)[0]
            expected = torch.cat([hf_weights[f"{prefix}.{part}"]
                                  for part in layer.module_names])
            assert torch.equal(layer.linear_method.dense_weight(layer), expected), name


def test_fine_grained_block_fp8_agrees_mixed_batch_prefix_cache(block16):
    """transformers' fine-grained FP8 (16x16 blocks, q/k/v and gate/up parts of their own
    blocks) with per-(token, 16 columns) activation scales."""
    llm = LLM(str(block16.base_dir), **ENGINE, max_loras=2, enable_prefix_caching=True)
    with shutting_down(llm):
        generate_twice_from_prefix_cache(llm, block16, GREEDY, check=assert_agrees)


def test_fine_grained_block_fp8_tensor_parallel_2(block16):
    """Each rank reads its rows' (column parallel) or columns' (row parallel) blocks."""
    llm = LLM(str(block16.base_dir), **ENGINE, max_loras=2, tensor_parallel_size=2)
    with shutting_down(llm):
        assert_agrees(generate_greedy(llm, block16, GREEDY), block16)


@pytest.mark.parametrize("weights,activations", [("tensor", "static"), ("channel", "token"),
                                                  ("block", "group")])
def test_compressed_tensors_fp8_w8a8_agrees(dense, weights, activations):
    root, base = dense
    case = _case(root, *write_compressed_tensors_fp8(
        base, root / f"ct-{weights}-{activations}", weights=weights, activations=activations,
        block=(32, 32)))
    llm = LLM(str(case.base_dir), **ENGINE, max_loras=3)
    with shutting_down(llm):
        assert_agrees(generate_greedy(llm, case, GREEDY), case)


def test_serialized_per_tensor_static_fp8_agrees(dense):
    """AutoFP8's layout: 0-d weight and input scales, one per q/k/v (and gate/up) part."""
    root, base = dense
    case = _case(root, *write_fp8_checkpoint(base, root / "static",
                                             activation_scheme="static"))
    llm = LLM(str(case.base_dir), **ENGINE, max_loras=3)
    with shutting_down(llm):
        assert_agrees(generate_greedy(llm, case, GREEDY), case)


def test_block_128_pads_small_dims_and_refuses_a_tp_split_through_a_block(dense):
    """128x128 blocks over 64- and 32-row projections: one partial block each. Two ranks
    would cut q_proj's only block at row 32: refused, naming the layer (vLLM's rule)."""
    root, base = dense
    case = _case(root, *write_fp8_checkpoint(base, root / "block128", block=(128, 128)))
    llm = LLM(str(case.base_dir), **ENGINE, max_loras=3)
    with shutting_down(llm):
        assert_agrees(generate_greedy(llm, case, GREEDY), case)
    with pytest.raises(Exception, match="cut through a 128-row FP8 weight block"):
        LLM(str(case.base_dir), **ENGINE, max_loras=3, tensor_parallel_size=2)


def test_online_fp8_agrees_with_the_16_bit_reference(dense):
    root, base = dense
    case = make_family_case(base, root / "online-adapters", SPECS, PROMPTS,
                            FAMILY_ADAPTER_NAMES, MAX_NEW)
    llm = LLM(str(base), **ENGINE, max_loras=3, quantization="fp8")
    with shutting_down(llm):
        assert_agrees(generate_greedy(llm, case, GREEDY), case)


def test_dummy_weights_fill_the_fp8_parameters(block16):
    """``load_format="dummy"`` (benchmarks) fills the FP8 weights and their block scales and
    the engine generates on them."""
    llm = LLM(str(block16.base_dir), **ENGINE, max_loras=1, load_format="dummy")
    with shutting_down(llm):
        out = llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == MAX_NEW


@pytest.fixture(scope="module")
def channel_token(dense):
    root, base = dense
    return _case(root, *write_compressed_tensors_fp8(base, root / "ct-channel-token",
                                                      weights="channel", activations="token"))


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["block16", "channel_token", "weight_only"])
def test_gpu_fp8_cuda_graphs_match_eager_and_the_reference(request, name):
    """On a GPU the products are the Triton block kernel (block16), ``torch._scaled_mm``
    (channel_token) and the dequantizing W8A16 path, warmed up and captured in the decode
    CUDA graphs: the replayed steps give the eager steps' tokens, agreeing with the
    reference."""
    case = request.getfixturevalue(name)
    gpu = {**ENGINE, "device": "cuda", "block_size": 16}
    runs = []
    for eager in (False, True):
        llm = LLM(str(case.base_dir), **gpu, max_loras=3, enforce_eager=eager)
        with shutting_down(llm):
            runs.append(generate_greedy(llm, case, GREEDY))
    assert [o.token_ids for o in runs[0]] == [o.token_ids for o in runs[1]]
    assert agreement(runs[0], case) >= AGREEMENT


def test_refusals_name_the_option():
    from manylora.config.quantization import parse_quantization
    from manylora.ops.quant import linear_method_for

    with pytest.raises(QuantizationError, match="e5m2"):
        parse_quantization({"quant_method": "fp8", "fmt": "e5m2"})
    with pytest.raises(QuantizationError, match="static"):
        parse_quantization({"quant_method": "fp8", "activation_scheme": "static",
                            "weight_block_size": [128, 128]})

    block_ct = {"quant_method": "compressed-tensors", "format": "float-quantized",
                "config_groups": {"g": {"targets": ["Linear"], "weights": {
                    "num_bits": 8, "type": "float", "strategy": "block",
                    "block_structure": [128, 128]},
                    "input_activations": {"num_bits": 8, "type": "float",
                                          "strategy": "token", "dynamic": True}}},
                "ignore": ["lm_head"]}
    with pytest.raises(QuantizationError, match="block-wise weights take dynamic per-group"):
        linear_method_for(parse_quantization(block_ct), ["model.layers.0.mlp.down_proj"])
