"""GGUF checkpoints: ``GGUFCheckpoint`` and the engine on a ``.gguf`` file.

References: transformers' own GGUF loading (``load_gguf_checkpoint`` /
``AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)``, float32) for
SmolLM2-135M-Instruct's Q4_1 GGUF; for tiny files written here with the ``gguf`` package
(llama.cpp's Q/K permutation, ``manylora.testing.gguf``), the Hugging Face checkpoint they were
written from (F32: the round trip is exact) and transformers (Q8_0).
"""

from __future__ import annotations

import gguf
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from manylora import LLM, SamplingParams
from manylora.checkpoint.gguf import GGUFCheckpoint, gguf_config, gguf_model_names, is_gguf
from manylora.checkpoint.weights import CheckpointError, ModelWeightsLoader, TPSlice
from manylora.config import ModelConfig
from manylora.lora.formats.trtllm_convert import _BaseWeights
from manylora.model.loader import load_hf_config
from manylora.structured_params import StructuredOutputsParams
from manylora.testing import make_checkpoint
from manylora.testing.gguf import write_gguf

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)
Q8_0 = gguf.GGMLQuantizationType.Q8_0
F32 = gguf.GGMLQuantizationType.F32
QUESTIONS = ["What is the capital of France?", "Name three primary colors."]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """``{arch: (checkpoint dir, {qtype name: gguf path})}`` for llama and qwen2."""
    root = tmp_path_factory.mktemp("gguf")
    out = {}
    for arch in ("llama", "qwen2"):
        ckpt = make_checkpoint(root / arch, arch, seed=1, **TINY)
        out[arch] = (ckpt, {q.name: write_gguf(ckpt, root / f"{arch}-{q.name}.gguf", q)
                            for q in (F32, Q8_0)})
    return out


@pytest.fixture(scope="module")
def smol_ckpt(smollm2_gguf):
    return GGUFCheckpoint(smollm2_gguf)


@pytest.fixture(scope="module")
def smol_llm(smollm2_llm):
    return smollm2_llm


def test_smollm2_tensors_equal_transformers(smol_ckpt, smollm2_hf_model):
    ref = smollm2_hf_model.state_dict()
    assert smol_ckpt.config.tie_word_embeddings and "lm_head.weight" not in smol_ckpt.keys()
    assert set(smol_ckpt.keys()) == set(ref) - {"lm_head.weight"}
    for key in smol_ckpt.keys():
        assert torch.equal(smol_ckpt.get_tensor(key), ref[key]), key


@pytest.mark.parametrize("key, index", [
    ("model.layers.2.self_attn.q_proj.weight", (slice(192, 384),)),        # 3 of 9 heads
    ("model.layers.2.self_attn.k_proj.weight", (slice(64, 128),)),         # 1 of 3 KV heads
    ("model.layers.2.self_attn.q_proj.weight", (slice(100, 300),)),        # not whole heads
    ("model.layers.2.mlp.gate_proj.weight", (slice(512, 1024),)),
    ("model.embed_tokens.weight", (slice(16384, 32768), slice(None))),
    ("model.layers.2.mlp.down_proj.weight", (slice(None), slice(512, 1024))),  # Q4_1 blocks
    ("model.layers.2.mlp.down_proj.weight", (slice(None), slice(10, 700))),    # inside blocks
    ("model.layers.2.self_attn.o_proj.weight", (slice(None), slice(192, 384))),
    ("model.norm.weight", (slice(100, 200),)),
])
def test_smollm2_slices_equal_cuts(smol_ckpt, smollm2_hf_model, key, index):
    whole = smollm2_hf_model.state_dict()[key]
    view = smol_ckpt.get_slice(key)
    assert view.get_shape() == list(whole.shape)
    assert torch.equal(view[index], whole[index])


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_gguf_round_trip(tiny, arch):
    ckpt, files = tiny[arch]
    original = load_file(str(ckpt / "model.safetensors"))
    exact = GGUFCheckpoint(files["F32"])
    assert set(exact.keys()) == set(original)
    for key in exact.keys():  # llama.cpp's permutation undone exactly
        assert torch.equal(exact.get_tensor(key), original[key]), key
    if arch == "qwen2":
        assert "model.layers.0.self_attn.q_proj.bias" in exact.keys()
    quant = GGUFCheckpoint(files["Q8_0"])
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(quant.config)
    ref = load_gguf_checkpoint(str(files["Q8_0"]), return_tensors=True,
                               model_to_load=meta)["tensors"]
    for key in quant.keys():
        whole = ref[key]
        assert torch.equal(quant.get_tensor(key), whole), key
        rows = whole.shape[0]
        for part in (slice(0, rows // 2), slice(rows // 2, rows)):
            assert torch.equal(quant.get_slice(key)[part], whole[part]), key
        if whole.ndim == 2:
            for part in (slice(0, 32), slice(32, whole.shape[1]), slice(5, 40)):
                assert torch.equal(quant.get_slice(key)[:, part], whole[:, part]), key


def test_weights_loader_reads_gguf(tiny):
    ckpt, files = tiny["llama"]
    loader = ModelWeightsLoader(files["Q8_0"])
    assert loader.format == "gguf"
    qkv = loader.load("model.layers.1.self_attn.qkv_proj.weight")
    assert [t.shape[0] for t in qkv] == [64, 32, 32]
    part = loader.load_part("model.layers.1.self_attn.k_proj.weight",
                            TPSlice(0, 16, 32, 32, 16))
    assert torch.equal(part, loader.load("model.layers.1.self_attn.k_proj.weight")[0][16:32])
    dora_base = _BaseWeights(files["Q8_0"])           # DoRA's base weights read the GGUF too
    assert torch.equal(dora_base.weight(1, "qkv_proj"), torch.cat(qkv))


def test_smollm2_engine_weights_equal_transformers(smol_llm, smollm2_hf_model):
    model = smol_llm.llm_engine.engine_core.executor.model
    ref = smollm2_hf_model.state_dict()
    packed = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    params = dict(model.named_parameters())
    assert params
    for name, param in params.items():
        parts = [name]
        for ours, theirs in packed.items():
            if f".{ours}." in name:
                parts = [name.replace(ours, t) for t in theirs]
        expected = torch.cat([ref[p] for p in parts], dim=0)
        assert torch.equal(param.detach(), expected), name


def _hf_greedy(model, tokenizer, text, max_new_tokens):
    ids = tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, do_sample=False, max_new_tokens=max_new_tokens,
                             pad_token_id=tokenizer.eos_token_id)
    return out[0, ids.shape[1]:].tolist()


def _chat(tokenizer, question):
    return tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                         tokenize=False, add_generation_prompt=True)


def test_smollm2_engine_greedy_equals_transformers(smol_llm, smollm2_hf_model,
                                                   smollm2_tokenizer):
    engine = smol_llm.llm_engine
    assert 2 in engine.eos_token_ids                         # <|im_end|>, from the GGUF
    assert engine.tokenizer.chat_template == smollm2_tokenizer.chat_template
    prompts = [_chat(smollm2_tokenizer, q) for q in QUESTIONS]
    outs = smol_llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12),
                             use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        ref = _hf_greedy(smollm2_hf_model, smollm2_tokenizer, prompt, 12)
        assert list(out.outputs[0].token_ids) == ref, prompt
    assert "Paris" in outs[0].outputs[0].text


def test_smollm2_structured_output_uses_gguf_tokenizer(smol_llm, smollm2_tokenizer):
    """xgrammar's tokenizer info is built from the GGUF's tokenizer: the output is one of
    the choices, in the GGUF tokenizer's tokens."""
    choices = ["Paris", "London", "Berlin"]
    params = SamplingParams(temperature=0.0, max_tokens=8,
                            structured_outputs=StructuredOutputsParams(choice=choices))
    out = smol_llm.generate([_chat(smollm2_tokenizer, QUESTIONS[0])], params, use_tqdm=False)
    completion = out[0].outputs[0]
    assert completion.text in choices
    assert smollm2_tokenizer.decode(completion.token_ids, skip_special_tokens=True) in choices


def test_tensor_parallel_gguf_equals_one_rank(tiny):
    """tensor_parallel_size 2 on a Q8_0 GGUF (rows and block-aligned columns read per rank)
    gives the tokens of the same file on one rank."""
    _, files = tiny["llama"]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 17, 33, 2, 90]}, {"prompt_token_ids": [7, 7, 101]}]
    engine = dict(device="cpu", dtype="float32", max_model_len=128, block_size=4,
                  num_kv_blocks=64, enable_lora=False, skip_tokenizer_init=True)
    results = []
    for tp in (1, 2):
        llm = LLM(str(files["Q8_0"]), **engine, tensor_parallel_size=tp)
        try:
            results.append([list(o.outputs[0].token_ids)
                            for o in llm.generate(prompts, params, use_tqdm=False)])
        finally:
            llm.llm_engine.shutdown()
    assert results[0] == results[1]


def test_unserved_architecture_is_named(tiny, tmp_path):
    ckpt, _ = tiny["llama"]
    stablelm = write_gguf(ckpt, tmp_path / "stablelm.gguf", architecture="stablelm")
    assert is_gguf(stablelm)
    with pytest.raises(ValueError, match="unsupported architecture.*stablelm"):
        ModelConfig.from_hf(load_hf_config(stablelm), torch.float32)
    with pytest.raises(ValueError, match="unsupported architecture.*stablelm"):
        LLM(str(stablelm), device="cpu", dtype="float32", skip_tokenizer_init=True)
    gemma = write_gguf(ckpt, tmp_path / "gemma.gguf", architecture="gemma")
    with pytest.raises(CheckpointError, match="gemma.gguf.*'gemma'"):
        gguf_config(gemma)


def test_split_and_corrupt_gguf_are_refused(tiny, tmp_path):
    ckpt, files = tiny["llama"]
    split = write_gguf(ckpt, tmp_path / "split-00001-of-00002.gguf", metadata={
        "split.count": 2, "split.no": 0})
    with pytest.raises(CheckpointError, match="split GGUF.*merge"):
        ModelWeightsLoader(split)
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(files["F32"].read_bytes()[:300])
    with pytest.raises(CheckpointError, match="corrupt.gguf"):
        load_hf_config(corrupt)
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(CheckpointError, match="garbage.gguf"):
        ModelWeightsLoader(garbage)


def test_undequantizable_tensor_is_named(tiny, tmp_path):
    ckpt, _ = tiny["llama"]
    key = "model.layers.0.input_layernorm.weight"
    path = write_gguf(ckpt, tmp_path / "f64.gguf", float64=(key,))
    checkpoint = GGUFCheckpoint(path)
    try:
        gguf.dequantize(checkpoint._tensors[key].data, gguf.GGMLQuantizationType.F64)
    except NotImplementedError:
        pass
    else:
        pytest.skip("this gguf package dequantizes F64")
    with pytest.raises(CheckpointError, match="blk.0.attn_norm.weight.*F64.*cannot dequantize"):
        checkpoint.get_tensor(key)



@pytest.mark.parametrize("name, names", [
    ("SmolLM2-135M-Instruct.Q4_1.gguf", ("SmolLM2-135M-Instruct",)),
    ("Meta-Llama-3-8B-Instruct-Q4_K_M.gguf", ("Meta-Llama-3-8B-Instruct",)),
    ("qwen2-0_5b-instruct-iq2_xs.gguf", ("qwen2-0_5b-instruct",)),
    ("mistral-7b.BF16.gguf", ("mistral-7b",)),
    ("model.gguf", ()),
])
def test_gguf_model_names_drop_the_quantization_suffix(name, names):
    # an adapter's base_model_name_or_path names the model, not the quantized file
    assert gguf_model_names(f"/models/{name}") == names
