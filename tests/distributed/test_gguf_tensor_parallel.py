"""SmolLM2-135M-Instruct's GGUF at ``tensor_parallel_size`` 2 on CPU (gloo): its 9 query /
3 KV heads do not divide over 2 ranks, so rank 0 serves two KV-head groups and rank 1 one
(``ModelConfig.shard``). One mixed batch of the base model and two peft adapters (LoRA on
q/k/v/o; DoRA on all seven projections) equals transformers + peft on the same GGUF
(float32, greedy), token for token.

Reference: ``manylora.testing.hf_greedy_reference`` (transformers dequantizes the GGUF through
the ``gguf`` package; peft applies the adapters), each prompt alone.
"""

from __future__ import annotations

import os

import pytest
import torch

from manylora import LLM, LoRARequest, SamplingParams
from manylora.config import LORA_TARGET_MODULES
from manylora.testing import compare_greedy, hf_greedy_reference, make_peft_adapter

ADAPTERS = {
    "attn": dict(r=8, lora_alpha=256, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                 seed=21),
    "dora_all": dict(r=4, lora_alpha=8, target_modules=list(LORA_TARGET_MODULES),
                     use_dora=True, seed=22),
}
QUESTIONS = ["What is the capital of France?", "Name three primary colors."]
MAX_NEW = 8
EOS = 2


def _drop_eos(ids) -> list[int]:
    ids = [int(t) for t in ids]
    return ids[:-1] if ids and ids[-1] == EOS else ids


@pytest.fixture
def threads_per_rank(monkeypatch):
    """This process (rank 0) and the spawned worker (rank 1, reading ``OMP_NUM_THREADS``)
    each compute on half the cores: two ranks of all-core OpenMP pools on a small machine
    wait at every op for each other's descheduled threads (several times slower on 2
    cores; vLLM's CPU backend binds each rank's threads to its own cores for the same
    reason)."""
    share = max(1, len(os.sched_getaffinity(0)) // 2)
    monkeypatch.setenv("OMP_NUM_THREADS", str(share))
    before = torch.get_num_threads()
    torch.set_num_threads(share)
    yield
    torch.set_num_threads(before)


def test_smollm2_gguf_tp2_mixed_batch_equals_transformers_peft(smollm2_gguf, smollm2_tokenizer,
                                                               smollm2_hf_model, tmp_path,
                                                               threads_per_rank):
    adapters = {name: make_peft_adapter(smollm2_gguf, tmp_path / name, init_std=0.02,
                                        base_model=smollm2_hf_model, **spec)
                for name, spec in ADAPTERS.items()}
    prompt_ids = []
    for question in QUESTIONS:
        text = smollm2_tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True)
        prompt_ids.append(smollm2_tokenizer(text).input_ids)
    # one mixed batch: each question to the base and to one of the adapters
    batch = [(prompt_ids[0], None), (prompt_ids[0], "attn"), (prompt_ids[1], "dora_all"),
             (prompt_ids[1], None)]
    requests = {name: LoRARequest(name, i + 1, str(path))
                for i, (name, path) in enumerate(adapters.items())}

    llm = LLM(model=str(smollm2_gguf), tensor_parallel_size=2, dtype="float32", device="cpu",
              enable_lora=True, max_loras=2, max_lora_rank=8, max_model_len=256,
              block_size=16, num_kv_blocks=32, max_num_seqs=len(batch))
    try:
        outs = llm.generate([{"prompt_token_ids": ids} for ids, _ in batch],
                            SamplingParams(temperature=0.0, max_tokens=MAX_NEW),
                            [None if name is None else requests[name] for _, name in batch],
                            use_tqdm=False)
        assert llm.llm_engine.kv_cache_stats().used_blocks == 0
    finally:
        llm.llm_engine.shutdown()
    ours = [_drop_eos(o.outputs[0].token_ids) for o in outs]

    refs = hf_greedy_reference(smollm2_gguf, adapters, [ids for ids, _ in batch],
                               [name for _, name in batch], MAX_NEW, base_model=smollm2_hf_model)
    for (ids, name), got, ref in zip(batch, ours, refs, strict=True):
        ref = ref._replace(token_ids=_drop_eos(ref.token_ids))
        ok, pos = compare_greedy(got, ref)
        assert ok, (f"adapter {name}, prompt {smollm2_tokenizer.decode(ids)!r}: differs from "
                    f"transformers + peft at token {pos}: {got} vs {ref.token_ids}")
    # each adapter changes its question's answer (so the comparison above tests it)
    assert ours[1] != ours[0], "attn"
    assert ours[2] != ours[3], "dora_all"

