"""Activated LoRA (aLoRA; peft's ``alora_invocation_tokens``) end to end against transformers +
peft: an adapter's weights apply from the start of the last occurrence of its invocation
sequence in the prompt on, every earlier token runs as the base model, and a prompt without
the sequence runs as the base model throughout (peft's ``calculate_alora_offsets``).

Greedy, token for token, on a tiny Llama written by transformers' ``save_pretrained``, with
two aLoRA adapters of different ranks, targets and invocation sequences and a plain LoRA
adapter (peft's own ``save_pretrained``), in one batch with the base model, with fewer slots
than adapters: invocation sequences at the start, in the middle, twice, missing, and at
positions where a prefill chunk (``max_num_batched_tokens``) and a KV block end inside them;
under preemption and then through the prefix cache; under tensor parallelism 2 (gloo).
A conversation the base model prefilled serves each aLoRA adapter's request on it from the
prefix cache up to its invocation start (the engine's prefix-hit tokens), and a plain
adapter's not at all. Adapter configs peft has no aLoRA variant for are refused naming the
field.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from manylora import LLM, LoRARequest, SamplingParams
from manylora.config import LORA_ALL_MODULES
from manylora.lora.adapter import LoRAAdapterError
from manylora.lora.formats.trtllm_convert import peft_to_trtllm
from manylora.lora_request import ALORA_NEVER, alora_start
from manylora.testing import compare_greedy, hf_greedy_reference, make_checkpoint, make_peft_adapter

INV_A = [41, 42, 43]
INV_B = [77, 5]
ADAPTERS = {
    "alora_a": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                    alora_invocation_tokens=INV_A, seed=1),
    "alora_b": dict(r=4, lora_alpha=4, target_modules=["q_proj", "v_proj", "gate_proj",
                                                         "up_proj", "down_proj"],
                    alora_invocation_tokens=INV_B, seed=2),
    "plain": dict(r=6, lora_alpha=12, target_modules=["q_proj", "o_proj", "down_proj"], seed=3),
}
MAX_NEW = 8
ENGINE = dict(device="cpu", dtype="float32", max_lora_rank=8, block_size=4, max_model_len=128,
              num_kv_blocks=128, max_loras=2, max_num_batched_tokens=16, max_num_seqs=16)


def _prompt(head: list[int], *parts: list[int]) -> list[int]:
    out = list(head)
    for p in parts:
        out += p
    return out


FILL = [9, 12, 30, 51, 60, 2, 88, 19, 25, 33, 70, 14, 8, 93]
#: (prompt, adapter): the sequence at the start, in the middle, twice, missing; straddling
#: the first prefill chunk's end (16 tokens) and a block end (position 15 of blocks of 4)
JOBS = [
    (_prompt(INV_A, FILL[:6]), "alora_a"),
    (_prompt(FILL[:7], INV_A, FILL[7:10]), "alora_a"),
    (_prompt(FILL[:3], INV_A, FILL[3:8], INV_A, FILL[8:10]), "alora_a"),
    (_prompt(FILL[:12]), "alora_a"),
    (_prompt(FILL[:14], INV_A, FILL[:5]), "alora_a"),
    (_prompt(FILL[:15], INV_B, FILL[:4]), "alora_b"),
    (_prompt(FILL[:5], INV_B, FILL[5:9]), "alora_b"),
    (_prompt(FILL[:7], INV_A, FILL[7:10]), "plain"),
    (_prompt(FILL[:7], INV_A, FILL[7:10]), None),
]


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    root = tmp_path_factory.mktemp("alora")
    base = make_checkpoint(root / "base", "llama", seed=4)
    adapters = {name: make_peft_adapter(base, root / name, init_std=0.1, **spec)
                for name, spec in ADAPTERS.items()}
    refs = hf_greedy_reference(base, adapters, [p for p, _ in JOBS], [n for _, n in JOBS],
                               MAX_NEW)
    return base, adapters, refs


def test_alora_start_follows_peft():
    assert alora_start([1, 2, 3], None) == 0
    assert alora_start([5, 41, 42, 43, 7], (41, 42, 43)) == 1
    assert alora_start([41, 42, 9, 41, 42, 1], (41, 42)) == 3           # the last one
    assert alora_start([41, 42], (41, 42, 43)) == ALORA_NEVER
    assert alora_start([], (1,)) == ALORA_NEVER


def _generate(case, passes: int = 1, **engine) -> tuple[list[list[list[int]]], object]:
    base, adapters, _ = case
    requests = {name: LoRARequest(name, i + 1, str(path))
                for i, (name, path) in enumerate(adapters.items())}
    llm = LLM(str(base), **{**ENGINE, **engine})
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    try:
        runs = [[o.outputs[0].token_ids for o in llm.generate(
            [{"prompt_token_ids": p} for p, _ in JOBS], params,
            [None if n is None else requests[n] for _, n in JOBS], use_tqdm=False)]
            for _ in range(passes)]
        return runs, llm.llm_engine.kv_cache_stats()
    finally:
        llm.llm_engine.shutdown()


def _assert_equal_peft(outs, refs) -> None:
    for (prompt, name), out, ref in zip(JOBS, outs, refs, strict=True):
        ok, at = compare_greedy(out, ref)
        assert ok, f"{name} on {prompt}: differs from transformers + peft at token {at}"


def test_mixed_batch_with_fewer_slots_and_chunked_prefill_equals_peft(case):
    base, _, refs = case
    (outs,), _ = _generate(case)
    _assert_equal_peft(outs, refs)
    # an adapter changes what it is invoked on; where its sequence is absent, peft's own
    # output is the base model's
    assert outs[1] != outs[-1]
    assert refs[3].token_ids == hf_greedy_reference(base, {}, [JOBS[3][0]], [None],
                                                    MAX_NEW)[0].token_ids


def test_preemption_and_prefix_cache_equal_peft(case):
    """A cache too small for the batch (requests preempted and prefilled again), then the
    same batch again through the prefix cache."""
    (first, second), kv = _generate(case, passes=2, num_kv_blocks=20)
    assert kv.preemptions > 0 and kv.prefix_hits > 0
    _assert_equal_peft(first, case[2])
    assert second == first


def test_tensor_parallel_2_equals_peft(case):
    (outs,), _ = _generate(case, tensor_parallel_size=2)
    _assert_equal_peft(outs, case[2])


def _edited(src, dst, **changes):
    """A copy of the adapter ``src`` whose ``adapter_config.json`` has ``changes``."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    cfg.update(changes)
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return dst


def test_unsupported_alora_combinations_are_refused_naming_them(case, tmp_path):
    """peft has no aLoRA variant with DoRA, of target_parameters or of an Embedding: such
    adapters fail alone, their error naming the field, while the engine serves on."""
    base, adapters, refs = case
    bad = {
        "DoRA": _edited(adapters["alora_a"], tmp_path / "dora", use_dora=True),
        "target_parameters": _edited(adapters["alora_a"], tmp_path / "params",
                                     target_parameters=["mlp.experts.gate_up_proj"]),
        "alora_invocation_tokens": _edited(adapters["alora_a"], tmp_path / "empty",
                                           alora_invocation_tokens=[]),
        "embed_tokens": _edited(make_peft_adapter(base, tmp_path / "embed-plain", r=4,
                                                  target_modules=["embed_tokens", "q_proj"]),
                                tmp_path / "embed", alora_invocation_tokens=INV_A),
    }
    llm = LLM(str(base), **ENGINE, lora_target_modules=LORA_ALL_MODULES)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    try:
        for i, (field, path) in enumerate(bad.items()):
            with pytest.raises(LoRAAdapterError, match=field):
                llm.generate([{"prompt_token_ids": JOBS[0][0]}], params,
                             LoRARequest(f"bad{i}", 10 + i, str(path)), use_tqdm=False)
        out = llm.generate([{"prompt_token_ids": JOBS[0][0]}], params,
                           LoRARequest("alora_a", 1, str(adapters["alora_a"])),
                           use_tqdm=False)
        assert compare_greedy(out[0].outputs[0].token_ids, refs[0])[0]
    finally:
        llm.llm_engine.shutdown()


def test_a_conversation_prefilled_once_serves_every_activated_adapter(case):
    """The base model prefills a conversation; then each aLoRA adapter's request on it (its
    invocation sequence and a question appended) finds every full block before its
    invocation start in the prefix cache, and computes only the rest; a plain adapter's
    request on it finds none. Outputs equal peft's."""
    base, adapters, _ = case
    conversation = [(7 * i + 3) % 97 + 1 for i in range(30)]      # 7 full blocks of 4, 2 left
    question = [11, 29, 63]
    jobs = [(conversation, None), (conversation + INV_A + question, "alora_a"),
            (conversation + INV_B + question, "alora_b"),
            (conversation + INV_A + question, "plain")]
    refs = hf_greedy_reference(base, adapters, [p for p, _ in jobs], [n for _, n in jobs],
                               MAX_NEW)
    requests = {name: LoRARequest(name, i + 1, str(path))
                for i, (name, path) in enumerate(adapters.items())}
    llm = LLM(str(base), **ENGINE)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    hits = []
    try:
        assert llm.llm_engine.kv_cache_stats().prefix_hits_alora == 0
        for (prompt, name), ref in zip(jobs, refs, strict=True):
            before = llm.llm_engine.kv_cache_stats().prefix_hits
            out = llm.generate([{"prompt_token_ids": prompt}], params,
                               None if name is None else requests[name], use_tqdm=False)
            hits.append(llm.llm_engine.kv_cache_stats().prefix_hits - before)
            ok, at = compare_greedy(out[0].outputs[0].token_ids, ref)
            assert ok, f"{name}: differs from transformers + peft at token {at}"
        shared = llm.llm_engine.kv_cache_stats().prefix_hits_alora
    finally:
        llm.llm_engine.shutdown()
    blocks_before_start = len(conversation) // ENGINE["block_size"] * ENGINE["block_size"]
    assert hits == [0, blocks_before_start, blocks_before_start, 0]
    assert shared == 2 * blocks_before_start


def test_tensorrt_llm_tensors_activated_by_the_request_field_equal_peft(case, tmp_path):
    """TensorRT-LLM's format has no config to hold the invocation tokens: the request's
    ``alora_invocation_tokens`` activates its tensors (here: ``convert-lora``'s of a copy of
    the PEFT aLoRA without the field), and the outputs equal peft's aLoRA. convert-lora
    refuses the aLoRA itself, and a PEFT adapter given the field in the request is refused:
    its own config says."""
    base, adapters, refs = case
    with pytest.raises(LoRAAdapterError, match="alora_invocation_tokens"):
        peft_to_trtllm(adapters["alora_a"], torch.float32)
    plain = _edited(adapters["alora_a"], tmp_path / "plain-copy", alora_invocation_tokens=None)
    weights, config = peft_to_trtllm(plain, torch.float32)
    request = LoRARequest("trt_alora", task_id=30, weights=weights, config=config,
                          alora_invocation_tokens=INV_A)
    jobs = [(i, p) for i, (p, n) in enumerate(JOBS) if n == "alora_a"]
    llm = LLM(str(base), **ENGINE)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for _, p in jobs], params,
                            [request] * len(jobs), use_tqdm=False)
        for (i, prompt), out in zip(jobs, outs, strict=True):
            ok, at = compare_greedy(out.outputs[0].token_ids, refs[i])
            assert ok, f"{prompt}: differs from peft's aLoRA at token {at}"
        with pytest.raises(LoRAAdapterError, match="adapter_config.json"):
            llm.generate([{"prompt_token_ids": JOBS[0][0]}], params,
                         LoRARequest("peft_with_field", 31, str(adapters["alora_b"]),
                                     alora_invocation_tokens=INV_A), use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    with pytest.raises(ValueError, match="alora_invocation_tokens"):
        LoRARequest("bad", 32, "x", alora_invocation_tokens=[])
