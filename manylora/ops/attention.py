"""Paged attention over a block-table KV cache: metadata, the PyTorch reference, dispatch.

KV cache layout, per layer (a ``KVCache``): ``data[2, num_blocks, block_size, num_kv_heads,
head_dim]`` (index 0 keys, 1 values). Token ``p`` of a sequence lives in physical block
``block_table[p // block_size]`` at offset ``p % block_size``, i.e. flat slot
``block_table[p // block_size] * block_size + p % block_size`` (vLLM's PagedAttention,
Kwon et al., SOSP 2023).

The cache holds the model dtype (``kv_cache_dtype`` "auto") or is quantized ("int8",
"fp8_e4m3"): symmetric, dynamic, one float32 scale per (K/V, token slot, KV head) in
``scale[2, num_blocks, block_size, num_kv_heads]``, computed when the token is written and
applied when attention reads it (LMDeploy TurboMind's online per-head, per-token KV
quantization, here without a zero point)::

    scale   = max_d |x[d]| / QMAX        QMAX = 127 (int8), 448 (float8 e4m3)
    code[d] = round(x[d] / scale)        (int8: to nearest even, clamped to ±127;
                                          fp8: the cast to float8_e4m3fn, clamped to ±448)
    x[d]   ≈ code[d] * scale             (a zero row has scale 0 and dequantizes to 0)

For a sequence with ``context_len`` tokens of which the last ``query_len`` are new this
step, query ``j`` sits at position ``qp = context_len - query_len + j`` and attends to
every key position ``kp`` with ``kp <= qp`` (and ``qp - kp < window`` under a sliding
window)::

    out[j, h] = softmax_kp(q[j, h] · k[kp, h // G] * scale) @ v[kp, h // G]

with ``G = num_heads / num_kv_heads`` (GQA; MQA when num_kv_heads is 1, MHA when G is 1)
and, for a quantized cache, ``k``/``v`` the dequantized rows ``code * scale``. Prefill, chunked
prefill over cached blocks and decode are the same formula. A query with no key to attend
(a padding sequence, ``context_len`` 0) yields zeros.

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

from manylora.config import KV_CACHE_DTYPES

#: Rows (query tokens × the G heads of one KV head) a prefill tile of the Triton kernel
#: holds: BLOCK_Q = PREFILL_TILE_ROWS // G query tokens per tile.
PREFILL_TILE_ROWS = 128

#: QMAX of each quantized storage dtype: the largest magnitude a stored code takes.
KV_QUANT_MAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
_KV_STORAGE = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def kv_storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The element dtype of a KV cache: ``model_dtype`` for "auto", ``torch.int8`` for
    "int8", ``torch.float8_e4m3fn`` for "fp8_e4m3" (vLLM's ``kv_cache_dtype`` names).

    Raises:
        ValueError: ``kv_cache_dtype`` is not one of ``KV_CACHE_DTYPES``.
    """
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in _KV_STORAGE:
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not one of {KV_CACHE_DTYPES}")
    return _KV_STORAGE[kv_cache_dtype]


class KVCache(NamedTuple):
    """One layer's paged KV cache: the stored keys/values and, when quantized, their scales.

    Attributes:
        data: ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (index 0 keys, 1
            values) in the model dtype (unquantized) or ``torch.int8`` /
            ``torch.float8_e4m3fn`` (quantized).
        scale: float32 ``[2, num_blocks, block_size, num_kv_heads]``, one scale per (K/V,
            token slot, KV head), or None when unquantized. Slot ``s`` of head ``h`` holds
            ``x ≈ data[:, s // bs, s % bs, h].float() * scale[:, s // bs, s % bs, h, None]``
            with ``scale = max_d |x[d]| / QMAX`` (``KV_QUANT_MAX``; see ``quantize_kv``).

    The layout follows vLLM's PagedAttention; the quantization LMDeploy TurboMind's online
    per-head, per-token int8 KV cache (symmetric here).
    """

    data: torch.Tensor
    scale: torch.Tensor | None = None

    @property
    def quantized(self) -> bool:
        """True when ``data`` holds int8 / float8 codes with per-(token, head) ``scale``."""
        return self.scale is not None

    @property
    def dtype(self) -> torch.dtype:
        """The storage dtype of ``data`` (model dtype, int8 or float8_e4m3fn)."""
        return self.data.dtype

    @property
    def device(self) -> torch.device:
        """The device of ``data`` (and ``scale``)."""
        return self.data.device


def quantize_kv(x: torch.Tensor, storage_dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row, per-head quantization of keys or values (the reference the Triton
    write kernel reproduces; LMDeploy TurboMind's online KV quantization, without its zero
    point)::

        scale[t, h]   = max_d |x[t, h, d]| / QMAX                   (float32)
        code[t, h, d] = round(x[t, h, d] / scale[t, h])             (x / 1 where scale is 0)

    int8 rounds half to even and clamps to ±127; float8_e4m3fn clamps to ±448 and casts
    (round to nearest even). A zero row gets scale 0 and codes 0, so it dequantizes to 0.
    Non-finite inputs give non-finite scales.

    Args:
        x: ``[T, num_kv_heads, head_dim]`` float32, bfloat16 or float16 (any strides).
        storage_dtype: ``torch.int8`` or ``torch.float8_e4m3fn``.

    Returns:
        ``(codes [T, num_kv_heads, head_dim] storage_dtype, scale [T, num_kv_heads] float32)``.

    Raises:
        ValueError: ``x`` not 3-D or not floating point, or another storage dtype.
    """
    if storage_dtype not in KV_QUANT_MAX:
        raise ValueError(f"storage_dtype must be one of {list(KV_QUANT_MAX)}, got {storage_dtype}")
    if x.dim() != 3 or not x.is_floating_point():
        raise ValueError(f"x must be a floating [T, num_kv_heads, head_dim] tensor, got "
                         f"{tuple(x.shape)} {x.dtype}")
    qmax = KV_QUANT_MAX[storage_dtype]
    xf = x.float()
    scale = xf.abs().amax(dim=-1) / qmax                                 # [T, Hkv]
    y = (xf / torch.where(scale == 0, 1.0, scale).unsqueeze(-1)).clamp(-qmax, qmax)
    if storage_dtype == torch.int8:
        y = torch.round(y)
    return y.to(storage_dtype), scale


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``q.float() * scale[..., None]``: float32 keys/values from codes and their scales.

    Args:
        q: ``[..., head_dim]`` int8 or float8_e4m3fn codes (``quantize_kv``'s first result).
        scale: float32 ``[...]`` (one per row of ``q``).

    Returns:
        float32 ``[..., head_dim]``.

    Raises:
        ValueError: ``scale.shape`` is not ``q.shape[:-1]``.
    """
    if scale.shape != q.shape[:-1]:
        raise ValueError(f"scale {tuple(scale.shape)} must be q's shape {tuple(q.shape)} "
                         "without its last dim")
    return q.float() * scale.float().unsqueeze(-1)


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
    table (``slot_mapping_from_block_table``).

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
        cache_loc: int64 ``[T]``, the flat cache slot each new token's K/V is written to;
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


def slot_mapping_from_block_table(positions: torch.Tensor, token_rows: torch.Tensor,
                                  block_table: torch.Tensor, block_size: int) -> torch.Tensor:
    """The KV cache slot of every token row, computed on the tables' device (vLLM v1
    computes it on the GPU too)::

        slot[t] = block_table[row[t], pos[t] // bs] * bs + pos[t] % bs   (row[t] >= 0)
        slot[t] = -1                                                      (row[t] == -1)

    A handful of elementwise kernels and one gather, no host sync: CUDA-graph safe.

    Args:
        positions: int32/int64 ``[T]``, each token's position in its sequence (≥ 0).
        token_rows: int32/int64 ``[T]``, each token's row of ``block_table``; -1: padding.
        block_table: int32 ``[R, W]``, physical block ids per row (contiguous).
        block_size: tokens per block.

    Returns:
        int64 ``[T]`` flat cache slots (``AttentionMetadata.cache_loc``).
    """
    width = block_table.shape[1]
    flat = token_rows.clamp(min=0) * width + torch.div(positions, block_size,
                                                       rounding_mode="floor")
    blocks = block_table.view(-1).index_select(0, flat)
    slots = blocks.to(torch.int64) * block_size + positions.remainder(block_size)
    return torch.where(token_rows >= 0, slots, -1)


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

    block_q = prefill_block_q(num_queries_per_kv)
    tile_seq, tile_query, num_decode_tiles = attention_tiles(ql, cl, block_q)

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


def check_kv_cache(kv_cache: KVCache) -> None:
    """Host-only checks of one layer's cache (no device sync).

    Raises:
        ValueError: ``kv_cache`` not a ``KVCache``; ``data`` not ``[2, blocks, block_size,
            Hkv, D]``; an unquantized cache whose data is not float32/bfloat16/float16; a
            quantized one whose data is not int8/float8_e4m3fn or whose scale is not float32
            ``[2, blocks, block_size, Hkv]`` on the data's device.
    """
    if not isinstance(kv_cache, KVCache):
        raise ValueError(f"the cache must be a KVCache(data, scale), got {type(kv_cache).__name__}")
    data, scale = kv_cache
    if data.dim() != 5 or data.shape[0] != 2:
        raise ValueError(f"kv_cache.data must be [2, blocks, block_size, Hkv, D], got "
                         f"{tuple(data.shape)}")
    if scale is None:
        if data.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"an unquantized cache holds {[str(d) for d in _FLOAT_DTYPES]}, got "
                             f"{data.dtype} (a quantized cache needs its scale)")
        return
    if data.dtype not in KV_QUANT_MAX:
        raise ValueError(f"a quantized cache holds {[str(d) for d in KV_QUANT_MAX]}, got "
                         f"{data.dtype}")
    if (scale.shape != data.shape[:4] or scale.dtype != torch.float32
            or scale.device != data.device):
        raise ValueError(f"kv_cache.scale must be float32 {tuple(data.shape[:4])} on "
                         f"{data.device}, got {scale.dtype} {tuple(scale.shape)} on {scale.device}")


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
        if q.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"q must be float32, bfloat16 or float16, got {q.dtype}")
    elif q.dtype != data.dtype:
        raise ValueError(f"q is {q.dtype} but the cache is {data.dtype}")


def write_kv_reference(k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache,
                       cache_loc: torch.Tensor) -> None:
    """PyTorch reference of ``write_kv``: ``index_copy_`` of the rows whose slot is ≥ 0,
    quantized first by ``quantize_kv`` (codes and scales) when the cache is.

    Args as ``write_kv`` (``k``, ``v`` ``[T, num_kv_heads, head_dim]``, a ``KVCache``, int64
    ``cache_loc [T]``); selecting the rows syncs on CUDA.

    Raises:
        ValueError: as ``check_kv_cache``.
    """
    check_kv_cache(kv_cache)
    data = kv_cache.data
    flat = data.view(2, -1, *data.shape[-2:])
    rows = torch.nonzero(cache_loc >= 0).squeeze(1)
    slots = cache_loc.index_select(0, rows)
    if not kv_cache.quantized:
        flat[0].index_copy_(0, slots, k.index_select(0, rows))
        flat[1].index_copy_(0, slots, v.index_select(0, rows))
        return
    flat_scale = kv_cache.scale.view(2, -1, data.shape[3])
    for i, x in enumerate((k, v)):
        codes, scale = quantize_kv(x.index_select(0, rows), data.dtype)
        # Byte views: index_copy_ has no float8 kernel on every device.
        flat[i].view(torch.uint8).index_copy_(0, slots, codes.view(torch.uint8))
        flat_scale[i].index_copy_(0, slots, scale)


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache,
             cache_loc: torch.Tensor) -> None:
    """Store this step's keys and values: ``data[:, slot // bs, slot % bs] = (k, v)``, or for
    a quantized cache their codes and per-head scales (``quantize_kv``).

    Rows whose slot is -1 (padding) write nothing (vLLM's ``reshape_and_cache``). CUDA: one
    Triton launch, no host sync (CUDA-graph safe); elsewhere the PyTorch reference.

    Args:
        k, v: ``[T, num_kv_heads, head_dim]`` (any strides): the cache's dtype when
            unquantized, float32 / bfloat16 / float16 when quantized.
        kv_cache: the layer's ``KVCache`` (``data [2, num_blocks, block_size, num_kv_heads,
            head_dim]``, float32 ``scale [2, num_blocks, block_size, num_kv_heads]`` or None;
            contiguous on CUDA).
        cache_loc: int64 ``[T]`` flat slots (``AttentionMetadata.cache_loc``).

    Raises:
        ValueError: a malformed cache (``check_kv_cache``); (CUDA) shapes, dtypes or a cache
            layout that do not match.
    """
    if kv_cache.data.is_cuda:
        from manylora.ops.triton_attention import write_kv_triton

        write_kv_triton(k, v, kv_cache, cache_loc)
    else:
        write_kv_reference(k, v, kv_cache, cache_loc)


def _host_seqs(meta: AttentionMetadata) -> tuple[SeqAttention, ...]:
    if meta.seqs or meta.query_start.numel() == 0:
        return meta.seqs
    return tuple(SeqAttention(*row) for row in zip(meta.query_start.tolist(),
                                                   meta.query_lens.tolist(),
                                                   meta.context_lens.tolist()))


def _gather_kv(flat: torch.Tensor, flat_scale: torch.Tensor | None,
               slots: torch.Tensor) -> torch.Tensor:
    """Rows ``slots`` of ``flat [S, Hkv, D]``: as stored, or dequantized to float32."""
    if flat_scale is None:
        return flat.index_select(0, slots)
    codes = flat.view(torch.uint8).index_select(0, slots).view(flat.dtype)
    return dequantize_kv(codes, flat_scale.index_select(0, slots))


def paged_attention_reference(q: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata,
                              scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """PyTorch reference of ``paged_attention``: per sequence, gather its keys/values through
    the block table and run ``scaled_dot_product_attention`` with the causal (and window)
    mask of the module's formula. Rows of padding sequences (context_len 0) are zeros. A
    quantized cache is gathered and dequantized to float32 (``dequantize_kv``) and attended
    in float32 (q upcast), the result cast to q's dtype.

    Args and result as ``paged_attention``: ``q [T, H, D]``, a ``KVCache`` with ``data [2,
    num_blocks, block_size, Hkv, D]`` → ``[T, H * D]`` in q's dtype. Reads ``meta.seqs`` (or,
    when it is empty, the per-sequence tensors, which syncs on CUDA).

    Raises:
        ValueError: as ``check_attention_inputs``, or a sliding_window < 1.
    """
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be ≥ 1 or None, got {sliding_window}")
    check_attention_inputs(q, kv_cache, meta)
    num_heads, head_dim = q.shape[1], q.shape[2]
    bs = meta.block_size
    data = kv_cache.data
    flat = data.view(2, -1, *data.shape[-2:])
    flat_scale = None
    if kv_cache.quantized:
        flat_scale = kv_cache.scale.view(2, -1, data.shape[3])
    group = meta.num_queries_per_kv
    out = torch.zeros(q.shape[0], num_heads, head_dim, dtype=q.dtype, device=q.device)
    for i, seq in enumerate(_host_seqs(meta)):
        if seq.context_len == 0:
            continue
        rows = slice(seq.query_start, seq.query_start + seq.query_len)
        k_pos = torch.arange(seq.context_len, device=q.device)
        blocks = meta.block_tables[i].to(torch.int64).index_select(0, k_pos // bs)
        kv_slots = blocks * bs + k_pos % bs
        k = _gather_kv(flat[0], None if flat_scale is None else flat_scale[0], kv_slots)
        v = _gather_kv(flat[1], None if flat_scale is None else flat_scale[1], kv_slots)
        if group > 1:
            k = k.repeat_interleave(group, dim=1)                      # [C, H, D]
            v = v.repeat_interleave(group, dim=1)
        q_pos = k_pos[seq.context_len - seq.query_len:]
        mask = k_pos[None, :] <= q_pos[:, None]                         # [Q, C]
        if sliding_window is not None:
            mask &= (q_pos[:, None] - k_pos[None, :]) < sliding_window
        q_seq = q[rows] if flat_scale is None else q[rows].float()
        o = F.scaled_dot_product_attention(
            q_seq.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
            attn_mask=mask, scale=scale)                               # [H, Q, D]
        out[rows] = o.transpose(0, 1).to(q.dtype)
    return out.view(q.shape[0], num_heads * head_dim)


def paged_attention(q: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata,
                    scale: float, sliding_window: int | None = None, *,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its cached keys/values.

    ``out[j, h] = softmax_kp(q[j, h] · k[kp, h // G] * scale) @ v[kp, h // G]`` over the
    key positions ``kp ≤ qp`` (and ``qp - kp < sliding_window``) of the query's sequence,
    ``k``/``v`` dequantized (``code * scale``) when the cache is quantized; see the module
    docstring. CUDA: the Triton kernels of ``manylora.ops.triton_attention``
    (FlashAttention-2 online softmax over paged KV, as vLLM's unified attention; quantized
    tiles dequantized in registers), no host sync, CUDA-graph safe; elsewhere
    ``paged_attention_reference``.

    Args:
        q: ``[T, num_heads, head_dim]`` queries after RoPE (float32, bfloat16 or float16;
            any strides).
        kv_cache: the layer's ``KVCache`` holding this step's keys/values already
            (``write_kv`` first): ``data [2, num_blocks, block_size, num_kv_heads,
            head_dim]`` in q's dtype, or int8 / float8_e4m3fn with float32 ``scale [2,
            num_blocks, block_size, num_kv_heads]``.
        meta: the step's attention metadata (``build_attention_metadata``).
        scale: softmax scale, usually ``head_dim ** -0.5``.
        sliding_window: attend to the last ``sliding_window`` positions only (Mistral), or None.
        out: optional ``[T, num_heads, head_dim]`` buffer of q's dtype (contiguous last dim)
            written instead of a new tensor (a piecewise CUDA graph's static input); rows no
            sequence covers (token padding past the last sequence) are unspecified (kept on
            CUDA, zeros on the reference path).

    Returns:
        ``[T, num_heads * head_dim]`` in the dtype of ``q`` (a view of ``out`` when given);
        zeros on the rows of padding sequences.

    Raises:
        ValueError: shapes, dtypes or ``num_queries_per_kv`` that do not match the metadata,
            a malformed cache, a sliding_window < 1, or (CUDA) a non-contiguous cache.
    """
    if q.is_cuda:
        from manylora.ops.triton_attention import paged_attention_triton

        return paged_attention_triton(q, kv_cache, meta, scale, sliding_window, out=out)
    o = paged_attention_reference(q, kv_cache, meta, scale, sliding_window)
    if out is None:
        return o
    if out.shape != q.shape or out.dtype != q.dtype:
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype}, got {tuple(out.shape)} "
                         f"{out.dtype}")
    out.copy_(o.view(q.shape))
    return out.view(q.shape[0], -1)
