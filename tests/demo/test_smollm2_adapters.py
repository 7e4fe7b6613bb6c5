"""The shipped demo adapters on SmolLM2-135M-Instruct's GGUF, in one mixed batch with the
base model and with adapters this test writes with other ranks and targets; then two
activated adapters (aLoRA) this test writes, on a conversation the base model prefilled.

Two independent references: each shipped adapter's answer to held-out prompts equals the
task's expected answer (``manylora.demo.tasks``, which generates the answers, not the
model), while the base model's does not; and every output, token for token, equals
transformers + peft on the same GGUF (float32, greedy, each prompt alone).
"""

from __future__ import annotations

import pytest

from manylora import LoRARequest, SamplingParams
from manylora.demo.tasks import TASKS, adapter_dir, chat_messages, exact_match, held_out
from manylora.testing import compare_greedy, hf_greedy_reference, make_peft_adapter

PER_TASK = 1
MAX_NEW = 32
EOS = 2
#: Adapters written here: ranks and targets the shipped ones do not have.
WRITTEN = {
    "mlp_r2": dict(r=2, lora_alpha=64, target_modules=["gate_proj", "down_proj"], seed=31),
    "rs_r12": dict(r=12, lora_alpha=24, target_modules=["k_proj", "o_proj", "up_proj"],
                   use_rslora=True, seed=32),
}


def _drop_eos(ids) -> list[int]:
    ids = [int(t) for t in ids]
    return ids[:-1] if ids and ids[-1] == EOS else ids


@pytest.fixture(scope="module")
def written(smollm2_gguf, smollm2_hf_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("smollm2-adapters")
    return {name: make_peft_adapter(smollm2_gguf, root / name, init_std=0.05,
                                    base_model=smollm2_hf_model, **spec)
            for name, spec in WRITTEN.items()}


def test_shipped_and_written_adapters_in_one_batch_equal_peft(smollm2_gguf, smollm2_tokenizer,
                                                              smollm2_hf_model, smollm2_llm,
                                                              written):
    adapters = {name: adapter_dir(name) for name in TASKS} | written
    jobs = []                                    # (prompt ids, adapter or None, expected)
    for task in TASKS:
        for prompt, answer in held_out(task, PER_TASK):
            ids = smollm2_tokenizer.apply_chat_template(
                chat_messages(prompt), add_generation_prompt=True, tokenize=True,
                return_dict=False)
            jobs += [(ids, task, answer), (ids, None, answer)]
    for i, name in enumerate(written):
        jobs.append((jobs[2 * i][0], name, None))
    requests = {name: LoRARequest(name, i + 1, str(path))
                for i, (name, path) in enumerate(adapters.items())}
    assert len(jobs) <= 24 and len(adapters) <= 6        # the shared engine's batch and slots
    outs = smollm2_llm.generate([{"prompt_token_ids": ids} for ids, _, _ in jobs],
                                SamplingParams(temperature=0.0, max_tokens=MAX_NEW),
                                [None if n is None else requests[n] for _, n, _ in jobs],
                                use_tqdm=False)

    base_of = {id(ids): out for (ids, name, _), out in zip(jobs, outs) if name is None}
    for (ids, name, answer), out in zip(jobs, outs, strict=True):
        if answer is None:                       # a written adapter changes the base's answer
            assert out.outputs[0].token_ids != base_of[id(ids)].outputs[0].token_ids, name
            continue
        text = out.outputs[0].text
        if name is None:
            assert not exact_match(answer, text), (answer, text)
        else:
            assert exact_match(answer, text), (name, answer, text)
            assert out.outputs[0].finish_reason == "stop"

    # every adapter row and the first base row against transformers + peft (the base's
    # greedy decoding of these chats is checked in tests/checkpoint/test_gguf.py)
    checked = [i for i, (_, name, _) in enumerate(jobs) if name is not None or i == 1]
    refs = hf_greedy_reference(smollm2_gguf, adapters, [jobs[i][0] for i in checked],
                               [jobs[i][1] for i in checked], MAX_NEW,
                               base_model=smollm2_hf_model)
    for i, ref in zip(checked, refs, strict=True):
        name, out = jobs[i][1], outs[i]
        ours = _drop_eos(out.outputs[0].token_ids)
        ok, at = compare_greedy(ours, type(ref)(_drop_eos(ref.token_ids), ref.logits))
        assert ok, f"{name or 'base'}: differs from transformers + peft at token {at}"


#: Activated adapters (aLoRA) written here, each with its own invocation text.
ACTIVATED = {
    "check_r8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj",
                                                         "o_proj"], seed=41),
    "rewrite_r4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                       seed=42),
}
INVOCATIONS = {"check_r8": "Safety check:", "rewrite_r4": "Rewrite it:"}
ACTIVATED_NEW = 12


def test_activated_adapters_share_the_conversation_and_equal_peft(
        smollm2_gguf, smollm2_tokenizer, smollm2_hf_model, smollm2_llm, tmp_path):
    """A chat conversation on the base model, then each aLoRA adapter's request on the same
    conversation with its invocation text and a question appended: token for token
    transformers + peft's, and prefilled from the prefix cache up to the last full block
    before the invocation (the engine's prefix-hit tokens)."""
    block = 16                                  # the smollm2_llm fixture's block_size
    conversation = smollm2_tokenizer.apply_chat_template(
        [{"role": "user", "content": "My neighbour's dog barks all night. What can I do?"},
         {"role": "assistant", "content": "Talk to your neighbour first, calmly and early."}],
        tokenize=True, return_dict=False)
    adapters, jobs = {}, [(conversation, None)]
    for name, spec in ACTIVATED.items():
        invocation = smollm2_tokenizer(INVOCATIONS[name], add_special_tokens=False).input_ids
        adapters[name] = make_peft_adapter(smollm2_gguf, tmp_path / name, init_std=0.05,
                                           base_model=smollm2_hf_model,
                                           alora_invocation_tokens=invocation, **spec)
        question = smollm2_tokenizer(" Is that advice fine?", add_special_tokens=False)
        jobs.append((conversation + invocation + question.input_ids, name))
    requests = {name: LoRARequest(name, 201 + i, str(path))
                for i, (name, path) in enumerate(adapters.items())}
    params = SamplingParams(temperature=0.0, max_tokens=ACTIVATED_NEW)
    engine = smollm2_llm.llm_engine
    hits, outs = [], []
    for ids, name in jobs:
        before = engine.kv_cache_stats().prefix_hits
        outs += smollm2_llm.generate([{"prompt_token_ids": ids}], params,
                                     None if name is None else requests[name], use_tqdm=False)
        hits.append(engine.kv_cache_stats().prefix_hits - before)
    assert hits[1:] == [len(conversation) // block * block] * len(ACTIVATED)
    refs = hf_greedy_reference(smollm2_gguf, adapters, [ids for ids, _ in jobs],
                               [n for _, n in jobs], ACTIVATED_NEW, base_model=smollm2_hf_model)
    for (_, name), out, ref in zip(jobs, outs, refs, strict=True):
        ours = _drop_eos(out.outputs[0].token_ids)
        ok, at = compare_greedy(ours, type(ref)(_drop_eos(ref.token_ids), ref.logits))
        assert ok, f"{name or 'base'}: differs from transformers + peft at token {at}"
