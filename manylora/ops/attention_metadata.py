"""One step's attention metadata: the batch's layout, block tables and kernel tiles.

Built once per step (``build_attention_metadata``, or on the device by the model runner)
and shared by every layer's ``write_kv`` and ``paged_attention``
(``manylora.ops.attention``); the Triton kernels (``manylora.ops.triton_attention``) read
its tiles.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from manylora.ops.paged_kv import FLOAT_DTYPES, KVCache, check_kv_cache

#: Rows (query tokens × the G heads of one KV head) a prefill tile of the Triton kernel
#: holds: BLOCK_Q = PREFILL_TILE_ROWS // G query tokens per tile.
PREFILL_TILE_ROWS = 128


class SeqAttention(NamedTuple):
    """Host view of one sequence of the step (read by the PyTorch reference).

    Attributes:
        query_start: first row of the sequence's new tokens in the flat batch.
        query_len: new tokens this step (≥ 1).
        context_len: tokens in the cache after this step's are written (≥ query_len).
    """

    query_start: int
    query_len: int
    context_len: int


class AttentionMetadata(NamedTuple):
    """The attention inputs of one step, built once by ``build_attention_metadata`` and
    shared by every layer.

    Sequence ``i`` of the batch owns rows ``query_start[i] .. query_start[i] + query_lens[i]``
    of the flat ``[T, ...]`` token batch and row ``i`` of ``block_tables``. Every tensor is
    on the step's device: from ``build_attention_metadata``, views of one buffer copied
    there in one transfer; from the model runner, views of its persistent step buffer, with
    ``cache_loc`` and ``block_tables`` computed on the device from its persistent block
    table (``cache_loc_from_block_table``).

    Work partition of the Triton kernel: a *tile* is ``(sequence, first query)``; tiles
    ``0 .. num_decode_tiles-1`` are the sequences with one new token (decode, one token per
    tile, all heads of a KV head in one tile), the rest are prefill tiles of
    ``prefill_block_q`` consecutive query tokens each, heaviest (most keys) first.

    CUDA-graph property: two metadata built with the same ``pad_to`` and
    ``max_blocks_per_seq`` (and the same block_size and num_queries_per_kv) have tensor
    fields of identical shapes, dtypes and devices and identical non-tensor fields
    (``seqs`` is empty when padded). A graph captured with one replays the other after
    ``dst.field.copy_(src.field)`` for every tensor field: the kernels' grids and constants
    depend only on the non-tensor fields and the shapes.

    Attributes:
        cache_loc: int64 ``[T]``, the flat cache location each new token's K/V is written to;
            -1 for padding rows (nothing written).
        block_tables: int32 ``[B, W]``, each sequence's physical blocks, padded with 0.
        query_start: int32 ``[B]``, first row of each sequence's new tokens.
        query_lens: int32 ``[B]``, new tokens of each sequence (1 for padding sequences).
        context_lens: int32 ``[B]``, tokens in the cache after this step's are written (0 for
            padding sequences).
        tile_seq: int32 ``[num_tiles]``, the sequence of each tile.
        tile_query: int32 ``[num_tiles]``, the first query (index within its sequence) of
            each tile.
        num_decode_tiles: the leading tiles that are decode sequences (query_len 1).
        prefill_block_q: query tokens per prefill tile.
        block_size: tokens per cache block.
        num_queries_per_kv: G, query heads per KV head.
        seqs: host ``SeqAttention`` per real sequence, in batch order; empty when padded.
    """

    cache_loc: torch.Tensor
    block_tables: torch.Tensor
    query_start: torch.Tensor
    query_lens: torch.Tensor
    context_lens: torch.Tensor
    tile_seq: torch.Tensor
    tile_query: torch.Tensor
    num_decode_tiles: int
    prefill_block_q: int
    block_size: int
    num_queries_per_kv: int
    seqs: tuple[SeqAttention, ...]


def prefill_block_q(num_queries_per_kv: int) -> int:
    """Query tokens per prefill tile: ``max(1, PREFILL_TILE_ROWS // G)``."""
    return max(1, PREFILL_TILE_ROWS // num_queries_per_kv)


def attention_tiles(query_lens: np.ndarray, seq_lens: np.ndarray,
                    block_q: int) -> tuple[np.ndarray, np.ndarray, int]:
    """The Triton kernel's work partition of a step (see ``AttentionMetadata``): decode
    sequences first, one tile each, then prefill tiles of ``block_q`` queries, most keys
    first. Numpy only, O(tiles).

    Args:
        query_lens: int64 ``[B]``, new tokens per sequence (≥ 1).
        seq_lens: int64 ``[B]``, tokens in the cache after the step (≥ query_lens).
        block_q: query tokens per prefill tile (``prefill_block_q``).

    Returns:
        ``(tile_seq int64 [num_tiles], tile_query int64 [num_tiles], num_decode_tiles)``.
    """
    decode = np.nonzero(query_lens == 1)[0]
    prefill = np.nonzero(query_lens > 1)[0]
    n_tiles = -(-query_lens[prefill] // block_q)
    pre_seq = np.repeat(prefill, n_tiles)
    pre_first = np.repeat(np.cumsum(n_tiles) - n_tiles, n_tiles)
    pre_query = (np.arange(pre_seq.size) - pre_first) * block_q
    pre_keys = (seq_lens[pre_seq] - query_lens[pre_seq]
                + np.minimum(pre_query + block_q, query_lens[pre_seq]))
    order = np.argsort(-pre_keys, kind="stable")
    return (np.concatenate([decode, pre_seq[order]]),
            np.concatenate([np.zeros_like(decode), pre_query[order]]), int(decode.size))


def cache_loc_from_block_table(positions: torch.Tensor, token_rows: torch.Tensor,
                                  block_table: torch.Tensor, block_size: int) -> torch.Tensor:
    """The KV cache location of every token row, computed on the tables' device (vLLM v1
    computes it on the GPU too)::

        loc[t] = block_table[row[t], pos[t] // bs] * bs + pos[t] % bs   (row[t] >= 0)
        loc[t] = -1                                                      (row[t] == -1)

    A handful of elementwise kernels and one gather, no host sync: CUDA-graph safe.

    Args:
        positions: int32/int64 ``[T]``, each token's position in its sequence (≥ 0).
        token_rows: int32/int64 ``[T]``, each token's row of ``block_table``; -1: padding.
        block_table: int32 ``[R, W]``, physical block ids per row (contiguous).
        block_size: tokens per block.

    Returns:
        int64 ``[T]`` flat cache locations (``AttentionMetadata.cache_loc``).
    """
    width = block_table.shape[1]
    flat = token_rows.clamp(min=0) * width + torch.div(positions, block_size,
                                                       rounding_mode="floor")
    blocks = block_table.view(-1).index_select(0, flat)
    locs = blocks.to(torch.int64) * block_size + positions.remainder(block_size)
    return torch.where(token_rows >= 0, locs, -1)


def build_attention_metadata(query_lens: Sequence[int], context_lens: Sequence[int],
                             block_tables: Sequence[Sequence[int]], block_size: int,
                             num_queries_per_kv: int, device: torch.device, *,
                             pad_to: int | None = None,
                             max_blocks_per_seq: int | None = None) -> AttentionMetadata:
    """Lay out one step's batch for ``write_kv`` and ``paged_attention``.

    Sequence ``i``'s new tokens are rows ``sum(query_lens[:i]) ..`` of the flat batch, at
    positions ``context_lens[i] - query_lens[i] + j``; their cache locations come from the
    block tables (``block_table[p // block_size] * block_size + p % block_size``). Every
    host list goes into one host buffer (pinned on CUDA) that is copied to ``device`` in
    one transfer; the tensor fields are views of it.

    Args:
        query_lens: new tokens of each sequence this step (≥ 1).
        context_lens: tokens in the cache after this step's are written (≥ query_len).
        block_tables: physical blocks of each sequence, covering at least
            ``ceil(context_len / block_size)`` blocks.
        block_size: tokens per cache block.
        num_queries_per_kv: G = num_heads / num_kv_heads (sizes the prefill tiles).
        device: where the tensors go.
        pad_to: CUDA-graph decode: pad the batch to ``pad_to`` sequences of one token each,
            so ``T = pad_to`` rows (padding sequences have context_len 0, cache location -1 and an
            all-zero table row; their output rows are zeros). Only valid when every sequence
            has query_len 1.
        max_blocks_per_seq: fixes the table width W (default: the longest table, at least 1).

    Returns:
        The step's ``AttentionMetadata`` (see its CUDA-graph property).

    Raises:
        ValueError: lists of different lengths, query_len < 1, context_len < query_len,
            a block table too short for its context or longer than ``max_blocks_per_seq``,
            block_size or num_queries_per_kv < 1, ``pad_to`` with a prefill sequence or
            smaller than the batch.
    """
    num_seqs = len(query_lens)
    if len(context_lens) != num_seqs or len(block_tables) != num_seqs:
        raise ValueError(f"query_lens ({num_seqs}), context_lens ({len(context_lens)}) and "
                         f"block_tables ({len(block_tables)}) must have one entry per sequence")
    if block_size < 1 or num_queries_per_kv < 1:
        raise ValueError(f"block_size ({block_size}) and num_queries_per_kv "
                         f"({num_queries_per_kv}) must be ≥ 1")
    q_lens = np.asarray(query_lens, dtype=np.int64).reshape(num_seqs)
    c_lens = np.asarray(context_lens, dtype=np.int64).reshape(num_seqs)
    t_lens = np.fromiter((len(t) for t in block_tables), dtype=np.int64, count=num_seqs)
    if num_seqs and q_lens.min() < 1:
        raise ValueError(f"every query_len must be ≥ 1, got {list(query_lens)}")
    if np.any(c_lens < q_lens):
        raise ValueError(f"context_len must be ≥ query_len, got context_lens "
                         f"{list(context_lens)} for query_lens {list(query_lens)}")
    short = np.nonzero(t_lens * block_size < c_lens)[0]
    if short.size:
        i = int(short[0])
        raise ValueError(f"sequence {i}: a block table of {t_lens[i]} blocks of {block_size} "
                         f"cannot hold context_len {c_lens[i]}")
    longest = int(t_lens.max()) if num_seqs else 0
    if max_blocks_per_seq is not None:
        if longest > max_blocks_per_seq:
            raise ValueError(f"a block table has {longest} blocks, more than "
                             f"max_blocks_per_seq={max_blocks_per_seq}")
        width = max(1, max_blocks_per_seq)
    else:
        width = max(1, longest)
    batch = num_seqs
    if pad_to is not None:
        if num_seqs and q_lens.max() > 1:
            raise ValueError("pad_to pads decode batches only: every query_len must be 1, "
                             f"got {list(query_lens)}")
        if pad_to < num_seqs:
            raise ValueError(f"pad_to={pad_to} is smaller than the batch ({num_seqs} sequences)")
        batch = pad_to

    # Per-sequence fields, padded to `batch` sequences (padding: one token, context 0).
    ql = np.ones(batch, dtype=np.int64)
    ql[:num_seqs] = q_lens
    cl = np.zeros(batch, dtype=np.int64)
    cl[:num_seqs] = c_lens
    qs = np.zeros(batch, dtype=np.int64)
    np.cumsum(ql[:-1], out=qs[1:])
    num_tokens = int(ql.sum())
    tables = np.zeros((batch, width), dtype=np.int64)
    tables[:num_seqs][np.arange(width) < t_lens[:, None]] = np.fromiter(
        itertools.chain.from_iterable(block_tables), dtype=np.int64, count=int(t_lens.sum()))

    # Slots of the new tokens; padding rows get -1.
    real_tokens = int(q_lens.sum())
    tok_seq = np.repeat(np.arange(num_seqs), q_lens)
    pos = cl[tok_seq] - ql[tok_seq] + (np.arange(real_tokens) - qs[tok_seq])
    locs = np.full(num_tokens, -1, dtype=np.int64)
    locs[:real_tokens] = tables[tok_seq, pos // block_size] * block_size + pos % block_size

    block_q = prefill_block_q(num_queries_per_kv)
    tile_seq, tile_query, num_decode_tiles = attention_tiles(ql, cl, block_q)

    # One host buffer: the int64 cache locations, then every int32 field; one copy to the device.
    int32_parts = (tables.reshape(-1), qs, ql, cl, tile_seq, tile_query)
    sizes = [p.size for p in int32_parts]
    nbytes = 8 * num_tokens + 4 * sum(sizes)
    device = torch.device(device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    host_np = host.numpy()
    host_np[: 8 * num_tokens].view(np.int64)[:] = locs
    host_np[8 * num_tokens:].view(np.int32)[:] = np.concatenate(int32_parts)
    buf = host.to(device, non_blocking=True)
    cache_loc = buf[: 8 * num_tokens].view(torch.int64)
    ints = buf[8 * num_tokens:].view(torch.int32)
    fields = ints.split(sizes)
    seqs = () if pad_to is not None else tuple(
        SeqAttention(int(qs[i]), int(ql[i]), int(cl[i])) for i in range(num_seqs))
    return AttentionMetadata(
        cache_loc=cache_loc,
        block_tables=fields[0].view(batch, width),
        query_start=fields[1],
        query_lens=fields[2],
        context_lens=fields[3],
        tile_seq=fields[4],
        tile_query=fields[5],
        num_decode_tiles=num_decode_tiles,
        prefill_block_q=block_q,
        block_size=block_size,
        num_queries_per_kv=num_queries_per_kv,
        seqs=seqs)

def check_attention_inputs(q: torch.Tensor, kv_cache: KVCache,
                           meta: AttentionMetadata) -> None:
    """Host-only shape checks shared by both paths (no device sync).

    Raises:
        ValueError: as ``check_kv_cache``; ``q`` not ``[T, H, D]`` with T the metadata's rows,
            ``kv_cache.data`` not ``[2, num_blocks, meta.block_size, Hkv, D]``, q's dtype not
            the cache's (unquantized) or not float32/bfloat16/float16 (quantized), or
            ``H / Hkv != meta.num_queries_per_kv``.
    """
    check_kv_cache(kv_cache)
    data = kv_cache.data
    if q.dim() != 3:
        raise ValueError(f"q must be [T, H, D], got {tuple(q.shape)}")
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = data.shape[3]
    if data.shape[4] != head_dim or data.shape[2] != meta.block_size:
        raise ValueError(f"kv_cache {tuple(data.shape)} does not match head_dim {head_dim} "
                         f"and block_size {meta.block_size}")
    if num_heads % num_kv_heads or num_heads // num_kv_heads != meta.num_queries_per_kv:
        raise ValueError(f"{num_heads} query heads over {num_kv_heads} KV heads does not match "
                         f"num_queries_per_kv={meta.num_queries_per_kv}")
    if q.shape[0] != meta.cache_loc.shape[0]:
        raise ValueError(f"q has {q.shape[0]} rows, the metadata {meta.cache_loc.shape[0]}")
    if kv_cache.quantized:
        if q.dtype not in FLOAT_DTYPES:
            raise ValueError(f"q must be float32, bfloat16 or float16, got {q.dtype}")
    elif q.dtype != data.dtype:
        raise ValueError(f"q is {q.dtype} but the cache is {data.dtype}")


def check_softcap(softcap: float | None) -> None:
    """The attention logits' soft cap is None or 0 (off) or a finite number > 0.

    Raises:
        ValueError: a negative, infinite or NaN cap.
    """
    if softcap and not 0.0 < softcap < float("inf"):
        raise ValueError(f"softcap must be > 0 (or None / 0 for none), got {softcap}")
