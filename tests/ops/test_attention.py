"""Paged attention, the paged KV write and the attention metadata against a float64 reference.

The reference is written here, independently of the module: for every sequence it gathers
each key/value position through the block table one position at a time, and for every
query row and head it takes a plain float64 softmax over the visible positions::

    qp = context_len - query_len + j
    out[j, h] = softmax_{kp ≤ qp, qp - kp < window}(q[j, h] · k[kp, h // G] * scale)
                @ v[kp, h // G]                       (zeros when no position is visible)

with, under a soft cap (Gemma 2), every logit ``s = q · k * scale`` replaced by
``cap * tanh(s / cap)`` before the softmax.

Inputs are fresh random tensors from seeded generators (the whole cache is random, unused
blocks included, and physical blocks are shuffled); Triton outputs are poisoned with NaN
first so that every element must be written. Without CUDA the Triton kernels run under
Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1).
"""

from __future__ import annotations

import math
import zlib

import pytest
import torch

from manylora.ops import triton_attention
from manylora.ops.attention import (
    paged_attention,
    paged_attention_reference,
    write_kv,
    write_kv_reference,
)
from manylora.ops.attention_metadata import AttentionMetadata, build_attention_metadata
from manylora.ops.paged_kv import KVCache

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-2}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# (num_heads, num_kv_heads)
HEADS = {"mha": (4, 4), "gqa4": (8, 2), "mqa": (8, 1)}
# (query_len, context_len) per sequence
SCENARIOS = {
    "decode": [(1, 9), (1, 70), (1, 1), (1, 33)],
    "prefill": [(37, 37), (5, 5), (1, 1)],
    "chunked": [(7, 100), (40, 41), (3, 3)],
    "mixed": [(1, 17), (12, 12), (1, 66), (9, 45), (1, 2)],
}
TENSOR_FIELDS = ("cache_loc", "block_tables", "query_start", "query_lens", "context_lens",
                 "tile_seq", "tile_query")


def seeded(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double().cpu(), want.double().cpu()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


# ------------------------------------------------------------------ float64 reference


def reference_attention(q, cache, query_lens, context_lens, tables, scale, window=None,
                        softcap=None):
    """Plain loops in float64; returns ``[T, H, D]`` (rows past the sequences stay zero)."""
    q, cache = q.double().cpu(), cache.double().cpu()
    num_heads, block_size, num_kv_heads = q.shape[1], cache.shape[2], cache.shape[3]
    group = num_heads // num_kv_heads
    out = torch.zeros(q.shape, dtype=torch.float64)
    row = 0
    for q_len, ctx, table in zip(query_lens, context_lens, tables):
        keys = [cache[0, table[p // block_size], p % block_size] for p in range(ctx)]
        vals = [cache[1, table[p // block_size], p % block_size] for p in range(ctx)]
        for j in range(q_len):
            qp = ctx - q_len + j
            visible = [p for p in range(ctx) if p <= qp and (window is None or qp - p < window)]
            for h in range(num_heads):
                logits = torch.stack([keys[p][h // group] @ q[row + j, h]
                                      for p in visible]) * scale
                if softcap:
                    logits = softcap * torch.tanh(logits / softcap)
                weights = torch.exp(logits - logits.max())
                weights = weights / weights.sum()
                out[row + j, h] = sum(w * vals[p][h // group] for w, p in zip(weights, visible))
        row += q_len
    return out


# ------------------------------------------------------------------ inputs


class Case:
    """Random cache and queries for a batch, with shuffled physical blocks."""

    def __init__(self, seqs, *, heads=(8, 2), head_dim=16, block_size=4, dtype=torch.float32,
                 key=(), extra_blocks=1, pad_to=None, max_blocks_per_seq=None,
                 strided_q=False):
        gen = seeded("case", seqs, heads, head_dim, block_size, str(dtype), key)
        self.num_heads, self.num_kv_heads = heads
        self.head_dim, self.block_size, self.dtype = head_dim, block_size, dtype
        self.query_lens = [ql for ql, _ in seqs]
        self.context_lens = [cl for _, cl in seqs]
        need = [-(-cl // block_size) + extra_blocks for cl in self.context_lens]
        num_blocks = sum(need) + 3
        perm = torch.randperm(num_blocks, generator=gen).tolist()
        self.tables, start = [], 0
        for n in need:
            self.tables.append(perm[start:start + n])
            start += n
        self.cache = torch.randn(2, num_blocks, block_size, self.num_kv_heads, head_dim,
                                 generator=gen).to(dtype).to(DEVICE)
        self.kv = KVCache(self.cache, None)
        rows = pad_to if pad_to is not None else sum(self.query_lens)
        width = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        if strided_q:   # q as the first part of a packed qkv projection, as the model has it
            qkv = torch.randn(rows, width, generator=gen).to(dtype).to(DEVICE)
            self.q = qkv[:, : self.num_heads * head_dim].view(rows, self.num_heads, head_dim)
        else:
            self.q = torch.randn(rows, self.num_heads, head_dim,
                                 generator=gen).to(dtype).to(DEVICE)
        self.scale = head_dim ** -0.5
        self.meta = build_attention_metadata(
            self.query_lens, self.context_lens, self.tables, block_size,
            self.num_heads // self.num_kv_heads, DEVICE, pad_to=pad_to,
            max_blocks_per_seq=max_blocks_per_seq)

    def expected(self, window=None, softcap=None):
        return reference_attention(self.q, self.cache, self.query_lens, self.context_lens,
                                   self.tables, self.scale, window, softcap)

    def triton(self, window=None, num_splits=None, softcap=None):
        out = torch.full_like(self.q, float("nan"))
        got = triton_attention.paged_attention_triton(
            self.q, self.kv, self.meta, self.scale, window, num_splits=num_splits, out=out,
            softcap=softcap)
        assert got.shape == (self.q.shape[0], self.num_heads * self.head_dim)
        assert got.dtype == self.dtype
        return got.view_as(self.q)


def check(got, want, dtype):
    assert not torch.isnan(got).any(), "an output element was not written"
    err = rel_err(got, want)
    assert err < TOL[dtype], err


# ------------------------------------------------------------------ metadata


def test_metadata_layout():
    seqs = [(1, 6), (6, 6), (3, 9), (1, 1)]
    tables = [[7, 2], [3, 0], [5, 1, 4], [6]]
    meta = build_attention_metadata([q for q, _ in seqs], [c for _, c in seqs], tables, 4,
                                    num_queries_per_kv=64, device=DEVICE)
    slots = []
    for (q_len, ctx), table in zip(seqs, tables):
        slots += [table[p // 4] * 4 + p % 4 for p in range(ctx - q_len, ctx)]
    assert meta.cache_loc.dtype == torch.int64
    assert meta.cache_loc.tolist() == slots
    assert meta.block_tables.dtype == torch.int32
    assert meta.block_tables.tolist() == [[7, 2, 0], [3, 0, 0], [5, 1, 4], [6, 0, 0]]
    assert meta.query_start.tolist() == [0, 1, 7, 10]
    assert meta.query_lens.tolist() == [1, 6, 3, 1]
    assert meta.context_lens.tolist() == [6, 6, 9, 1]
    # G = 64 → 2 query tokens per prefill tile; decode tiles first, then most keys first.
    assert meta.prefill_block_q == 2
    assert meta.num_decode_tiles == 2
    tiles = list(zip(meta.tile_seq.tolist(), meta.tile_query.tolist()))
    assert tiles[:2] == [(0, 0), (3, 0)]
    assert sorted(tiles[2:]) == [(1, 0), (1, 2), (1, 4), (2, 0), (2, 2)]
    keys = [c - q + min(f + 2, q) for s, f in tiles[2:] for q, c in [seqs[s]]]
    assert keys == sorted(keys, reverse=True)
    assert [tuple(s) for s in meta.seqs] == [(0, 1, 6), (1, 6, 6), (7, 3, 9), (10, 1, 1)]
    # Every tensor field is a view of the one device buffer.
    storages = {getattr(meta, f).untyped_storage().data_ptr() for f in TENSOR_FIELDS}
    assert len(storages) == 1
    assert all(getattr(meta, f).device.type == DEVICE.type for f in TENSOR_FIELDS)


def test_metadata_pad_to():
    meta = build_attention_metadata([1, 1], [5, 9], [[3, 1], [0, 2, 4]], 4, 4, DEVICE,
                                    pad_to=4, max_blocks_per_seq=5)
    assert meta.cache_loc.tolist() == [1 * 4 + 0, 4 * 4 + 0, -1, -1]
    assert meta.block_tables.tolist() == [[3, 1, 0, 0, 0], [0, 2, 4, 0, 0]] + [[0] * 5] * 2
    assert meta.query_start.tolist() == [0, 1, 2, 3]
    assert meta.query_lens.tolist() == [1, 1, 1, 1]
    assert meta.context_lens.tolist() == [5, 9, 0, 0]
    assert meta.num_decode_tiles == 4 and meta.tile_seq.tolist() == [0, 1, 2, 3]
    assert meta.seqs == ()
    # An all-padding batch (what a CUDA-graph capture runs) has the same layout.
    empty = build_attention_metadata([], [], [], 4, 4, DEVICE, pad_to=4, max_blocks_per_seq=5)
    assert empty.cache_loc.tolist() == [-1] * 4
    assert empty.context_lens.tolist() == [0] * 4
    assert empty.block_tables.shape == (4, 5) and empty.num_decode_tiles == 4
    q = torch.randn(4, 8, 16, generator=seeded("empty")).to(DEVICE)
    cache = torch.randn(2, 3, 4, 2, 16, generator=seeded("empty-cache")).to(DEVICE)
    got = triton_attention.paged_attention_triton(q, KVCache(cache), empty, 0.25,
                                                  out=torch.full_like(q, float("nan")))
    assert torch.equal(got, torch.zeros_like(got))


def test_metadata_cuda_graph_property():
    """Same pad_to and max_blocks_per_seq → same shapes and host fields; after copying every
    tensor field into the captured metadata, the kernels compute the new batch."""
    a = Case([(1, 3), (1, 20)], pad_to=6, max_blocks_per_seq=12, key="a")
    b = Case([(1, 30), (1, 7), (1, 1), (1, 44), (1, 13)], pad_to=6, max_blocks_per_seq=12,
             key="b")
    for name, value in a.meta._asdict().items():
        other = getattr(b.meta, name)
        if isinstance(value, torch.Tensor):
            assert (value.shape, value.dtype, value.device) == (
                other.shape, other.dtype, other.device), name
        else:
            assert value == other, name
    static = a.meta
    for name in TENSOR_FIELDS:
        getattr(static, name).copy_(getattr(b.meta, name))
    got = triton_attention.paged_attention_triton(b.q, b.kv, static, b.scale)
    check(got.view_as(b.q), b.expected(), torch.float32)


@pytest.mark.parametrize("bad", [
    dict(query_lens=[1, 2], context_lens=[3]),
    dict(query_lens=[0], context_lens=[3]),
    dict(query_lens=[4], context_lens=[3]),
    dict(query_lens=[1], context_lens=[9]),                        # table too short
    dict(query_lens=[1], context_lens=[3], max_blocks_per_seq=1, tables=[[0, 1]]),
    dict(query_lens=[2], context_lens=[3], pad_to=4),              # pad_to with a prefill
    dict(query_lens=[1, 1], context_lens=[3, 3], pad_to=1, tables=[[0], [1]]),
    dict(query_lens=[1], context_lens=[3], block_size=0),
])
def test_metadata_errors(bad):
    bad = dict(bad)
    tables = bad.pop("tables", [[0, 1]] * len(bad["query_lens"]))
    block_size = bad.pop("block_size", 4)
    with pytest.raises(ValueError):
        build_attention_metadata(bad.pop("query_lens"), bad.pop("context_lens"), tables,
                                 block_size, 2, DEVICE, **bad)


def test_empty_batch():
    meta = build_attention_metadata([], [], [], 16, 4, DEVICE)
    q = torch.randn(0, 8, 16, device=DEVICE)
    cache = KVCache(torch.randn(2, 2, 16, 2, 16, device=DEVICE))
    assert triton_attention.paged_attention_triton(q, cache, meta, 0.25).shape == (0, 128)
    assert paged_attention_reference(q, cache, meta, 0.25).shape == (0, 128)


# ------------------------------------------------------------------ Triton attention


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_dtypes_and_heads(dtype, heads):
    """Mixed decode/prefill/chunked batch, head_dim a power of two and not, both block sizes."""
    for head_dim, block_size in ((16, 16), (12, 4)):
        case = Case(SCENARIOS["mixed"], heads=HEADS[heads], head_dim=head_dim,
                    block_size=block_size, dtype=DTYPES[dtype], strided_q=True)
        check(case.triton(), case.expected(), DTYPES[dtype])


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_attention_scenarios(scenario, block_size):
    case = Case(SCENARIOS[scenario], heads=(6, 2), head_dim=12, block_size=block_size,
                extra_blocks=2)
    check(case.triton(), case.expected(), torch.float32)


@pytest.mark.parametrize("window", [1, 5, 40])
@pytest.mark.parametrize("scenario", ["decode", "chunked", "mixed"])
def test_attention_sliding_window(scenario, window):
    case = Case(SCENARIOS[scenario], heads=(8, 2), head_dim=16, block_size=4, key=window)
    check(case.triton(window), case.expected(window), torch.float32)


def test_attention_head_dim_80_bf16():
    case = Case([(1, 50), (20, 70), (33, 33)], heads=(4, 1), head_dim=80, block_size=16,
                dtype=torch.bfloat16)
    check(case.triton(), case.expected(), torch.bfloat16)


def test_attention_mha_multi_tile_prefill():
    """G = 1: 128 query tokens per prefill tile, so 130 new tokens take two tiles."""
    case = Case([(130, 135), (1, 4)], heads=(2, 2), head_dim=16, block_size=16)
    check(case.triton(), case.expected(), torch.float32)


@pytest.mark.parametrize("num_splits", [1, 2, 5])
@pytest.mark.parametrize("window", [None, 20])
def test_attention_decode_splits(num_splits, window):
    """Flash-decoding splits of the key range, including splits with no keys at all."""
    case = Case([(1, 150), (1, 3), (1, 64), (1, 1)], heads=(8, 2), head_dim=12, block_size=16,
                dtype=torch.float16, key=num_splits)
    check(case.triton(window, num_splits=num_splits), case.expected(window), torch.float16)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_attention_pad_to(num_splits):
    case = Case([(1, 21), (1, 5), (1, 40)], heads=(8, 2), head_dim=16, block_size=4, pad_to=7,
                max_blocks_per_seq=16)
    got = case.triton(num_splits=num_splits)
    check(got, case.expected(), torch.float32)
    assert torch.equal(got[3:], torch.zeros_like(got[3:]))


@pytest.mark.parametrize("scenario", ["decode", "prefill", "chunked", "mixed"])
def test_attention_softcap(scenario):
    """A cap of 0.5 on logits of spread about 1: tanh bends most of them, and the result is
    far from the uncapped attention."""
    case = Case(SCENARIOS[scenario], heads=(8, 2), head_dim=16, block_size=4, key="cap")
    got = case.triton(softcap=0.5)
    check(got, case.expected(softcap=0.5), torch.float32)
    assert rel_err(got, case.expected()) > 100 * TOL[torch.float32]


@pytest.mark.parametrize("num_splits", [1, 3])
def test_attention_softcap_window_splits_fp16(num_splits):
    """Soft-capping with a sliding window through the flash-decoding splits, float16."""
    case = Case([(1, 90), (1, 7), (13, 40)], heads=(4, 1), head_dim=16, block_size=16,
                dtype=torch.float16, key=("cap", num_splits))
    check(case.triton(9, num_splits=num_splits, softcap=0.7), case.expected(9, softcap=0.7),
          torch.float16)


def test_attention_softcap_saturates_without_overflow():
    """Logits in the thousands: tanh is ±1 there, with no inf or NaN on the way."""
    case = Case(SCENARIOS["mixed"], heads=(8, 2), head_dim=16, block_size=4, key="big")
    case.scale = 300.0
    check(case.triton(softcap=2.0), case.expected(softcap=2.0), torch.float32)


def test_reference_softcap_matches_float64():
    case = Case(SCENARIOS["mixed"], heads=(8, 2), head_dim=12, key="ref-cap")
    got = paged_attention(case.q, case.kv, case.meta, case.scale, 6, softcap=0.5)
    check(got.view_as(case.q), case.expected(6, softcap=0.5), torch.float32)


@pytest.mark.parametrize("softcap", [-1.0, float("inf"), float("nan")])
def test_attention_softcap_errors(softcap):
    case = Case([(1, 5)], heads=(8, 2))
    for attend in (triton_attention.paged_attention_triton, paged_attention_reference):
        with pytest.raises(ValueError, match="softcap"):
            attend(case.q, case.kv, case.meta, 1.0, softcap=softcap)


def test_attention_errors():
    case = Case([(1, 5)], heads=(8, 2))
    with pytest.raises(ValueError):
        triton_attention.paged_attention_triton(case.q, case.kv, case.meta, 1.0, 0)
    with pytest.raises(ValueError):      # metadata built for another G
        triton_attention.paged_attention_triton(case.q[:, :4], case.kv, case.meta, 1.0)
    with pytest.raises(ValueError):
        triton_attention.paged_attention_triton(case.q.half(), case.kv, case.meta, 1.0)
    with pytest.raises(ValueError):
        triton_attention.paged_attention_triton(case.q, case.kv, case.meta, 1.0,
                                                num_splits=0)
    with pytest.raises(ValueError):      # a bare tensor, not a KVCache
        triton_attention.paged_attention_triton(case.q, case.cache, case.meta, 1.0)


# ------------------------------------------------------------------ reference and dispatch


@pytest.mark.parametrize("window", [None, 6])
def test_reference_matches_float64(window):
    for seqs, kw in ((SCENARIOS["mixed"], {}), (SCENARIOS["chunked"], {"block_size": 16}),
                     ([(1, 30), (1, 2)], {"pad_to": 4})):
        case = Case(seqs, heads=(8, 2), head_dim=12, **kw)
        got = paged_attention_reference(case.q, case.kv, case.meta, case.scale, window)
        check(got.view_as(case.q), case.expected(window), torch.float32)


def test_paged_attention_dispatch():
    case = Case(SCENARIOS["mixed"], heads=(8, 2), dtype=torch.bfloat16)
    got = paged_attention(case.q, case.kv, case.meta, case.scale)
    check(got.view_as(case.q), case.expected(), torch.bfloat16)


# ------------------------------------------------------------------ write_kv


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("impl", ["triton", "reference", "dispatch"])
def test_write_kv(impl, dtype):
    dtype = DTYPES[dtype]
    gen = seeded("write", impl, str(dtype))
    num_blocks, block_size, kv_heads, head_dim, rows = 6, 4, 3, 12, 9
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    cache = cache.to(DEVICE)
    before = cache.clone()
    qkv = torch.randn(rows, (2 + 2 * kv_heads) * head_dim, generator=gen).to(dtype).to(DEVICE)
    k = qkv[:, 2 * head_dim: (2 + kv_heads) * head_dim].view(rows, kv_heads, head_dim)
    v = qkv[:, (2 + kv_heads) * head_dim:].view(rows, kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:rows]
    slots[[2, 5]] = -1
    cache_loc = slots.to(DEVICE)
    fn = {"triton": triton_attention.write_kv_triton, "reference": write_kv_reference,
          "dispatch": write_kv}[impl]
    fn(k, v, KVCache(cache), cache_loc)
    want = before.clone().view(2, -1, kv_heads, head_dim)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            want[0, slot], want[1, slot] = k[t], v[t]
    assert torch.equal(cache.view_as(want), want)


# ------------------------------------------------------------------ GPU, real shapes


def _llama3_case(seqs, dtype=torch.bfloat16):
    return Case(seqs, heads=(32, 8), head_dim=128, block_size=16, dtype=dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 64])
def test_gpu_llama3_decode_and_prefill(batch):
    """Llama-3-8B attention shapes on the GPU against the module's reference in float32."""
    for seqs in ([(1, 512)] * batch, [(128, 128)] * 4 + [(1, 300)] * 3):
        case = _llama3_case(seqs)
        got = case.triton()
        want = paged_attention_reference(case.q.float(), KVCache(case.cache.float()),
                                         case.meta, case.scale).view_as(case.q)
        check(got, want, torch.bfloat16)


@pytest.mark.gpu
def test_gpu_cuda_graph_replay():
    """Capture write_kv + paged_attention with one padded batch, replay another."""
    kw = dict(pad_to=8, max_blocks_per_seq=40)
    first = Case([(1, 100), (1, 7)], heads=(32, 8), head_dim=128, block_size=16,
                 dtype=torch.bfloat16, key="first", **kw)
    second = Case([(1, 600), (1, 3), (1, 250)], heads=(32, 8), head_dim=128, block_size=16,
                  dtype=torch.bfloat16, key="second", **kw)
    gen = seeded("graph")
    k_new = torch.randn(8, 8, 128, generator=gen).to(DEVICE, torch.bfloat16)
    v_new = torch.randn(8, 8, 128, generator=gen).to(DEVICE, torch.bfloat16)
    q = first.q.clone()
    cache = KVCache(second.cache.clone())
    meta: AttentionMetadata = first.meta
    out = torch.empty_like(q)

    def step():
        write_kv(k_new, v_new, cache, meta.cache_loc)
        triton_attention.paged_attention_triton(q, cache, meta, first.scale, out=out)

    step()                                       # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for name in TENSOR_FIELDS:
        getattr(meta, name).copy_(getattr(second.meta, name))
    q.copy_(second.q)
    cache.data.copy_(second.cache)               # undo the warm-up step's writes
    graph.replay()
    torch.cuda.synchronize()
    want_cache = KVCache(second.cache.clone())
    write_kv_reference(k_new, v_new, want_cache, second.meta.cache_loc)
    want = paged_attention_reference(second.q.float(), KVCache(want_cache.data.float()),
                                     second.meta, second.scale).view_as(q)
    assert torch.equal(cache.data, want_cache.data)
    check(out, want, torch.bfloat16)
    assert math.isfinite(out.float().abs().max().item())
