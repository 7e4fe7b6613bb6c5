"""Paged attention over a block-table KV cache: the two entry points and their references.

``write_kv`` stores a step's keys and values into a layer's ``KVCache`` (the layout and the
quantization are ``manylora.ops.paged_kv``'s) and ``paged_attention`` attends over it, both
laid out by the step's ``AttentionMetadata`` (``manylora.ops.attention_metadata``).

For a sequence with ``context_len`` tokens of which the last ``query_len`` are new this
step, query ``j`` sits at position ``qp = context_len - query_len + j`` and attends to
every key position ``kp`` with ``kp <= qp`` (and ``qp - kp < window`` under a sliding
window)::

    s[j, h, kp] = q[j, h] · k[kp, h // G] * scale
    s[j, h, kp] = cap * tanh(s[j, h, kp] / cap)          (soft-capping, when cap is given)
    out[j, h] = softmax_kp(s[j, h, kp]) @ v[kp, h // G]

with ``G = num_heads / num_kv_heads`` (GQA; MQA when num_kv_heads is 1, MHA when G is 1),
the soft cap ``cap`` Gemma 2's ``attn_logit_softcapping`` (as transformers' eager
attention: the cap applies before the mask), and, for a quantized cache, ``k``/``v`` the
dequantized rows ``code * scale``. Prefill, chunked prefill over cached blocks and decode
are the same formula. A query with no key to attend
(a padding sequence, ``context_len`` 0) yields zeros.

On CUDA, ``write_kv`` and ``paged_attention`` run the Triton kernels of
``manylora.ops.triton_attention`` (one launch for the decode sequences and one for the
prefill tiles, FlashAttention-2's online softmax over key tiles gathered through the block
table); elsewhere they run the PyTorch references below. The Triton module is imported
only when a CUDA tensor arrives, so CPU installs without Triton run the references.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from manylora.ops.attention_metadata import (
    AttentionMetadata,
    SeqAttention,
    check_attention_inputs,
    check_softcap,
)
from manylora.ops.paged_kv import (
    KVCache,
    check_kv_cache,
    dequantize_kv,
    quantize_kv,
)


def write_kv_reference(k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache,
                       cache_loc: torch.Tensor) -> None:
    """PyTorch reference of ``write_kv``: ``index_copy_`` of the rows whose cache location is ≥ 0,
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
    locs = cache_loc.index_select(0, rows)
    if not kv_cache.quantized:
        flat[0].index_copy_(0, locs, k.index_select(0, rows))
        flat[1].index_copy_(0, locs, v.index_select(0, rows))
        return
    flat_scale = kv_cache.scale.view(2, -1, data.shape[3])
    for i, x in enumerate((k, v)):
        codes, scale = quantize_kv(x.index_select(0, rows), data.dtype)
        # Byte views: index_copy_ has no float8 kernel on every device.
        flat[i].view(torch.uint8).index_copy_(0, locs, codes.view(torch.uint8))
        flat_scale[i].index_copy_(0, locs, scale)


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache,
             cache_loc: torch.Tensor) -> None:
    """Store this step's keys and values: ``data[:, loc // bs, loc % bs] = (k, v)``, or for
    a quantized cache their codes and per-head scales (``quantize_kv``).

    Rows whose cache location is -1 (padding) write nothing (vLLM's ``reshape_and_cache``).
    CUDA: one Triton launch, no host sync (CUDA-graph safe); elsewhere the PyTorch reference.

    Args:
        k, v: ``[T, num_kv_heads, head_dim]`` (any strides): the cache's dtype when
            unquantized, float32 / bfloat16 / float16 when quantized.
        kv_cache: the layer's ``KVCache`` (``data [2, num_blocks, block_size, num_kv_heads,
            head_dim]``, float32 ``scale [2, num_blocks, block_size, num_kv_heads]`` or None;
            contiguous on CUDA).
        cache_loc: int64 ``[T]`` flat cache locations (``AttentionMetadata.cache_loc``).

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
               locs: torch.Tensor) -> torch.Tensor:
    """Rows ``locs`` of ``flat [S, Hkv, D]``: as stored, or dequantized to float32."""
    if flat_scale is None:
        return flat.index_select(0, locs)
    codes = flat.view(torch.uint8).index_select(0, locs).view(flat.dtype)
    return dequantize_kv(codes, flat_scale.index_select(0, locs))


def paged_attention_reference(q: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata,
                              scale: float, sliding_window: int | None = None, *,
                              softcap: float | None = None) -> torch.Tensor:
    """PyTorch reference of ``paged_attention``: per sequence, gather its keys/values through
    the block table and run ``scaled_dot_product_attention`` with the causal (and window)
    mask of the module's formula (with a ``softcap``, the same steps written out: logits,
    ``cap * tanh(logits / cap)``, the mask, a float32 softmax, as transformers' eager
    attention). Rows of padding sequences (context_len 0) are zeros. A
    quantized cache is gathered and dequantized to float32 (``dequantize_kv``) and attended
    in float32 (q upcast), the result cast to q's dtype.

    Args and result as ``paged_attention``: ``q [T, H, D]``, a ``KVCache`` with ``data [2,
    num_blocks, block_size, Hkv, D]`` → ``[T, H * D]`` in q's dtype. Reads ``meta.seqs`` (or,
    when it is empty, the per-sequence tensors, which syncs on CUDA).

    Raises:
        ValueError: as ``check_attention_inputs``, a sliding_window < 1, or a softcap ≤ 0.
    """
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be ≥ 1 or None, got {sliding_window}")
    check_attention_inputs(q, kv_cache, meta)
    check_softcap(softcap)
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
        kv_locs = blocks * bs + k_pos % bs
        k = _gather_kv(flat[0], None if flat_scale is None else flat_scale[0], kv_locs)
        v = _gather_kv(flat[1], None if flat_scale is None else flat_scale[1], kv_locs)
        if group > 1:
            k = k.repeat_interleave(group, dim=1)                      # [C, H, D]
            v = v.repeat_interleave(group, dim=1)
        q_pos = k_pos[seq.context_len - seq.query_len:]
        mask = k_pos[None, :] <= q_pos[:, None]                         # [Q, C]
        if sliding_window is not None:
            mask &= (q_pos[:, None] - k_pos[None, :]) < sliding_window
        q_seq = q[rows] if flat_scale is None else q[rows].float()
        q_seq, k, v = q_seq.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
        if softcap:
            o = _softcapped_attention(q_seq, k, v, mask, scale, softcap)
        else:
            o = F.scaled_dot_product_attention(q_seq, k, v, attn_mask=mask,
                                               scale=scale)            # [H, Q, D]
        out[rows] = o.transpose(0, 1).to(q.dtype)
    return out.view(q.shape[0], num_heads * head_dim)


def _softcapped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          mask: torch.Tensor, scale: float, softcap: float) -> torch.Tensor:
    """``q [H, Q, D]``, ``k``/``v [H, C, D]``, boolean ``mask [Q, C]`` → ``[H, Q, D]``:
    ``softmax(cap * tanh(q kᵀ * scale / cap), masked) @ v``, the softmax in float32."""
    logits = torch.matmul(q, k.transpose(1, 2)) * scale                # [H, Q, C]
    logits = torch.tanh(logits / softcap) * softcap
    logits = logits.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(logits, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(weights, v)


def paged_attention(q: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata,
                    scale: float, sliding_window: int | None = None, *,
                    out: torch.Tensor | None = None,
                    softcap: float | None = None) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its cached keys/values.

    ``out[j, h] = softmax_kp(q[j, h] · k[kp, h // G] * scale) @ v[kp, h // G]`` over the
    key positions ``kp ≤ qp`` (and ``qp - kp < sliding_window``) of the query's sequence,
    each logit ``s`` first soft-capped to ``softcap * tanh(s / softcap)`` when given,
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
        softcap: the attention logits' soft cap (Gemma 2's ``attn_logit_softcapping``), or
            None / 0 for none.

    Returns:
        ``[T, num_heads * head_dim]`` in the dtype of ``q`` (a view of ``out`` when given);
        zeros on the rows of padding sequences.

    Raises:
        ValueError: shapes, dtypes or ``num_queries_per_kv`` that do not match the metadata,
            a malformed cache, a sliding_window < 1, a softcap ≤ 0, or (CUDA) a
            non-contiguous cache.
    """
    if q.is_cuda:
        from manylora.ops.triton_attention import paged_attention_triton

        return paged_attention_triton(q, kv_cache, meta, scale, sliding_window, out=out,
                                      softcap=softcap)
    o = paged_attention_reference(q, kv_cache, meta, scale, sliding_window, softcap=softcap)
    if out is None:
        return o
    if out.shape != q.shape or out.dtype != q.dtype:
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype}, got {tuple(out.shape)} "
                         f"{out.dtype}")
    out.copy_(o.view(q.shape))
    return out.view(q.shape[0], -1)
