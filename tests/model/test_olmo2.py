"""OLMo 2 (``Olmo2ForCausalLM``) end to end against transformers + peft: greedy, token for
token, on a tiny checkpoint written by transformers' own ``save_pretrained``.

The reference runs every prompt alone through a ``PeftModel`` holding both adapters
(``hf_greedy_reference``); manylora runs them as one mixed batch with base rows, two
adapters of different ranks and targets (attention only; all seven linear layers) and one
adapter slot, with prefix caching (the batch runs twice, the second time from cached
prefixes), and under tensor parallelism 2 (gloo, CPU). The checkpoint's 6 query / 3 KV
heads split unevenly over 2 ranks (rank 0 holds two KV-head groups, rank 1 one), so the
q/k norms' all-reduced mean square and the norm weights' slices follow that split; an MQA
checkpoint (one KV head, replicated on both ranks) checks that the k norm counts the
replicated head once.
"""

from __future__ import annotations

import pytest

from manylora import LLM, SamplingParams
from manylora.config import LORA_TARGET_MODULES
from manylora.testing import (
    assert_greedy_matches,
    generate_greedy,
    generate_twice_from_prefix_cache,
    make_checkpoint,
    make_family_case,
    shutting_down,
)

TINY = dict(hidden_size=96, intermediate_size=128, num_hidden_layers=2, num_attention_heads=6,
            num_key_value_heads=3, max_position_embeddings=128)
ENGINE = dict(device="cpu", dtype="float32", max_lora_rank=8, block_size=4,
              max_model_len=128, num_kv_blocks=96, max_loras=1)
# Shared 9-token prefix: two full blocks cached per adapter on the second run.
PROMPTS = [[1, 17, 40, 33, 8, 91, 54, 23, 70, 5, 61],
           [1, 17, 40, 33, 8, 91, 54, 23, 70, 12],
           [1, 17, 40, 33, 8, 91, 54, 23, 70, 44, 9, 30],
           [1, 88, 3, 47],
           [1, 17, 40, 33, 8, 91, 54, 23, 70, 77]]
NAMES = [None, "attn", "all", "attn", "all"]
MAX_NEW = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
SPECS = {"attn": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj",
                                                          "o_proj"], seed=1),
         "all": dict(r=8, lora_alpha=16, target_modules=list(LORA_TARGET_MODULES), seed=2)}


@pytest.fixture(scope="module")
def olmo2(tmp_path_factory):
    root = tmp_path_factory.mktemp("olmo2")
    base = make_checkpoint(root / "base", "olmo2", seed=3, **TINY)
    case = make_family_case(base, root, SPECS, PROMPTS, NAMES, MAX_NEW)
    assert all(len(r.token_ids) == MAX_NEW for r in case.reference)
    return case


def test_registry_builds_olmo2(olmo2):
    from transformers import AutoConfig

    from manylora.config import ModelConfig
    from manylora.model.olmo2 import Olmo2ForCausalLM
    from manylora.model.registry import model_class

    cfg = ModelConfig.from_hf(AutoConfig.from_pretrained(olmo2.base_dir), dtype=None)
    assert cfg.architecture == "Olmo2ForCausalLM"
    assert model_class(cfg.architecture) is Olmo2ForCausalLM


def test_mixed_batch_with_prefix_caching_and_pieces_matches_peft(olmo2, monkeypatch):
    """One slot for two adapters and base rows; the second run starts from cached prefixes
    (under each adapter's own cache key) and still matches peft. Steps are padded to piece
    buckets and run piece by piece (on the CPU eagerly, over the pieces' static buffers), so
    the layer's methods compose along the piecewise CUDA graphs' cut."""
    from manylora.worker.piecewise_graphs import PiecewiseGraphs

    pieces = []
    real_run = PiecewiseGraphs.run

    def spy(self, key, *args, **kwargs):
        pieces.append(key)
        return real_run(self, key, *args, **kwargs)

    monkeypatch.setattr(PiecewiseGraphs, "run", spy)
    llm = LLM(str(olmo2.base_dir), **ENGINE, enable_prefix_caching=True,
              max_num_batched_tokens=32, piecewise_cuda_graph_sizes=(8, 32))
    with shutting_down(llm):
        generate_twice_from_prefix_cache(llm, olmo2, GREEDY)
        assert pieces


def _generate_tp2(case):
    llm = LLM(str(case.base_dir), **ENGINE, tensor_parallel_size=2)
    with shutting_down(llm):
        return generate_greedy(llm, case, GREEDY)


def test_tensor_parallel_2_matches_peft(olmo2):
    assert_greedy_matches(_generate_tp2(olmo2), olmo2)


def test_tensor_parallel_2_with_a_replicated_kv_head_matches_peft(tmp_path):
    base = make_checkpoint(tmp_path / "mqa", "olmo2", seed=5,
                           **{**TINY, "num_attention_heads": 4, "num_key_value_heads": 1,
                              "hidden_size": 64})
    case = make_family_case(base, tmp_path, {"all": {**SPECS["all"], "seed": 4}}, PROMPTS[:2],
                            [None, "all"], MAX_NEW)
    assert_greedy_matches(_generate_tp2(case), case)
