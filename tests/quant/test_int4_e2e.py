"""INT4 weight-only bases (GPTQ, AWQ, compressed-tensors W4A16) under adapters, against
transformers + peft on the dequantized weights, greedy, token for token.

Each format's tiny checkpoint is written from one ``make_checkpoint`` model
(``manylora.testing.quant_int4``: GPTQ and AWQ by our packer, checked against the projects'
unpacking rules in ``test_int4_formats.py``; compressed-tensors by compressed-tensors), with
a float32 checkpoint of its dequantized weights. peft writes the adapters on that dequantized
model (attention only, every linear layer, a DoRA one) and computes the reference; manylora
runs the quantized checkpoint as one mixed batch with base rows, through two slots for three
adapters, twice so that the second pass reads the prefix cache, and one format of each
family under tensor parallelism 2 (gloo, CPU).
"""

from __future__ import annotations

import pytest

from manylora import LLM, SamplingParams
from manylora.config.quantization import QuantizationError
from manylora.testing import (
    FAMILY_ADAPTER_NAMES,
    FAMILY_SPECS,
    FAMILY_TEXTS,
    assert_greedy_matches,
    generate_greedy,
    generate_twice_from_prefix_cache,
    make_checkpoint,
    make_family_case,
    shutting_down,
)
from manylora.testing.quant_int4 import write_ct_int4_checkpoint, write_int4_checkpoint

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)
ENGINE = dict(device="cpu", dtype="float32", max_lora_rank=8, block_size=4, num_kv_blocks=64,
              max_model_len=128)
MAX_NEW = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)

#: name → (writer, its arguments)
FORMATS = {
    "gptq-sym-g32": (write_int4_checkpoint, dict(fmt="gptq", group_size=32, sym=True)),
    "gptq-asym-g32-act-order": (write_int4_checkpoint,
                                dict(fmt="gptq", group_size=32, sym=False, desc_act=True)),
    "gptq_v2-asym-whole-input": (write_int4_checkpoint,
                                 dict(fmt="gptq", group_size=-1, sym=False,
                                      checkpoint_format="gptq_v2")),
    "awq-g32": (write_int4_checkpoint, dict(fmt="awq", group_size=32)),
    "ct-group-sym": (write_ct_int4_checkpoint, dict(strategy="group", group_size=32, sym=True)),
    "ct-channel-asym": (write_ct_int4_checkpoint, dict(strategy="channel", sym=False)),
    "ct-group-asym": (write_ct_int4_checkpoint, dict(strategy="group", group_size=16,
                                                     sym=False)),
}


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("int4") / "dense", "llama", seed=0, **TINY)


@pytest.fixture(scope="module")
def cases(dense, tmp_path_factory):
    """Format name → (quantized checkpoint, the family case on its dequantized weights),
    written on first use."""
    made = {}

    def get(name):
        if name not in made:
            root = tmp_path_factory.mktemp(name)
            writer, kwargs = FORMATS[name]
            quantized, dequantized = writer(dense, root, **kwargs)
            made[name] = quantized, make_family_case(dequantized, root, FAMILY_SPECS,
                                                     FAMILY_TEXTS, FAMILY_ADAPTER_NAMES,
                                                     MAX_NEW)
        return made[name]
    return get


@pytest.mark.parametrize("name", list(FORMATS))
def test_int4_base_mixed_batch_prefix_cache_matches_peft_on_dequantized(cases, name):
    quantized, case = cases(name)
    llm = LLM(str(quantized), **ENGINE, max_loras=2, enable_prefix_caching=True)
    with shutting_down(llm):
        generate_twice_from_prefix_cache(llm, case, GREEDY)


@pytest.mark.parametrize("name", ["gptq-asym-g32-act-order", "awq-g32", "ct-group-asym"])
def test_int4_base_tensor_parallel_2_matches_peft(cases, name):
    """Column-parallel q/k/v and gate/up take their output columns (packed words of 8),
    row-parallel o/down their input rows with their groups (all groups under act order)."""
    quantized, case = cases(name)
    llm = LLM(str(quantized), **ENGINE, max_loras=2, tensor_parallel_size=2)
    with shutting_down(llm):
        assert_greedy_matches(generate_greedy(llm, case, GREEDY), case)


def test_quantization_gptq_named_on_a_gptq_checkpoint_is_accepted(cases):
    """``manylora serve --quantization gptq`` (vLLM's flag) reaches the engine's
    ``quantization``; the engine built with it serves the checkpoint."""
    from manylora.engine.arg_utils import EngineArgs
    from manylora.entrypoints.openai.serve_args import serve_parser

    quantized, case = cases("gptq-sym-g32")
    flags = serve_parser().parse_args(["--model", str(quantized), "--quantization", "gptq"])
    assert EngineArgs.from_cli_args(flags).quantization == "gptq"
    llm = LLM(str(quantized), **ENGINE, max_loras=2, quantization="gptq")
    with shutting_down(llm):
        assert_greedy_matches(generate_greedy(llm, case, GREEDY), case)


def test_tensor_parallel_split_through_a_group_is_refused_naming_it(tmp_path):
    """down_proj's 96 inputs split over 2 ranks give each 48 rows: a group and a half of
    32."""
    dense = make_checkpoint(tmp_path / "dense", "llama", seed=0,
                            **{**TINY, "intermediate_size": 96})
    quantized, _ = write_int4_checkpoint(dense, tmp_path, "gptq", group_size=32)
    # whichever rank builds its down_proj first names its own rows
    cut = r"down_proj: tensor-parallel input rows \[(0, 48|48, 96)\) of 96 cut a group"
    with pytest.raises(Exception, match=cut):
        LLM(str(quantized), **ENGINE, tensor_parallel_size=2)


def test_quantization_awq_on_a_gptq_checkpoint_is_refused(cases):
    quantized, _ = cases("gptq-sym-g32")
    with pytest.raises(QuantizationError, match="quantized with 'gptq'"):
        LLM(str(quantized), **ENGINE, quantization="awq")


# one format under TP 2 (the real weights' TP 2 runs every format above)
@pytest.mark.parametrize("name, tp", [("gptq-sym-g32", 2), ("awq-g32", 1),
                                      ("ct-group-asym", 1)])
def test_int4_base_with_dummy_weights_serves(cases, name, tp):
    """``load_format="dummy"`` (the benchmarks' Llama-3-8B shapes) fills the packed
    tensors with random bits, sliced per rank like the real ones."""
    quantized, case = cases(name)
    llm = LLM(str(quantized), **ENGINE, load_format="dummy", tensor_parallel_size=tp)
    with shutting_down(llm):
        params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
        outputs = generate_greedy(llm, case, params)
        assert all(len(out.token_ids) == MAX_NEW for out in outputs)
