"""Penalties, ``logit_bias`` and ``allowed_token_ids`` through ``LLM.generate``.

Reference: transformers (+ peft) on the same weights, teacher-forced on each generated
prefix, with the penalties applied in float64 per token from vLLM v1's formula, then argmax.
Requests without any processor must come out of a mixed batch as they do alone. Runs with
async scheduling on and off: under async scheduling the newest output token of a row is still
on the device when the next step is prepared, and it is counted (as vLLM v1 does, which waits
for it; here it is counted on the device).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from manylora import LLM, LoRARequest, SamplingParams
from manylora.testing import make_checkpoint, make_peft_adapter

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)
ENGINE = dict(max_lora_rank=8, block_size=4, max_model_len=96, device="cpu", dtype="float32",
              skip_tokenizer_init=True, max_loras=2)
N_NEW = 12


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("pen") / "base", "llama", seed=3, **TINY)


@pytest.fixture(scope="module")
def adapter(base_dir, tmp_path_factory):
    path = make_peft_adapter(base_dir, tmp_path_factory.mktemp("pen-lora") / "a1", r=4,
                             target_modules=["q_proj", "v_proj", "o_proj"], seed=1)
    return LoRARequest("a1", 1, str(path))


@pytest.fixture(scope="module")
def hf(base_dir, adapter):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32,
                                                attn_implementation="eager").eval()
    return PeftModel.from_pretrained(base, adapter.lora_path, adapter_name="a1").eval()


def _penalized(logits, prompt, output, p):
    row = logits.to(torch.float64).clone()
    if p.allowed_token_ids is not None:
        keep = torch.full_like(row, float("-inf"))
        keep[p.allowed_token_ids] = 0.0
        row += keep
    for t, b in (p.logit_bias or {}).items():
        row[t] += b
    counts, seen = Counter(output), set(prompt) | set(output)
    for t in seen:
        x = row[t].item()
        row[t] = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
    for t, c in counts.items():
        row[t] -= p.frequency_penalty * c + p.presence_penalty
    return row


@torch.no_grad()
def _reference(hf, prompt, p, lora):
    out: list[int] = []
    for _ in range(N_NEW):
        ids = torch.tensor([prompt + out])
        if lora is None:
            with hf.disable_adapter():
                logits = hf(ids).logits[0, -1]
        else:
            hf.set_adapter(lora.lora_name)
            logits = hf(ids).logits[0, -1]
        out.append(int(_penalized(logits, prompt, out, p).argmax()))
    return out


def _prompts(vocab):
    return [[1 + (11 * i + 7 * j) % (vocab - 1) for j in range(4 + 5 * i)] + [5, 5, 9]
            for i in range(6)]


def _params(vocab):
    g = dict(temperature=0.0, max_tokens=N_NEW, ignore_eos=True)
    return [
        SamplingParams(presence_penalty=1.8, **g),
        SamplingParams(frequency_penalty=1.1, **g),
        SamplingParams(repetition_penalty=1.9, **g),
        SamplingParams(logit_bias={3: 4.0, vocab - 1: -100.0, 17: 1.5}, **g),
        SamplingParams(allowed_token_ids=[2, 5, 9, 40, vocab - 2], presence_penalty=2.0, **g),
        SamplingParams(presence_penalty=-0.5, frequency_penalty=0.9, repetition_penalty=0.7,
                       logit_bias={5: 2.0}, **g),
    ]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_greedy_with_penalties_matches_reference(base_dir, adapter, hf, async_scheduling):
    llm = LLM(str(base_dir), **ENGINE, num_kv_blocks=64, async_scheduling=async_scheduling)
    vocab = llm.llm_engine.engine_core.model_config.vocab_size
    prompts, params = _prompts(vocab), _params(vocab)
    plain = SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True)
    loras = [None, adapter] * 3
    alone = llm.generate([{"prompt_token_ids": q} for q in prompts], [plain] * 6, loras,
                         use_tqdm=False)
    # A mixed batch: each penalized request next to the same prompt without any processor.
    mixed = llm.generate([{"prompt_token_ids": q} for q in prompts * 2], params + [plain] * 6,
                         loras * 2, use_tqdm=False)
    for q, p, lora, o in zip(prompts, params, loras, mixed[:6]):
        assert o.outputs[0].token_ids == _reference(hf, q, p, lora), p
    for a, m in zip(alone, mixed[6:]):
        assert m.outputs[0].token_ids == a.outputs[0].token_ids
    # The penalties change the output (or the test could not fail).
    assert sum(m.outputs[0].token_ids != a.outputs[0].token_ids
               for m, a in zip(mixed[:6], alone)) >= 5
    assert set(mixed[4].outputs[0].token_ids) <= {2, 5, 9, 40, vocab - 2}


def test_penalties_count_outputs_after_preemption(base_dir):
    """A request preempted and recomputed keeps counting its generated tokens as output
    (presence/frequency) and not as prompt: equal to a run that never preempts."""
    def run(num_kv_blocks):
        llm = LLM(str(base_dir), **ENGINE, num_kv_blocks=num_kv_blocks,
                  max_num_batched_tokens=16)
        vocab = llm.llm_engine.engine_core.model_config.vocab_size
        p = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                           frequency_penalty=1.5, presence_penalty=0.5)
        outs = llm.generate([{"prompt_token_ids": q} for q in _prompts(vocab)[:4]], [p] * 4,
                            use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], llm
    roomy, _ = run(80)
    tight, llm = run(14)
    assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0
    assert tight == roomy


def test_out_of_vocabulary_ids_are_refused(base_dir):
    llm = LLM(str(base_dir), **ENGINE, num_kv_blocks=16)
    vocab = llm.llm_engine.engine_core.model_config.vocab_size
    for p, field in ((SamplingParams(logit_bias={vocab: 1.0}), "logit_bias"),
                     (SamplingParams(allowed_token_ids=[0, vocab + 3]), "allowed_token_ids")):
        with pytest.raises(ValueError, match=field):
            llm.generate([{"prompt_token_ids": [1, 2, 3]}], p, use_tqdm=False)
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2, "the engine keeps serving"
