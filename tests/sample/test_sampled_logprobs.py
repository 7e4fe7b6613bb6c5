"""Tests for the sampler's log-probabilities (``compute_logprobs``, ``tokens_and_logprobs_to_host``)
against a per-row float64 NumPy reference."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import manylora.sample.logprobs as logprobs_mod
from manylora.sample.logprobs import (
    TokenLogprobs,
    compute_logprobs,
    tokens_and_logprobs_to_host,
)
from manylora.sample.sampler import Sampler, SamplingTensors
from manylora.sampling_params import SamplingParams

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def ref_log_softmax(row: np.ndarray) -> np.ndarray:
    """log_softmax of one row in float64."""
    x = row.astype(np.float64)
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())


def ref_rank(logprobs: np.ndarray, token: int) -> int:
    """1 + the number of tokens with a strictly larger log-probability."""
    return 1 + int((logprobs > logprobs[token]).sum())


def _distinct_logits(n: int, v: int, seed: int) -> torch.Tensor:
    """[n, v] float32 logits with well separated values (no near-ties)."""
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(v, generator=g).float() * 0.05 for _ in range(n)])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k", [0, 1, 5, 20])
def test_compute_logprobs_matches_reference(device, k):
    n, v = 6, 97
    logits = _distinct_logits(n, v, 3).to(device)
    tokens = torch.tensor([0, 5, 96, 40, 7, 12], device=device)
    out = compute_logprobs(logits, tokens, k)
    assert out.token_logprob.shape == (n,) and out.token_logprob.dtype == torch.float32
    assert out.token_rank.shape == (n,) and out.token_rank.dtype == torch.int64
    assert out.topk_ids.shape == (n, k) and out.topk_ids.dtype == torch.int64
    assert out.topk_logprobs.shape == (n, k) and out.topk_logprobs.dtype == torch.float32
    for i in range(n):
        ref = ref_log_softmax(logits[i].cpu().numpy())
        t = int(tokens[i])
        assert float(out.token_logprob[i]) == pytest.approx(ref[t], abs=1e-5)
        assert int(out.token_rank[i]) == ref_rank(ref, t)
        order = np.argsort(-ref, kind="stable")[:k]
        assert out.topk_ids[i].tolist() == order.tolist()
        np.testing.assert_allclose(out.topk_logprobs[i].cpu().numpy(), ref[order], atol=1e-5)


def test_rank_counts_only_strictly_larger_and_top_token_is_rank_one():
    # Row 0: tokens 1 and 2 tie for the top; row 1: token 3 below a three-way tie.
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0], [1.0, 1.0, 1.0, 0.5]])
    out = compute_logprobs(logits, torch.tensor([2, 3]), 2)
    assert out.token_rank.tolist() == [1, 4]
    greedy = logits.argmax(dim=-1)
    assert compute_logprobs(logits, greedy, 0).token_rank.tolist() == [1, 1]


def test_k_is_clamped_to_vocab_and_inputs_not_modified():
    logits = torch.randn(3, 4)
    before = logits.clone()
    out = compute_logprobs(logits, torch.tensor([0, 1, 2]), 20)
    assert out.topk_ids.shape == (3, 4)
    assert torch.equal(logits, before)
    # All four tokens returned: the probabilities sum to one.
    torch.testing.assert_close(out.topk_logprobs.exp().sum(-1), torch.ones(3))


def test_half_precision_logits_are_computed_in_float32():
    logits = torch.randn(2, 50).to(torch.bfloat16)
    out = compute_logprobs(logits, torch.tensor([3, 4]), 3)
    assert out.token_logprob.dtype == torch.float32
    expected = logits.float().log_softmax(-1)
    torch.testing.assert_close(out.token_logprob, expected[[0, 1], [3, 4]])


def test_compute_logprobs_empty_batch():
    out = compute_logprobs(torch.empty(0, 10), torch.empty(0, dtype=torch.int64), 3)
    assert out.token_logprob.shape == (0,) and out.topk_ids.shape == (0, 3)


@pytest.mark.parametrize(
    "args, match",
    [
        ((torch.zeros(10), torch.zeros(1, dtype=torch.int64), 1), "logits must be"),
        ((torch.zeros(2, 10), torch.zeros(3, dtype=torch.int64), 1), "token_ids must be"),
        ((torch.zeros(2, 10), torch.zeros(2, dtype=torch.int64), -1), "num_logprobs"),
    ],
)
def test_compute_logprobs_bad_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        compute_logprobs(*args)


def test_logprobs_do_not_depend_on_sampling_parameters():
    """Raw log-probabilities: the same whatever temperature / filters drew the token."""
    logits = _distinct_logits(2, 64, 5)
    tokens = torch.tensor([10, 20])
    ref = compute_logprobs(logits, tokens, 4)
    params = [SamplingParams(temperature=0.3, top_k=3, top_p=0.5, min_p=0.1),
              SamplingParams(temperature=2.0)]
    st = SamplingTensors.from_params(params, 64, "cpu")
    Sampler().sample(logits, st, {})
    again = compute_logprobs(logits, tokens, 4)
    for a, b in zip(ref, again):
        assert torch.equal(a, b)
    scaled = (logits / 0.3).log_softmax(-1)
    assert not torch.allclose(ref.token_logprob[0], scaled[0, 10])


def test_to_host_mixed_rows_and_counts():
    n, v = 5, 40
    logits = _distinct_logits(n, v, 9)
    tokens = torch.tensor([1, 2, 3, 4, 5])
    rows, counts = [3, 0, 4], [2, 0, 5]
    ids, lps = tokens_and_logprobs_to_host(logits, tokens, rows, counts)
    assert ids == [1, 2, 3, 4, 5] and all(type(t) is int for t in ids)
    assert len(lps) == 3
    for row, count, lp in zip(rows, counts, lps):
        assert isinstance(lp, TokenLogprobs)
        ref = ref_log_softmax(logits[row].numpy())
        t = int(tokens[row])
        assert lp.logprob == pytest.approx(ref[t], abs=1e-5)
        assert type(lp.rank) is int and lp.rank == ref_rank(ref, t)
        order = np.argsort(-ref, kind="stable")[:count]
        assert lp.topk_ids == order.tolist() and all(type(t) is int for t in lp.topk_ids)
        np.testing.assert_allclose(lp.topk_logprobs, ref[order], atol=1e-5)
    # Values are the float32 results exactly, rows in any order.
    direct = compute_logprobs(logits[[3]], tokens[[3]], 2)
    assert lps[0].logprob == float(direct.token_logprob[0])
    assert lps[0].topk_logprobs == direct.topk_logprobs[0].tolist()


def test_to_host_all_rows():
    logits = _distinct_logits(3, 30, 2)
    tokens = logits.argmax(-1)
    ids, lps = tokens_and_logprobs_to_host(logits, tokens, [0, 1, 2], [1, 1, 1])
    assert ids == tokens.tolist()
    assert [lp.rank for lp in lps] == [1, 1, 1]
    assert [lp.topk_ids for lp in lps] == [[t] for t in ids]


def test_to_host_without_logprob_rows_does_no_logprob_work(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("compute_logprobs must not run when no row asks")

    monkeypatch.setattr(logprobs_mod, "compute_logprobs", boom)
    ids, lps = tokens_and_logprobs_to_host(torch.randn(2, 8), torch.tensor([3, 4]), [], [])
    assert ids == [3, 4] and lps == []
    with pytest.raises(ValueError, match="rows"):
        tokens_and_logprobs_to_host(torch.randn(2, 8), torch.tensor([3, 4]), [0], [])


def test_to_host_reads_back_once(monkeypatch):
    calls = []
    for name in ("tolist", "item", "cpu", "numpy"):
        original = getattr(torch.Tensor, name)

        def spy(self, *args, _original=original, _name=name, **kwargs):
            calls.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, spy)
    tokens_and_logprobs_to_host(torch.randn(4, 16), torch.tensor([1, 2, 3, 4]), [1, 2], [3, 0])
    assert calls == ["tolist"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_one_sync_and_matches_cpu():
    n, v = 6, 128
    logits = _distinct_logits(n, v, 4)
    tokens = torch.tensor([0, 1, 2, 3, 4, 5])
    rows, counts = [1, 3, 5], [0, 4, 20]
    want = tokens_and_logprobs_to_host(logits, tokens, rows, counts)
    logits_d, tokens_d = logits.cuda(), tokens.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = tokens_and_logprobs_to_host(logits_d, tokens_d, rows, counts)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) == 1
    assert got[0] == want[0]
    for a, b in zip(got[1], want[1]):
        assert a.rank == b.rank and a.topk_ids == b.topk_ids
        assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
        np.testing.assert_allclose(a.topk_logprobs, b.topk_logprobs, atol=1e-5)
