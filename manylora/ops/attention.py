"""Paged attention over a block-table KV cache: the PyTorch reference.

KV cache layout, per layer: ``kv_cache[2, num_blocks, block_size, num_kv_heads, head_dim]``
(index 0 keys, 1 values). Token ``p`` of a sequence lives in physical block
``block_table[p // block_size]`` at offset ``p % block_size``, i.e. flat slot
``block * block_size + offset``.

For a sequence with ``context_len`` tokens of which the last ``query_len`` are new this
step, query ``j`` sits at position ``qp = context_len - query_len + j`` and attends to
every key position ``kp`` with ``kp <= qp`` (and ``qp - kp < window`` under a sliding
window)::

    out[j, h] = softmax_kp(q[j, h] · k[kp, h // G] * scale) @ v[kp, h // G]

with ``G = num_heads / num_kv_heads`` (GQA; MQA when num_kv_heads is 1). Prefill, chunked
prefill over cached blocks and decode are the same formula.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F


class SeqAttention(NamedTuple):
    """One sequence of the step.

    Attributes:
        query_start: first row of the sequence's new tokens in the flat batch.
        query_len: new tokens this step.
        context_len: tokens in the cache after this step's are written (≥ query_len).
        kv_slots: int64 ``[context_len]``, flat cache slot of every position ``0..context_len-1``.
    """

    query_start: int
    query_len: int
    context_len: int
    kv_slots: torch.Tensor


class AttentionMetadata(NamedTuple):
    """Built once per step by the model runner and shared by every layer.

    Attributes:
        slot_mapping: int64 ``[T]``, the flat cache slot each new token's K/V is written to.
        seqs: one ``SeqAttention`` per scheduled sequence, in batch order.
    """

    slot_mapping: torch.Tensor
    seqs: tuple[SeqAttention, ...]


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store this step's keys and values: ``kv_cache[:, slot // bs, slot % bs] = (k, v)``.

    Args:
        k, v: ``[T, num_kv_heads, head_dim]``, dtype of the cache.
        kv_cache: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``.
        slot_mapping: int64 ``[T]`` flat slots.
    """
    flat = kv_cache.view(2, -1, *kv_cache.shape[-2:])
    flat[0].index_copy_(0, slot_mapping, k)
    flat[1].index_copy_(0, slot_mapping, v)


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its cached keys/values.

    Args:
        q: ``[T, num_heads, head_dim]`` queries after RoPE.
        kv_cache: ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` holding this step's
            keys/values already (``write_kv`` first).
        meta: the step's attention metadata.
        scale: softmax scale, usually ``head_dim ** -0.5``.
        sliding_window: attend to the last ``sliding_window`` positions only (Mistral), or None.

    Returns:
        ``[T, num_heads * head_dim]`` in the dtype of ``q``.
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    flat = kv_cache.view(2, -1, *kv_cache.shape[-2:])
    group = num_heads // kv_cache.shape[-2]
    out = torch.empty(q.shape[0], num_heads, head_dim, dtype=q.dtype, device=q.device)
    for seq in meta.seqs:
        rows = slice(seq.query_start, seq.query_start + seq.query_len)
        k = flat[0].index_select(0, seq.kv_slots)                      # [C, Hkv, D]
        v = flat[1].index_select(0, seq.kv_slots)
        if group > 1:
            k = k.repeat_interleave(group, dim=1)                      # [C, H, D]
            v = v.repeat_interleave(group, dim=1)
        q_pos = torch.arange(seq.context_len - seq.query_len, seq.context_len, device=q.device)
        k_pos = torch.arange(seq.context_len, device=q.device)
        mask = k_pos[None, :] <= q_pos[:, None]                         # [Q, C]
        if sliding_window is not None:
            mask &= (q_pos[:, None] - k_pos[None, :]) < sliding_window
        o = F.scaled_dot_product_attention(
            q[rows].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
            attn_mask=mask, scale=scale)                               # [H, Q, D]
        out[rows] = o.transpose(0, 1)
    return out.view(q.shape[0], num_heads * head_dim)
