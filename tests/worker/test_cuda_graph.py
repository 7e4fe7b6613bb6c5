"""Decode steps as CUDA graphs: buckets on CPU; capture, replay and adapter churn
against eager execution and transformers + peft on a GPU."""

from __future__ import annotations

import pytest

from manylora import LLM, LoRARequest, SamplingParams
from manylora.worker.cuda_graph import DecodeGraphs


def test_buckets_pad_up_and_stop_at_the_largest():
    graphs = DecodeGraphs((8, 1, 4))
    assert [graphs.bucket(n) for n in (1, 2, 4, 5, 8, 9)] == [1, 4, 4, 8, 8, None]


def _ids(demo_set):
    return {name: i + 1 for i, name in enumerate(demo_set.adapters)}


@pytest.mark.gpu
def test_graphs_equal_eager_and_survive_adapter_churn(demo_set):
    """Decode through graphs gives the eager path's tokens, bit for bit (float32), while two
    slots cycle four adapters; no step captures a new all-projection graph after start-up
    (graphs of fewer projections, ``worker/graph_masks.py``, may be)."""
    names = list(demo_set.adapters) * 3 + [None] * 3
    ids = _ids(demo_set)
    loras = [None if n is None else LoRARequest(n, ids[n], str(demo_set.adapters[n]))
             for n in names]
    prompts = [{"prompt_token_ids": list(range(3 + i, 10 + 2 * i))} for i in range(len(names))]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = {}
    for eager in (True, False):
        llm = LLM(str(demo_set.base_dir), device="cuda", dtype="float32", max_loras=2,
                  max_lora_rank=32, max_num_seqs=8, enforce_eager=eager)
        runner = llm.llm_engine.engine_core.executor.runner
        captured = 0 if eager else runner.graphs.num_graphs
        outs[eager] = [o.outputs[0].token_ids
                       for o in llm.generate(prompts, params, loras, use_tqdm=False)]
        if not eager:
            assert captured == 3 * len(runner.graphs.capture_sizes)
            full = runner.graphs.policy.full_mask
            assert sum(k[2] == full for k in runner.graphs.keys) == captured
            # four adapters through two slots: adapters were evicted and loaded between steps
            assert llm.llm_engine.lora_cache_stats().device_misses >= len(demo_set.adapters)
        del llm
    assert outs[False] == outs[True]
