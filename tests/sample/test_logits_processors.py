"""The logits processors (``sample.penalties``) against a float64 reference written per row
and per token from the formula of vLLM v1's sampler."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from manylora.sample.penalties import PenaltyInputs, penalize_logits
from manylora.sampling_params import SamplingParams

V = 50


def _reference(logits, rows):
    """float64, one token at a time: allowed mask, bias, repetition, frequency, presence."""
    out = logits.to(torch.float64).clone()
    for i, r in rows.items():
        row = out[i]
        if r.get("allowed") is not None:
            keep = set(r["allowed"])
            for t in range(V):
                if t not in keep:
                    row[t] = float("-inf")
        for t, b in (r.get("bias") or {}).items():
            row[t] += b
        counts = Counter(r["output"])
        seen = set(r["prompt"]) | set(r["output"])
        rep = r.get("rep", 1.0)
        for t in range(V):
            x = row[t].item()
            if t in seen:
                x = x / rep if x > 0 else x * rep
            x -= r.get("freq", 0.0) * counts[t]
            x -= r.get("pres", 0.0) * (counts[t] > 0)
            row[t] = x
    return out


def _inputs(rows, prev_rows=None):
    """PenaltyInputs for ``rows`` ({batch index: spec}); ``prev_rows``: {batch index: index
    in the previous samples} for rows whose last output token is still on the device."""
    prev_rows = prev_rows or {}
    index = sorted(rows)
    host = [r["prompt"] + (r["output"][:-1] if i in prev_rows else r["output"])
            for i, r in ((i, rows[i]) for i in index)]
    width = max(len(h) for h in host)
    tokens = np.full((len(index), width), V, np.int64)
    for j, h in enumerate(host):
        tokens[j, :len(h)] = h
    bias_index, bias_value, allowed_index, allowed_rows = [], [], [], []
    for j, i in enumerate(index):
        for t, b in (rows[i].get("bias") or {}).items():
            bias_index.append((j, t))
            bias_value.append(b)
        if rows[i].get("allowed") is not None:
            allowed_rows.append(j)
            allowed_index += [(j, t) for t in rows[i]["allowed"]]
    col = lambda key, default: np.array([rows[i].get(key, default) for i in index],  # noqa: E731
                                        np.float32)
    return PenaltyInputs(
        np.array(index, np.int64), tokens,
        np.array([len(rows[i]["prompt"]) for i in index], np.int64),
        np.array([len(h) for h in host], np.int64),
        np.array([prev_rows.get(i, -1) for i in index], np.int64),
        col("pres", 0.0), col("freq", 0.0), col("rep", 1.0),
        np.array(bias_index, np.int64).reshape(-1, 2), np.array(bias_value, np.float32),
        np.array(allowed_index, np.int64).reshape(-1, 2), np.array(allowed_rows, np.int64))


def _random_rows(gen, n, **spec):
    rows = {}
    for i in range(n):
        if i % 3 == 2:
            continue                      # rows without any processor stay untouched
        rows[i] = dict(prompt=torch.randint(0, V, (int(torch.randint(1, 12, (1,),
                                                                        generator=gen)),),
                                            generator=gen).tolist(),
                       output=torch.randint(0, 10, (int(torch.randint(0, 15, (1,),
                                                                      generator=gen)),),
                                            generator=gen).tolist(),
                       **spec)
    return rows


CASES = {
    "presence": dict(pres=1.5),
    "negative presence": dict(pres=-2.0),
    "frequency": dict(freq=0.7),
    "repetition": dict(rep=1.3),
    "repetition below 1": dict(rep=0.6),
    "logit_bias": dict(bias={3: 5.0, 7: -100.0, 49: 100.0}),
    "allowed": dict(allowed=[1, 4, 9, 16, 25]),
    "allowed on some rows": dict(freq=0.3),
    "all together": dict(pres=0.5, freq=-0.4, rep=1.7, bias={4: 2.5, 0: -3.0},
                         allowed=[0, 4, 8, 12, 40]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_matches_float64_reference(name):
    gen = torch.Generator().manual_seed(len(name))
    logits = torch.randn(7, V, generator=gen) * 3
    raw = logits.clone()
    rows = _random_rows(gen, 7, **CASES[name])
    if name == "allowed on some rows":
        for i in list(rows)[::2]:
            rows[i]["allowed"] = [2, 3, 5]
    got = penalize_logits(logits, _inputs(rows), None)
    assert torch.equal(logits, raw), "the raw logits (for log-probabilities) stay as they are"
    ref = _reference(raw, rows)
    finite = torch.isfinite(ref)
    assert torch.equal(finite, torch.isfinite(got))
    torch.testing.assert_close(got.double()[finite], ref[finite], rtol=1e-6, atol=1e-5)
    for i in range(7):
        if i not in rows:
            assert torch.equal(got[i], raw[i])


def test_in_flight_output_token_is_counted_from_the_device():
    """Async scheduling: a row's newest output token is still in the previous step's samples
    on the device; it counts as an output token (not the prompt) without a host sync."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(3, V, generator=gen)
    rows = {0: dict(prompt=[1, 2], output=[7, 7, 11], pres=0.9, freq=0.5, rep=1.2),
            2: dict(prompt=[3], output=[7], freq=1.0)}
    prev = torch.tensor([30, 11, 7, 2])            # row 0's last token is prev[1], row 2's prev[2]
    got = penalize_logits(logits, _inputs(rows, {0: 1, 2: 2}), prev)
    torch.testing.assert_close(got.double(), _reference(logits, rows), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="previous samples"):
        penalize_logits(logits, _inputs(rows, {0: 1}), None)


@pytest.mark.parametrize("field,value,match", [
    ("presence_penalty", 2.5, r"presence_penalty must be in \[-2, 2\]"),
    ("frequency_penalty", -2.01, r"frequency_penalty must be in \[-2, 2\]"),
    ("frequency_penalty", "1", "frequency_penalty must be a number"),
    ("repetition_penalty", 0.0, "repetition_penalty must be finite and > 0"),
    ("repetition_penalty", float("inf"), "repetition_penalty must be finite"),
    ("logit_bias", {5: 101.0}, r"logit_bias values must be in \[-100, 100\]"),
    ("logit_bias", {"x": 1.0}, "logit_bias keys must be token ids"),
    ("logit_bias", [1, 2], "logit_bias must be a dict"),
    ("allowed_token_ids", [], "allowed_token_ids must not be empty"),
    ("allowed_token_ids", [1, 2.5], "allowed_token_ids must be ints"),
])
def test_invalid_values_name_the_field(field, value, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**{field: value})


def test_normalization_and_vocabulary_check():
    p = SamplingParams(logit_bias={"12": 3, 4: -1.5}, allowed_token_ids=(3, np.int64(9)))
    assert p.logit_bias == {12: 3.0, 4: -1.5} and p.allowed_token_ids == [3, 9]
    assert p.uses_logits_processors
    assert not SamplingParams(logit_bias={}).uses_logits_processors
    assert not SamplingParams(presence_penalty=0, repetition_penalty=1).uses_logits_processors
    p.verify_token_ids(13)
    with pytest.raises(ValueError, match=r"logit_bias holds token ids \[12\]"):
        p.verify_token_ids(12)
    with pytest.raises(ValueError, match=r"allowed_token_ids holds token ids \[-1\]"):
        SamplingParams(allowed_token_ids=[-1, 2]).verify_token_ids(10)


@pytest.mark.gpu
def test_cuda_matches_reference_with_in_flight_tokens():
    """On CUDA (pinned host arrays, non-blocking copies) the processed logits equal the
    float64 reference, with every processor and an in-flight output token."""
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(9, V, generator=gen) * 2
    rows = _random_rows(gen, 9, **CASES["all together"])
    for i in list(rows)[::2]:
        rows[i]["allowed"] = None
    for r in rows.values():
        r["output"].append(13)
    prev_rows = {i: 1 for i in rows}
    got = penalize_logits(logits.cuda(), _inputs(rows, prev_rows),
                          torch.tensor([0, 13], device="cuda"))
    ref = _reference(logits, rows)
    finite = torch.isfinite(ref)
    assert torch.equal(finite, torch.isfinite(got.cpu()))
    torch.testing.assert_close(got.cpu().double()[finite], ref[finite], rtol=1e-5, atol=1e-4)
