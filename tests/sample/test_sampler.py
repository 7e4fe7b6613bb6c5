"""Tests for manylora.sample.sampler, its filters and generators, against straightforward
per-row NumPy references."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from manylora.sample.filters import apply_min_p, apply_top_k_top_p
from manylora.sample.generators import make_generator
from manylora.sample.sampler import Sampler, SamplingTensors
from manylora.sampling_params import SamplingParams

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


# ------------------------------------------------------------------ reference implementation


def ref_keep_mask(row: np.ndarray, k: int, p: float, min_p: float) -> np.ndarray:
    """Boolean [V] mask of the tokens kept after top-k, top-p and min-p (vLLM's order),
    written per row with plain NumPy in float64."""
    v = row.shape[0]
    keep = np.ones(v, dtype=bool)
    if 0 < k < v:
        kth = np.sort(row)[::-1][k - 1]
        keep &= row >= kth
    if p < 1.0:
        x = np.where(keep, row, -np.inf)
        probs = np.exp(x - x.max())
        probs /= probs.sum()
        order = np.argsort(-probs, kind="stable")
        cum = 0.0
        nucleus = np.zeros(v, dtype=bool)
        for t in order:
            nucleus[t] = True
            cum += probs[t]
            if cum >= p:
                break
        keep &= nucleus
    if min_p > 0.0:
        x = np.where(keep, row, -np.inf)
        probs = np.exp(x - x.max())
        probs /= probs.sum()
        keep &= probs >= min_p * probs.max()
    return keep


def ref_probs(row: np.ndarray, temperature: float, k: int, p: float, min_p: float) -> np.ndarray:
    x = row.astype(np.float64) / temperature
    keep = ref_keep_mask(x, k, p, min_p)
    x = np.where(keep, x, -np.inf)
    e = np.exp(x - x.max())
    return e / e.sum()


def _distinct_logits(n: int, v: int, seed: int) -> torch.Tensor:
    """Random logits whose values (and cumulative sums) are well separated, so that the
    float32 kernel and the float64 reference make the same top-p decisions."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randperm(v, generator=g).to(torch.float32) * 0.37 for _ in range(n)]
    return torch.stack(rows) / 4.0


# ------------------------------------------------------------------------------- masks


@pytest.mark.parametrize("seed", range(5))
def test_masks_match_reference(seed):
    n, v = 16, 50
    logits = _distinct_logits(n, v, seed)
    rng = np.random.default_rng(seed)
    top_k = torch.tensor(rng.choice([0, 1, 2, 5, 17, v, v + 3], size=n), dtype=torch.int64)
    top_p = torch.tensor(rng.choice([1.0, 0.9, 0.5, 0.123, 0.01], size=n), dtype=torch.float32)
    min_p = torch.tensor(rng.choice([0.0, 0.05, 0.3, 1.0], size=n), dtype=torch.float32)

    masked = apply_top_k_top_p(logits.clone(), top_k, top_p)
    masked = apply_min_p(masked, min_p)
    got = torch.isfinite(masked).numpy()
    for i in range(n):
        want = ref_keep_mask(
            logits[i].double().numpy(), int(top_k[i]), float(top_p[i]), float(min_p[i])
        )
        np.testing.assert_array_equal(got[i], want, err_msg=f"row {i}")
        # Kept logits are unchanged.
        np.testing.assert_array_equal(masked[i][want].numpy(), logits[i][want].numpy())


def test_top_k_keeps_ties():
    logits = torch.tensor([[1.0, 3.0, 2.0, 3.0, 2.0, 0.0]])
    out = apply_top_k_top_p(logits, torch.tensor([2]), None)
    assert torch.isfinite(out).tolist() == [[False, True, False, True, False, False]]
    out = apply_top_k_top_p(logits, torch.tensor([3]), None)
    assert torch.isfinite(out).tolist() == [[False, True, True, True, True, False]]


def test_top_p_always_keeps_top_token():
    logits = torch.tensor([[0.0, 10.0, 1.0]])
    out = apply_top_k_top_p(logits, None, torch.tensor([1e-6]))
    assert torch.isfinite(out).tolist() == [[False, True, False]]


def test_inputs_not_modified():
    logits = _distinct_logits(4, 20, 0)
    before = logits.clone()
    Sampler()(
        logits,
        torch.tensor([0.7, 0.0, 1.0, 2.0]),
        torch.tensor([3, 0, 0, 5]),
        torch.tensor([0.9, 1.0, 0.5, 1.0]),
        torch.tensor([0.1, 0.0, 0.0, 0.0]),
        {},
    )
    assert torch.equal(logits, before)


# ------------------------------------------------------------------------------- greedy


def test_greedy_equals_argmax():
    logits = torch.randn(7, 33, generator=torch.Generator().manual_seed(0))
    n = logits.shape[0]
    zeros = torch.zeros(n)
    out = Sampler()(logits, zeros, torch.zeros(n, dtype=torch.int64), torch.ones(n), zeros, {})
    assert out.dtype == torch.int64 and out.shape == (n,)
    assert torch.equal(out, logits.argmax(-1))


def test_mixed_batch_greedy_rows_are_argmax():
    torch.manual_seed(0)
    logits = torch.randn(6, 40)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_k=3),
        SamplingParams(temperature=0.0, top_p=0.5),
        SamplingParams(temperature=0.8, top_p=0.9, min_p=0.05),
        SamplingParams(temperature=1e-6),
        SamplingParams(temperature=1.5),
    ]
    st = SamplingTensors.from_params(params, 40, "cpu")
    assert not st.all_greedy and not st.all_random
    sampler = Sampler()
    for _ in range(20):
        out = sampler.sample(logits, st, {})
        for i in (0, 2, 4):
            assert out[i] == logits[i].argmax()
        # The top-k=3 row stays within its 3 largest.
        assert int(out[1]) in logits[1].topk(3).indices.tolist()


def test_empty_batch():
    out = Sampler()(
        torch.empty(0, 10),
        torch.empty(0),
        torch.empty(0, dtype=torch.int64),
        torch.empty(0),
        torch.empty(0),
        {},
    )
    assert out.shape == (0,) and out.dtype == torch.int64


# ------------------------------------------------------------------------------- seeds


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_row_independent_of_batch(device):
    v = 64
    torch.manual_seed(1)
    target = torch.randn(v, device=device)
    sampler = Sampler()
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=42)

    def run(batch_rows: int, row: int, other_seed: int) -> list[int]:
        torch.manual_seed(other_seed)  # the default generator differs between runs
        gen = make_generator(42, device)
        tokens = []
        for step in range(12):
            logits = torch.randn(batch_rows, v, device=device)
            logits[row] = target + step * 0.01
            plist = [SamplingParams(temperature=0.7, top_k=10)] * batch_rows
            plist[row] = params
            st = SamplingTensors.from_params(plist, v, device)
            tokens.append(int(sampler.sample(logits, st, {row: gen})[row]))
        return tokens

    a = run(1, 0, 0)
    b = run(5, 3, 1)
    c = run(9, 8, 2)
    assert a == b == c
    assert len(set(a)) > 1  # really sampled, not constant


def test_make_generator_is_deterministic():
    g1, g2 = make_generator(7, "cpu"), make_generator(7, torch.device("cpu"))
    assert torch.equal(
        torch.empty(5).exponential_(generator=g1), torch.empty(5).exponential_(generator=g2)
    )


# ------------------------------------------------------------------------- distributions


def _frequencies(
    logits_row, params: SamplingParams, draws: int, v: int, device: str = "cpu"
) -> np.ndarray:
    """Sample ``draws`` tokens by tiling one row into a batch (one call)."""
    torch.manual_seed(1234)
    logits = logits_row.to(device).expand(draws, v).contiguous()
    st = SamplingTensors.from_params([params] * draws, v, device)
    out = Sampler().sample(logits, st, {})
    assert out.device.type == torch.device(device).type
    return np.bincount(out.cpu().numpy(), minlength=v) / draws


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.5),
        SamplingParams(temperature=2.0, top_p=0.8),
        SamplingParams(temperature=1.3, top_k=3),
        SamplingParams(temperature=0.9, min_p=0.2),
        SamplingParams(temperature=1.0, top_k=4, top_p=0.9, min_p=0.1),
    ],
)
@pytest.mark.parametrize("device", DEVICES)
def test_empirical_frequencies(params, device):
    v, draws = 5, 4000
    row = torch.tensor([1.0, 0.2, -0.5, 0.7, -1.2])
    want = ref_probs(row.numpy(), params.temperature, params.top_k, params.top_p, params.min_p)
    got = _frequencies(row, params, draws, v, device)
    assert np.max(np.abs(got - want)) < 0.03, (got, want)
    # Masked tokens are never drawn.
    assert np.all(got[want == 0] == 0)


@pytest.mark.parametrize("device", DEVICES)
def test_token_outside_top_k_never_drawn(device):
    v, draws = 50, 4000
    row = torch.linspace(0.0, 1.0, v)  # nearly flat: every token would be likely
    params = SamplingParams(temperature=5.0, top_k=7)
    got = _frequencies(row, params, draws, v, device)
    allowed = set(row.topk(7).indices.tolist())
    assert {int(t) for t in np.nonzero(got)[0]} <= allowed
    assert len(np.nonzero(got)[0]) == 7


# ----------------------------------------------------------------------- SamplingTensors


def test_sampling_tensors_from_params():
    params = [
        SamplingParams(temperature=0.0, top_k=5),
        SamplingParams(temperature=0.7, top_k=-1, top_p=0.9),
        SamplingParams(temperature=1.0, top_k=1000),
    ]
    st = SamplingTensors.from_params(params, 100, "cpu")
    assert st.temperature.dtype == torch.float32
    assert st.top_k.dtype == torch.int64
    assert st.top_p.dtype == torch.float32 and st.min_p.dtype == torch.float32
    assert st.temperature.tolist() == pytest.approx([0.0, 0.7, 1.0])
    assert st.top_k.tolist() == [0, 0, 0]  # greedy row neutral, -1 off, >= V off
    assert st.top_p.tolist() == pytest.approx([1.0, 0.9, 1.0])
    assert (st.all_greedy, st.all_random) == (False, False)
    assert (st.do_top_k, st.do_top_p, st.do_min_p) == (False, True, False)

    greedy = SamplingTensors.from_params([SamplingParams(temperature=0.0)] * 2, 10, "cpu")
    assert greedy.all_greedy and not greedy.all_random
    rand = SamplingTensors.from_params([SamplingParams(top_k=3)], 10, "cpu")
    assert rand.all_random and not rand.all_greedy and rand.do_top_k


def test_flags_do_not_change_result():
    """The skip flags are optimizations only: with the same noise, the result matches the
    unflagged run."""
    v = 30
    logits = _distinct_logits(8, v, 3)
    params = [SamplingParams(temperature=0.8)] * 4 + [SamplingParams(temperature=0.0)] * 4
    st = SamplingTensors.from_params(params, v, "cpu")
    torch.manual_seed(5)
    a = Sampler().sample(logits, st, {})
    torch.manual_seed(5)
    b = Sampler()(
        logits,
        st.temperature,
        st.top_k,
        st.top_p,
        st.min_p,
        {},
        all_greedy=False,
        all_random=False,
        do_top_k=True,
        do_top_p=True,
        do_min_p=True,
    )
    assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore:Synchronization debug mode")
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_no_host_sync_and_masks_match_cpu():
    v = 128
    dev = torch.device("cuda")
    logits = _distinct_logits(6, v, 11)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_p=0.9, seed=3),
        SamplingParams(temperature=0.7, top_k=5, min_p=0.05),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.5, top_k=20, top_p=0.5),
        SamplingParams(temperature=2.0, min_p=0.3),
    ]
    gens = {1: make_generator(3, dev)}
    logits_d = logits.to(dev)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        st = SamplingTensors.from_params(params, v, dev)
        out1 = Sampler().sample(logits_d, st, gens)
        # Without host flags the sampler must not sync either.
        out2 = Sampler()(logits_d, st.temperature, st.top_k, st.top_p, st.min_p, {})
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert out1.device.type == "cuda" and out1.dtype == torch.int64
    assert out1[0] == logits[0].argmax() and out2[0] == logits[0].argmax()
    out3 = Sampler().sample(logits_d, st, {1: make_generator(3, dev)})
    assert out1[1] == out3[1]

    st_cpu = SamplingTensors.from_params(params, v, "cpu")
    for t in (1.0, 0.7):
        masked_c = apply_min_p(
            apply_top_k_top_p(logits / t, st_cpu.top_k, st_cpu.top_p), st_cpu.min_p
        )
        masked_d = apply_min_p(apply_top_k_top_p(logits_d / t, st.top_k, st.top_p), st.min_p)
        assert torch.equal(torch.isfinite(masked_c), torch.isfinite(masked_d).cpu())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_seeded_and_greedy():
    v = 128
    dev = torch.device("cuda")
    logits = torch.randn(4, v, device=dev)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_p=0.9, seed=3),
        SamplingParams(temperature=0.7, top_k=5, min_p=0.05),
        SamplingParams(temperature=1.0),
    ]
    st = SamplingTensors.from_params(params, v, dev)
    out1 = Sampler().sample(logits, st, {1: make_generator(3, dev)})
    out2 = Sampler().sample(logits, st, {1: make_generator(3, dev)})
    assert out1.device.type == "cuda"
    assert out1[0] == logits[0].argmax()
    assert out1[1] == out2[1]
