"""``sample.prompt_logprobs``: the packed prompt log-probabilities vs a float64 reference
(chunked so that several logits chunks run, K clamped to V, each request's top lists cut to
its own K), ``PromptLogprobs.drop_before``, and the rows ``InputBatch`` picks for a chunked
prompt vs a plain-Python rule."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from manylora.sample import prompt_logprobs as plp
from manylora.sample.prompt_logprobs import (
    PromptLogprobs,
    PromptLogprobsPlan,
    compute_prompt_logprobs,
    prompt_logits_chunks,
    unpack_prompt_logprobs,
)


def _reference(hidden, weight, rows, targets):
    lp = (hidden[rows].double() @ weight.double().T).log_softmax(-1)
    token = lp[torch.arange(len(rows)), targets]
    rank = (lp > token[:, None]).sum(-1) + 1
    return lp, token, rank


@pytest.mark.parametrize("vocab, k", [(50, 3), (7, 10)])
def test_packed_prompt_logprobs_match_float64(monkeypatch, vocab, k):
    monkeypatch.setattr(plp, "PROMPT_LOGITS_ELEMENTS", 2 * vocab)   # chunks of 2 rows
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(9, 16, generator=g)
    weight = torch.randn(vocab, 16, generator=g)
    rows = torch.tensor([0, 1, 2, 4, 5, 8])
    targets = torch.randint(0, vocab, (6,), generator=g)
    calls = []

    def logits(h, lo, hi):
        assert hi - lo == h.shape[0]
        calls.append(h.shape[0])
        return h @ weight.T

    packed = compute_prompt_logprobs(hidden, rows, targets, k, logits, vocab)
    assert calls == [2, 2, 2]
    plan = PromptLogprobsPlan(["a", "b"], [1, 3], [4, 2], [k, 1])
    out = unpack_prompt_logprobs(packed.numpy(), plan, vocab)
    lp, token, rank = _reference(hidden, weight, rows, targets)
    kk = min(k, vocab)
    for name, lo, hi, own in (("a", 0, 4, kk), ("b", 4, 6, min(1, kk))):
        got = out[name]
        assert got.start == (1 if name == "a" else 3) and len(got) == hi - lo
        np.testing.assert_allclose(got.logprobs, token[lo:hi].numpy(), atol=1e-5)
        assert got.ranks.tolist() == rank[lo:hi].tolist()
        top = lp[lo:hi].topk(own, dim=-1)
        assert got.topk_ids.shape == (hi - lo, own)
        np.testing.assert_allclose(got.topk_logprobs, top.values.numpy(), atol=1e-5)
        np.testing.assert_array_equal(
            np.take_along_axis(lp[lo:hi].numpy(), got.topk_ids, axis=1),
            top.values.numpy())


def test_chunks_cover_the_rows_and_refusals():
    assert prompt_logits_chunks(0, 10) == []
    chunks = prompt_logits_chunks(1000, 1 << 20)
    assert chunks[0] == (0, 64) and chunks[-1][1] == 1000
    assert all(b == c for (_, b), (c, _) in zip(chunks, chunks[1:]))
    with pytest.raises(ValueError, match="differ"):
        compute_prompt_logprobs(torch.zeros(2, 4), torch.tensor([0]), torch.tensor([0, 1]), 1,
                                lambda h: h, 4)
    with pytest.raises(ValueError, match="num_logprobs"):
        compute_prompt_logprobs(torch.zeros(2, 4), torch.tensor([0]), torch.tensor([0]), -1,
                                lambda h: h, 4)


def test_drop_before_keeps_only_unreported_positions():
    chunk = PromptLogprobs(3, np.arange(4, dtype=np.float32), np.arange(4),
                           np.zeros((4, 2), np.int64), np.zeros((4, 2), np.float32))
    assert chunk.drop_before(2) is chunk and chunk.drop_before(3) is chunk
    tail = chunk.drop_before(5)
    assert tail.start == 5 and tail.logprobs.tolist() == [2.0, 3.0]
    assert chunk.drop_before(7) is None


def test_input_batch_prompt_rows_follow_the_chunks():
    """A prompt of P tokens computed in chunks [s, s + n): rows s..min(s + n, P - 1) - 1 of
    each chunk, targets the next prompt tokens, none past the prompt."""
    from manylora.worker.input_batch import InputBatch
    from manylora.worker.prepare_inputs import prompt_logprob_rows

    batch = InputBatch(4, 64, 4, 0, 100, 1)
    prompt = list(range(10, 20))                   # P = 10
    batch.token_ids[0, :12] = prompt + [90, 91]     # two generated tokens after it
    batch.num_prompt[0], batch.prompt_lp[0] = 10, 2
    batch.token_ids[1, :5] = [1, 2, 3, 4, 5]
    batch.num_prompt[1], batch.prompt_lp[1] = 5, -1
    for start, n in ((0, 4), (4, 4), (8, 3), (10, 2)):
        plan, rows, targets = prompt_logprob_rows(
            batch, ["a", "b"], np.array([0, 1]), np.array([start, 0]), np.array([n, 5]),
            np.array([0, n]))
        want = [j for j in range(start, start + n) if j <= 8]
        if not want:
            assert plan is None
            continue
        assert plan.req_ids == ["a"] and plan.starts == [start + 1]
        assert plan.counts == [len(want)] and plan.num_logprobs == [2]
        assert rows.tolist() == [j - start for j in want]
        assert targets.tolist() == [prompt[j + 1] for j in want]
