"""DoRA's weight norms ``||W + BA||`` per output row, whole or under tensor parallelism.

DoRA (Liu et al. 2024, "DoRA: Weight-Decomposed Low-Rank Adaptation"; peft's ``use_dora``)
rescales a row's output by ``m / ||W + BA||``; these functions compute the norm once per
adapter and module, when the adapter is loaded, in float32.
"""

from __future__ import annotations

import torch

from manylora.distributed.parallel_state import PARALLEL_MODES, TPGroup


def dora_row_norm(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                  rows_per_chunk: int = 4096) -> torch.Tensor:
    """``||W + b @ a||`` per output row, what DoRA normalizes its magnitude by (peft's
    ``get_weight_norm``; Liu et al. 2024), in float32, a chunk of rows at a time.

    Args:
        weight: the base weight ``W`` ``[out, in]`` (any float dtype, any device).
        a: ``[r, in]``; b: ``[out, r]`` with the LoRA scaling folded in.

    Returns:
        float32 ``[out]`` on ``weight``'s device.
    """
    a32 = a.to(weight.device, torch.float32)
    b32 = b.to(weight.device, torch.float32)
    out = torch.empty(weight.shape[0], dtype=torch.float32, device=weight.device)
    for i in range(0, weight.shape[0], rows_per_chunk):
        w = weight[i: i + rows_per_chunk].float() + b32[i: i + rows_per_chunk] @ a32
        out[i: i + rows_per_chunk] = torch.linalg.vector_norm(w, dim=1)
    return out


def dora_row_norm_tp(weight_shard: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                     tp: TPGroup, parallel: str | None, *,
                     out_range: tuple[int, int] | None = None,
                     in_range: tuple[int, int] | None = None,
                     rows_per_chunk: int = 4096) -> torch.Tensor:
    """``||W + b @ a||`` per output row of the whole weight ``W`` when this rank holds only
    ``weight_shard`` of it (DoRA, Liu et al. 2024, under Megatron-LM's split). Every rank
    gets the same full-length result, so an adapter's DoRA scale stays one whole ``[out]``
    vector that ``LoRASlots.set_slot`` cuts like B's rows.

    * ``parallel="column"``: the rank has whole rows ``out_range`` of ``W``; it computes their
      norms and the ranks' norms are all-gathered into place (rows held by several ranks,
      replicated KV heads, come out the same from each; ranks may hold different numbers of
      rows, uneven attention heads).
    * ``parallel="row"``: the rank has columns ``in_range`` of every row; the partial squared
      sums ``||W_i + b @ a[:, in_range]||^2`` are all-reduced, then square-rooted.
    * None or one rank: ``dora_row_norm(weight_shard, a, b)``.

    A collective at more than one rank: every rank of ``tp`` must call it, for the same
    module, with the same ``a`` and ``b``, in the same order as the others.

    Args:
        weight_shard: this rank's part of ``W`` (``[rows, in]`` or ``[out, cols]``), any float
            dtype and device (the device the collectives run on).
        a: the adapter's whole ``[r, in]``; b: its whole ``[out, r]``, scaling folded in.
        tp: the tensor-parallel group.
        parallel: None, ``"column"`` or ``"row"``.
        out_range: column: this rank's rows of ``W`` (default: an even split).
        in_range: row: this rank's columns of ``W`` (default: an even split).

    Returns:
        float32 ``[out]`` on ``weight_shard``'s device.

    Raises:
        ValueError: an unknown ``parallel``, or ranges that do not match ``weight_shard``.
    """
    if parallel not in PARALLEL_MODES:
        raise ValueError(f"parallel must be one of {PARALLEL_MODES}, got {parallel!r}")
    if parallel is None or tp.size == 1:
        return dora_row_norm(weight_shard, a, b, rows_per_chunk)
    if parallel == "column":
        lo, hi = out_range or tp.even_range(b.shape[0], "DoRA output")
        if hi - lo != weight_shard.shape[0]:
            raise ValueError(f"rows {(lo, hi)} do not match a weight shard of "
                             f"{tuple(weight_shard.shape)}")
        ranges = tp.all_gather(torch.tensor([lo, hi], dtype=torch.int64,
                                            device=weight_shard.device), dim=0)
        ranges = ranges.view(tp.size, 2).tolist()
        most = max(stop - start for start, stop in ranges)   # ranks may hold unequal rows
        local = torch.zeros(most, dtype=torch.float32, device=weight_shard.device)
        local[: hi - lo] = dora_row_norm(weight_shard, a, b[lo:hi], rows_per_chunk)
        norms = tp.all_gather(local, dim=0).view(tp.size, most)
        out = torch.empty(b.shape[0], dtype=torch.float32, device=weight_shard.device)
        for (start, stop), part in zip(ranges, norms):
            out[start:stop] = part[: stop - start]
        return out
    lo, hi = in_range or tp.even_range(a.shape[1], "DoRA input")
    if hi - lo != weight_shard.shape[1]:
        raise ValueError(f"columns {(lo, hi)} do not match a weight shard of "
                         f"{tuple(weight_shard.shape)}")
    a32 = a[:, lo:hi].to(weight_shard.device, torch.float32)
    b32 = b.to(weight_shard.device, torch.float32)
    sq = torch.empty(weight_shard.shape[0], dtype=torch.float32, device=weight_shard.device)
    for i in range(0, weight_shard.shape[0], rows_per_chunk):
        w = weight_shard[i: i + rows_per_chunk].float() + b32[i: i + rows_per_chunk] @ a32
        sq[i: i + rows_per_chunk] = w.square().sum(dim=1)
    return tp.all_reduce(sq).sqrt_()
