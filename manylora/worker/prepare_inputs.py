"""A step's inputs packed from the input batch's rows (vLLM v1's ``_prepare_inputs``):
numpy vector ops over the rows of the scheduled requests, into one pinned buffer
(``StepInputs``), and the host facts of the sampled rows (``SampleInfo``).

Per step, with ``B`` requests and ``T`` tokens, the host work is O(B) Python for the ids of
the scheduled requests and numpy for the rest: ``np.repeat`` / ``cumsum`` / ``arange`` for
positions and query starts, one fancy index for the token ids, a stable ``argsort`` and a
``bincount`` for the LoRA mapping.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from manylora.lora.kernels.cost_model import graph_block_m
from manylora.lora.kernels.meta import default_variant, fill_lora_segment, lora_kernel_meta_arrays
from manylora.lora.kernels.row_tiles import max_row_tiles
from manylora.model.layers.rotary import rope_rows
from manylora.ops.attention_metadata import attention_tiles
from manylora.sample.penalties import PenaltyInputs
from manylora.sample.prompt_logprobs import PromptLogprobsPlan
from manylora.scheduler_output import SchedulerOutput
from manylora.worker.input_batch import InputBatch, SampleInfo
from manylora.worker.step_inputs import (
    LORA_VARIANT_CODES,
    StepBuffers,
    StepInputs,
    StepLayout,
    split_segments,
    total_size,
)


def prepare_inputs(batch: InputBatch, out: SchedulerOutput, ids: list[str],
                   lora_slots: Mapping[int, int], bucket_of, buffers: StepBuffers,
                   pieces_of=None) -> tuple[StepInputs, SampleInfo]:
    """Pack the step's inputs (vLLM v1's ``_prepare_inputs``), numpy over ``batch``'s rows.

    Args:
        batch: the input batch.
        out: the plan (after ``InputBatch.update_states``); ids: its request ids in batch
            order.
        lora_slots: ``{lora_int_id: slot}`` of the step's adapters.
        bucket_of: ``num_rows -> graph batch size or None`` (None: no graphs).
        buffers: where the packed step goes (``StepBuffers.host_array``).
        pieces_of: ``num_tokens -> piecewise token bucket or None``; None: no piecewise
            graphs. A step that is not a decode graph step and has a bucket ``Tb`` pads
            its token segments to ``Tb`` (ids 0, positions 0, token rows -1: the slot
            mapping skips them; the LoRA mapping built for ``Tb`` rows with the tiled
            variant, ``max_seg_len = Tb``) and leaves the sequence, tile and sampling
            segments unpadded (attention runs eagerly between the pieces).

    Returns:
        ``(StepInputs, SampleInfo)``.

    Raises:
        ValueError: a plan that computes tokens a row does not hold.
        KeyError: a request's adapter has no slot in ``lora_slots``.
    """
    sched = out.scheduled
    num_seqs = len(sched)
    row_of = batch.row_of
    seq_rows = np.fromiter((row_of[rid] for rid in ids), np.int64, num_seqs)
    starts = np.fromiter((s.start for s in sched), np.int64, num_seqs)
    query_lens = np.fromiter((s.num_tokens for s in sched), np.int64, num_seqs)
    seq_lens = starts + query_lens
    known = batch.num_tokens[seq_rows]
    prev = np.full(num_seqs, -1, np.int64)
    if batch.pending:
        pending = batch.pending
        prev = np.fromiter((pending.get(rid, -1) for rid in ids), np.int64, num_seqs)
    held = known + (prev >= 0)          # a token still on the device counts as held
    bad = np.nonzero((seq_lens > held) | (query_lens < 1))[0]
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"request {ids[i]!r}: the plan computes tokens "
                         f"{starts[i]}..{seq_lens[i]} but its row holds {held[i]}")
    num_tokens = int(query_lens.sum())
    cu = np.cumsum(query_lens)
    query_start = cu - query_lens
    token_rows = np.repeat(seq_rows, query_lens)
    positions = np.arange(num_tokens) - np.repeat(query_start - starts, query_lens)
    sampled = np.nonzero(seq_lens == held)[0]
    sample_rows_in_batch = cu[sampled] - 1
    num_sampled = int(sampled.size)
    late = np.nonzero(seq_lens > known)[0]        # their last token is on the device
    bucket = bucket_of(num_seqs) if num_tokens == num_seqs else None
    pending = batch.block_table.num_pending()
    token_slots = _token_slots(batch, seq_rows, query_lens, positions, lora_slots)
    plan, prompt_rows, prompt_targets = prompt_logprob_rows(batch, ids, seq_rows, starts,
                                                            query_lens, query_start)
    num_prompt_lp = 0 if prompt_rows is None else int(prompt_rows.size)
    if bucket is not None:
        probe = StepLayout(bucket, bucket, bucket, bucket, 0, int(token_slots is not None),
                           0, pending, num_sampled, 0, bucket, 0, int(late.size),
                           lora_tiles=bucket, num_prompt_lp=num_prompt_lp,
                           rope_rows=buffers.rope_rows)
        if total_size(probe, batch.max_loras) > buffers.capacity:
            bucket = None     # a graph reads the persistent buffer only: run eagerly
    pad_tokens = num_tokens if bucket is None else bucket
    pad_seqs = num_seqs if bucket is None else bucket
    if bucket is None:
        tile_seq, tile_query, num_decode = attention_tiles(query_lens, seq_lens,
                                                           batch.block_q)
        width = max(1, -(-int(seq_lens.max(initial=0)) // batch.block_size))
    else:
        tile_seq = np.arange(bucket)
        tile_query = np.zeros(bucket, dtype=np.int64)
        num_decode, width = bucket, batch.width
    pieces = None
    if bucket is None and pieces_of is not None:
        pieces = pieces_of(num_tokens)
    if pieces is not None:
        probe = StepLayout(pieces, num_seqs, int(tile_seq.size), num_decode, width,
                           int(token_slots is not None), 0, pending, num_sampled, 0, -1,
                           0, int(late.size), pieces, lora_tiles=pieces,
                           num_prompt_lp=num_prompt_lp, rope_rows=buffers.rope_rows)
        if total_size(probe, batch.max_loras) > buffers.capacity:
            pieces = None     # a graph reads the persistent buffer only: run eagerly
        else:
            pad_tokens = pieces

    lora = None
    padded = pad_tokens if bucket is not None or pieces is not None else None
    max_seg_len = padded or 0
    variant = block_m = num_tiles = 0
    if token_slots is not None:
        lora = lora_kernel_meta_arrays(token_slots, batch.max_loras, pad_tokens)
        if not max_seg_len:
            max_seg_len = lora.max_seg_len
        if pieces is not None:          # piece graphs are captured with tiles only
            name, block_m = "tiled", graph_block_m(pieces, batch.max_loras)
        else:
            name, block_m = default_variant(lora.seg_len, batch.max_loras,
                                            padded_rows=bucket, model=batch.lora_variant)
        variant = LORA_VARIANT_CODES.index(name)
        if block_m:
            num_tiles = (max_row_tiles(padded, batch.max_loras, block_m) if padded
                         else int((-(-lora.seg_len // block_m)).sum()))
    layout = StepLayout(
        num_tokens=pad_tokens, num_seqs=pad_seqs, num_tiles=int(tile_seq.size),
        num_decode_tiles=num_decode, table_width=width, variant=variant,
        max_seg_len=max_seg_len, num_table_updates=pending,
        num_sampled=num_sampled,
        sample_prefix=int(num_sampled == 0 or sample_rows_in_batch[-1] == num_sampled - 1),
        bucket=-1 if bucket is None else bucket,
        table_rows=batch.num_rows, num_prev=int(late.size),
        pieces=-1 if pieces is None else pieces, lora_block_m=block_m,
        lora_tiles=num_tiles, num_prompt_lp=num_prompt_lp, rope_rows=buffers.rope_rows)
    data = buffers.host_array(total_size(layout, batch.max_loras))
    v = split_segments(data, layout, batch.max_loras)
    _put(v["ids"], batch.token_ids[token_rows, positions], 0)
    _put(v["positions"], positions, 0)
    _put(v["token_rows"], token_rows, -1)
    if buffers.long_rows is not None:
        _put(v["rope_rows"], rope_rows(positions, np.repeat(held, query_lens),
                                       buffers.long_rows), 0)
    _put(v["seq_rows"], seq_rows, 0)
    v["query_start"][:num_seqs] = query_start
    v["query_start"][num_seqs:] = np.arange(num_tokens, num_tokens + pad_seqs - num_seqs)
    _put(v["query_lens"], query_lens, 1)
    _put(v["seq_lens"], seq_lens, 0)
    v["tile_seq"][:] = tile_seq
    v["tile_query"][:] = tile_query
    if lora is not None:
        fill_lora_segment(v["lora"], lora, block_m, num_tiles if block_m else None)
    batch.block_table.take_updates(v["table_index"], v["table_value"])
    v["prev_dst"][:] = cu[late] - 1
    v["prev_src"][:] = prev[late]
    v["sample_rows"][:] = sample_rows_in_batch
    rows = seq_rows[sampled]
    greedy = batch.greedy[rows]
    random = ~greedy
    v["temperature"][:] = batch.temperature[rows]
    v["top_k"][:] = batch.top_k[rows]
    v["top_p"][:] = batch.top_p[rows]
    v["min_p"][:] = batch.min_p[rows]
    if num_prompt_lp:
        v["prompt_rows"][:] = prompt_rows
        v["prompt_targets"][:] = prompt_targets
    lp = batch.logprobs[rows]
    req_ids = [ids[i] for i in sampled.tolist()]
    step = batch.begin_step(req_ids)
    info = SampleInfo(
        req_ids=req_ids, rows=rows, uids=batch.row_uid[rows], step=step,
        all_greedy=bool(greedy.all()), all_random=not greedy.any(),
        do_top_k=bool((batch.top_k[rows][random] > 0).any()),
        do_top_p=bool((batch.top_p[rows][random] < 1.0).any()),
        do_min_p=bool((batch.min_p[rows][random] > 0.0).any()),
        seeded=np.nonzero(batch.seeded[rows])[0].tolist(),
        logprobs=[(int(i), int(lp[i])) for i in np.nonzero(lp >= 0)[0]],
        penalties=_penalty_inputs(batch, req_ids, rows, prev[sampled]), prompt=plan,
        masked=_nonzero_or_none(batch.masked[rows]))
    return StepInputs(layout, data), info


def prompt_logprob_rows(batch: InputBatch, ids: list[str], seq_rows: np.ndarray,
                        starts: np.ndarray, query_lens: np.ndarray, query_start: np.ndarray
                        ) -> tuple[PromptLogprobsPlan | None, np.ndarray | None,
                                   np.ndarray | None]:
    """The step's prompt log-probability rows (``sample.prompt_logprobs``): for each
    sequence whose request asks, the token rows of its chunk ``[s, s + n)`` at prompt
    positions ``<= P - 2`` (their logits predict prompt tokens ``s + 1 ..``), and those
    tokens. ``(plan, rows int64 [M], targets int64 [M])``; ``(None, None, None)``, at
    the cost of one numpy ``nonzero``, when no row asks."""
    asks = np.nonzero(batch.prompt_lp[seq_rows] >= 0)[0]
    if not asks.size:
        return None, None, None
    rows = seq_rows[asks]
    lo = starts[asks]
    counts = np.minimum(lo + query_lens[asks], batch.num_prompt[rows] - 1) - lo
    keep = counts > 0
    if not keep.any():
        return None, None, None
    asks, rows, lo, counts = asks[keep], rows[keep], lo[keep], counts[keep]
    total = int(counts.sum())
    offset = np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)
    step_rows = np.repeat(query_start[asks], counts) + offset
    targets = batch.token_ids[np.repeat(rows, counts), np.repeat(lo, counts) + offset + 1]
    plan = PromptLogprobsPlan([ids[i] for i in asks.tolist()], (lo + 1).tolist(),
                              counts.tolist(), batch.prompt_lp[rows].tolist())
    return plan, step_rows, targets.astype(np.int64)


def _penalty_inputs(batch: InputBatch, req_ids: list[str], rows: np.ndarray,
                    prev: np.ndarray) -> PenaltyInputs | None:
    """The ``PenaltyInputs`` of the sampled rows (``rows``, their ids, and ``prev``:
    each one's index in the previous step's samples, -1 when its tokens are all on the
    host) that use a logits processor; None, at the cost of one numpy ``any``, when
    none does."""
    which = np.nonzero(batch.processed[rows])[0]
    if not which.size:
        return None
    r = rows[which]
    n_tok = batch.num_tokens[r]
    width = max(1, int(n_tok.max()))
    tokens = batch.token_ids[r, :width].astype(np.int64)
    tokens[np.arange(width)[None, :] >= n_tok[:, None]] = batch.vocab_size
    presence = np.zeros(which.size, np.float32)
    frequency = np.zeros(which.size, np.float32)
    repetition = np.ones(which.size, np.float32)
    bias_index: list[tuple[int, int]] = []
    bias_value: list[float] = []
    allowed_index: list[tuple[int, int]] = []
    allowed_rows: list[int] = []
    for j, i in enumerate(which.tolist()):
        p = batch.requests[req_ids[i]].sampling_params
        presence[j], frequency[j] = p.presence_penalty, p.frequency_penalty
        repetition[j] = p.repetition_penalty
        if p.logit_bias:
            bias_index.extend((j, t) for t in p.logit_bias)
            bias_value.extend(p.logit_bias.values())
        if p.allowed_token_ids is not None:
            allowed_rows.append(j)
            allowed_index.extend((j, t) for t in p.allowed_token_ids)
    return PenaltyInputs(
        which.astype(np.int64), tokens, batch.num_prompt[r].copy(), n_tok.copy(),
        prev[which].astype(np.int64), presence, frequency, repetition,
        np.asarray(bias_index, np.int64).reshape(-1, 2),
        np.asarray(bias_value, np.float32),
        np.asarray(allowed_index, np.int64).reshape(-1, 2),
        np.asarray(allowed_rows, np.int64))


def _token_slots(batch: InputBatch, seq_rows: np.ndarray, query_lens: np.ndarray,
                 positions: np.ndarray, lora_slots: Mapping[int, int]) -> np.ndarray | None:
    """Each token's adapter slot (-1: base, and the tokens of an activated adapter's
    request before its ``lora_start``), or None when no row uses an adapter."""
    if not batch.max_loras:
        return None
    ids = batch.lora_id[seq_rows]
    if not ids.any():
        return None
    if lora_slots:
        keys = np.fromiter(lora_slots.keys(), np.int64, len(lora_slots))
        vals = np.fromiter(lora_slots.values(), np.int64, len(lora_slots))
        order = np.argsort(keys)
        keys, vals = keys[order], vals[order]
        pos = np.minimum(np.searchsorted(keys, ids), keys.size - 1)
        found = keys[pos] == ids
    else:
        vals = np.zeros(0, np.int64)
        pos = np.zeros_like(ids)
        found = np.zeros(ids.shape, bool)
    missing = np.nonzero((ids != 0) & ~found)[0]
    if missing.size:
        raise KeyError(f"adapter {int(ids[missing[0]])} has no slot this step")
    seq_slots = np.where(found & (ids != 0), vals[pos] if vals.size else -1, -1)
    slots = np.repeat(seq_slots, query_lens)
    starts = batch.lora_start[seq_rows]
    if starts.any():
        slots = np.where(positions >= np.repeat(starts, query_lens), slots, -1)
    return slots


def _put(dst: np.ndarray, src: np.ndarray, pad: int) -> None:
    """``dst[:len(src)] = src``, the rest ``pad``."""
    n = src.shape[0]
    dst[:n] = src
    dst[n:] = pad


def _nonzero_or_none(flags: np.ndarray) -> np.ndarray | None:
    """The indices of ``flags``' True entries, None (one numpy ``any``) when there is none."""
    return np.flatnonzero(flags) if flags.any() else None
