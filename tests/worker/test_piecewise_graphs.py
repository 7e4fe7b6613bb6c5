"""Piecewise steps (the model between attention calls, over token segments padded to a
bucket) against the eager forward pass of the same step unpadded.

The engine runs with piece buckets; every step it pads is also repacked without padding
(its LoRA mapping rebuilt by ``lora_kernel_meta_arrays`` over the real rows, the default
variant) and run through the plain eager forward on the same KV cache first; the hidden
states of the real rows must match (float32). On the CPU the pieces run eagerly over the
padded static buffers (the composition and the padded layout are what is checked); on a GPU
(``gpu``) the captured piece graphs replay, and the engine's tokens with piecewise graphs
equal those without.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from manylora import LLM, LoRARequest, SamplingParams
from manylora.lora.kernels.meta import (
    default_variant,
    fill_lora_segment,
    lora_kernel_meta_arrays,
    lora_segment_size,
)
from manylora.testing import (
    compare_greedy,
    hf_greedy_reference,
    make_checkpoint,
    make_peft_adapter,
)
from manylora.worker.step_inputs import (
    LORA_VARIANT_CODES,
    StepInputs,
    split_segments,
    total_size,
)

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)
TOKEN_SEGMENTS = ("ids", "positions", "token_rows")


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("pieces") / "base", "llama", seed=3, **TINY)


@pytest.fixture(scope="module")
def adapters(base_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("pieces-loras")
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    return [LoRARequest(f"a{i}", i, str(make_peft_adapter(
        base_dir, root / f"a{i}", r=(2, 4, 8)[i - 1], target_modules=targets, seed=i)))
        for i in (1, 2, 3)]


def unpadded(inputs: StepInputs, max_loras: int) -> StepInputs:
    """The same step without token padding: the token segments cut to the real rows, the
    LoRA mapping rebuilt over them (default variant), every other segment as it is."""
    layout = inputs.layout
    host = split_segments(inputs.data, layout, max_loras)
    t = int(host["query_lens"].sum())               # the sequence segments are unpadded
    m = max_loras
    variant, max_seg_len, lora, block_m, num_tiles = 0, 0, None, 0, 0
    if layout.variant:
        buf = host["lora"]
        arrays = lora_kernel_meta_arrays(buf[:t].astype(np.int64), m)
        name, block_m = default_variant(arrays.seg_len, m)
        variant = LORA_VARIANT_CODES.index(name)
        max_seg_len = arrays.max_seg_len
        lora = np.zeros(lora_segment_size(t, m, t), np.int32)
        num_tiles = fill_lora_segment(lora, arrays, block_m)
        lora = lora[:lora_segment_size(t, m, num_tiles)]
    plain = layout._replace(num_tokens=t, pieces=-1, variant=variant,
                            max_seg_len=max_seg_len, lora_block_m=block_m,
                            lora_tiles=num_tiles)
    data = np.zeros(total_size(plain, m), np.int32)
    v = split_segments(data, plain, m)
    for name, dst in v.items():
        if name == "lora":
            dst[:] = lora
        else:
            dst[:] = host[name][:t] if name in TOKEN_SEGMENTS else host[name]
    return StepInputs(plain, data)


def _compare_pieces_with_eager(llm, atol: float) -> list:
    """Wrap the runner's ``forward_step``: each piecewise step runs unpadded and eager
    first, then padded through the pieces; returns ``(bucket, variant, captured)`` of
    each step compared."""
    runner = llm.llm_engine.engine_core.executor.runner
    original = runner.forward_step
    compared = []

    def checked(inputs, prev_sampled=None):
        layout = inputs.layout
        if layout.pieces < 0:
            return original(inputs, prev_sampled)
        saved = StepInputs(layout, inputs.data.copy())  # the host buffer is reused below
        plain = unpadded(saved, runner.max_loras)
        eager, _ = original(plain, prev_sampled)
        eager = eager.clone()
        hidden, views = original(saved, prev_sampled)
        t = plain.layout.num_tokens
        assert hidden.shape[0] == layout.pieces > t or layout.pieces == t
        torch.testing.assert_close(hidden[:t], eager, rtol=atol, atol=atol)
        key = (layout.pieces, LORA_VARIANT_CODES[layout.variant])
        compared.append((layout.pieces, layout.variant, runner.pieces.has(key)))
        return hidden, views

    runner.forward_step = checked
    return compared


def _recorded(run, keys: list, key, *args):
    keys.append(key)
    return run(key, *args)


def _workload(adapters, n: int = 10):
    prompts = [{"prompt_token_ids": [1 + (11 * i + 7 * j) % 200 for j in range(3 + 4 * i)]}
               for i in range(n)]
    loras = [[None, *adapters][i % 4] for i in range(n)]
    return prompts, loras


@pytest.mark.parametrize("enable_lora", [True, False])
def test_padded_piecewise_steps_equal_the_unpadded_eager_step(base_dir, adapters,
                                                              enable_lora):
    """Prefill chunks, mixed prefill + decode and decode steps padded to a bucket give,
    on the real rows, the hidden states of the same step unpadded and eager (float32),
    with LoRA rows of three adapters and base rows in one step, and without LoRA."""
    llm = LLM(str(base_dir), device="cpu", dtype="float32", skip_tokenizer_init=True,
              max_loras=3, max_lora_rank=8, block_size=4, max_model_len=96,
              max_num_batched_tokens=24, num_kv_blocks=64, enable_lora=enable_lora,
              piecewise_cuda_graph_sizes=(4, 8, 16, 32))
    runner = llm.llm_engine.engine_core.executor.runner
    assert runner.pieces.sizes == (4, 8, 16, 24)
    compared = _compare_pieces_with_eager(llm, 1e-5)
    prompts, loras = _workload(adapters if enable_lora else [None] * 3)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    llm.generate(prompts, params, loras, use_tqdm=False)
    buckets = {tb for tb, _, _ in compared}
    assert len(buckets) >= 3, buckets
    with_lora = [tb for tb, variant, _ in compared if variant]
    if enable_lora:
        assert all(LORA_VARIANT_CODES[s] in (None, "tiled") for _, s, _ in compared)
        assert len(set(with_lora)) >= 2, "steps with LoRA rows in several buckets"
    else:
        assert not with_lora


def test_engine_outputs_with_piece_buckets_equal_those_without(base_dir, adapters):
    """Greedy, seeded and logprob requests through chunked prefills and preemption: the
    same tokens and log-probabilities with piece buckets on and off."""
    prompts, loras = _workload(adapters, 12)
    params = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
              if i % 3 == 0 else
              SamplingParams(temperature=0.8, top_k=20, seed=i, max_tokens=7, ignore_eos=True)
              if i % 3 == 1 else SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)
              for i in range(len(prompts))]
    outs = {}
    for sizes in ((), (8, 16, 32)):
        llm = LLM(str(base_dir), device="cpu", dtype="float32", skip_tokenizer_init=True,
                  max_loras=2, max_lora_rank=8, block_size=4, max_model_len=96,
                  max_num_batched_tokens=20, num_kv_blocks=22,
                  piecewise_cuda_graph_sizes=sizes)
        core = llm.llm_engine.engine_core
        pieces = core.executor.runner.pieces
        assert (pieces is None) == (not sizes)
        runs = []
        if pieces is not None:
            pieces.run = functools.partial(_recorded, pieces.run, runs)
        outs[sizes] = llm.generate(prompts, params, loras, use_tqdm=False)
        assert core.scheduler.num_preemptions > 0
        assert bool(sizes) == (len({tb for tb, _ in runs}) == 3)     # every bucket used
        assert llm.llm_engine.kv_cache_stats().used_blocks == 0
    for a, b in zip(outs[()], outs[(8, 16, 32)]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids, a.request_id
        for x, y in zip(a.outputs[0].logprobs or [], b.outputs[0].logprobs or []):
            assert x.keys() == y.keys()
            assert all(abs(x[k].logprob - y[k].logprob) < 1e-4 for k in x)


def test_greedy_outputs_with_piece_buckets_match_peft(base_dir, adapters):
    """Against transformers + peft on the same weights: mixed adapters and base rows,
    prefills chunked over piecewise steps."""
    prompts = [[5 + i, 17, 3 * i + 1, 40, 2] * (1 + i) for i in range(6)]
    loras = [None, *adapters, adapters[0], None]
    llm = LLM(str(base_dir), device="cpu", dtype="float32", skip_tokenizer_init=True,
              max_loras=3, max_lora_rank=8, block_size=4, max_model_len=96,
              max_num_batched_tokens=16, num_kv_blocks=64, piecewise_cuda_graph_sizes=(8, 16))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, loras,
                        use_tqdm=False)
    refs = hf_greedy_reference(base_dir, {a.lora_name: a.lora_path for a in adapters},
                               prompts, [a.lora_name if a else None for a in loras], 8)
    for out, ref in zip(outs, refs):
        ok, where = compare_greedy(out.outputs[0].token_ids, ref)
        assert ok, where


# ---------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("max_loras", [0, 3])
def test_piecewise_graph_replay_equals_the_eager_step(base_dir, adapters, max_loras):
    """On a GPU every piecewise step replays captured piece graphs (all keys captured at
    start-up: L + 1 per bucket and variant), and its real rows equal the unpadded eager
    step (float32; SGMV against the eager step's own variant)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    llm = LLM(str(base_dir), device="cuda", dtype="float32", skip_tokenizer_init=True,
              max_loras=max(max_loras, 1), max_lora_rank=8, block_size=4, max_model_len=96,
              max_num_batched_tokens=24, enable_lora=bool(max_loras), max_num_seqs=8,
              piecewise_cuda_graph_sizes=(4, 8, 16, 32))
    runner = llm.llm_engine.engine_core.executor.runner
    variants = 2 if max_loras else 1
    assert runner.pieces.num_graphs == (TINY["num_hidden_layers"] + 1) * 4 * variants
    compared = _compare_pieces_with_eager(llm, 1e-4)
    prompts, loras = _workload(adapters if max_loras else [None] * 3)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    llm.generate(prompts, params, loras, use_tqdm=False)
    assert len(compared) > 5 and all(captured for _, _, captured in compared)
    assert bool(max_loras) == any(variant for _, variant, _ in compared)


@pytest.mark.gpu
def test_engine_tokens_with_piecewise_graphs_equal_those_without_on_gpu(base_dir, adapters):
    """The engine's greedy tokens with piecewise CUDA graphs (default buckets) equal its
    tokens with them off, decode graphs on in both, through chunked prefills and
    preemption."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    prompts, loras = _workload(adapters, 12)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outs = {}
    for sizes in ((), None):
        llm = LLM(str(base_dir), device="cuda", dtype="float32", skip_tokenizer_init=True,
                  max_loras=2, max_lora_rank=8, block_size=4, max_model_len=96,
                  max_num_batched_tokens=32, num_kv_blocks=24, max_num_seqs=8,
                  piecewise_cuda_graph_sizes=sizes)
        core = llm.llm_engine.engine_core
        assert core.executor.runner.graphs is not None
        assert (core.executor.runner.pieces is None) == (sizes == ())
        outs[sizes] = [o.outputs[0].token_ids
                       for o in llm.generate(prompts, params, loras, use_tqdm=False)]
        assert core.scheduler.num_preemptions > 0
        del llm
    assert outs[()] == outs[None]
