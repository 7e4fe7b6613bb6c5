"""Fair sharing between client groups changes when requests run, never what they produce:
every greedy output equals the same workload's under ``scheduling_policy="fcfs"`` (itself
checked token for token against transformers + peft in test_peft_equivalence.py), while
preemptions for fairness happen (async scheduling on, prefix cache on, an adapter)."""

from __future__ import annotations

import pytest

from manylora import LLM, LoRARequest, SamplingParams
from manylora.testing import make_checkpoint, make_peft_adapter

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)
ENGINE = dict(max_lora_rank=8, block_size=4, max_model_len=128, device="cpu", dtype="float32",
              skip_tokenizer_init=True, max_loras=2, max_num_seqs=4)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("fair") / "base", "llama", seed=0, **TINY)


@pytest.fixture(scope="module")
def adapter(base_dir, tmp_path_factory):
    path = make_peft_adapter(base_dir, tmp_path_factory.mktemp("fair-lora") / "a1", r=4,
                             target_modules=["q_proj", "v_proj", "down_proj"], seed=1)
    return LoRARequest("a1", 1, str(path))


def _run(base_dir, adapter, policy: str) -> tuple[dict[str, list[int]], int]:
    """A 12-child group (one prompt family, shared prefix) fills the batch; after 3 steps
    two other clients arrive, one on an adapter. Greedy outputs by id, and the fairness
    preemptions."""
    llm = LLM(str(base_dir), **ENGINE, scheduling_policy=policy)
    engine = llm.llm_engine
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    # read before it is asked for: a request whose adapter is still being read preempts
    # no one, and how long the read takes is the machine's business, not the test's
    engine.add_lora(adapter)
    for i in range(12):
        engine.add_request(f"big-{i}", {"prompt_token_ids": [5, 9, 13, 17, 21, 25, 29, 3 + i]},
                           greedy, client_group="big")
    outputs: dict[str, list[int]] = {}

    def collect() -> None:
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = list(out.outputs[0].token_ids)

    for _ in range(3):
        collect()
    engine.add_request("small", {"prompt_token_ids": [40, 41, 42]},
                       SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
                       client_group="small")
    engine.add_request("lora", {"prompt_token_ids": [50, 51, 52, 53, 54]},
                       SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                       adapter, client_group="lora")
    while engine.has_unfinished_requests():
        collect()
    sched = engine.engine_core.scheduler
    assert sched.kv.snapshot().used_blocks == 0
    preemptions = sched.fairness_preemptions
    engine.shutdown()
    return outputs, preemptions


def test_fair_sharing_keeps_every_greedy_output(base_dir, adapter):
    fair, preempted = _run(base_dir, adapter, "fair")
    fcfs, none = _run(base_dir, adapter, "fcfs")
    assert preempted >= 2 and none == 0      # the newcomers preempted big's children
    assert fair.keys() == fcfs.keys() and len(fair) == 14
    for rid in fcfs:
        assert fair[rid] == fcfs[rid], rid
    assert [len(fair[f"big-{i}"]) for i in range(12)] == [16] * 12
