"""The tiled LoRA shrink/expand (``lora/kernels/triton_lora_tiled.py``) against a float64 reference,
and the host row tiles (``lora/kernels/row_tiles.py``) against a per-slot Python count.

Without a GPU the kernels run under ``TRITON_INTERPRET=1`` (``tests/conftest.py``). The slot
buffers are laid out as the spec lays them out: A ``[max_loras, R, in]``, B rank-major
``[max_loras, R, out_s]``; ranks and DoRA flags come from a rank table per (slot, slice),
rank 0 included. Everything a kernel must not read (A and B rows past a (slot, slice)'s
rank, buffer columns past it, the buffer of rows of rank-0 slices) holds NaN.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

from manylora.lora.kernels.cost_model import graph_block_m
from manylora.lora.kernels.meta import build_lora_kernel_meta, lora_kernel_meta_arrays
from manylora.lora.kernels.row_tiles import max_row_tiles, row_tiles
from manylora.lora.kernels.tiled_plans import tiled_expand_plan, tiled_shrink_plan
from manylora.lora.kernels.triton_lora_tiled import lora_expand_tiled, lora_shrink_tiled

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 1e-2}


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double().cpu(), want.double().cpu()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def make_tiles(token_slots: list[int], max_loras: int, block_m: int,
               pad_rows: int = 0, padded: bool = False) -> tuple:
    """The tiled ops' mapping arguments (sorted rows, tile arrays on the device, block_m):
    padded (a graph lora_meta) to ``max_row_tiles``."""
    arrays = lora_kernel_meta_arrays(np.asarray(token_slots), max_loras,
                                     len(token_slots) + pad_rows)
    total = arrays.token_lora_indices.size
    tiles = row_tiles(arrays.active_slots, arrays.seg_start, arrays.seg_len, block_m,
                      max_row_tiles(total, max_loras, block_m) if padded else None)
    def as_t(a):
        return torch.from_numpy(np.ascontiguousarray(a)).to(DEVICE)

    return (as_t(arrays.sorted_rows), as_t(tiles.tile_slot), as_t(tiles.tile_start),
            as_t(tiles.tile_len), block_m)


def rows_per_slot(counts: dict[int, int], base: int, gen: torch.Generator) -> list[int]:
    """Token slots: ``counts[slot]`` rows per slot and ``base`` base rows, shuffled."""
    slots = [s for s, n in counts.items() for _ in range(n)] + [-1] * base
    return [slots[i] for i in torch.randperm(len(slots), generator=gen).tolist()]


CASES = {
    # name: (rows per slot, base rows, max_loras, slices (offset, out), out_total, in, R)
    "decode-1-row-each": ({0: 1, 1: 1, 3: 1, 5: 1}, 2, 6, ((0, 40),), 40, 48, 16),
    "decode-4-rows-each-3slices": ({0: 4, 2: 4, 4: 4}, 1, 5, ((0, 24), (24, 40), (64, 8)),
                                   72, 40, 16),
    "long-segment-splits": ({1: 37, 2: 3}, 0, 3, ((0, 24), (32, 16)), 48, 600, 16),
    "rank80": ({0: 5, 1: 2}, 3, 2, ((0, 40),), 40, 72, 80),
}


def make_case(case_id: str, dtype: torch.dtype, gen: torch.Generator):
    counts, base, max_loras, slices, out_total, k, max_rank = CASES[case_id]
    token_slots = rows_per_slot(counts, base, gen)
    num_slices = len(slices)
    # ranks per (slot, slice), 0 for some: an untargeted module or an empty slot
    ranks = torch.randint(1, max_rank + 1, (max_loras, num_slices), generator=gen)
    ranks[0, -1] = 0
    ranks[max_loras - 1, 0] = 0
    a_stacked, b_stacked = [], []
    for s, (_, size) in enumerate(slices):
        a = torch.randn(max_loras, max_rank, k, generator=gen, dtype=torch.float64) / k ** 0.5
        b = torch.randn(max_loras, max_rank, size, generator=gen, dtype=torch.float64)
        for slot in range(max_loras):
            r = int(ranks[slot, s])
            a[slot, r:] = float("nan")
            b[slot, r:] = float("nan")
            b[slot, :r] /= max(r, 1) ** 0.5
        a_stacked.append(a.to(dtype).to(DEVICE))
        b_stacked.append(b.to(dtype).to(DEVICE))
    # the table of a whole model: this projection's columns start at 2 of 7
    table = torch.zeros(max_loras, 7, dtype=torch.int32)
    table[:, 2:2 + num_slices] = ranks
    return token_slots, ranks, table.to(DEVICE), a_stacked, b_stacked


def reference_shrink(x, token_slots, a_stacked, ranks, max_rank):
    x = x.double().cpu()
    out = torch.zeros(x.shape[0], len(a_stacked), max_rank, dtype=torch.float64)
    for t, slot in enumerate(token_slots):
        for s, a in enumerate(a_stacked):
            if slot >= 0 and ranks[slot, s]:
                r = int(ranks[slot, s])
                out[t, s, :r] = a[slot, :r].double().cpu() @ x[t]
    return out


def reference_expand(y0, buffer, token_slots, b_stacked, ranks, slices, dora=None,
                     scales=None, biases=None):
    """float64 result of the expand: ``y + delta`` per (row, slice) of nonzero rank, DoRA
    ``(y + delta) * scale + (1 - scale) * bias`` where flagged."""
    y = y0.double().clone()
    buffer = buffer.double().cpu()
    for t, slot in enumerate(token_slots):
        for s, (b, (off, n)) in enumerate(zip(b_stacked, slices, strict=True)):
            r = int(ranks[slot, s]) if slot >= 0 else 0
            if not r:
                continue
            delta = buffer[t, s, :r] @ b[slot, :r].double().cpu()
            out = y[t, off:off + n] + delta
            if dora is not None and dora[slot, s]:
                sc = scales[s][slot].double().cpu()
                out = out * sc
                if biases is not None:
                    out = out + (1 - sc) * biases[s].double().cpu()
            y[t, off:off + n] = out
    return y


@pytest.mark.parametrize("padded", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case_id", list(CASES))
def test_tiled_shrink_expand_match_float64(case_id, dtype, padded):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{case_id}-{dtype}-{padded}".encode()))
    token_slots, ranks, table, a_stacked, b_stacked = make_case(case_id, dtype, gen)
    _, _, max_loras, slices, out_total, k, max_rank = CASES[case_id]
    pad_rows = 5 if padded else 0
    rows = token_slots + [-1] * pad_rows
    block_m = 16
    tiles = make_tiles(token_slots, max_loras, block_m, pad_rows, padded)
    cols = table[:, 2:2 + len(slices)]
    x = torch.randn(len(rows), k, generator=gen).to(dtype).to(DEVICE)

    buffer = lora_shrink_tiled(x, a_stacked, cols, *tiles).cpu()
    assert buffer.shape == (len(rows), len(slices), max_rank)
    assert not buffer.isnan().any(), "A past a (slot, slice)'s rank must never be read"
    want = reference_shrink(x, rows, a_stacked, ranks, max_rank)
    assert torch.all(buffer[want == 0] == 0), "base rows and ranks past r must stay zero"
    assert rel_err(buffer, want) < TOL[dtype]

    # expand from a buffer that is NaN wherever the kernel must not read it
    fresh = torch.randn(len(rows), len(slices), max_rank, generator=gen)
    for t, slot in enumerate(rows):
        for s in range(len(slices)):
            fresh[t, s, int(ranks[slot, s]) if slot >= 0 else 0:] = float("nan")
    y0 = torch.randn(len(rows), out_total, generator=gen).to(dtype)
    y = y0.to(DEVICE, copy=True)
    lora_expand_tiled(y, fresh.to(DEVICE), b_stacked, cols, *tiles, [o for o, _ in slices])
    want = reference_expand(y0, fresh, rows, b_stacked, ranks, slices)
    untouched = want == y0.double()
    y = y.cpu()
    assert torch.equal(y[untouched], y0[untouched]), \
        "base rows, rank-0 slices and columns of no slice must not change"
    assert rel_err(y.double() - y0.double(), want - y0.double()) < TOL[dtype]


@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_tiled_expand_dora_per_slot_and_slice(with_bias):
    case_id = "decode-4-rows-each-3slices"
    dtype = torch.float32
    gen = torch.Generator().manual_seed(zlib.crc32(f"dora-{with_bias}".encode()))
    token_slots, ranks, table, _, b_stacked = make_case(case_id, dtype, gen)
    _, _, max_loras, slices, out_total, _, max_rank = CASES[case_id]
    tiles = make_tiles(token_slots, max_loras, 16, 3, padded=True)
    rows = token_slots + [-1] * 3
    dora = torch.zeros(max_loras, 7, dtype=torch.int32)
    dora[0, 2] = dora[2, 3] = dora[4, 2:5] = 1         # some (slot, slice)s only
    num_slices = len(slices)
    dora_cols = dora[:, 2:2 + num_slices].to(DEVICE)
    scales = [torch.rand(max_loras, n, generator=gen) + 0.5 for _, n in slices]
    bias = torch.randn(out_total, generator=gen) if with_bias else None
    biases = None if bias is None else [bias[o:o + n] for o, n in slices]
    buffer = torch.randn(len(rows), len(slices), max_rank, generator=gen)
    y0 = torch.randn(len(rows), out_total, generator=gen)
    y = y0.to(DEVICE, copy=True)
    ranks_cols = table[:, 2:2 + num_slices]
    lora_expand_tiled(y, buffer.to(DEVICE), b_stacked, ranks_cols, *tiles,
                      [o for o, _ in slices], dora_cols, [s.to(DEVICE) for s in scales],
                      None if bias is None else bias.to(DEVICE))
    want = reference_expand(y0, buffer, rows, b_stacked, ranks, slices, dora[:, 2:],
                            scales, biases)
    assert rel_err(y.cpu(), want) < 1e-6
    # plain (slot, slice)s are exactly what a launch without DoRA arguments gives
    plain = y0.to(DEVICE, copy=True)
    lora_expand_tiled(plain, buffer.to(DEVICE), b_stacked, ranks_cols, *tiles,
                      [o for o, _ in slices])
    for t, slot in enumerate(rows):
        for s, (off, n) in enumerate(slices):
            if slot < 0 or not dora[slot, 2 + s]:
                assert torch.equal(y[t, off:off + n].cpu(), plain[t, off:off + n].cpu())


def test_row_tiles_cut_each_slot_into_block_m_rows():
    gen = torch.Generator().manual_seed(7)
    counts = {0: 1, 3: 16, 4: 17, 6: 40}
    token_slots = rows_per_slot(counts, 5, gen)
    arrays = lora_kernel_meta_arrays(np.asarray(token_slots), 8)
    tiles = row_tiles(arrays.active_slots, arrays.seg_start, arrays.seg_len, 16)
    assert tiles.num_real == 1 + 1 + 2 + 3
    sorted_rows = arrays.sorted_rows
    seen: dict[int, list[int]] = {}
    for slot, start, n in zip(tiles.tile_slot, tiles.tile_start, tiles.tile_len):
        assert 1 <= n <= 16
        got = sorted_rows[start:start + n].tolist()
        assert all(token_slots[r] == slot for r in got)
        seen.setdefault(int(slot), []).extend(got)
    want = {s: sorted(i for i, t in enumerate(token_slots) if t == s) for s in counts}
    assert {s: sorted(r) for s, r in seen.items()} == want


@pytest.mark.parametrize("block_m", [16, 32, 64])
def test_max_row_tiles_bounds_every_split_of_the_rows(block_m):
    """No way of spreading ``N`` rows over ``L`` slots needs more tiles than the bound, and
    some way needs exactly that many (so the bound is tight)."""
    for max_loras in (1, 4, 16, 64):
        for num_rows in (1, 7, 16, 33, 64, 100, 256):
            bound = max_row_tiles(num_rows, max_loras, block_m)
            gen = np.random.default_rng(num_rows * 131 + max_loras)
            for _ in range(20):
                slots = gen.integers(0, max_loras, num_rows)
                arrays = lora_kernel_meta_arrays(slots, max_loras)
                tiles = row_tiles(arrays.active_slots, arrays.seg_start, arrays.seg_len,
                                  block_m, bound)
                assert tiles.num_real <= bound
            # the worst split: a slots of (block_m + 1) rows each, the rest in singles
            a = min(max_loras, num_rows)
            worst = np.zeros(max_loras, np.int64)
            worst[:a] = 1
            rest = num_rows - a
            for i in range(a):
                add = min(block_m, rest)
                worst[i] += add
                rest -= add
            worst[0] += rest
            slots = np.repeat(np.arange(max_loras), worst)
            arrays = lora_kernel_meta_arrays(slots, max_loras)
            assert row_tiles(arrays.active_slots, arrays.seg_start, arrays.seg_len,
                             block_m).num_real == bound


def test_graph_grid_depends_only_on_the_row_count():
    """Padded mappings (``build_lora_kernel_meta(pad_to=...)``, as the engine's graph steps build
    them) of the same row count give the same launches whatever the split of the rows over
    slots (a captured graph replays them all); the tile count is the bound."""
    max_loras, total = 8, 48
    block_m = graph_block_m(total, max_loras)
    bound = max_row_tiles(total, max_loras, block_m)
    launches = set()
    gen = np.random.default_rng(3)
    for lora_rows in (1, 5, 20, 48):
        for _ in range(5):
            slots = gen.integers(0, max_loras, lora_rows).tolist()
            lora_meta = build_lora_kernel_meta(slots, max_loras, torch.device("cpu"),
                                             pad_to=total, variant="tiled")
            n = lora_meta.tile_slot.shape[0]
            assert (n, lora_meta.block_m, lora_meta.sorted_rows.shape[0]) == (bound, block_m, total)
            assert int((lora_meta.tile_slot >= 0).sum()) <= bound
            launches.add(repr((tiled_shrink_plan(n, lora_meta.block_m, 4096, 16, 3, 2),
                               tiled_expand_plan(n, lora_meta.block_m, 4096, 16, 3, True,
                                                 False))))
    assert len(launches) == 1


def test_tiled_ops_reject_bad_tables():
    tiles = make_tiles([0, 0], 2, 16)
    x = torch.randn(2, 8, device=DEVICE)
    a = [torch.randn(2, 4, 8, device=DEVICE)]
    with pytest.raises(ValueError, match="int32"):
        lora_shrink_tiled(x, a, torch.zeros(2, 1, dtype=torch.int64, device=DEVICE), *tiles)
    with pytest.raises(ValueError, match="BLOCK_M"):
        lora_shrink_tiled(x, a, torch.ones(2, 1, dtype=torch.int32, device=DEVICE),
                          *tiles[:4], 8)
    y = torch.randn(2, 6, device=DEVICE)
    b = [torch.randn(2, 4, 6, device=DEVICE)]
    buf = torch.zeros(2, 1, 4, device=DEVICE)
    ranks = torch.ones(2, 1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="without DoRA scales"):
        lora_expand_tiled(y, buf, b, ranks, *tiles, [0], bias=torch.zeros(6))
    with pytest.raises(ValueError, match="do not fit"):
        lora_expand_tiled(y, buf, b, ranks, *tiles, [1])


def test_dispatcher_ops_match_the_wrappers_and_have_fake_kernels():
    """``torch.ops.manylora.lora_shrink_tiled`` / ``lora_expand_tiled`` (what
    ``torch.compile`` traces) give the wrappers' results, and their fake kernels the
    buffer's shape without running a kernel."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import manylora.lora.kernels.triton_lora  # noqa: F401  (registers the ops)

    gen = torch.Generator().manual_seed(11)
    token_slots, _, table, a_stacked, b_stacked = make_case("decode-1-row-each",
                                                            torch.float32, gen)
    _, _, max_loras, slices, out_total, k, max_rank = CASES["decode-1-row-each"]
    tiles = make_tiles(token_slots, max_loras, 16)
    x = torch.randn(len(token_slots), k, generator=gen).to(DEVICE)
    cols = table[:, 2:2 + len(slices)]
    want = lora_shrink_tiled(x, a_stacked, cols, *tiles)
    got = torch.ops.manylora.lora_shrink_tiled(x, a_stacked, cols, *tiles)
    assert torch.equal(got, want)
    y0 = torch.randn(len(token_slots), out_total, generator=gen).to(DEVICE)
    y1, y2 = y0.clone(), y0.clone()
    lora_expand_tiled(y1, want, b_stacked, cols, *tiles, [o for o, _ in slices])
    torch.ops.manylora.lora_expand_tiled(y2, want, b_stacked, cols, *tiles,
                                         [o for o, _ in slices])
    assert torch.equal(y1, y2) and not torch.equal(y1, y0)
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = torch.ops.manylora.lora_shrink_tiled(torch.empty(5, k), a_stacked, cols, *tiles)
    assert tuple(fake.shape) == (5, 1, max_rank) and fake.dtype == torch.float32


def test_shrink_reads_only_its_rank_rows_under_rank_sharding():
    """Fully sharded column parallelism: A holds rank rows ``[start, start + R)`` of each
    adapter; a row of rank ``r`` reduces ``clamp(r - start, 0, R)`` of them (none when its
    rank ends before ``start``)."""
    gen = torch.Generator().manual_seed(5)
    max_loras, k, width, start = 4, 40, 8, 8
    ranks = torch.tensor([[3], [12], [16], [0]], dtype=torch.int32)
    full = torch.randn(max_loras, 2 * width, k, generator=gen, dtype=torch.float64)
    shard = full[:, start:start + width].clone()
    for slot in range(max_loras):
        shard[slot, max(0, int(ranks[slot]) - start):] = float("nan")   # never read
    token_slots = [0, 1, 2, 3, 1, -1, 2]
    x = torch.randn(len(token_slots), k, generator=gen, dtype=torch.float64)
    got = lora_shrink_tiled(x.float().to(DEVICE), [shard.float().to(DEVICE)],
                            ranks.to(DEVICE), *make_tiles(token_slots, max_loras, 16),
                            rank_start=start).cpu()
    want = torch.zeros(len(token_slots), 1, width, dtype=torch.float64)
    for t, slot in enumerate(token_slots):
        c = min(max(int(ranks[slot]) - start, 0), width) if slot >= 0 else 0
        want[t, 0, :c] = full[slot, start:start + c] @ x[t]
    assert not got.isnan().any()
    assert torch.all(got[want == 0] == 0)
    assert rel_err(got, want) < 1e-5
