"""Paged attention over a block-table KV cache: metadata, the PyTorch reference, dispatch.

KV cache layout, per layer: ``kv_cache[2, num_blocks, block_size, num_kv_heads, head_dim]``
(index 0 keys, 1 values). Token ``p`` of a sequence lives in physical block
``block_table[p // block_size]`` at offset ``p % block_size``, i.e. flat slot
``block_table[p // block_size] * block_size + p % block_size`` (vLLM's PagedAttention,
Kwon et al., SOSP 2023).

For a sequence with ``context_len`` tokens of which the last ``query_len`` are new this
step, query ``j`` sits at position ``qp = context_len - query_len + j`` and attends to
every key position ``kp`` with ``kp <= qp`` (and ``qp - kp < window`` under a sliding
window)::

    out[j, h] = softmax_kp(q[j, h] · k[kp, h // G] * scale) @ v[kp, h // G]

with ``G = num_heads / num_kv_heads`` (GQA; MQA when num_kv_heads is 1, MHA when G is 1).
Prefill, chunked prefill over cached blocks and decode are the same formula. A query with
no key to attend (a padding sequence, ``context_len`` 0) yields zeros.

On CUDA, ``write_kv`` and ``paged_attention`` run the Triton kernels of
``manylora.ops.triton_attention`` (one launch for the decode sequences and one for the
prefill tiles, FlashAttention-2's online softmax over key tiles gathered through the block
table); elsewhere they run the PyTorch references below. ``build_attention_metadata`` lays
out one step's batch for both, once per step, shared by every layer.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

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
    on the step's device and is a view of one buffer copied there in one transfer.

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
        slot_mapping: int64 ``[T]``, the flat cache slot each new token's K/V is written to;
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

    slot_mapping: torch.Tensor
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


def build_attention_metadata(query_lens: Sequence[int], context_lens: Sequence[int],
                             block_tables: Sequence[Sequence[int]], block_size: int,
                             num_queries_per_kv: int, device: torch.device, *,
                             pad_to: int | None = None,
                             max_blocks_per_seq: int | None = None) -> AttentionMetadata:
    """Lay out one step's batch for ``write_kv`` and ``paged_attention``.

    Sequence ``i``'s new tokens are rows ``sum(query_lens[:i]) ..`` of the flat batch, at
    positions ``context_lens[i] - query_lens[i] + j``; their cache slots come from the
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
            so ``T = pad_to`` rows (padding sequences have context_len 0, slot -1 and an
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
    slots = np.full(num_tokens, -1, dtype=np.int64)
    slots[:real_tokens] = tables[tok_seq, pos // block_size] * block_size + pos % block_size

    # Tiles: decode sequences first (one token each), then prefill tiles, most keys first.
    block_q = prefill_block_q(num_queries_per_kv)
    decode = np.nonzero(ql == 1)[0]
    prefill = np.nonzero(ql > 1)[0]
    n_tiles = -(-ql[prefill] // block_q)
    pre_seq = np.repeat(prefill, n_tiles)
    pre_first = np.repeat(np.cumsum(n_tiles) - n_tiles, n_tiles)
    pre_query = (np.arange(pre_seq.size) - pre_first) * block_q
    pre_keys = cl[pre_seq] - ql[pre_seq] + np.minimum(pre_query + block_q, ql[pre_seq])
    order = np.argsort(-pre_keys, kind="stable")
    tile_seq = np.concatenate([decode, pre_seq[order]])
    tile_query = np.concatenate([np.zeros_like(decode), pre_query[order]])

    # One host buffer: the int64 slots, then every int32 field; one copy to the device.
    int32_parts = (tables.reshape(-1), qs, ql, cl, tile_seq, tile_query)
    sizes = [p.size for p in int32_parts]
    nbytes = 8 * num_tokens + 4 * sum(sizes)
    device = torch.device(device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    host_np = host.numpy()
    host_np[: 8 * num_tokens].view(np.int64)[:] = slots
    host_np[8 * num_tokens:].view(np.int32)[:] = np.concatenate(int32_parts)
    buf = host.to(device, non_blocking=True)
    slot_mapping = buf[: 8 * num_tokens].view(torch.int64)
    ints = buf[8 * num_tokens:].view(torch.int32)
    fields = ints.split(sizes)
    seqs = () if pad_to is not None else tuple(
        SeqAttention(int(qs[i]), int(ql[i]), int(cl[i])) for i in range(num_seqs))
    return AttentionMetadata(
        slot_mapping=slot_mapping,
        block_tables=fields[0].view(batch, width),
        query_start=fields[1],
        query_lens=fields[2],
        context_lens=fields[3],
        tile_seq=fields[4],
        tile_query=fields[5],
        num_decode_tiles=int(decode.size),
        prefill_block_q=block_q,
        block_size=block_size,
        num_queries_per_kv=num_queries_per_kv,
        seqs=seqs)


def check_attention_inputs(q: torch.Tensor, kv_cache: torch.Tensor,
                           meta: AttentionMetadata) -> None:
    """Host-only shape checks shared by both paths (no device sync).

    Raises:
        ValueError: ``q`` not ``[T, H, D]`` with T the metadata's rows, ``kv_cache`` not
            ``[2, num_blocks, meta.block_size, Hkv, D]``, dtypes differ, or
            ``H / Hkv != meta.num_queries_per_kv``.
    """
    if q.dim() != 3 or kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(f"q must be [T, H, D] and kv_cache [2, blocks, block_size, Hkv, D], "
                         f"got {tuple(q.shape)} and {tuple(kv_cache.shape)}")
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = kv_cache.shape[3]
    if kv_cache.shape[4] != head_dim or kv_cache.shape[2] != meta.block_size:
        raise ValueError(f"kv_cache {tuple(kv_cache.shape)} does not match head_dim {head_dim} "
                         f"and block_size {meta.block_size}")
    if num_heads % num_kv_heads or num_heads // num_kv_heads != meta.num_queries_per_kv:
        raise ValueError(f"{num_heads} query heads over {num_kv_heads} KV heads does not match "
                         f"num_queries_per_kv={meta.num_queries_per_kv}")
    if q.shape[0] != meta.slot_mapping.shape[0]:
        raise ValueError(f"q has {q.shape[0]} rows, the metadata {meta.slot_mapping.shape[0]}")
    if q.dtype != kv_cache.dtype:
        raise ValueError(f"q is {q.dtype} but the cache is {kv_cache.dtype}")


def write_kv_reference(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
    """PyTorch reference of ``write_kv``: ``index_copy_`` of the rows whose slot is ≥ 0.

    Args as ``write_kv`` (``k``, ``v`` ``[T, num_kv_heads, head_dim]``, int64
    ``slot_mapping [T]``); selecting the rows syncs on CUDA.
    """
    flat = kv_cache.view(2, -1, *kv_cache.shape[-2:])
    rows = torch.nonzero(slot_mapping >= 0).squeeze(1)
    slots = slot_mapping.index_select(0, rows)
    flat[0].index_copy_(0, slots, k.index_select(0, rows))
    flat[1].index_copy_(0, slots, v.index_select(0, rows))


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store this step's keys and values: ``kv_cache[:, slot // bs, slot % bs] = (k, v)``.

    Rows whose slot is -1 (padding) write nothing (vLLM's ``reshape_and_cache``). CUDA: one
    Triton launch, no host sync (CUDA-graph safe); elsewhere the PyTorch reference.

    Args:
        k, v: ``[T, num_kv_heads, head_dim]`` (any strides), dtype of the cache.
        kv_cache: ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (contiguous on CUDA).
        slot_mapping: int64 ``[T]`` flat slots (``AttentionMetadata.slot_mapping``).

    Raises:
        ValueError: (CUDA) shapes, dtypes or a cache layout that do not match.
    """
    if kv_cache.is_cuda:
        from manylora.ops.triton_attention import write_kv_triton

        write_kv_triton(k, v, kv_cache, slot_mapping)
    else:
        write_kv_reference(k, v, kv_cache, slot_mapping)


def _host_seqs(meta: AttentionMetadata) -> tuple[SeqAttention, ...]:
    if meta.seqs or meta.query_start.numel() == 0:
        return meta.seqs
    return tuple(SeqAttention(*row) for row in zip(meta.query_start.tolist(),
                                                    meta.query_lens.tolist(),
                                                    meta.context_lens.tolist()))


def paged_attention_reference(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                              scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """PyTorch reference of ``paged_attention``: per sequence, gather its keys/values through
    the block table and run ``scaled_dot_product_attention`` with the causal (and window)
    mask of the module's formula. Rows of padding sequences (context_len 0) are zeros.

    Args and result as ``paged_attention``: ``q [T, H, D]``, ``kv_cache [2, num_blocks,
    block_size, Hkv, D]`` → ``[T, H * D]`` in q's dtype. Reads ``meta.seqs`` (or, when it
    is empty, the per-sequence tensors, which syncs on CUDA).

    Raises:
        ValueError: as ``check_attention_inputs``, or a sliding_window < 1.
    """
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be ≥ 1 or None, got {sliding_window}")
    check_attention_inputs(q, kv_cache, meta)
    num_heads, head_dim = q.shape[1], q.shape[2]
    bs = meta.block_size
    flat = kv_cache.view(2, -1, *kv_cache.shape[-2:])
    group = meta.num_queries_per_kv
    out = torch.zeros(q.shape[0], num_heads, head_dim, dtype=q.dtype, device=q.device)
    for i, seq in enumerate(_host_seqs(meta)):
        if seq.context_len == 0:
            continue
        rows = slice(seq.query_start, seq.query_start + seq.query_len)
        k_pos = torch.arange(seq.context_len, device=q.device)
        blocks = meta.block_tables[i].to(torch.int64).index_select(0, k_pos // bs)
        kv_slots = blocks * bs + k_pos % bs
        k = flat[0].index_select(0, kv_slots)                          # [C, Hkv, D]
        v = flat[1].index_select(0, kv_slots)
        if group > 1:
            k = k.repeat_interleave(group, dim=1)                      # [C, H, D]
            v = v.repeat_interleave(group, dim=1)
        q_pos = k_pos[seq.context_len - seq.query_len:]
        mask = k_pos[None, :] <= q_pos[:, None]                         # [Q, C]
        if sliding_window is not None:
            mask &= (q_pos[:, None] - k_pos[None, :]) < sliding_window
        o = F.scaled_dot_product_attention(
            q[rows].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
            attn_mask=mask, scale=scale)                               # [H, Q, D]
        out[rows] = o.transpose(0, 1)
    return out.view(q.shape[0], num_heads * head_dim)


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its cached keys/values.

    ``out[j, h] = softmax_kp(q[j, h] · k[kp, h // G] * scale) @ v[kp, h // G]`` over the
    key positions ``kp ≤ qp`` (and ``qp - kp < sliding_window``) of the query's sequence;
    see the module docstring. CUDA: the Triton kernels of ``manylora.ops.triton_attention``
    (FlashAttention-2 online softmax over paged KV, as vLLM's unified attention), no host
    sync, CUDA-graph safe; elsewhere ``paged_attention_reference``.

    Args:
        q: ``[T, num_heads, head_dim]`` queries after RoPE (float32, bfloat16 or float16;
            any strides).
        kv_cache: ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` holding this step's
            keys/values already (``write_kv`` first), dtype of ``q``.
        meta: the step's attention metadata (``build_attention_metadata``).
        scale: softmax scale, usually ``head_dim ** -0.5``.
        sliding_window: attend to the last ``sliding_window`` positions only (Mistral), or None.

    Returns:
        ``[T, num_heads * head_dim]`` in the dtype of ``q``; zeros on padding rows.

    Raises:
        ValueError: shapes, dtypes or ``num_queries_per_kv`` that do not match the metadata,
            a sliding_window < 1, or (CUDA) a non-contiguous cache.
    """
    if q.is_cuda:
        from manylora.ops.triton_attention import paged_attention_triton

        return paged_attention_triton(q, kv_cache, meta, scale, sliding_window)
    return paged_attention_reference(q, kv_cache, meta, scale, sliding_window)
