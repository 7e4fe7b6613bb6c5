"""The adapter read's finiteness check and content digest against independent references
(``torch.isfinite``; ``hashlib.blake2b`` over the tensors' bytes as the digest defines it)."""

from __future__ import annotations

import hashlib

import pytest
import torch

from manylora.lora.adapter import LoRAWeights, all_finite, weights_digest

SPECIALS = (float("nan"), float("inf"), float("-inf"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32,
                                   torch.float64], ids=str)
def test_all_finite_equals_torch_isfinite(dtype):
    gen = torch.Generator().manual_seed(0)
    info = torch.finfo(dtype)
    base = torch.randn(64, 33, generator=gen).to(dtype)
    edge = torch.tensor([info.max, -info.max, info.tiny, info.tiny / 4, 0.0, -0.0],
                        dtype=dtype)                      # largest, subnormal, signed zero
    cases = [base, edge, base[:, ::2], base.t(), torch.empty(0, dtype=dtype)]
    for special in SPECIALS:
        for where in ((0, 0), (63, 32), (17, 5)):
            t = base.clone()
            t[where] = special
            cases += [t, t.t()]
    for t in cases:
        assert all_finite(t) == bool(torch.isfinite(t).all()), (t.dtype, t.shape)
    assert all_finite(torch.arange(5))                     # integers are finite


def test_weights_digest_is_blake2b_of_the_bytes():
    gen = torch.Generator().manual_seed(1)
    weights = {(1, "v_proj"): LoRAWeights(torch.randn(2, 8, generator=gen).bfloat16(),
                                          torch.randn(4, 2, generator=gen).bfloat16()),
               (0, "q_proj"): LoRAWeights(torch.randn(3, 8, generator=gen),
                                          torch.randn(8, 3, generator=gen),
                                          torch.rand(8, generator=gen))}
    ref = hashlib.blake2b(digest_size=16)
    for (layer, module) in sorted(weights):
        ref.update(f"{layer}:{module};".encode())
        for t in weights[(layer, module)].tensors():
            ref.update(f"{t.dtype}{tuple(t.shape)};".encode())
            ref.update(bytes(t.contiguous().view(torch.uint8).flatten().tolist()))
    assert weights_digest(weights) == ref.hexdigest()
