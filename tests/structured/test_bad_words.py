"""``bad_words`` through ``LLM.generate``, against transformers' greedy decoding of the same
weights with vLLM's rule applied in the test: each word tokenized as is and with a leading
space (kept when it tokenizes to as many tokens starting differently), and before each token
the last token of a sequence banned when the output ends with the rest. Async scheduling on
and off; unconstrained rows of the batch come out as they do alone."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from manylora import LLM, SamplingParams
from manylora.structured.bad_words import DEFAULT_MAX_BAD_WORDS, BadWords, clear_tokens
from manylora.testing import make_checkpoint

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)
ENGINE = dict(block_size=8, max_model_len=256, device="cpu", dtype="float32", max_num_seqs=8)
N_NEW = 20
PROMPTS = ["The weather today", "Once upon a time", "numbers: 1 2 3"]


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("bw") / "base", "llama", seed=9, **TINY)


@pytest.fixture(scope="module")
def hf(base_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    return model, AutoTokenizer.from_pretrained(str(base_dir))


def _sequences(tok, words):
    seqs = []
    for w in words:
        a = tok.encode(w.lstrip(), add_special_tokens=False)
        b = tok.encode(" " + w.lstrip(), add_special_tokens=False)
        seqs.append(a)
        if len(b) == len(a) and b[0] != a[0]:
            seqs.append(b)
    return seqs


@torch.no_grad()
def _reference(hf, prompt, words):
    model, tok = hf
    seqs = _sequences(tok, words)
    ids = tok(prompt).input_ids
    out: list[int] = []
    for _ in range(N_NEW):
        logits = model(torch.tensor([ids + out])).logits[0, -1].double()
        for s in seqs:
            if len(s) == 1 or out[len(out) - len(s) + 1:] == s[:-1] and len(out) >= len(s) - 1:
                logits[s[-1]] = float("-inf")
        out.append(int(logits.argmax()))
    return out


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_bad_words_match_transformers(base_dir, hf, async_scheduling):
    tok = hf[1]
    llm = LLM(str(base_dir), async_scheduling=async_scheduling, **ENGINE)
    plain = SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, plain, use_tqdm=False)]
    # words the unconstrained output contains: a two-token span and a single token
    words = [[tok.decode(a[4:6]), tok.decode(a[10:11])] for a in alone]
    params = [SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True,
                             bad_words=words[i]) if i != 1 else plain
              for i in range(len(PROMPTS))]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for i, out in enumerate(outs):
        if i == 1:
            assert out.outputs[0].token_ids == alone[1]
        else:
            expected = _reference(hf, PROMPTS[i], words[i])
            assert out.outputs[0].token_ids == expected
            assert expected != list(alone[i])        # the words did change the output


def test_bad_words_token_ids_without_tokenizer(base_dir, hf):
    llm = LLM(str(base_dir), skip_tokenizer_init=True, **ENGINE)
    ids = hf[1]("The weather today").input_ids
    plain = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    first = llm.generate({"prompt_token_ids": ids}, plain, use_tqdm=False)[0]
    banned = first.outputs[0].token_ids[0]
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(
        temperature=0.0, max_tokens=8, ignore_eos=True, bad_words_token_ids=[[banned]]),
        use_tqdm=False)[0]
    assert banned not in out.outputs[0].token_ids
    with pytest.raises(ValueError, match="bad_words need a tokenizer"):
        llm.generate({"prompt_token_ids": ids}, SamplingParams(bad_words=["x"]),
                     use_tqdm=False)
    with pytest.raises(ValueError, match="bad_words_token_ids"):
        llm.generate({"prompt_token_ids": ids}, SamplingParams(
            bad_words_token_ids=[[10**6]]), use_tqdm=False)


@pytest.mark.parametrize("fields", [dict(bad_words="word"), dict(bad_words=[""]),
                                    dict(bad_words=[3]), dict(bad_words_token_ids=[[]]),
                                    dict(bad_words_token_ids=[["a"]]),
                                    dict(bad_words_token_ids=[1, 2])])
def test_bad_words_validation(fields):
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(**fields)


def _banned_reference(sequences, output):
    """vLLM's rule, scanning every sequence: ``seq[-1]`` when ``seq[:-1]`` ends ``output``."""
    return {s[-1] for s in sequences
            if len(s) == 1 or (len(output) >= len(s) - 1 and output[len(output) - len(s) + 1:]
                               == s[:-1])}


def _allowed(row: np.ndarray, vocab: int) -> set[int]:
    """The tokens a bitmask row allows, its bits unpacked with torch."""
    bits = (torch.from_numpy(row.view(np.int32)).long().unsqueeze(1) >> torch.arange(32)) & 1
    return set(torch.nonzero(bits.flatten()[:vocab]).flatten().tolist())


def test_index_bans_what_a_full_scan_bans():
    rng, vocab = random.Random(0), 40
    for _ in range(300):
        sequences = [[rng.randrange(6) if rng.random() < 0.8 else rng.randrange(vocab)
                      for _ in range(rng.randint(1, 4))] for _ in range(rng.randint(1, 12))]
        bad = BadWords(sequences, vocab)
        prompt = [rng.randrange(6) for _ in range(rng.randint(0, 3))]
        output = [rng.randrange(6) for _ in range(rng.randint(0, 6))]
        expected = _banned_reference(sequences, output)
        more = bad.bans(prompt + output, len(prompt))
        if more is None:
            assert not expected
            continue
        row = np.full(-(-vocab // 32), 0xFFFFFFFF, dtype=np.uint32)
        bad.clear(row, more)
        assert set(range(vocab)) - _allowed(row, vocab) == expected


def test_clear_tokens_clears_exactly_those_bits():
    vocab = 100
    row = np.full(-(-vocab // 32), 0xFFFFFFFF, dtype=np.uint32)
    tokens = np.array([0, 31, 32, 63, 64, 99, 31], dtype=np.int64)
    clear_tokens(row, tokens)
    assert set(range(vocab)) - _allowed(row, vocab) == {0, 31, 32, 63, 64, 99}


def test_the_most_bad_words_allowed_ban_as_the_reference(base_dir, hf):
    # DEFAULT_MAX_BAD_WORDS words: two seen in the unconstrained output, the rest fillers
    # of one or more tokens; then one word more, and words over the byte bound, are refused
    tok = hf[1]
    llm = LLM(str(base_dir), **ENGINE)
    plain = SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True)
    alone = llm.generate(PROMPTS[:1], plain, use_tqdm=False)[0].outputs[0].token_ids
    seen = [tok.decode(alone[4:6]), tok.decode(alone[10:11])]
    words = seen + [f"w{i}" for i in range(DEFAULT_MAX_BAD_WORDS - len(seen))]
    params = SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True,
                            bad_words=words)
    out = llm.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0].token_ids
    expected = _reference(hf, PROMPTS[0], words)
    assert list(out) == expected and expected != list(alone)
    with pytest.raises(ValueError, match=f"bad_words holds {DEFAULT_MAX_BAD_WORDS + 1} "
                                         f"words; the server allows at most "
                                         f"{DEFAULT_MAX_BAD_WORDS} \\(--max-bad-words\\)"):
        llm.generate(PROMPTS[:1], SamplingParams(bad_words=words + ["one more"]),
                     use_tqdm=False)
    with pytest.raises(ValueError, match="--max-structured-output-spec-bytes"):
        llm.generate(PROMPTS[:1], SamplingParams(bad_words=["x" * 2**16] * 3),
                     use_tqdm=False)
