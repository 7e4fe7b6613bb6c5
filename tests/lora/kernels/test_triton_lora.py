"""The Triton SGMV/BGMV shrink and expand kernels against an independent float64 reference.

On a CUDA machine the kernels run on the GPU; without one, ``tests/conftest.py`` sets
``TRITON_INTERPRET=1`` and the same kernels run through Triton's interpreter on CPU tensors.
The reference is a per-row gather in float64 over slot buffers laid out as ``LoRASlots``
lays them out (``A [max_loras, max_lora_rank, in]``, B rank-major ``[max_loras,
max_lora_rank, out]``), with each (slot, slice)'s rank read from a rank table laid out as
the ``SlotTable``'s (an int32 view of some columns of a wider table). Adapter popularity
follows Punica's tests: distinct, uniform, zipf, identical, all base, base rows mixed in;
ranks differ per slot and per slice, some are 0; sizes are not multiples of the tiles.
Everything past a (slot, slice)'s rank is NaN in A and B: the kernels must never read it.

DoRA rows (the (slot, slice)s the table flags) are checked against
``(y + delta) * scale (+ (1 - scale) * bias)`` in float64, with the other rows bit-identical
to a launch without DoRA arguments; without a GPU the expand kernels are also compiled for
sm_90.
"""

from __future__ import annotations

import os
import textwrap
import zlib
from typing import NamedTuple

import pytest
import torch

from manylora.lora.kernels import sgmv_kernels as lora_kernels
from manylora.lora.kernels.meta import build_lora_kernel_meta
from manylora.lora.kernels.triton_lora import lora_expand_triton, lora_shrink_triton

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 1e-2}


class Case(NamedTuple):
    popularity: str
    num_seqs: int                       # sequences of 1-6 rows each (T = their sum)
    in_features: int
    slices: tuple[tuple[int, int], ...]  # (offset, out_s) per slice
    out_total: int
    ranks: tuple[int, ...]              # rank of each slot's first slice (max_loras = len)
    max_rank: int
    pad_to_extra: int = 0               # > 0: a CUDA-graph mapping padded by this many rows


CASES = {
    "distinct-1slice": Case("distinct", 6, 40, ((0, 24),), 24, (1, 16, 7, 3, 12, 5), 16),
    "uniform-2slices-gap-rank80": Case("uniform", 8, 72, ((0, 40), (48, 8)), 56,
                                       (4, 80, 2, 65, 1, 33), 80),
    "zipf-3slices-rank12": Case("zipf", 9, 72, ((0, 136), (136, 24), (160, 8)), 168,
                                (1, 12, 7, 3, 12, 5), 12),
    "identical-long-segment": Case("identical", 20, 40, ((0, 24), (24, 40)), 64,
                                   (3, 8, 16, 5, 16, 11), 16),
    "all-base": Case("all_base", 7, 40, ((0, 24), (24, 40), (64, 8)), 72,
                     (1, 16, 7, 3, 12, 5), 16),
    "base-mixed-splitk-padded": Case("base_mixed", 8, 600, ((0, 24), (24, 40), (64, 8)), 72,
                                     (6, 16, 1, 13, 8, 2), 16, pad_to_extra=5),
    "single-row": Case("single", 1, 72, ((0, 40),), 40, (5, 2, 16, 8), 16),
}


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double().cpu(), want.double().cpu()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def rank_table(case: Case) -> list[list[int]]:
    """``[max_loras][S]``: slice 0 has the case's ranks; the others another slot's rank,
    and every fifth (slot, slice) rank 0 (a module the slot's adapter does not target)."""
    n = len(case.ranks)
    return [[0 if (3 * slot + s) % 5 == 4 else case.ranks[(slot + s) % n]
             for s in range(len(case.slices))] for slot in range(n)]


def table_view(rows: list[list[int]], first_col: int = 1) -> torch.Tensor:
    """int32 ``[max_loras, S]`` on the device: columns ``first_col..`` of a wider table
    (the other columns -7), as ``LoRASlots.ranks`` views the model's ``SlotTable``."""
    num_slices = len(rows[0])
    wide = torch.full((len(rows), first_col + num_slices + 2), -7, dtype=torch.int32)
    wide[:, first_col:first_col + num_slices] = torch.tensor(rows, dtype=torch.int32)
    return wide.to(DEVICE)[:, first_col:first_col + num_slices]


def make_token_slots(case: Case, gen: torch.Generator) -> list[int]:
    """One slot per sequence, drawn the way Punica's tests draw them, then 1-6 rows each
    (distinct and single: one row per sequence, so every row has its own slot)."""
    max_loras, n = len(case.ranks), case.num_seqs
    if case.popularity == "distinct":
        seq_slots = torch.randperm(max_loras, generator=gen)[:n].tolist()
    elif case.popularity in ("uniform", "single"):
        seq_slots = torch.randint(0, max_loras, (n,), generator=gen).tolist()
    elif case.popularity == "zipf":
        w = 1.0 / torch.arange(1, max_loras + 1, dtype=torch.float64) ** 1.5
        perm = torch.randperm(max_loras, generator=gen)
        seq_slots = perm[torch.multinomial(w, n, replacement=True, generator=gen)].tolist()
    elif case.popularity == "identical":
        seq_slots = [int(torch.randint(0, max_loras, (1,), generator=gen))] * n
    elif case.popularity == "all_base":
        seq_slots = [-1] * n
    elif case.popularity == "base_mixed":
        seq_slots = torch.randint(-1, max_loras, (n,), generator=gen).tolist()
        seq_slots[0], seq_slots[-1] = -1, 0
    else:
        raise AssertionError(case.popularity)
    if case.popularity in ("distinct", "single"):
        return seq_slots
    token_slots: list[int] = []
    for slot in seq_slots:
        token_slots.extend([slot] * int(torch.randint(1, 7, (1,), generator=gen)))
    return token_slots


def make_stacks(case: Case, table: list[list[int]], dtype: torch.dtype,
                gen: torch.Generator):
    """A ``[L, R, in]`` and rank-major B ``[L, R, out_s]`` slot buffers. Rows past each
    (slot, slice)'s rank hold NaN in both, which the kernels must never read."""
    max_loras, k = len(case.ranks), case.in_features
    a_stacked, b_stacked = [], []
    for s, (_, size) in enumerate(case.slices):
        a = torch.randn(max_loras, case.max_rank, k, generator=gen, dtype=torch.float64)
        b = torch.randn(max_loras, case.max_rank, size, generator=gen, dtype=torch.float64)
        a /= k ** 0.5
        for slot in range(max_loras):
            r = table[slot][s]
            a[slot, r:] = float("nan")
            b[slot, r:] = float("nan")
            b[slot, :r] /= max(r, 1) ** 0.5
        a_stacked.append(a.to(dtype).to(DEVICE))
        b_stacked.append(b.to(dtype).to(DEVICE))
    return a_stacked, b_stacked


def make_mapping(case: Case, token_slots: list[int], variant: str):
    pad_to = len(token_slots) + case.pad_to_extra if case.pad_to_extra else None
    return build_lora_kernel_meta(token_slots, len(case.ranks), DEVICE, pad_to=pad_to,
                                  variant=variant)


def reference_shrink(x, token_slots, a_stacked, table, max_rank) -> torch.Tensor:
    """float64 ``[T, S, max_rank]``: per row and slice, its slot's first ``rank`` rows of
    A (``rank = table[slot][s]``)."""
    x = x.double().cpu()
    out = torch.zeros(x.shape[0], len(a_stacked), max_rank, dtype=torch.float64)
    for t, slot in enumerate(token_slots):
        if slot >= 0:
            for s, a in enumerate(a_stacked):
                r = table[slot][s]
                out[t, s, :r] = a[slot, :r].double().cpu() @ x[t]
    return out


def reference_delta(buffer, token_slots, b_stacked, table, slices, out_total) -> torch.Tensor:
    """float64 ``[T, out_total]``: per row and slice, ``buffer[t, s, :r] @ B_s[slot, :r]``
    (``r = table[slot][s]``)."""
    buffer = buffer.double().cpu()
    delta = torch.zeros(buffer.shape[0], out_total, dtype=torch.float64)
    for t, slot in enumerate(token_slots):
        if slot >= 0:
            for s, (b, (off, n)) in enumerate(zip(b_stacked, slices, strict=True)):
                r = table[slot][s]
                if r:
                    delta[t, off:off + n] = buffer[t, s, :r] @ b[slot, :r].double().cpu()
    return delta


@pytest.mark.parametrize("variant", ["sgmv", "bgmv"])
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("case_id", list(CASES))
def test_shrink_expand_match_reference(case_id, dtype, variant):
    case = CASES[case_id]
    gen = torch.Generator().manual_seed(zlib.crc32(f"{case_id}-{dtype}-{variant}".encode()))
    token_slots = make_token_slots(case, gen)
    num_rows = len(token_slots) + case.pad_to_extra
    rows_slots = token_slots + [-1] * case.pad_to_extra
    lora_meta = make_mapping(case, token_slots, variant)
    assert lora_meta.variant == variant
    table = rank_table(case)
    ranks = table_view(table)
    x = torch.randn(num_rows, case.in_features, generator=gen).to(dtype).to(DEVICE)
    a_stacked, b_stacked = make_stacks(case, table, dtype, gen)
    base = torch.tensor([s < 0 for s in rows_slots])
    lora_rows = ~base

    # shrink: every row and column written (zero for base rows and past each rank)
    buffer = lora_shrink_triton(x, a_stacked, ranks, lora_meta)
    assert buffer.dtype == torch.float32 and buffer.device.type == DEVICE.type
    assert buffer.shape == (num_rows, len(case.slices), case.max_rank)
    buffer = buffer.cpu()
    assert not buffer.isnan().any(), "A past a (slot, slice)'s rank must never be read"
    assert torch.all(buffer[base] == 0), "base rows must shrink to zero"
    for t, slot in enumerate(rows_slots):
        for s in range(len(case.slices)):
            if slot >= 0:
                assert torch.all(buffer[t, s, table[slot][s]:] == 0), "past the rank: zero"
    want = reference_shrink(x, rows_slots, a_stacked, table, case.max_rank)
    if lora_rows.any():
        assert rel_err(buffer[lora_rows], want[lora_rows]) < TOL[dtype]

    # expand, from a fresh buffer whose columns past each rank and base rows hold NaN
    # (never read) into a y of random values
    fresh = torch.randn(num_rows, len(case.slices), case.max_rank, generator=gen)
    for t, slot in enumerate(rows_slots):
        for s in range(len(case.slices)):
            fresh[t, s, table[slot][s] if slot >= 0 else 0:] = float("nan")
    y0 = torch.randn(num_rows, case.out_total, generator=gen).to(dtype)
    y = y0.to(DEVICE, copy=True)
    lora_expand_triton(y, fresh.to(DEVICE), b_stacked, ranks, lora_meta, case.slices)
    y = y.cpu()
    assert y.dtype == dtype and y.shape == y0.shape
    assert torch.equal(y[base], y0[base]), "base rows must be left untouched"
    covered = torch.zeros(case.out_total, dtype=torch.bool)
    for off, n in case.slices:
        covered[off:off + n] = True
    assert torch.equal(y[:, ~covered], y0[:, ~covered]), "columns of no slice must not change"
    for t, slot in enumerate(rows_slots):
        for s, (off, n) in enumerate(case.slices):
            if slot >= 0 and not table[slot][s]:
                assert torch.equal(y[t, off:off + n], y0[t, off:off + n]), "rank 0: untouched"
    if lora_rows.any():
        delta = reference_delta(fresh, rows_slots, b_stacked, table, case.slices,
                                case.out_total)
        got = y.double() - y0.double()
        assert rel_err(got[lora_rows][:, covered], delta[lora_rows][:, covered]) < TOL[dtype]


@pytest.mark.parametrize("variant", ["sgmv", "bgmv"])
def test_rank_zero_reads_and_writes_nothing(variant):
    """Slot 0 targets only the second slice (ranks 0 and 5), slot 1 nothing (0, 0). The x
    rows of slot 1, A and B of every rank-0 (slot, slice), their DoRA scales and the buffer
    past each rank are NaN, and y holds -0.0: a kernel that read any of it, or wrote y back
    (``-0.0 + 0`` is ``+0.0``), would show."""
    gen = torch.Generator().manual_seed(23 + len(variant))
    token_slots, k, n, max_rank = [0, 1, 0, -1, 1, 0], 40, 24, 16
    table = [[0, 5], [0, 0]]
    ranks = table_view(table, first_col=3)
    a = [torch.full((2, max_rank, k), float("nan")) for _ in range(2)]
    b = [torch.full((2, max_rank, n), float("nan")) for _ in range(2)]
    a[1][0, :5] = torch.randn(5, k, generator=gen)
    b[1][0, :5] = torch.randn(5, n, generator=gen)
    x = torch.randn(len(token_slots), k, generator=gen)
    x[[1, 4]] = float("nan")                                 # the rows of slot 1
    lora_meta = build_lora_kernel_meta(token_slots, 2, DEVICE, variant=variant)
    buffer = lora_shrink_triton(x.to(DEVICE), [t.to(DEVICE) for t in a], ranks, lora_meta).cpu()
    assert not buffer.isnan().any()
    want = reference_shrink(x.nan_to_num(), token_slots, a, table, max_rank)
    assert rel_err(buffer, want) < 1e-5
    buffer[:, 0] = float("nan")
    buffer[:, 1, 5:] = float("nan")
    buffer[[1, 4]] = float("nan")
    y0 = torch.full((len(token_slots), 2 * n), -0.0)
    y = y0.to(DEVICE)
    # DoRA flagged only where the rank is 0 (NaN scales): the epilogue must not run there
    flags, nan_scales = table_view([[1, 0], [1, 1]]), torch.full((2, n), float("nan"))
    lora_expand_triton(y, buffer.to(DEVICE), [t.to(DEVICE) for t in b], ranks, lora_meta,
                       [(0, n), (n, n)], flags, [nan_scales.to(DEVICE)] * 2)
    y = y.cpu()
    untouched = torch.ones_like(y, dtype=torch.bool)
    untouched[[0, 2, 5], n:] = False                          # slot 0, slice 1
    assert torch.equal(y[untouched].view(torch.int32), y0[untouched].view(torch.int32))
    delta = reference_delta(buffer.nan_to_num(), token_slots, b, table, [(0, n), (n, n)],
                            2 * n)
    assert rel_err(y[~untouched], delta[~untouched]) < 1e-5


def test_ranks_are_read_as_data():
    """One set of launch arguments, run again after the rank table is overwritten in place
    (what a slot write between two CUDA-graph replays does): the work follows the table."""
    gen = torch.Generator().manual_seed(31)
    token_slots, k, n, max_rank = [1, 0, 1, 1], 24, 16, 8
    a = torch.randn(2, max_rank, k, generator=gen).to(DEVICE)
    b = torch.randn(2, max_rank, n, generator=gen).to(DEVICE)
    x = torch.randn(4, k, generator=gen).to(DEVICE)
    ranks = table_view([[8], [3]])
    lora_meta = build_lora_kernel_meta(token_slots, 2, DEVICE, variant="bgmv")
    for table in ([[8], [3]], [[0], [6]], [[2], [0]]):
        ranks.copy_(torch.tensor(table, dtype=torch.int32))
        buffer = lora_shrink_triton(x, [a], ranks, lora_meta)
        assert rel_err(buffer, reference_shrink(x, token_slots, [a], table, max_rank)) < 1e-5
        y = torch.zeros(4, n, device=DEVICE)
        lora_expand_triton(y, buffer, [b], ranks, lora_meta, [(0, n)])
        assert rel_err(y, reference_delta(buffer, token_slots, [b], table, [(0, n)], n)) < 1e-5


@pytest.mark.parametrize("variant", ["sgmv", "bgmv"])
def test_rank_sharded_shrink_clamps_to_its_rows(variant):
    """Fully sharded column parallelism: A holds rank rows ``[4, 8)``; a slot of rank 6
    reduces rows 4 and 5 into columns 0 and 1, one of rank 3 nothing (rows past are NaN)."""
    gen = torch.Generator().manual_seed(41)
    token_slots, k = [0, 1, 0, -1], 32
    a_whole = torch.randn(2, 8, k, generator=gen)
    local = a_whole[:, 4:8].clone()
    local[0, 2:] = float("nan")
    local[1] = float("nan")
    x = torch.randn(4, k, generator=gen)
    lora_meta = build_lora_kernel_meta(token_slots, 2, DEVICE, variant=variant)
    buffer = lora_shrink_triton(x.to(DEVICE), [local.to(DEVICE)], table_view([[6], [3]]),
                                lora_meta, rank_start=4).cpu()
    want = torch.zeros(4, 1, 4)
    for t in (0, 2):
        want[t, 0, :2] = a_whole[0, 4:6] @ x[t]
    assert not buffer.isnan().any()
    assert rel_err(buffer, want) < 1e-5


def test_no_lora_row_launches_nothing(monkeypatch):
    class NoLaunch:
        def __getitem__(self, grid):
            raise AssertionError("a kernel was launched for a step without LoRA rows")

    for name in ("sgmv_shrink_kernel", "bgmv_shrink_kernel", "sgmv_expand_kernel",
                 "bgmv_expand_kernel"):
        monkeypatch.setattr(lora_kernels, name, NoLaunch())
    x, y = torch.randn(3, 16, device=DEVICE), torch.randn(3, 8, device=DEVICE)
    a, b = torch.randn(2, 4, 16, device=DEVICE), torch.randn(2, 4, 8, device=DEVICE)
    ranks = table_view([[4], [4]])
    for variant in ("sgmv", "bgmv"):
        lora_meta = build_lora_kernel_meta([-1, -1, -1], 2, DEVICE, variant=variant)
        buffer = lora_shrink_triton(x, [a], ranks, lora_meta)
        assert buffer.shape == (3, 1, 4) and torch.all(buffer == 0)
        y0 = y.clone()
        lora_expand_triton(y, buffer, [b], ranks, lora_meta, [(0, 8)])
        assert torch.equal(y, y0)


def test_bad_arguments_raise():
    lora_meta = build_lora_kernel_meta([0, -1], 1, DEVICE)
    x = torch.randn(2, 16, device=DEVICE)
    a = torch.randn(1, 4, 16, device=DEVICE)
    ranks = table_view([[4]])
    with pytest.raises(ValueError, match="1 to 3"):
        lora_shrink_triton(x, [a] * 4, table_view([[4] * 4]), lora_meta)
    with pytest.raises(ValueError, match="float16"):
        lora_shrink_triton(x, [a.half()], ranks, lora_meta)
    with pytest.raises(ValueError, match="rows"):
        lora_shrink_triton(x[:1], [a], ranks, lora_meta)
    with pytest.raises(ValueError, match="ranks must be an int32"):
        lora_shrink_triton(x, [a], ranks.long(), lora_meta)
    with pytest.raises(ValueError, match="ranks must be an int32"):
        lora_shrink_triton(x, [a, a], ranks, lora_meta)                  # one column, 2 slices
    y, buffer, b = (torch.zeros(2, 16, device=DEVICE), torch.zeros(2, 2, 4, device=DEVICE),
                    torch.zeros(1, 4, 8, device=DEVICE))
    ranks2 = table_view([[4, 4]])
    with pytest.raises(ValueError, match="output slices"):
        lora_expand_triton(y, buffer, [b, b], ranks2, lora_meta, [(0, 8)])
    with pytest.raises(ValueError, match="do not fit"):
        lora_expand_triton(y, buffer, [b, b], ranks2, lora_meta, [(0, 8), (4, 8)])   # overlap
    with pytest.raises(ValueError, match="do not fit"):
        lora_expand_triton(y, buffer, [b, b], ranks2, lora_meta, [(0, 8), (12, 8)])  # past end
    with pytest.raises(ValueError, match="column stride"):
        strided = torch.zeros(1, 4, dtype=torch.int32, device=DEVICE)[:, ::2]
        lora_expand_triton(y, buffer, [b, b], strided, lora_meta, [(0, 8), (8, 8)])


def _fields(lora_meta):
    return [lora_meta.token_lora_indices, lora_meta.sorted_rows, lora_meta.active_slots,
            lora_meta.seg_start, lora_meta.seg_len]


def test_custom_ops_registered_with_fake_impls():
    from torch._subclasses.fake_tensor import FakeTensorMode

    assert hasattr(torch.ops.manylora, "lora_shrink")
    assert hasattr(torch.ops.manylora, "lora_expand")
    lora_meta = build_lora_kernel_meta([0, 1, -1], 2, torch.device("cpu"), variant="sgmv")
    with FakeTensorMode() as mode:
        x = mode.from_tensor(torch.randn(3, 16, dtype=torch.bfloat16))
        a = [mode.from_tensor(torch.randn(2, 8, 16, dtype=torch.bfloat16)) for _ in range(3)]
        b = [mode.from_tensor(torch.randn(2, 8, n, dtype=torch.bfloat16)) for n in (16, 4, 4)]
        y = mode.from_tensor(torch.randn(3, 24, dtype=torch.bfloat16))
        ranks = mode.from_tensor(torch.full((2, 3), 4, dtype=torch.int32))
        fields = [mode.from_tensor(t) for t in _fields(lora_meta)]
        buffer = torch.ops.manylora.lora_shrink(x, a, ranks, *fields, lora_meta.max_seg_len,
                                                "sgmv")
        assert buffer.shape == (3, 3, 8) and buffer.dtype == torch.float32
        assert torch.ops.manylora.lora_expand(y, buffer, b, ranks, *fields,
                                              lora_meta.max_seg_len, "sgmv", [0, 16, 20]) is None


def test_custom_ops_pass_opcheck():
    """Every opcheck test (schema with the mutation of ``y``, fake kernels, autograd
    registration, AOT dispatch) on the directly registered ops."""
    gen = torch.Generator().manual_seed(3)
    lora_meta = build_lora_kernel_meta([1, 0, -1, 1], 2, DEVICE, variant="bgmv")
    x = torch.randn(4, 16, generator=gen).to(DEVICE)
    a = [torch.randn(2, 8, 16, generator=gen).to(DEVICE) for _ in range(2)]
    b = [torch.randn(2, 8, n, generator=gen).to(DEVICE) for n in (16, 8)]
    ranks = table_view([[3, 0], [8, 5]])
    fields = _fields(lora_meta)
    buffer = torch.ops.manylora.lora_shrink(x, a, ranks, *fields, lora_meta.max_seg_len, "bgmv")
    torch.library.opcheck(torch.ops.manylora.lora_shrink.default,
                          (x, a, ranks, *fields, lora_meta.max_seg_len, "bgmv"))
    torch.library.opcheck(torch.ops.manylora.lora_expand.default,
                          (torch.zeros(4, 24, device=DEVICE), buffer, b, ranks, *fields,
                           lora_meta.max_seg_len, "bgmv", [0, 16]))


@pytest.mark.parametrize("variant", ["sgmv", "bgmv"])
def test_entry_points_compile_to_the_registered_ops(variant):
    """Under ``torch.compile(fullgraph=True)`` the entry points trace to
    ``torch.ops.manylora.*`` (no graph break) and compute what the eager calls compute."""
    gen = torch.Generator().manual_seed(4)
    lora_meta = build_lora_kernel_meta([1, 0, -1, 1, 1], 2, DEVICE, variant=variant)
    x = torch.randn(5, 16, generator=gen).to(DEVICE)
    a = [torch.randn(2, 8, 16, generator=gen).to(DEVICE) for _ in range(2)]
    b = [torch.randn(2, 8, n, generator=gen).to(DEVICE) for n in (16, 8)]
    scales = [torch.rand(2, n, generator=gen).to(DEVICE) for n in (16, 8)]
    bias = torch.randn(24, generator=gen).to(DEVICE)
    ranks, dora = table_view([[3, 0], [8, 6]]), table_view([[0, 0], [1, 0]])

    def lora_delta(x, y, lora_meta):
        buffer = lora_shrink_triton(x, a, ranks, lora_meta)
        lora_expand_triton(y, buffer, b, ranks, lora_meta, [(0, 16), (16, 8)], dora, scales,
                           bias)
        return y

    y0 = torch.randn(5, 24, generator=gen).to(DEVICE)
    want = lora_delta(x, y0.clone(), lora_meta)
    torch._dynamo.reset()
    got = torch.compile(lora_delta, fullgraph=True, backend="aot_eager")(x, y0.clone(), lora_meta)
    assert not torch.equal(want, y0)
    assert torch.equal(got, want)


# ---------------------------------------------------------------------------------------------
# DoRA: (y + delta) * scale (+ (1 - scale) * bias) for the flagged (slot, slice)s

DORA_TABLE = [[4, 2, 4], [16, 16, 0], [3, 0, 5], [8, 8, 8], [0, 0, 0]]    # slot 4 is empty
DORA_FLAGS = [[1, 1, 0], [0, 0, 0], [1, 0, 1], [0, 1, 0], [0, 0, 0]]
DORA_SLICES = ((0, 24), (32, 16), (48, 8))
DORA_OUT, DORA_MAX_RANK = 60, 16
# base rows, rows of DoRA and plain (slot, slice)s, a slot's rows split apart
DORA_TOKEN_SLOTS = [0, 0, -1, 1, 2, 2, 2, -1, 1, 0, 3, 2]


def make_dora_scales(gen: torch.Generator, flags) -> list[torch.Tensor]:
    """Per slice float32 ``[max_loras, out_s]`` scales: NaN in the rows of (slot, slice)s
    that are not flagged, which the kernels must never read."""
    scales = []
    for s, (_, n) in enumerate(DORA_SLICES):
        sc = 1 + 0.2 * torch.randn(len(flags), n, generator=gen)
        for slot, row in enumerate(flags):
            if not row[s]:
                sc[slot] = float("nan")
        scales.append(sc.to(DEVICE))
    return scales


def reference_dora(y0, buffer, token_slots, b_stacked, scales, bias, flags) -> torch.Tensor:
    """float64 ``[T, out]``: plain cells ``y + delta``, DoRA cells of nonzero rank
    ``(y + delta) * scale + (1 - scale) * bias``, base rows ``y``."""
    want = y0.double() + reference_delta(buffer, token_slots, b_stacked, DORA_TABLE,
                                         DORA_SLICES, DORA_OUT)
    for t, slot in enumerate(token_slots):
        for s, (off, n) in enumerate(DORA_SLICES):
            if slot >= 0 and flags[slot][s] and DORA_TABLE[slot][s]:
                scale = scales[s][slot].double().cpu()
                want[t, off:off + n] *= scale
                if bias is not None:
                    want[t, off:off + n] += (1 - scale) * bias[off:off + n].double().cpu()
    return want


def _dora_inputs(variant: str, dtype: torch.dtype, pad: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    token_slots = DORA_TOKEN_SLOTS
    rows_slots = token_slots + [-1] * pad
    case = Case("uniform", len(token_slots), 8, DORA_SLICES, DORA_OUT,
                tuple(r[0] for r in DORA_TABLE), DORA_MAX_RANK)
    _, b_stacked = make_stacks(case, DORA_TABLE, dtype, gen)
    buffer = torch.randn(len(rows_slots), len(DORA_SLICES), DORA_MAX_RANK, generator=gen)
    y0 = torch.randn(len(rows_slots), DORA_OUT, generator=gen).to(dtype)
    lora_meta = build_lora_kernel_meta(token_slots, len(DORA_TABLE), DEVICE,
                                     pad_to=len(rows_slots) if pad else None, variant=variant)
    return gen, rows_slots, b_stacked, buffer, y0, lora_meta


@pytest.mark.parametrize("variant", ["sgmv", "bgmv"])
@pytest.mark.parametrize("shift", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("dtype,pad", [(torch.float32, 0), (torch.bfloat16, 3)],
                         ids=["fp32", "bf16-padded"])
def test_dora_expand_matches_reference(variant, shift, dtype, pad):
    gen, rows_slots, b_stacked, buffer, y0, lora_meta = _dora_inputs(
        variant, dtype, pad, zlib.crc32(f"dora-{variant}-{shift}-{dtype}".encode()))
    scales = make_dora_scales(gen, DORA_FLAGS)
    bias = torch.randn(DORA_OUT, generator=gen).to(dtype).to(DEVICE) if shift else None
    ranks, flags = table_view(DORA_TABLE), table_view(DORA_FLAGS, first_col=2)
    y = y0.to(DEVICE, copy=True)
    lora_expand_triton(y, buffer.to(DEVICE), b_stacked, ranks, lora_meta, DORA_SLICES, flags,
                       scales, bias)
    plain = y0.to(DEVICE, copy=True)
    lora_expand_triton(plain, buffer.to(DEVICE), b_stacked, ranks, lora_meta, DORA_SLICES)
    y, plain = y.cpu(), plain.cpu()

    assert not y.isnan().any(), "scales of (slot, slice)s without the DoRA flag were read"
    dora_cells = torch.zeros(y.shape, dtype=torch.bool)
    for t, slot in enumerate(rows_slots):
        for s, (off, n) in enumerate(DORA_SLICES):
            dora_cells[t, off:off + n] = slot >= 0 and DORA_FLAGS[slot][s] == 1 \
                and DORA_TABLE[slot][s] > 0
    assert torch.equal(y[~dora_cells], plain[~dora_cells]), (
        "base rows, plain and rank-0 cells must be bit-identical to a launch without DoRA")
    want = reference_dora(y0, buffer, rows_slots, b_stacked, scales, bias, DORA_FLAGS)
    assert rel_err(y[dora_cells], want[dora_cells]) < TOL[dtype]
    assert torch.equal(y[:, 24:32], y0[:, 24:32]), "columns of no slice must not change"


@pytest.mark.parametrize("variant", ["sgmv", "bgmv"])
def test_dora_flag_is_read_as_data(variant):
    """One launch's arguments, replayed after the table's DoRA flags are overwritten in
    place (what a slot write between CUDA-graph replays does): the rescaling follows."""
    gen, rows_slots, b_stacked, buffer, y0, lora_meta = _dora_inputs(variant, torch.float32,
                                                                   0, 17)
    scales = make_dora_scales(gen, [[1] * 3] * len(DORA_TABLE))
    bias = torch.randn(DORA_OUT, generator=gen).to(DEVICE)
    ranks, flags = table_view(DORA_TABLE), table_view(DORA_FLAGS)
    none = [[0] * 3] * len(DORA_TABLE)
    outs = []
    for new_flags in (none, DORA_FLAGS):
        flags.copy_(torch.tensor(new_flags, dtype=torch.int32))
        y = y0.to(DEVICE, copy=True)
        lora_expand_triton(y, buffer.to(DEVICE), b_stacked, ranks, lora_meta, DORA_SLICES,
                           flags, scales, bias)
        outs.append(y.cpu())
    want = [reference_dora(y0, buffer, rows_slots, b_stacked, scales, bias, f)
            for f in (none, DORA_FLAGS)]
    for got, ref in zip(outs, want):
        assert rel_err(got, ref) < 1e-5


def test_dora_bad_arguments_raise():
    lora_meta = build_lora_kernel_meta([0, -1], 1, DEVICE)
    y, buffer = torch.zeros(2, 8, device=DEVICE), torch.zeros(2, 1, 4, device=DEVICE)
    b = torch.zeros(1, 4, 8, device=DEVICE)
    ranks, flags = table_view([[4]]), table_view([[1]])
    scale = torch.ones(1, 8, device=DEVICE)
    with pytest.raises(ValueError, match="without DoRA scales"):
        lora_expand_triton(y, buffer, [b], ranks, lora_meta, [(0, 8)], flags, None,
                           torch.zeros(8, device=DEVICE))
    with pytest.raises(ValueError, match="DoRA scales"):
        lora_expand_triton(y, buffer, [b], ranks, lora_meta, [(0, 8)], flags, [scale.double()])
    with pytest.raises(ValueError, match="bias"):
        lora_expand_triton(y, buffer, [b], ranks, lora_meta, [(0, 8)], flags, [scale],
                           torch.zeros(4, device=DEVICE))
    with pytest.raises(ValueError, match="DoRA scales"):
        lora_expand_triton(y, buffer, [b], ranks, lora_meta, [(0, 8)], flags, [scale, scale])
    fields = _fields(lora_meta)
    with pytest.raises(ValueError, match="dora flags"):
        torch.ops.manylora.lora_expand(y, buffer, [b], ranks, *fields, lora_meta.max_seg_len,
                                       "bgmv", [0], None, [scale])
    with pytest.raises(ValueError, match="dora must be an int32"):
        torch.ops.manylora.lora_expand(y, buffer, [b], ranks, *fields, lora_meta.max_seg_len,
                                       "bgmv", [0], flags.long(), [scale])


def test_dora_custom_op_passes_opcheck():
    gen = torch.Generator().manual_seed(5)
    lora_meta = build_lora_kernel_meta([1, 0, -1, 1], 2, DEVICE, variant="sgmv")
    buffer = torch.randn(4, 2, 8, generator=gen).to(DEVICE)
    b = [torch.randn(2, 8, n, generator=gen).to(DEVICE) for n in (16, 8)]
    scales = [torch.rand(2, n, generator=gen).to(DEVICE) for n in (16, 8)]
    bias = torch.randn(24, generator=gen).to(DEVICE)
    torch.library.opcheck(
        torch.ops.manylora.lora_expand.default,
        (torch.zeros(4, 24, device=DEVICE), buffer, b, table_view([[3, 8], [8, 2]]),
         *_fields(lora_meta), lora_meta.max_seg_len, "sgmv", [0, 16], table_view([[0, 1], [1, 0]]),
         scales, bias))


_COMPILE_EXPAND_FOR_H100 = textwrap.dedent("""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from manylora.lora.kernels import sgmv_kernels as tl_
    from manylora.lora.kernels import tiled_kernels as tiled_

    def ptx(fn, types, consts):
        sig = {name: types.get(name, "constexpr") for name in fn.arg_names}
        return triton.compile(ASTSource(fn, sig, consts, {}), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": 4}).asm["ptx"]

    types = {n: "*i32" for n in ("ranks_ptr", "sorted_rows_ptr", "active_slots_ptr",
                                 "seg_start_ptr", "seg_len_ptr", "token_lora_ptr",
                                 "tile_slot_ptr", "tile_start_ptr", "tile_len_ptr",
                                 "dora_ptr")}
    types.update({n: "*bf16" for n in ("b0_ptr", "b1_ptr", "b2_ptr", "y_ptr", "bias_ptr")})
    types.update({n: "*fp32" for n in ("buf_ptr", "sc0_ptr", "sc1_ptr", "sc2_ptr")})
    types.update({n: "i32" for n in ("N0", "N1", "N2", "OFF0", "OFF1", "OFF2", "N_TILES",
                                     "stride_bt", "stride_bs", "stride_yt", "stride_yn",
                                     "stride_rank", "stride_dora")})
    loads = {}
    for dora, shift in ((False, False), (True, False), (True, True)):
        flags = {"HAS_DORA": dora, "HAS_SHIFT": shift, "R": 16, "BLOCK_N": 128, "BLOCK_R": 16}
        sgmv = ptx(tl_.sgmv_expand_kernel, types,
                   {**flags, "NUM_SLICES": 3, "BLOCK_M": 16, "DOT_FP32": False})
        bgmv = ptx(tl_.bgmv_expand_kernel, types, flags)
        tiled = ptx(tiled_.tiled_expand_kernel, types,
                    {**flags, "BLOCK_M": 16, "DOT_FP32": False})
        loads[dora, shift] = [code.count("ld.global") for code in (sgmv, bgmv, tiled)]
    for i in range(3):
        assert loads[False, False][i] < loads[True, False][i] < loads[True, True][i], loads
""")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs the kernels themselves")
def test_expand_kernels_compile_for_h100(compile_for_h100):
    """The DoRA epilogue's runtime branch on the loaded flag must also compile for sm_90 (the
    interpreter runs it as Python): the SGMV, BGMV and tiled expand kernels compile, and the
    scale and bias loads exist only in the variants that take them."""
    compile_for_h100(_COMPILE_EXPAND_FOR_H100,
                     TRITON_DEFAULT_FP_FUSION=os.environ.get("TRITON_DEFAULT_FP_FUSION", "1"))


# ---------------------------------------------------------------------------------------------
# real shapes, on a GPU only


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["sgmv", "bgmv"])
@pytest.mark.parametrize("max_rank", [16, 64])
def test_decode_shapes_on_gpu(variant, max_rank):
    """Decode-sized batch: 64 rows over 16 adapters (ranks 8..max_rank, some modules
    untargeted), q/k/v 4096/1024/1024 from 4096, bf16, through the public ``lora_shrink`` /
    ``lora_expand`` dispatch."""
    from manylora.lora.kernels.expand import lora_expand
    from manylora.lora.kernels.shrink import lora_shrink

    gen = torch.Generator().manual_seed(max_rank)
    num_rows, k, max_loras = 64, 4096, 16
    slices = ((0, 4096), (4096, 1024), (5120, 1024))
    ranks = [8 * (1 + i % (max_rank // 8)) for i in range(max_loras)]
    token_slots = torch.randint(-1, max_loras, (num_rows,), generator=gen).tolist()
    case = Case("uniform", num_rows, k, slices, 6144, tuple(ranks), max_rank)
    table = rank_table(case)
    a_stacked, b_stacked = make_stacks(case, table, torch.bfloat16, gen)
    x = torch.randn(num_rows, k, generator=gen).to(torch.bfloat16).cuda()
    lora_meta = build_lora_kernel_meta(token_slots, max_loras, DEVICE, variant=variant)
    buffer = lora_shrink(x, a_stacked, table_view(table), lora_meta)
    want = reference_shrink(x, token_slots, a_stacked, table, max_rank)
    lora_rows = torch.tensor([s >= 0 for s in token_slots])
    assert rel_err(buffer.cpu()[lora_rows], want[lora_rows]) < 2e-2
    y0 = torch.randn(num_rows, 6144, generator=gen).to(torch.bfloat16)
    y = y0.cuda()
    lora_expand(y, buffer, b_stacked, table_view(table), lora_meta, slices)
    delta = reference_delta(buffer, token_slots, b_stacked, table, slices, 6144)
    got = y.cpu().double() - y0.double()
    assert torch.equal(y.cpu()[~lora_rows], y0[~lora_rows])
    assert rel_err(got[lora_rows], delta[lora_rows]) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["sgmv", "bgmv"])
def test_cuda_graph_replay_follows_the_mapping_and_table(variant):
    """Captured once with a padded lora_meta, replayed after the mapping's tensors and the
    rank table are overwritten in place with another step's: the output follows both."""
    gen = torch.Generator().manual_seed(11)
    num_rows, k, n, max_loras, max_rank = 32, 4096, 1024, 8, 16
    first_ranks = [[16], [8], [16], [4], [16], [12], [16], [8]]
    second_ranks = [[0], [16], [8], [4], [0], [12], [3], [16]]
    a = (torch.randn(max_loras, max_rank, k, generator=gen) / k ** 0.5).to(torch.bfloat16)
    b = (torch.randn(max_loras, max_rank, n, generator=gen) / 4).to(torch.bfloat16)
    a, b = a.cuda(), b.cuda()
    x = torch.randn(num_rows, k, generator=gen).to(torch.bfloat16).cuda()
    y = torch.zeros(num_rows, n, dtype=torch.bfloat16, device="cuda")
    ranks = table_view(first_ranks)

    def mapping_for(slots):
        return build_lora_kernel_meta(slots, max_loras, DEVICE, pad_to=num_rows, variant=variant)

    first = torch.randint(-1, max_loras, (num_rows - 3,), generator=gen).tolist()
    static = mapping_for(first)

    def step():
        y.zero_()
        buffer = lora_shrink_triton(x, [a], ranks, static)
        lora_expand_triton(y, buffer, [b], ranks, static, [(0, n)])

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()                                        # compile and load outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    second = torch.randint(-1, max_loras, (num_rows - 3,), generator=gen).tolist()
    new = mapping_for(second)
    for dst, src in zip(_fields(static), _fields(new)):
        dst.copy_(src)
    ranks.copy_(torch.tensor(second_ranks, dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    slots = second + [-1] * 3
    buffer = reference_shrink(x, slots, [a], second_ranks, max_rank)
    delta = reference_delta(buffer, slots, [b], second_ranks, [(0, n)], n)
    assert rel_err(y.cpu(), delta) < 2e-2
