"""The Triton SGMV/BGMV shrink and expand kernels against an independent float64 reference.

On a CUDA machine the kernels run on the GPU; without one, ``tests/conftest.py`` sets
``TRITON_INTERPRET=1`` and the same kernels run through Triton's interpreter on CPU tensors.
The reference is a per-row gather in float64 over slot buffers laid out as ``LoRASlots``
lays them out (``A [max_loras, max_lora_rank, in]``, ``B [max_loras, out, max_lora_rank]``).
Adapter popularity follows Punica's tests: distinct, uniform, zipf, identical, all base,
base rows mixed in; ranks differ per slot; sizes are not multiples of the tiles.

DoRA rows (slots flagged in ``LoRAMapping.slot_dora``) are checked against
``(y + delta) * scale (+ shift)`` in float64, with the other rows bit-identical to a launch
without DoRA arguments; without a GPU the expand kernels are also compiled for sm_90.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from manylora.lora.punica import build_lora_mapping
from manylora.ops import lora_kernels
from manylora.ops.triton_lora import lora_expand_triton, lora_shrink_triton

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 1e-2}


class Case(NamedTuple):
    popularity: str
    num_seqs: int                       # sequences of 1-6 rows each (T = their sum)
    in_features: int
    slices: tuple[tuple[int, int], ...]  # (offset, out_s) per slice
    out_total: int
    ranks: tuple[int, ...]              # true rank of each slot (max_loras = len)
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


def make_stacks(case: Case, dtype: torch.dtype, gen: torch.Generator):
    """A and B slot buffers. Rows of A past a slot's rank hold NaN, which the kernels must
    never read; columns of B past it are zero, as ``LoRASlots`` keeps them."""
    max_loras, k = len(case.ranks), case.in_features
    a_stacked, b_stacked = [], []
    for _, size in case.slices:
        a = torch.randn(max_loras, case.max_rank, k, generator=gen, dtype=torch.float64)
        b = torch.randn(max_loras, size, case.max_rank, generator=gen, dtype=torch.float64)
        a /= k ** 0.5
        for slot, r in enumerate(case.ranks):
            a[slot, r:] = float("nan")
            b[slot, :, r:] = 0
            b[slot, :, :r] /= r ** 0.5
        a_stacked.append(a.to(dtype).to(DEVICE))
        b_stacked.append(b.to(dtype).to(DEVICE))
    return a_stacked, b_stacked


def make_mapping(case: Case, token_slots: list[int], schedule: str):
    pad_to = len(token_slots) + case.pad_to_extra if case.pad_to_extra else None
    return build_lora_mapping(token_slots, list(case.ranks), DEVICE, pad_to=pad_to,
                              schedule=schedule)


def reference_shrink(x, token_slots, a_stacked, ranks, max_rank) -> torch.Tensor:
    """float64 ``[T, S, max_rank]``: per row, its slot's first ``rank`` rows of A."""
    x = x.double().cpu()
    out = torch.zeros(x.shape[0], len(a_stacked), max_rank, dtype=torch.float64)
    for t, slot in enumerate(token_slots):
        if slot >= 0:
            r = ranks[slot]
            for s, a in enumerate(a_stacked):
                out[t, s, :r] = a[slot, :r].double().cpu() @ x[t]
    return out


def reference_delta(buffer, token_slots, b_stacked, ranks, slices, out_total) -> torch.Tensor:
    """float64 ``[T, out_total]``: per row, ``buffer[t, s, :rank] @ B_s[slot, :, :rank]^T``."""
    buffer = buffer.double().cpu()
    delta = torch.zeros(buffer.shape[0], out_total, dtype=torch.float64)
    for t, slot in enumerate(token_slots):
        if slot >= 0:
            r = ranks[slot]
            for s, (b, (off, n)) in enumerate(zip(b_stacked, slices, strict=True)):
                delta[t, off:off + n] = b[slot, :, :r].double().cpu() @ buffer[t, s, :r]
    return delta


@pytest.mark.parametrize("schedule", ["sgmv", "bgmv"])
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("case_id", list(CASES))
def test_shrink_expand_match_reference(case_id, dtype, schedule):
    case = CASES[case_id]
    gen = torch.Generator().manual_seed(zlib.crc32(f"{case_id}-{dtype}-{schedule}".encode()))
    token_slots = make_token_slots(case, gen)
    num_rows = len(token_slots) + case.pad_to_extra
    rows_slots = token_slots + [-1] * case.pad_to_extra
    mapping = make_mapping(case, token_slots, schedule)
    assert mapping.schedule == schedule
    x = torch.randn(num_rows, case.in_features, generator=gen).to(dtype).to(DEVICE)
    a_stacked, b_stacked = make_stacks(case, dtype, gen)
    base = torch.tensor([s < 0 for s in rows_slots])
    lora_rows = ~base

    # shrink: every row and column written (zero for base rows and past each rank)
    buffer = lora_shrink_triton(x, a_stacked, mapping)
    assert buffer.dtype == torch.float32 and buffer.device.type == DEVICE.type
    assert buffer.shape == (num_rows, len(case.slices), case.max_rank)
    buffer = buffer.cpu()
    assert not buffer.isnan().any(), "A past a slot's rank must never be read"
    assert torch.all(buffer[base] == 0), "base rows must shrink to zero"
    for t, slot in enumerate(rows_slots):
        if slot >= 0:
            assert torch.all(buffer[t, :, case.ranks[slot]:] == 0), "padded ranks must be zero"
    want = reference_shrink(x, rows_slots, a_stacked, case.ranks, case.max_rank)
    if lora_rows.any():
        assert rel_err(buffer[lora_rows], want[lora_rows]) < TOL[dtype]

    # expand, from a fresh buffer whose padded ranks and base rows hold NaN (never read)
    # into a y of random values
    fresh = torch.randn(num_rows, len(case.slices), case.max_rank, generator=gen)
    for t, slot in enumerate(rows_slots):
        fresh[t, :, case.ranks[slot] if slot >= 0 else 0:] = float("nan")
    y0 = torch.randn(num_rows, case.out_total, generator=gen).to(dtype)
    y = y0.to(DEVICE, copy=True)
    lora_expand_triton(y, fresh.to(DEVICE), b_stacked, mapping, case.slices)
    y = y.cpu()
    assert y.dtype == dtype and y.shape == y0.shape
    assert torch.equal(y[base], y0[base]), "base rows must be left untouched"
    covered = torch.zeros(case.out_total, dtype=torch.bool)
    for off, n in case.slices:
        covered[off:off + n] = True
    assert torch.equal(y[:, ~covered], y0[:, ~covered]), "columns of no slice must not change"
    if lora_rows.any():
        delta = reference_delta(fresh, rows_slots, b_stacked, case.ranks, case.slices,
                                case.out_total)
        got = y.double() - y0.double()
        assert rel_err(got[lora_rows][:, covered], delta[lora_rows][:, covered]) < TOL[dtype]


@pytest.mark.parametrize("schedule", ["sgmv", "bgmv"])
def test_rank_skipping_reads_only_the_true_rank(schedule):
    """One slot of rank 3 in rank-32 buffers: A rows and buffer columns past 3 are NaN, B
    columns past 8 (the vector-aligned bound) are NaN: none of them may reach the output."""
    gen = torch.Generator().manual_seed(7 + len(schedule))
    token_slots, k, n, max_rank = [0, 1, 0, 0, -1, 1], 40, 24, 32
    a = torch.full((2, max_rank, k), float("nan"))
    b = torch.full((2, n, max_rank), float("nan"))
    a[:, :3] = torch.randn(2, 3, k, generator=gen)
    b[:, :, :8] = 0
    b[:, :, :3] = torch.randn(2, n, 3, generator=gen)
    x = torch.randn(len(token_slots), k, generator=gen)
    mapping = build_lora_mapping(token_slots, [3, 3], DEVICE, schedule=schedule)
    buffer = lora_shrink_triton(x.to(DEVICE), [a.to(DEVICE)], mapping).cpu()
    want = reference_shrink(x, token_slots, [a], [3, 3], max_rank)
    assert not buffer.isnan().any()
    assert rel_err(buffer, want) < 1e-5
    buffer[:, :, 3:] = float("nan")
    y = torch.zeros(len(token_slots), n)
    y_dev = y.to(DEVICE)
    lora_expand_triton(y_dev, buffer.to(DEVICE), [b.to(DEVICE)], mapping, [(0, n)])
    delta = reference_delta(buffer, token_slots, [b], [3, 3], [(0, n)], n)
    assert rel_err(y_dev.cpu(), delta) < 1e-5


def test_no_lora_row_launches_nothing(monkeypatch):
    class NoLaunch:
        def __getitem__(self, grid):
            raise AssertionError("a kernel was launched for a step without LoRA rows")

    for name in ("sgmv_shrink_kernel", "bgmv_shrink_kernel", "sgmv_expand_kernel",
                 "bgmv_expand_kernel"):
        monkeypatch.setattr(lora_kernels, name, NoLaunch())
    x, y = torch.randn(3, 16, device=DEVICE), torch.randn(3, 8, device=DEVICE)
    a, b = torch.randn(2, 4, 16, device=DEVICE), torch.randn(2, 8, 4, device=DEVICE)
    for schedule in ("sgmv", "bgmv"):
        mapping = build_lora_mapping([-1, -1, -1], [4, 4], DEVICE, schedule=schedule)
        buffer = lora_shrink_triton(x, [a], mapping)
        assert buffer.shape == (3, 1, 4) and torch.all(buffer == 0)
        y0 = y.clone()
        lora_expand_triton(y, buffer, [b], mapping, [(0, 8)])
        assert torch.equal(y, y0)


def test_bad_arguments_raise():
    mapping = build_lora_mapping([0, -1], [4], DEVICE)
    x = torch.randn(2, 16, device=DEVICE)
    a = torch.randn(1, 4, 16, device=DEVICE)
    with pytest.raises(ValueError, match="1 to 3"):
        lora_shrink_triton(x, [a] * 4, mapping)
    with pytest.raises(ValueError, match="float16"):
        lora_shrink_triton(x, [a.half()], mapping)
    with pytest.raises(ValueError, match="rows"):
        lora_shrink_triton(x[:1], [a], mapping)
    y, buffer, b = (torch.zeros(2, 16, device=DEVICE), torch.zeros(2, 2, 4, device=DEVICE),
                    torch.zeros(1, 8, 4, device=DEVICE))
    with pytest.raises(ValueError, match="output slices"):
        lora_expand_triton(y, buffer, [b, b], mapping, [(0, 8)])
    with pytest.raises(ValueError, match="do not fit"):
        lora_expand_triton(y, buffer, [b, b], mapping, [(0, 8), (4, 8)])     # overlap
    with pytest.raises(ValueError, match="do not fit"):
        lora_expand_triton(y, buffer, [b, b], mapping, [(0, 8), (12, 8)])    # past the end


def test_custom_ops_registered_with_fake_impls():
    from torch._subclasses.fake_tensor import FakeTensorMode

    assert hasattr(torch.ops.manylora, "lora_shrink")
    assert hasattr(torch.ops.manylora, "lora_expand")
    mapping = build_lora_mapping([0, 1, -1], [4, 2], torch.device("cpu"), schedule="sgmv")
    with FakeTensorMode() as mode:
        x = mode.from_tensor(torch.randn(3, 16, dtype=torch.bfloat16))
        a = [mode.from_tensor(torch.randn(2, 8, 16, dtype=torch.bfloat16)) for _ in range(3)]
        b = [mode.from_tensor(torch.randn(2, n, 8, dtype=torch.bfloat16)) for n in (16, 4, 4)]
        y = mode.from_tensor(torch.randn(3, 24, dtype=torch.bfloat16))
        fields = [mode.from_tensor(t) for t in mapping[:6]]
        buffer = torch.ops.manylora.lora_shrink(x, a, *fields, mapping.max_seg_len, "sgmv")
        assert buffer.shape == (3, 3, 8) and buffer.dtype == torch.float32
        assert torch.ops.manylora.lora_expand(y, buffer, b, *fields, mapping.max_seg_len,
                                              "sgmv", [0, 16, 20]) is None


def test_custom_ops_pass_opcheck():
    """Every opcheck test (schema with the mutation of ``y``, fake kernels, autograd
    registration, AOT dispatch) on the directly registered ops."""
    gen = torch.Generator().manual_seed(3)
    mapping = build_lora_mapping([1, 0, -1, 1], [3, 8], DEVICE, schedule="bgmv")
    x = torch.randn(4, 16, generator=gen).to(DEVICE)
    a = [torch.randn(2, 8, 16, generator=gen).to(DEVICE) for _ in range(2)]
    b = [torch.randn(2, n, 8, generator=gen).to(DEVICE) for n in (16, 8)]
    fields = list(mapping[:6])
    buffer = torch.ops.manylora.lora_shrink(x, a, *fields, mapping.max_seg_len, "bgmv")
    torch.library.opcheck(torch.ops.manylora.lora_shrink.default,
                          (x, a, *fields, mapping.max_seg_len, "bgmv"))
    torch.library.opcheck(torch.ops.manylora.lora_expand.default,
                          (torch.zeros(4, 24, device=DEVICE), buffer, b, *fields,
                           mapping.max_seg_len, "bgmv", [0, 16]))


@pytest.mark.parametrize("schedule", ["sgmv", "bgmv"])
def test_entry_points_compile_to_the_registered_ops(schedule):
    """Under ``torch.compile(fullgraph=True)`` the entry points trace to
    ``torch.ops.manylora.*`` (no graph break) and compute what the eager calls compute."""
    gen = torch.Generator().manual_seed(4)
    mapping = build_lora_mapping([1, 0, -1, 1, 1], [3, 8], DEVICE, slot_dora=[0, 1],
                                 schedule=schedule)
    x = torch.randn(5, 16, generator=gen).to(DEVICE)
    a = [torch.randn(2, 8, 16, generator=gen).to(DEVICE) for _ in range(2)]
    b = [torch.randn(2, n, 8, generator=gen).to(DEVICE) for n in (16, 8)]
    scales = [torch.rand(2, n, generator=gen).to(DEVICE) for n in (16, 8)]

    def lora_delta(x, y, mapping):
        buffer = lora_shrink_triton(x, a, mapping)
        lora_expand_triton(y, buffer, b, mapping, [(0, 16), (16, 8)], scales)
        return y

    y0 = torch.randn(5, 24, generator=gen).to(DEVICE)
    want = lora_delta(x, y0.clone(), mapping)
    torch._dynamo.reset()
    got = torch.compile(lora_delta, fullgraph=True, backend="aot_eager")(x, y0.clone(), mapping)
    assert not torch.equal(want, y0)
    assert torch.equal(got, want)


# ---------------------------------------------------------------------------------------------
# DoRA: (y + delta) * scale (+ shift) for the rows of flagged slots, fused into the expand

DORA_RANKS = (4, 16, 3, 8, 0)           # slot 4 is empty
DORA_FLAGS = (1, 0, 1, 0, 0)            # slots 0 and 2 hold DoRA adapters
DORA_SLICES = ((0, 24), (32, 16), (48, 8))
DORA_OUT, DORA_MAX_RANK = 60, 16
# base rows, rows of both DoRA slots and of a plain slot, a slot's rows split apart
DORA_TOKEN_SLOTS = [0, 0, -1, 1, 2, 2, 2, -1, 1, 0, 3, 2]


def make_dora_stacks(gen: torch.Generator, flags, shift: bool):
    """Per slice float32 ``[max_loras, out_s]`` scales (and shifts): NaN in the rows of slots
    that are not flagged, which the kernels must never read."""
    scales, shifts = [], []
    for _, n in DORA_SLICES:
        sc = 1 + 0.2 * torch.randn(len(flags), n, generator=gen)
        sh = torch.randn(len(flags), n, generator=gen)
        for slot, flag in enumerate(flags):
            if not flag:
                sc[slot] = sh[slot] = float("nan")
        scales.append(sc.to(DEVICE))
        shifts.append(sh.to(DEVICE))
    return scales, (shifts if shift else None)


def reference_dora(y0, buffer, token_slots, b_stacked, scales, shifts, flags) -> torch.Tensor:
    """float64 ``[T, out]``: plain rows ``y + delta``, DoRA rows ``(y + delta) * scale +
    shift``, base rows ``y``."""
    want = y0.double() + reference_delta(buffer, token_slots, b_stacked, DORA_RANKS,
                                         DORA_SLICES, DORA_OUT)
    for t, slot in enumerate(token_slots):
        if slot >= 0 and flags[slot]:
            for s, (off, n) in enumerate(DORA_SLICES):
                want[t, off:off + n] *= scales[s][slot].double().cpu()
                if shifts is not None:
                    want[t, off:off + n] += shifts[s][slot].double().cpu()
    return want


def _dora_inputs(schedule: str, dtype: torch.dtype, pad: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    token_slots = DORA_TOKEN_SLOTS
    rows_slots = token_slots + [-1] * pad
    case = Case("uniform", len(token_slots), 8, DORA_SLICES, DORA_OUT, DORA_RANKS,
                DORA_MAX_RANK)
    _, b_stacked = make_stacks(case, dtype, gen)
    buffer = torch.randn(len(rows_slots), len(DORA_SLICES), DORA_MAX_RANK, generator=gen)
    y0 = torch.randn(len(rows_slots), DORA_OUT, generator=gen).to(dtype)
    mapping = build_lora_mapping(token_slots, list(DORA_RANKS), DEVICE,
                                 slot_dora=list(DORA_FLAGS), pad_to=len(rows_slots) if pad
                                 else None, schedule=schedule)
    return gen, rows_slots, b_stacked, buffer, y0, mapping


@pytest.mark.parametrize("schedule", ["sgmv", "bgmv"])
@pytest.mark.parametrize("shift", [False, True], ids=["noshift", "shift"])
@pytest.mark.parametrize("dtype,pad", [(torch.float32, 0), (torch.bfloat16, 3)],
                         ids=["fp32", "bf16-padded"])
def test_dora_expand_matches_reference(schedule, shift, dtype, pad):
    gen, rows_slots, b_stacked, buffer, y0, mapping = _dora_inputs(
        schedule, dtype, pad, zlib.crc32(f"dora-{schedule}-{shift}-{dtype}".encode()))
    scales, shifts = make_dora_stacks(gen, DORA_FLAGS, shift)
    y = y0.to(DEVICE, copy=True)
    lora_expand_triton(y, buffer.to(DEVICE), b_stacked, mapping, DORA_SLICES, scales, shifts)
    plain = y0.to(DEVICE, copy=True)
    lora_expand_triton(plain, buffer.to(DEVICE), b_stacked, mapping, DORA_SLICES)
    y, plain = y.cpu(), plain.cpu()

    assert not y.isnan().any(), "scales/shifts of slots without the DoRA flag were read"
    dora_rows = torch.tensor([s >= 0 and DORA_FLAGS[s] == 1 for s in rows_slots])
    assert torch.equal(y[~dora_rows], plain[~dora_rows]), (
        "base and plain LoRA rows must be bit-identical to a launch without DoRA")
    want = reference_dora(y0, buffer, rows_slots, b_stacked, scales, shifts, DORA_FLAGS)
    assert rel_err(y[dora_rows], want[dora_rows]) < TOL[dtype]
    assert torch.equal(y[:, 24:32], y0[:, 24:32]), "columns of no slice must not change"


@pytest.mark.parametrize("schedule", ["sgmv", "bgmv"])
def test_dora_flag_is_read_as_data(schedule):
    """One launch's arguments, replayed after the mapping's ``slot_dora`` is overwritten in
    place (what a CUDA-graph replay does): the rescaling follows the new flags."""
    gen, rows_slots, b_stacked, buffer, y0, mapping = _dora_inputs(schedule, torch.float32,
                                                                   0, 17)
    flags = [1] * len(DORA_RANKS)
    scales, shifts = make_dora_stacks(gen, flags, True)
    outs = []
    for new_flags in ((0,) * len(DORA_RANKS), DORA_FLAGS):
        mapping.slot_dora.copy_(torch.tensor(new_flags, dtype=torch.int32))
        y = y0.to(DEVICE, copy=True)
        lora_expand_triton(y, buffer.to(DEVICE), b_stacked, mapping, DORA_SLICES, scales,
                           shifts)
        outs.append(y.cpu())
    want = [reference_dora(y0, buffer, rows_slots, b_stacked, scales, shifts, f)
            for f in ((0,) * len(DORA_RANKS), DORA_FLAGS)]
    for got, ref in zip(outs, want):
        assert rel_err(got, ref) < 1e-5


def test_dora_bad_arguments_raise():
    mapping = build_lora_mapping([0, -1], [4], DEVICE, slot_dora=[1])
    y, buffer = torch.zeros(2, 8, device=DEVICE), torch.zeros(2, 1, 4, device=DEVICE)
    b = torch.zeros(1, 8, 4, device=DEVICE)
    scale = torch.ones(1, 8, device=DEVICE)
    with pytest.raises(ValueError, match="without DoRA scales"):
        lora_expand_triton(y, buffer, [b], mapping, [(0, 8)], None, [scale])
    with pytest.raises(ValueError, match="DoRA scales"):
        lora_expand_triton(y, buffer, [b], mapping, [(0, 8)], [scale.double()])
    with pytest.raises(ValueError, match="DoRA shifts"):
        lora_expand_triton(y, buffer, [b], mapping, [(0, 8)], [scale], [scale[:, :4]])
    with pytest.raises(ValueError, match="DoRA scales"):
        lora_expand_triton(y, buffer, [b], mapping, [(0, 8)], [scale, scale])
    fields = list(mapping[:6])
    with pytest.raises(ValueError, match="slot_dora"):
        torch.ops.manylora.lora_expand(y, buffer, [b], *fields, mapping.max_seg_len, "bgmv",
                                       [0], None, [scale])
    with pytest.raises(ValueError, match="slot_dora"):
        torch.ops.manylora.lora_expand(y, buffer, [b], *fields, mapping.max_seg_len, "bgmv",
                                       [0], mapping.slot_dora.long(), [scale])


def test_dora_custom_op_passes_opcheck():
    gen = torch.Generator().manual_seed(5)
    mapping = build_lora_mapping([1, 0, -1, 1], [3, 8], DEVICE, slot_dora=[0, 1],
                                 schedule="sgmv")
    buffer = torch.randn(4, 2, 8, generator=gen).to(DEVICE)
    b = [torch.randn(2, n, 8, generator=gen).to(DEVICE) for n in (16, 8)]
    scales = [torch.rand(2, n, generator=gen).to(DEVICE) for n in (16, 8)]
    shifts = [torch.randn(2, n, generator=gen).to(DEVICE) for n in (16, 8)]
    torch.library.opcheck(
        torch.ops.manylora.lora_expand.default,
        (torch.zeros(4, 24, device=DEVICE), buffer, b, *mapping[:6], mapping.max_seg_len,
         "sgmv", [0, 16], mapping.slot_dora, scales, shifts))


_COMPILE_EXPAND_FOR_H100 = textwrap.dedent("""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from manylora.ops import lora_kernels as tl_

    def ptx(fn, types, consts):
        sig = {name: types.get(name, "constexpr") for name in fn.arg_names}
        return triton.compile(ASTSource(fn, sig, consts, {}), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": 4}).asm["ptx"]

    types = {n: "*i32" for n in ("slot_ranks_ptr", "sorted_rows_ptr", "active_slots_ptr",
                                 "seg_start_ptr", "seg_len_ptr", "token_lora_ptr",
                                 "slot_dora_ptr")}
    types.update({n: "*bf16" for n in ("b0_ptr", "b1_ptr", "b2_ptr", "y_ptr")})
    types.update({n: "*fp32" for n in ("buf_ptr", "sc0_ptr", "sc1_ptr", "sc2_ptr", "sh0_ptr",
                                       "sh1_ptr", "sh2_ptr")})
    types.update({n: "i32" for n in ("N0", "N1", "N2", "OFF0", "OFF1", "OFF2", "N_TILES",
                                     "stride_bt", "stride_bs", "stride_yt", "stride_yn")})
    loads = {}
    for dora, shift in ((False, False), (True, False), (True, True)):
        flags = {"HAS_DORA": dora, "HAS_SHIFT": shift, "R": 16, "RANK_ALIGN": 8,
                 "BLOCK_N": 128, "BLOCK_R": 16}
        sgmv = ptx(tl_.sgmv_expand_kernel, types,
                   {**flags, "NUM_SLICES": 3, "BLOCK_M": 16, "DOT_FP32": False})
        bgmv = ptx(tl_.bgmv_expand_kernel, types, flags)
        loads[dora, shift] = [code.count("ld.global") for code in (sgmv, bgmv)]
    for i in range(2):
        assert loads[False, False][i] < loads[True, False][i] < loads[True, True][i], loads
""")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs the kernels themselves")
def test_expand_kernels_compile_for_h100():
    """The DoRA epilogue's runtime branch on the loaded flag must also compile for sm_90 (the
    interpreter runs it as Python): each variant compiles, and the scale/shift loads exist
    only in the variants that take them."""
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-c", _COMPILE_EXPAND_FOR_H100], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)
    if proc.returncode and ("ptxas" in proc.stderr and "not found" in proc.stderr):
        pytest.skip("no ptxas in this triton install")
    assert proc.returncode == 0, proc.stderr[-3000:]


# ---------------------------------------------------------------------------------------------
# real shapes, on a GPU only


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", ["sgmv", "bgmv"])
@pytest.mark.parametrize("max_rank", [16, 64])
def test_decode_shapes_on_gpu(schedule, max_rank):
    """Decode-sized batch: 64 rows over 16 adapters (ranks 8..max_rank), q/k/v 4096/1024/1024
    from 4096, bf16, through the public ``lora_shrink`` / ``lora_expand`` dispatch."""
    from manylora.ops.lora_expand import lora_expand
    from manylora.ops.lora_shrink import lora_shrink

    gen = torch.Generator().manual_seed(max_rank)
    num_rows, k, max_loras = 64, 4096, 16
    slices = ((0, 4096), (4096, 1024), (5120, 1024))
    ranks = [8 * (1 + i % (max_rank // 8)) for i in range(max_loras)]
    token_slots = torch.randint(-1, max_loras, (num_rows,), generator=gen).tolist()
    case = Case("uniform", num_rows, k, slices, 6144, tuple(ranks), max_rank)
    a_stacked, b_stacked = make_stacks(case, torch.bfloat16, gen)
    for a in a_stacked:                     # zero padding, as LoRASlots holds it
        for slot, rank in enumerate(ranks):
            a[slot, rank:] = 0
    x = torch.randn(num_rows, k, generator=gen).to(torch.bfloat16).cuda()
    mapping = build_lora_mapping(token_slots, ranks, DEVICE, schedule=schedule)
    buffer = lora_shrink(x, a_stacked, mapping)
    want = reference_shrink(x, token_slots, a_stacked, ranks, max_rank)
    lora_rows = torch.tensor([s >= 0 for s in token_slots])
    assert rel_err(buffer.cpu()[lora_rows], want[lora_rows]) < 2e-2
    y0 = torch.randn(num_rows, 6144, generator=gen).to(torch.bfloat16)
    y = y0.cuda()
    lora_expand(y, buffer, b_stacked, mapping, slices)
    delta = reference_delta(buffer, token_slots, b_stacked, ranks, slices, 6144)
    got = y.cpu().double() - y0.double()
    assert torch.equal(y.cpu()[~lora_rows], y0[~lora_rows])
    assert rel_err(got[lora_rows], delta[lora_rows]) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", ["sgmv", "bgmv"])
def test_cuda_graph_replay_follows_the_mapping(schedule):
    """Captured once with a padded mapping, replayed after the mapping's tensors are
    overwritten in place with another step's: the output follows the new mapping."""
    gen = torch.Generator().manual_seed(11)
    num_rows, k, n, max_loras, max_rank = 32, 4096, 1024, 8, 16
    ranks = [16, 8, 16, 4, 16, 12, 16, 8]
    a = torch.randn(max_loras, max_rank, k, generator=gen) / k ** 0.5
    b = torch.randn(max_loras, n, max_rank, generator=gen) / 4
    for slot, r in enumerate(ranks):
        a[slot, r:] = 0
        b[slot, :, r:] = 0
    a, b = a.to(torch.bfloat16).cuda(), b.to(torch.bfloat16).cuda()
    x = torch.randn(num_rows, k, generator=gen).to(torch.bfloat16).cuda()
    y = torch.zeros(num_rows, n, dtype=torch.bfloat16, device="cuda")

    def mapping_for(slots):
        return build_lora_mapping(slots, ranks, DEVICE, pad_to=num_rows, schedule=schedule)

    first = torch.randint(-1, max_loras, (num_rows - 3,), generator=gen).tolist()
    static = mapping_for(first)

    def step():
        y.zero_()
        buffer = lora_shrink_triton(x, [a], static)
        lora_expand_triton(y, buffer, [b], static, [(0, n)])

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
    for dst, src in zip(static[:6], new[:6]):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    slots = second + [-1] * 3
    buffer = reference_shrink(x, slots, [a], ranks, max_rank)
    delta = reference_delta(buffer, slots, [b], ranks, [(0, n)], n)
    assert rel_err(y.cpu(), delta) < 2e-2
