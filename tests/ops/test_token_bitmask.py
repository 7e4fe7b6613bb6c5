"""``apply_token_bitmask_`` (the Triton kernel, and the PyTorch reference) vs a per-element
float64 reference on random logits and random bitmasks: masked tokens become -inf, every
other logit keeps its bits, unconstrained rows are untouched."""

from __future__ import annotations

import pytest
import torch

from manylora.ops.token_bitmask import apply_token_bitmask_, token_bitmask_reference_
from manylora.ops.triton_token_bitmask import apply_token_bitmask_triton


def _case(n, vocab, rows, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, vocab, generator=g)
    words = -(-vocab // 32)
    bits = torch.rand(len(rows), words * 32, generator=g) < 0.3
    weights = (1 << torch.arange(32, dtype=torch.int64))
    packed_words = (bits.view(len(rows), words, 32).long() * weights).sum(-1)
    packed = torch.empty(len(rows), 1 + words, dtype=torch.int32)
    packed[:, 0] = torch.tensor(rows, dtype=torch.int32)
    packed[:, 1:] = torch.where(packed_words >= 1 << 31, packed_words - (1 << 32),
                                packed_words).to(torch.int32)
    return logits.to(device), packed.to(device), bits


def _expected(logits, rows, bits):
    out = logits.to(torch.float64).clone()
    for r, row in enumerate(rows):
        for j in range(logits.shape[1]):
            if not bits[r, j]:
                out[row, j] = float("-inf")
    return out


CASES = [(5, 100, [0, 3], 0), (8, 257, [7, 1, 4], 1), (3, 32, [2], 2), (4, 4099, [3, 0], 3),
         (6, 90, [], 4)]


@pytest.mark.parametrize("n,vocab,rows,seed", CASES)
@pytest.mark.parametrize("op", [token_bitmask_reference_, apply_token_bitmask_triton,
                                apply_token_bitmask_])
def test_bitmask_matches_float64_reference(n, vocab, rows, seed, op):
    logits, packed, bits = _case(n, vocab, rows, seed)
    expected = _expected(logits, rows, bits)
    if op is apply_token_bitmask_triton and not rows:
        return                      # the kernel is never launched for an empty grid
    op(logits, packed)
    assert torch.equal(logits.to(torch.float64), expected)


def test_bitmask_refuses_wrong_width_and_dtype():
    logits, packed, _ = _case(2, 64, [1], 0)
    with pytest.raises(ValueError, match="columns"):
        apply_token_bitmask_(logits, packed[:, :-1])
    with pytest.raises(ValueError, match="int32"):
        apply_token_bitmask_(logits, packed.long())


@pytest.mark.gpu
@pytest.mark.parametrize("n,vocab,rows,seed", CASES + [(256, 128256, list(range(0, 256, 3)), 5)])
def test_bitmask_cuda(n, vocab, rows, seed):
    logits, packed, bits = _case(n, vocab, rows, seed)
    ref = token_bitmask_reference_(logits.clone(), packed)
    out = apply_token_bitmask_(logits.cuda(), packed.cuda())
    assert torch.equal(out.cpu(), ref)
