"""lora_shrink / lora_expand and LoRALinear against an independent float64 reference.

The reference is a plain per-row loop::

    y[t, off:off+n] += x[t] @ A[slot].T @ B[slot].T        (slot[t] >= 0)

over slot buffers laid out as the engine lays them out: ``A [max_loras, max_lora_rank, in]``
and B rank-major ``[max_loras, max_lora_rank, out]``, each (slot, slice)'s rank from a rank
table (``SlotTable`` columns), with everything past the rank NaN (never read). Adapter
popularity follows Punica's tests: distinct, uniform, zipf, identical, all base (-1) and base
rows mixed in. DoRA rows get ``(y + delta) * scale + (1 - scale) * bias``, and through
``LoRALinear`` peft's ``scale * (x W^T + delta) + bias``.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

from manylora.lora.dora import dora_row_norm
from manylora.lora.kernels.expand import lora_expand
from manylora.lora.kernels.meta import build_lora_kernel_meta
from manylora.lora.kernels.shrink import lora_shrink
from manylora.lora.linear import LoRALinear

MAX_LORAS = 4
MAX_RANK = 16
IN = 32
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}

# (output_slices, out_total): 1-3 slices of different widths; the last one leaves a gap
# (only q and v of a packed qkv enabled), as LoRALinear does for restricted target modules.
SLICES = {
    "one": ([(0, 24)], 24),
    "two": ([(0, 32), (32, 16)], 48),
    "three": ([(0, 32), (32, 16), (48, 8)], 56),
    "gap": ([(0, 32), (48, 16)], 64),
}
RANKS = {
    "mixed": (1, MAX_RANK, 7, 3),
    "all_max": (MAX_RANK,) * MAX_LORAS,
    "all_one": (1,) * MAX_LORAS,
}
QKV_NAMES = ("q_proj", "k_proj", "v_proj")
QKV_WIDTH = {"q_proj": 32, "k_proj": 16, "v_proj": 16}
QKV_OFFSET = {"q_proj": 0, "k_proj": 32, "v_proj": 48}
POPULARITY = ("distinct", "uniform", "zipf", "identical", "all_base", "base_mixed")


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def make_seq_slots(popularity: str, gen: torch.Generator) -> list[int]:
    """One slot per sequence (-1 = base model), drawn the way Punica's tests draw them."""
    num_seqs = MAX_LORAS if popularity == "distinct" else 9
    if popularity == "distinct":
        return torch.randperm(MAX_LORAS, generator=gen).tolist()
    if popularity == "uniform":
        return torch.randint(0, MAX_LORAS, (num_seqs,), generator=gen).tolist()
    if popularity == "zipf":
        w = 1.0 / torch.arange(1, MAX_LORAS + 1, dtype=torch.float64) ** 1.5
        perm = torch.randperm(MAX_LORAS, generator=gen)
        draws = torch.multinomial(w, num_seqs, replacement=True, generator=gen)
        return perm[draws].tolist()
    if popularity == "identical":
        return [int(torch.randint(0, MAX_LORAS, (1,), generator=gen))] * num_seqs
    if popularity == "all_base":
        return [-1] * num_seqs
    if popularity == "base_mixed":
        slots = torch.randint(-1, MAX_LORAS, (num_seqs,), generator=gen).tolist()
        slots[0], slots[-1] = -1, 0          # at least one of each
        return slots
    raise AssertionError(popularity)


def make_token_slots(popularity: str, gen: torch.Generator) -> list[int]:
    """Sequences of 1-6 tokens (decode rows and prefill chunks), flattened to rows."""
    token_slots: list[int] = []
    for slot in make_seq_slots(popularity, gen):
        token_slots.extend([slot] * int(torch.randint(1, 7, (1,), generator=gen)))
    return token_slots


def rank_table(ranks, num_slices) -> list[list[int]]:
    """``[max_loras][S]``: slice 0 the given ranks, slice s another slot's, and rank 0 for
    every third (slot, slice) past the first slice (a module the adapter does not target)."""
    return [[0 if s and (slot + s) % 3 == 0 else ranks[(slot + s) % len(ranks)]
             for s in range(num_slices)] for slot in range(len(ranks))]


def table_tensor(table) -> torch.Tensor:
    return torch.tensor(table, dtype=torch.int32)


def make_stacks(table, slices, dtype, gen):
    """Slot buffers as LoRASlots holds them (B rank-major), NaN past each (slot, slice)'s
    rank: nothing may read there."""
    a_stacked, b_stacked = [], []
    for s, (_, size) in enumerate(slices):
        a = torch.randn(MAX_LORAS, MAX_RANK, IN, generator=gen, dtype=torch.float64) / IN ** 0.5
        b = torch.randn(MAX_LORAS, MAX_RANK, size, generator=gen, dtype=torch.float64)
        for slot in range(MAX_LORAS):
            r = table[slot][s]
            a[slot, r:] = float("nan")
            b[slot, r:] = float("nan")
            b[slot, :r] /= max(r, 1) ** 0.5
        a_stacked.append(a.to(dtype))
        b_stacked.append(b.to(dtype))
    return a_stacked, b_stacked


def reference_delta(x, token_slots, a_stacked, b_stacked, table, slices, out_total):
    """float64 per-row loop over each (slot, slice)'s first ``rank`` rows, independent of
    the Punica lora_meta."""
    delta = torch.zeros(x.shape[0], out_total, dtype=torch.float64)
    for t, slot in enumerate(token_slots):
        if slot < 0:
            continue
        for s, (a, b, (off, n)) in enumerate(zip(a_stacked, b_stacked, slices, strict=True)):
            r = table[slot][s]
            delta[t, off:off + n] += x[t].double() @ a[slot, :r].double().T @ b[slot, :r].double()
    return delta


@pytest.mark.parametrize("popularity", POPULARITY)
@pytest.mark.parametrize("ranks", list(RANKS.values()), ids=list(RANKS))
@pytest.mark.parametrize("slices_key", list(SLICES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_shrink_expand_match_reference(dtype, slices_key, ranks, popularity):
    seed = zlib.crc32(f"{dtype}-{slices_key}-{ranks}-{popularity}".encode())
    gen = torch.Generator().manual_seed(seed)
    slices, out_total = SLICES[slices_key]
    token_slots = make_token_slots(popularity, gen)
    num_rows = len(token_slots)
    x = torch.randn(num_rows, IN, generator=gen).to(dtype)
    y0 = torch.randn(num_rows, out_total, generator=gen).to(dtype)
    table = rank_table(ranks, len(slices))
    a_stacked, b_stacked = make_stacks(table, slices, dtype, gen)
    lora_meta = build_lora_kernel_meta(token_slots, MAX_LORAS, torch.device("cpu"))
    assert lora_meta.has_lora == any(s >= 0 for s in token_slots)
    assert lora_meta.token_lora_indices.tolist() == token_slots

    buffer = lora_shrink(x, a_stacked, table_tensor(table), lora_meta)
    assert buffer.dtype == torch.float32
    assert buffer.shape == (num_rows, len(slices), MAX_RANK)
    ref_buffer = torch.zeros(num_rows, len(slices), MAX_RANK, dtype=torch.float64)
    for t, slot in enumerate(token_slots):
        if slot >= 0:
            for s, a in enumerate(a_stacked):
                r = table[slot][s]
                ref_buffer[t, s, :r] = x[t].double() @ a[slot, :r].double().T
    base = torch.tensor([s < 0 for s in token_slots])
    assert torch.all(buffer[base] == 0), "base rows must shrink to zero"
    assert not buffer.isnan().any(), "A past a rank was read"
    for t, slot in enumerate(token_slots):
        for s in range(len(slices)):
            if slot >= 0:
                assert torch.all(buffer[t, s, table[slot][s]:] == 0), "past the rank: zero"
    if lora_meta.has_lora:
        assert rel_err(buffer, ref_buffer) < TOL[dtype]

    y = y0.clone()
    lora_expand(y, buffer, b_stacked, table_tensor(table), lora_meta, slices)
    want = y0.double() + reference_delta(x, token_slots, a_stacked, b_stacked, table, slices,
                                         out_total)
    assert y.dtype == dtype and y.shape == y0.shape
    assert torch.equal(y[base], y0[base]), "base rows must be left untouched"
    lora_rows = ~base
    if lora_rows.any():
        assert rel_err(y[lora_rows], want[lora_rows]) < TOL[dtype]
        if dtype == torch.float32:
            # the delta itself (not only the sum with y0) is accurate
            assert rel_err((y - y0)[lora_rows], (want - y0.double())[lora_rows]) < 1e-5
        covered = torch.zeros(out_total, dtype=torch.bool)
        for off, n in slices:
            covered[off:off + n] = True
        assert torch.equal(y[:, ~covered], y0[:, ~covered]), "columns of no slice changed"


def test_expand_rejects_mismatched_slices():
    lora_meta = build_lora_kernel_meta([0], 1, torch.device("cpu"))
    with pytest.raises(ValueError, match="output slices"):
        lora_expand(torch.zeros(1, 8), torch.zeros(1, 1, 4), [torch.zeros(1, 4, 8)] * 2,
                    table_tensor([[4, 4]]), lora_meta, [(0, 8)])


def test_build_lora_kernel_meta_segments_and_bad_slot():
    lora_meta = build_lora_kernel_meta([2, -1, 0, 2, 2, -1], 3, torch.device("cpu"))
    assert [(s.slot, s.rows.tolist()) for s in lora_meta.segments] == [(0, [2]), (2, [0, 3, 4])]
    assert lora_meta.used_columns is None
    assert not build_lora_kernel_meta([-1, -1], 1, torch.device("cpu")).has_lora
    with pytest.raises(IndexError, match="slot 3"):
        build_lora_kernel_meta([0, 3], 3, torch.device("cpu"))


def test_build_lora_kernel_meta_one_copy_and_used_columns():
    """Five int32 tensors from one host copy; ``used_columns`` is the OR over the step's
    slots of their nonzero table entries (slot 1, in the table but not in the step, adds
    nothing); a padded (CUDA-graph) mapping carries the ``columns`` of its graph's mask
    instead (None: all), and on the CPU the segments of its real rows."""
    cpu = torch.device("cpu")
    ranks_host = np.array([[4, 0, 0, 0], [0, 8, 8, 0], [0, 0, 2, 0]], np.int32)
    lora_meta = build_lora_kernel_meta([2, -1, 0, 2], 3, cpu, ranks_host=ranks_host)
    storages = {t.untyped_storage().data_ptr() for t in lora_meta if isinstance(t, torch.Tensor)}
    assert len(storages) == 1, "every index tensor must come from one host → device copy"
    assert lora_meta.used_columns == (True, False, True, False)
    padded = build_lora_kernel_meta([2, 0], 3, cpu, pad_to=4, ranks_host=ranks_host)
    assert padded.used_columns is None and padded.max_seg_len == 4
    assert [(s.slot, s.rows.tolist()) for s in padded.segments] == [(0, [1]), (2, [0])]
    masked = build_lora_kernel_meta([2, 0], 3, cpu, pad_to=4, columns=(True, False) * 2)
    assert masked.used_columns == (True, False, True, False)
    with pytest.raises(ValueError, match="rank table of 2 slots"):
        build_lora_kernel_meta([0], 3, cpu, ranks_host=ranks_host[:2])


# ---------------------------------------------------------------------------------------------
# LoRALinear with slots filled through LoRASlots.set_slot


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("enabled", [("q_proj", "k_proj", "v_proj"), ("q_proj", "v_proj"),
                                     ("k_proj",)], ids=["qkv", "qv", "k"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_lora_linear_equals_base_plus_per_row_delta(dtype, enabled, bias):
    gen = torch.Generator().manual_seed(len(enabled) * 10 + bias)
    names, sizes = QKV_NAMES, tuple(QKV_WIDTH.values())
    layer = LoRALinear(IN, sizes, names, bias=bias, dtype=dtype, device=torch.device("cpu"))
    with torch.no_grad():
        layer.weight.copy_(torch.randn(sum(sizes), IN, generator=gen) / IN ** 0.5)
        if bias:
            layer.bias.copy_(torch.randn(sum(sizes), generator=gen))
    slots = layer.create_lora_slots(enabled, MAX_LORAS, MAX_RANK)
    assert slots is not None and slots.module_names == enabled
    assert slots.output_slices == tuple((QKV_OFFSET[m], QKV_WIDTH[m]) for m in enabled)

    # slot 1 is first filled with a rank-16 adapter (NaN), then overwritten by a rank-2 one:
    # the rows left behind past rank 2 are never read. Slot 2's adapter does not target
    # the first enabled module, and its modules have ranks of their own (rank_pattern).
    for m in enabled:
        slots.set_slot(1, m, torch.full((MAX_RANK, IN), float("nan")).to(dtype),
                       torch.full((QKV_WIDTH[m], MAX_RANK), float("nan")).to(dtype))
    ranks = {0: 5, 1: 2, 2: MAX_RANK}
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor] | None] = {}
    for slot, r in ranks.items():
        for i, m in enumerate(enabled):
            if slot == 2 and i == 0:
                weights[(slot, m)] = None            # this adapter does not target m
                slots.set_slot(slot, m, None, None)
                continue
            r_m = r - 3 * i if slot == 2 else r
            out = QKV_WIDTH[m]
            a = (torch.randn(r_m, IN, generator=gen) / IN ** 0.5).to(dtype)
            b = (torch.randn(out, r_m, generator=gen) / r_m ** 0.5).to(dtype)
            weights[(slot, m)] = (a, b)
            slots.set_slot(slot, m, a, b)
    want_table = [[0 if weights.get((slot, m)) is None else weights[(slot, m)][0].shape[0]
                   for m in enabled] for slot in range(MAX_LORAS)]
    assert slots.ranks.tolist() == want_table
    assert slots.table.ranks_host[:, slots.rank_col:].tolist() == want_table
    assert not slots.dora.any()

    token_slots = [0, -1, 1, 1, 2, -1, 0, 2, 2, 1]
    x = torch.randn(len(token_slots), IN, generator=gen).to(dtype)
    lora_meta = build_lora_kernel_meta(token_slots, MAX_LORAS, torch.device("cpu"),
                                     ranks_host=slots.table.ranks_host)
    with torch.no_grad():
        got = layer(x, lora_meta)
        base_only = layer(x, None)

    want = x.double() @ layer.weight.double().T
    if bias:
        want += layer.bias.double()
    assert rel_err(base_only, want) < TOL[dtype]
    for t, slot in enumerate(token_slots):
        if slot < 0:
            continue
        for m in enabled:
            w = weights[(slot, m)]
            if w is None:
                continue
            a, b = w
            off, n = QKV_OFFSET[m], QKV_WIDTH[m]
            want[t, off:off + n] += x[t].double() @ a.double().T @ b.double().T
    base = torch.tensor([s < 0 for s in token_slots])
    assert torch.equal(got[base], base_only[base])
    assert rel_err(got, want) < TOL[dtype]
    if dtype == torch.float32:
        assert rel_err(got - base_only, want - base_only.double()) < 1e-5
    # an all-base mapping gives the base output exactly
    with torch.no_grad():
        all_base = layer(x, build_lora_kernel_meta([-1] * len(token_slots), MAX_LORAS,
                                                   torch.device("cpu")))
    assert torch.equal(all_base, base_only)


def test_lora_linear_skips_projections_no_slot_of_the_step_targets(monkeypatch):
    """An eager step launches the shrink and expand of a projection only when one of its
    slots has a nonzero rank in one of the projection's columns; a mapping without
    ``used_columns`` (a CUDA-graph step) always launches."""
    from manylora.lora import slots as lora_slots

    calls = []
    real_shrink, real_expand = lora_slots.lora_shrink, lora_slots.lora_expand
    monkeypatch.setattr(lora_slots, "lora_shrink",
                        lambda *a, **k: calls.append("shrink") or real_shrink(*a, **k))
    monkeypatch.setattr(lora_slots, "lora_expand",
                        lambda *a, **k: calls.append("expand") or real_expand(*a, **k))
    layer = LoRALinear(IN, tuple(QKV_WIDTH.values()), QKV_NAMES, bias=False,
                       dtype=torch.float32, device=torch.device("cpu"))
    with torch.no_grad():
        layer.weight.copy_(torch.randn(layer.weight.shape))
    slots = layer.create_lora_slots(QKV_NAMES, MAX_LORAS, MAX_RANK)
    slots.set_slot(1, "v_proj", torch.randn(4, IN), torch.randn(16, 4))   # slot 1: v only
    x = torch.randn(3, IN)
    cpu = torch.device("cpu")
    host = slots.table.ranks_host
    for token_slots, launches in (([0, 2, -1], 0), ([0, 1, 2], 2), ([-1, 1, 1], 2)):
        calls.clear()
        with torch.no_grad():
            got = layer(x, build_lora_kernel_meta(token_slots, MAX_LORAS, cpu, ranks_host=host))
            base = layer(x, None)
        assert len(calls) == launches, (token_slots, calls)
        assert torch.equal(got, base) == (launches == 0)
    calls.clear()
    with torch.no_grad():
        layer(x, build_lora_kernel_meta([0, 2, -1], MAX_LORAS, cpu))      # no used_columns
    assert calls == ["shrink", "expand"]


def test_create_lora_slots_none_when_nothing_enabled():
    layer = LoRALinear(IN, (32,), ("o_proj",), bias=False, dtype=torch.float32,
                       device=torch.device("cpu"))
    assert layer.create_lora_slots(("q_proj",), MAX_LORAS, MAX_RANK) is None
    assert layer.lora is None


# ---------------------------------------------------------------------------------------------
# DoRA: (y + delta) * scale + (1 - scale) * bias for the (slot, slice)s the table flags

DORA_FLAGS = [[1, 1], [0, 0], [1, 0], [0, 1]]


@pytest.mark.parametrize("shift", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_dora_expand_reference(dtype, shift):
    gen = torch.Generator().manual_seed(31 + shift)
    slices, out_total = SLICES["gap"]
    table = rank_table(RANKS["mixed"], len(slices))
    token_slots = [0, -1, 1, 2, 2, 3, 0, -1, 1, 2]
    x = torch.randn(len(token_slots), IN, generator=gen).to(dtype)
    y0 = torch.randn(len(token_slots), out_total, generator=gen).to(dtype)
    a_stacked, b_stacked = make_stacks(table, slices, dtype, gen)
    scales = [1 + 0.2 * torch.randn(MAX_LORAS, n, generator=gen) for _, n in slices]
    bias = torch.randn(out_total, generator=gen).to(dtype) if shift else None
    lora_meta = build_lora_kernel_meta(token_slots, MAX_LORAS, torch.device("cpu"))
    ranks, flags = table_tensor(table), table_tensor(DORA_FLAGS)
    buffer = lora_shrink(x, a_stacked, ranks, lora_meta)

    y = y0.clone()
    lora_expand(y, buffer, b_stacked, ranks, lora_meta, slices, flags, scales, bias)
    plain = y0.clone()
    lora_expand(plain, buffer, b_stacked, ranks, lora_meta, slices)
    want = y0.double() + reference_delta(x, token_slots, a_stacked, b_stacked, table, slices,
                                         out_total)
    dora = torch.zeros(want.shape, dtype=torch.bool)
    for t, slot in enumerate(token_slots):
        for s, (off, n) in enumerate(slices):
            if slot >= 0 and DORA_FLAGS[slot][s] and table[slot][s]:
                dora[t, off:off + n] = True
                scale = scales[s][slot].double()
                want[t, off:off + n] *= scale
                if bias is not None:
                    want[t, off:off + n] += (1 - scale) * bias[off:off + n].double()
    assert dora.any() and torch.equal(y[~dora], plain[~dora]), "non-DoRA cells changed"
    assert rel_err(y[dora], want[dora]) < TOL[dtype]
    assert torch.equal(y[:, 32:48], y0[:, 32:48]), "columns of no slice changed"


def test_dora_expand_rejects_bad_stacks():
    lora_meta = build_lora_kernel_meta([0], 1, torch.device("cpu"))
    y, buffer, b = torch.zeros(1, 8), torch.zeros(1, 1, 4), torch.zeros(1, 4, 8)
    ranks, flags = table_tensor([[4]]), table_tensor([[1]])
    with pytest.raises(ValueError, match="without DoRA scales"):
        lora_expand(y, buffer, [b], ranks, lora_meta, [(0, 8)], flags, None, torch.zeros(8))
    with pytest.raises(ValueError, match="DoRA scales"):
        lora_expand(y, buffer, [b], ranks, lora_meta, [(0, 8)], flags, [torch.ones(1, 4)])
    with pytest.raises(ValueError, match="dora flags"):
        lora_expand(y, buffer, [b], ranks, lora_meta, [(0, 8)], None, [torch.ones(1, 8)])
    with pytest.raises(ValueError, match="bias"):
        lora_expand(y, buffer, [b], ranks, lora_meta, [(0, 8)], flags, [torch.ones(1, 8)],
                    torch.zeros(4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_lora_linear_dora_matches_peft_formula(bias, dtype):
    """DoRA rows give ``scale * (x W^T + x a^T b^T) + bias`` (peft), plain rows
    ``x W^T + bias + x a^T b^T``; a slot that held a DoRA adapter and then a plain one is
    plain again (its table flag 0), and a DoRA adapter that does not target a module leaves
    that module's rows as the base computes them."""
    gen = torch.Generator().manual_seed(41 + bias)
    enabled = ("q_proj", "v_proj")
    layer = LoRALinear(IN, tuple(QKV_WIDTH.values()), QKV_NAMES, bias=bias, dtype=dtype,
                       device=torch.device("cpu"))
    with torch.no_grad():
        layer.weight.copy_(torch.randn(layer.weight.shape, generator=gen) / IN ** 0.5)
        if bias:
            layer.bias.copy_(torch.randn(layer.bias.shape, generator=gen))
    slots = layer.create_lora_slots(enabled, MAX_LORAS, MAX_RANK)
    assert (slots.bias is not None) == bias
    assert all(t.dtype == torch.float32 and t.shape == (MAX_LORAS, QKV_WIDTH[m])
               for t, m in zip(slots.dora_scale_stacked, enabled))

    ranks = {0: 5, 1: 3, 2: 8, 3: 2}
    dora_slots = {0, 3}
    weights = {}
    for slot, r in ranks.items():
        for m in enabled:
            a = (torch.randn(r, IN, generator=gen) / IN ** 0.5).to(dtype)
            b = (torch.randn(QKV_WIDTH[m], r, generator=gen) / r ** 0.5).to(dtype)
            magnitude = 1 + 0.1 * torch.randn(QKV_WIDTH[m], generator=gen)
            scale = magnitude / dora_row_norm(layer.module_weight(m), a, b)
            if slot == 2:                        # a DoRA adapter, then a plain one
                slots.set_slot(slot, m, a, b, scale)
            if slot not in dora_slots:
                scale = None
            if slot == 3 and m == "v_proj":      # a DoRA adapter that does not target v
                a = b = scale = None
            weights[(slot, m)] = (a, b, scale)
            slots.set_slot(slot, m, a, b, scale)
    assert slots.dora.tolist() == [[1, 1], [0, 0], [0, 0], [1, 0]]
    assert slots.ranks.tolist() == [[5, 5], [3, 3], [8, 8], [2, 0]]

    token_slots = [0, -1, 1, 2, 3, 3, 0, -1, 2, 1]
    x = torch.randn(len(token_slots), IN, generator=gen).to(dtype)
    lora_meta = build_lora_kernel_meta(token_slots, MAX_LORAS, torch.device("cpu"))
    with torch.no_grad():
        got = layer(x, lora_meta)
        base_only = layer(x, None)

    base = x.double() @ layer.weight.double().T
    want = base.clone()
    for t, slot in enumerate(token_slots):
        if slot < 0:
            continue
        for m in enabled:
            a, b, scale = weights[(slot, m)]
            cols = slice(QKV_OFFSET[m], QKV_OFFSET[m] + QKV_WIDTH[m])
            if a is not None:
                want[t, cols] += x[t].double() @ a.double().T @ b.double().T
            if scale is not None:
                want[t, cols] *= scale.double()
    if bias:
        want += layer.bias.double()
    rows = torch.tensor([s >= 0 for s in token_slots])
    assert torch.equal(got[~rows], base_only[~rows])
    assert rel_err(got, want) < TOL[dtype]


def test_set_slot_rejects_bad_tensors_and_keeps_the_slot():
    layer = LoRALinear(IN, (32,), ("o_proj",), bias=True, dtype=torch.float32,
                       device=torch.device("cpu"))
    slots = layer.create_lora_slots(("o_proj",), MAX_LORAS, MAX_RANK)
    a, b = torch.ones(2, IN), torch.ones(32, 2)
    slots.set_slot(0, "o_proj", a, b, torch.full((32,), 2.0))
    with pytest.raises(ValueError, match="DoRA scale"):
        slots.set_slot(0, "o_proj", a * 3, b * 3, torch.ones(16))
    with pytest.raises(ValueError, match="do not fit"):
        slots.set_slot(0, "o_proj", torch.ones(MAX_RANK + 1, IN), torch.ones(32, MAX_RANK + 1))
    with pytest.raises(ValueError, match="do not fit"):
        slots.set_slot(0, "o_proj", a, torch.ones(32, 3))
    with pytest.raises(ValueError, match="together"):
        slots.set_slot(0, "o_proj", a, None)
    assert torch.all(slots.lora_a_stacked[0][0, :2] == 1), "a refused write changed the slot"
    assert torch.all(slots.dora_scale_stacked[0][0] == 2)
    assert slots.ranks.tolist()[0] == [2] and slots.dora.tolist()[0] == [1]


def test_set_slot_writes_rows_up_to_the_rank_only():
    """A slot write of rank r writes rows [0, r) of A and of rank-major B (B transposed)
    and nothing else: rows past r, other slots and an untargeted module's buffers keep what
    they held (no zeroing; no kernel reads them)."""
    layer = LoRALinear(IN, tuple(QKV_WIDTH.values()), QKV_NAMES, bias=False,
                       dtype=torch.float32, device=torch.device("cpu"))
    slots = layer.create_lora_slots(QKV_NAMES, MAX_LORAS, MAX_RANK)
    for t in (*slots.lora_a_stacked, *slots.lora_b_stacked):
        t.fill_(7.0)
    a, b = torch.randn(3, IN), torch.randn(QKV_WIDTH["k_proj"], 3)
    slots.set_slot(1, "k_proj", a, b)
    slots.set_slot(1, "q_proj", None, None)
    a_k, b_k = slots.lora_a_stacked[1], slots.lora_b_stacked[1]
    assert torch.equal(a_k[1, :3], a) and torch.equal(b_k[1, :3], b.T)
    assert torch.all(a_k[1, 3:] == 7) and torch.all(b_k[1, 3:] == 7)
    assert torch.all(a_k[[0, 2, 3]] == 7) and torch.all(b_k[[0, 2, 3]] == 7)
    for s in (0, 2):
        assert torch.all(slots.lora_a_stacked[s] == 7) and torch.all(slots.lora_b_stacked[s] == 7)
    assert slots.ranks.tolist()[1] == [0, 3, 0]
