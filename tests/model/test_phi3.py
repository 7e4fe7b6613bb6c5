"""Phi-3 / Phi-4 (``Phi3ForCausalLM``: fused ``qkv_proj`` and ``gate_up_proj`` in the
checkpoint, RoPE on the first ``partial_rotary_factor`` of each head, ``longrope``) against
transformers + peft on the same weights, greedy, token for token.

The checkpoints are written by transformers' own ``save_pretrained`` (``make_checkpoint``),
the adapters by peft's (``make_peft_adapter``) on Phi-3's own module names: attention only
(``qkv_proj`` and ``o_proj`` of different ranks), every linear layer, and a DoRA one over
the fused ``qkv_proj``. manylora runs them as one mixed batch with the base model, through
a single slot (fewer slots than adapters), twice so that the second pass reads the prefix
cache, and under tensor parallelism 2 (gloo, CPU) with 6 query / 3 KV heads, which split
unevenly. The reference runs each prompt alone (``hf_greedy_reference``).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import Phi3Config

from manylora import LLM, SamplingParams
from manylora.config import ModelConfig, SchedulerConfig
from manylora.model.phi3 import Phi3ForCausalLM
from manylora.model.registry import model_class
from manylora.request import Request
from manylora.scheduler.kv_cache_manager import KVCacheManager
from manylora.scheduler.scheduler import Scheduler
from manylora.testing import (
    FAMILY_ADAPTER_NAMES,
    FAMILY_TEXTS,
    assert_greedy_matches,
    generate_greedy,
    generate_twice_from_prefix_cache,
    make_checkpoint,
    make_family_case,
    shutting_down,
)

# head_dim 16, rotary on its first 12 (Phi-4-mini's factor)
TINY = dict(hidden_size=96, intermediate_size=96, num_hidden_layers=2, num_attention_heads=6,
            num_key_value_heads=3, max_position_embeddings=256, partial_rotary_factor=0.75)
ENGINE = dict(device="cpu", dtype="float32", max_lora_rank=8, block_size=4, num_kv_blocks=64,
              max_model_len=128)
MAX_NEW = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
SPECS = {"attn": dict(r=4, target_modules=["qkv_proj", "o_proj"], rank_pattern={"o_proj": 2}),
         "all": dict(r=8, target_modules="all-linear"),
         "dora": dict(r=2, target_modules=["qkv_proj", "down_proj"], use_dora=True)}


def test_phi3_resolves_by_transformers_name():
    hf = Phi3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                    num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                    max_position_embeddings=64)
    cfg = ModelConfig.from_hf(hf, torch.float32)
    assert cfg.architecture == "Phi3ForCausalLM"
    assert (cfg.qkv_bias, cfg.o_bias, cfg.mlp_bias) == (False, False, False)
    assert model_class(cfg.architecture) is Phi3ForCausalLM


def _family(root, prompts, adapter_names, specs, max_new, **checkpoint_kwargs):
    base = make_checkpoint(root / "base", "phi3", seed=0, **checkpoint_kwargs)
    return make_family_case(base, root, specs, prompts, adapter_names, max_new)


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    return _family(tmp_path_factory.mktemp("phi3"), FAMILY_TEXTS, FAMILY_ADAPTER_NAMES, SPECS,
                   MAX_NEW, **TINY)


def _trtllm_adapters(adapters, base, root):
    """The all-linear and the DoRA adapters converted to TensorRT-LLM's tensors
    (``peft_to_trtllm``, the DoRA magnitudes normalized against the fused base weights):
    Phi-3's ``qkv_proj`` and ``gate_up_proj`` become rows of module ids 0 (``attn_qkv``) and
    18 (``mlp_gate_up``), and no q/k/v, gate or up rows of their own."""
    from manylora.lora.formats.trtllm_convert import peft_to_trtllm
    from manylora.lora.formats.trtllm_npy import write_trtllm_dir

    converted = {}
    for name in ("all", "dora"):
        weights, config = peft_to_trtllm(adapters[name], torch.float32, base)
        assert set(config[0, :, 0].tolist()) == ({0, 4, 6, 18} if name == "all" else {0, 6})
        converted[f"trt-{name}"] = write_trtllm_dir(root / name, weights, config)
    return converted


def test_phi3_mixed_batch_one_slot_prefix_cache_matches_peft(phi3, tmp_path):
    """The peft adapters twice (the second pass from the prefix cache), then the
    TensorRT-LLM conversions of two of them (``_trtllm_adapters``), which manylora splits
    onto the q/k/v and gate/up slices again."""
    llm = LLM(str(phi3.base_dir), **ENGINE, max_loras=1, enable_prefix_caching=True)
    with shutting_down(llm):
        first, second = generate_twice_from_prefix_cache(llm, phi3, GREEDY)
        assert first >= len(phi3.adapters)
        assert second >= first + len(phi3.adapters) - 1
        converted = _trtllm_adapters(phi3.adapters, phi3.base_dir, tmp_path)
        trt = dataclasses.replace(phi3, adapters={**phi3.adapters, **converted},
                                  prompts=phi3.prompts[3:], adapter_names=["trt-all", "trt-dora"],
                                  reference=phi3.reference[3:])
        assert_greedy_matches(generate_greedy(llm, trt, GREEDY), trt)


def test_phi3_tensor_parallel_2_uneven_heads_matches_peft(phi3):
    """3 KV heads over 2 ranks: rank 0 takes rows of KV heads 0-1 and query heads 0-3 out
    of each fused ``qkv_proj``, rank 1 the rest; each rank its half of ``gate`` and of
    ``up`` out of ``gate_up_proj``. The steps run as the piecewise CUDA graphs' pieces
    (eager on CPU)."""
    llm = LLM(str(phi3.base_dir), **ENGINE, max_loras=2, tensor_parallel_size=2,
              piecewise_cuda_graph_sizes=(8, 16, 32))
    with shutting_down(llm):
        assert_greedy_matches(generate_greedy(llm, phi3, GREEDY), phi3)


def test_phi3_gguf_fused_tensors_match_transformers_peft(tmp_path):
    """A Phi-3 GGUF (Q8_0, llama.cpp's fused ``attn_qkv`` and ``ffn_up``; Phi-3's 32064-token
    vocabulary) against transformers' own GGUF loading + peft. transformers reads no
    ``partial_rotary_factor`` from a GGUF, so the rotary is whole."""
    import gguf

    from manylora.testing.gguf import write_gguf

    tiny = {k: v for k, v in TINY.items() if k != "partial_rotary_factor"}
    ckpt = make_checkpoint(tmp_path / "hf", "phi3", seed=2, **tiny)
    path = write_gguf(ckpt, tmp_path / "phi3.gguf", qtype=gguf.GGMLQuantizationType.Q8_0)
    case = make_family_case(path, tmp_path, {"all": dict(r=4, target_modules="all-linear", seed=3)},
                            [[1, 40, 41, 42, 43], [1, 7, 9]], ["all", None], MAX_NEW)
    llm = LLM(str(path), **ENGINE, max_loras=1, skip_tokenizer_init=True)
    with shutting_down(llm):
        assert_greedy_matches(generate_greedy(llm, case, GREEDY), case)

# longrope past 16 positions (Phi-3-mini-128k's scheme at a tiny scale), rotary dim 12
LONG_SHORT = [1.0, 1.2, 1.5, 2.0, 3.0, 4.0]
LONG_LONG = [1.5, 3.0, 6.0, 12.0, 24.0, 48.0]
LONG_NEW = 10
_PREFIX = [40 + i for i in range(12)]
# 5 + 10 stays short; 12 + 10 crosses 16 while decoding; 16 + 10 is long from its first
# generated token; 20 (the 12-token prompt's prefix and 8 more) is long from position 0
LONG_PROMPTS = [[7, 9, 11, 13, 15], _PREFIX, [60 + i for i in range(16)],
                _PREFIX + [90 + i for i in range(8)]]
LONG_ADAPTERS = [None, "all", None, "all"]


@pytest.fixture(scope="module")
def phi3_longrope(tmp_path_factory):
    return _family(tmp_path_factory.mktemp("phi3_longrope"), LONG_PROMPTS, LONG_ADAPTERS,
                   {"all": SPECS["all"]}, LONG_NEW, **TINY, original_max_position_embeddings=16,
                   rope_scaling={"rope_type": "longrope", "short_factor": LONG_SHORT,
                                 "long_factor": LONG_LONG})


def test_phi3_longrope_short_and_long_sequences_in_one_batch_match_transformers(
        phi3_longrope):
    """Each sequence takes the short or the long factors by its own length, as
    transformers' ``longrope_frequency_update`` does for that sequence alone, and a
    sequence that grows past the original length while decoding is computed again with the
    long factors, as Phi-3's ``generate`` does: one batch holds a sequence that stays short,
    two that turn long while decoding and a prompt longer than the original length,
    computed in chunks of 8 tokens. The 20-token prompt shares its first 12 tokens (3
    blocks) with a short one under the same adapter, but not their rotation: the second
    pass, which reads the prefix cache, must not give it the short one's blocks."""
    params = SamplingParams(temperature=0.0, max_tokens=LONG_NEW)
    llm = LLM(str(phi3_longrope.base_dir), **ENGINE, max_loras=1, enable_prefix_caching=True,
              max_num_batched_tokens=8)
    with shutting_down(llm):
        generate_twice_from_prefix_cache(llm, phi3_longrope, params)


def test_longrope_sequence_growing_past_the_original_length_is_computed_again():
    """The scheduler alone (no model): a request of 6 tokens under ``long_rope_after=8``
    decodes short up to 8 tokens; the step that would compute its 9th token gives its
    blocks back and computes all 9 again (in the same step, as a new request for the
    runner), marked ``long_rope``, not counted as a preemption; under async scheduling
    (its token still in flight) it waits one step for that token first."""
    sched = Scheduler(SchedulerConfig(4, 64, 1), KVCacheManager(32, 4), long_rope_after=8)
    req = Request("r", None, list(range(100, 106)), SamplingParams(max_tokens=20), None, 26)
    sched.add_request(req)
    for _ in range(3):                     # the prompt, then 7 and 8 tokens held
        out = sched.schedule()
        sched.update(out, {"r": 5})
        assert not req.long_rope and not out.preempted
    out = sched.schedule()                 # the 9th token: computed again, from 0
    assert out.preempted == ["r"]
    assert [(s.start, s.num_tokens, s.sample) for s in out.scheduled] == [(0, 9, True)]
    assert [n.req_id for n in out.scheduled_new_reqs] == ["r"]
    assert req.long_rope and req.num_preemptions == 0
    sched.update(out, {"r": 5})
    out = sched.schedule()                 # long from then on: plain decode
    assert not out.preempted and [(s.start, s.num_tokens) for s in out.scheduled] == [(9, 1)]

    async_req = Request("a", None, list(range(200, 208)), SamplingParams(max_tokens=20),
                        None, 28)
    sched.add_request(async_req)
    sched.update(out, {"r": 5})
    first = sched.schedule()               # its 8-token prompt: sampled, not yet arrived
    second = sched.schedule()              # 9 tokens with one in flight: it waits
    assert "a" not in [s.request.request_id for s in second.scheduled]
    sched.update(first, {"a": 5, "r": 5})
    sched.update(second, {"r": 5})
    third = sched.schedule()
    assert third.preempted == ["a"] and async_req.long_rope
    assert [(s.start, s.num_tokens) for s in third.scheduled
            if s.request.request_id == "a"] == [(0, 9)]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the Triton path needs CUDA"))])
def test_rotary_partial_longrope_rows_match_transformers(device):
    """``RotaryEmbedding`` (PyTorch on CPU, Triton on CUDA) over the first 12 of 16
    elements of each head, its short and long rows against transformers' own
    ``Phi3RotaryEmbedding`` and ``apply_rotary_pos_emb`` at a sequence length on each side
    of ``original_max_position_embeddings``."""
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding, apply_rotary_pos_emb

    from manylora.model.layers.rotary import RotaryEmbedding, rope_rows

    hf = Phi3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                    max_position_embeddings=256, original_max_position_embeddings=16,
                    partial_rotary_factor=0.75,
                    rope_scaling={"rope_type": "longrope", "short_factor": LONG_SHORT,
                                  "long_factor": LONG_LONG})
    ours = RotaryEmbedding(hf, 16, 64).to(device)
    assert (ours.rotary_dim, ours.long_rows) == (12, (16, 64))
    gen = torch.Generator().manual_seed(0)
    for seq_len in (16, 40):                                      # short, then long
        positions = torch.arange(seq_len)
        q = torch.randn(seq_len, 4, 16, generator=gen)
        k = torch.randn(seq_len, 2, 16, generator=gen)
        cos, sin = Phi3RotaryEmbedding(hf)(q, positions[None])
        want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                              cos, sin)
        rows = torch.from_numpy(rope_rows(positions.numpy(), positions.numpy() * 0 + seq_len,
                                          ours.long_rows))
        got_q, got_k = ours(rows.to(device), q.to(device), k.to(device))
        torch.testing.assert_close(got_q.cpu(), want_q[0].transpose(0, 1))
        torch.testing.assert_close(got_k.cpu(), want_k[0].transpose(0, 1))
