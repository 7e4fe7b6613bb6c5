"""The persistent input batch against plain-Python references.

A real ``Scheduler`` (small pool: preemption; small budget: requests left out of steps)
drives an ``InputBatch`` exactly as the model runner does; every step's packed inputs are
checked against a per-request Python reference built from the requests themselves (token
ids, positions, query starts, sequence lengths, sampled rows), the device block table
built only from the deltas against the KV cache manager's tables, and the slot mapping
computed from that table against ``table[p // bs] * bs + p % bs``. On a GPU, decode graph
replays over the persistent buffers equal the eager pass over the same buffers.
"""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch

from manylora import LLM, LoRARequest, SamplingParams
from manylora.config import SchedulerConfig
from manylora.lora.kernels.cost_model import graph_block_m
from manylora.lora.kernels.meta import lora_kernel_meta_arrays
from manylora.lora.kernels.row_tiles import max_row_tiles
from manylora.ops.attention_metadata import cache_loc_from_block_table
from manylora.request import Request, RequestStatus
from manylora.sample.sampler import SamplingTensors
from manylora.scheduler.kv_cache_manager import KVCacheManager
from manylora.scheduler.scheduler import Scheduler
from manylora.scheduler_output import (
    CachedRequestData,
    NewRequestData,
    ScheduledRequest,
    SchedulerOutput,
)
from manylora.worker.input_batch import InputBatch
from manylora.worker.prepare_inputs import prepare_inputs
from manylora.worker.step_inputs import (
    LORA_VARIANT_CODES,
    StepBuffers,
    _offsets,
    segment_sizes,
    split_segments,
)

BLOCK_SIZE = 4
MAX_MODEL_LEN = 64
_ids = itertools.count()


def _request(num_prompt: int, max_tokens: int, lora_id: int = 0, seed: int | None = None,
             temperature: float = 0.0) -> Request:
    rid = f"q{next(_ids)}"
    first = 100 * next(_ids) % 5000
    params = SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens,
                            top_k=3 if temperature else 0)
    lora = LoRARequest(f"a{lora_id}", lora_id, "/unused") if lora_id else None
    return Request(rid, None, list(range(first, first + num_prompt)), params, lora,
                   num_prompt + max_tokens)


def _no_bucket(n):
    return None


class Harness:
    """A scheduler and an input batch stepped together as the engine and runner do; with
    ``async_scheduling`` each step is planned and prepared before the previous step's
    tokens reach the host (they are gathered on the device from its samples)."""

    def __init__(self, *, num_blocks: int, budget: int, max_loras: int = 0,
                 bucket_of=_no_bucket, rows: int = 2, async_scheduling: bool = False,
                 pieces_of=None) -> None:
        self.sched = Scheduler(SchedulerConfig(8, budget, max(max_loras, 1)),
                               KVCacheManager(num_blocks, BLOCK_SIZE))
        self.max_loras = max_loras
        self.batch = InputBatch(rows, MAX_MODEL_LEN, BLOCK_SIZE, max_loras, 5000, 2)
        self.width = self.batch.width
        self.buffers = StepBuffers(1 << 14, rows, self.width, torch.device("cpu"))
        self.bucket_of = bucket_of
        self.pieces_of = pieces_of
        self.lora_slots = {}
        self.tokens = itertools.count(7)
        self.async_scheduling = async_scheduling
        self.in_flight = None             # (plan, SampleInfo, {rid: token}) not yet read
        self.prev_sampled = None          # the last launched step's tokens, "on the device"
        self.gathered = 0                 # token ids taken from those samples, in all

    def has_work(self) -> bool:
        return self.in_flight is not None or self.sched.has_unfinished_requests()

    def step(self, lora_slots=None, drop: bool = False, fail: bool = False):
        """One engine step; ``drop``: the engine drops the plan unrun; ``fail``: the
        runner applies its deltas, then the step fails and the plan is undone (sent
        again)."""
        sched, batch = self.sched, self.batch
        out = sched.schedule()
        batch.remove(out.finished_ids)                 # ModelRunner.release
        launched = inputs = views = None
        if drop:
            sched.revert(out)
        elif out.scheduled:
            ids = batch.update_states(out)
            if fail:
                sched.revert(out)
                return out, None, None
            self.lora_slots = lora_slots or {}
            inputs, info = prepare_inputs(batch, out, ids, self.lora_slots, self.bucket_of,
                                          self.buffers, self.pieces_of)
            views = self.buffers.upload(inputs, self.max_loras, self.prev_sampled)
            self.check(out, inputs, info, views)
            sampled = {rid: next(self.tokens) for rid in info.req_ids}
            self.prev_sampled = torch.tensor([sampled[r] for r in info.req_ids])
            launched = (out, info, sampled)
        done = launched
        if self.async_scheduling:
            done, self.in_flight = self.in_flight, launched
        if done is not None:
            plan, info, sampled = done
            batch.append_sampled(info, [sampled[r] for r in info.req_ids])
            sched.update(plan, sampled)
            ended = [r.request_id for r in sched.running if r.num_tokens >= r.max_total_tokens]
            sched.finish_requests(ended, RequestStatus.FINISHED_LENGTH)
        return out, inputs, views

    def check(self, out: SchedulerOutput, inputs, info, views) -> None:
        """Every packed field against a plain-Python reference of the plan (a token the
        step in flight sampled is read from its samples)."""
        layout = inputs.layout
        host = split_segments(inputs.data, layout, self.max_loras)
        flying = self.in_flight[2] if self.in_flight is not None else {}
        ids, positions, rows, qs, ql, sl, sample_rows, samplers = [], [], [], [], [], [], [], []
        for s in out.scheduled:
            req = s.request
            rid = req.request_id
            row = self.batch.row_of[rid]
            tokens = req.token_ids + ([flying[rid]] if rid in flying else [])
            qs.append(len(ids))
            ql.append(s.num_tokens)
            sl.append(s.start + s.num_tokens)
            for p in range(s.start, s.start + s.num_tokens):
                ids.append(tokens[p])
                positions.append(p)
                rows.append(row)
            if s.start + s.num_tokens == len(tokens):
                sample_rows.append(len(ids) - 1)
                samplers.append(rid)
        t, b = len(ids), len(qs)
        assert views["ids"][:t].tolist() == ids
        assert host["positions"][:t].tolist() == positions
        assert host["token_rows"][:t].tolist() == rows
        assert (host["token_rows"][t:] == -1).all()
        assert host["query_start"][:b].tolist() == qs
        assert host["query_lens"][:b].tolist() == ql
        assert host["seq_lens"][:b].tolist() == sl
        assert (host["seq_lens"][b:] == 0).all()
        assert host["sample_rows"].tolist() == sample_rows
        assert info.req_ids == samplers
        assert layout.num_prev == sum(s.request.request_id in flying for s in out.scheduled)
        self.gathered += layout.num_prev
        # The device table, built only from deltas, holds each request's true table.
        table = self.buffers.block_table
        kv = self.sched.kv
        for s in out.scheduled:
            rid = s.request.request_id
            truth = kv.block_table(rid)
            got = table[self.batch.row_of[rid], :len(truth)].tolist()
            assert got == truth, rid
        # Slot mapping computed from the device table vs the reference formula.
        slots = cache_loc_from_block_table(views["positions"], views["token_rows"], table,
                                              BLOCK_SIZE)
        ref = []
        for s in out.scheduled:
            truth = kv.block_table(s.request.request_id)
            ref += [truth[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                    for p in range(s.start, s.start + s.num_tokens)]
        assert slots[:t].tolist() == ref
        assert (slots[t:] == -1).all()
        assert slots.dtype == torch.int64
        if layout.pieces >= 0:
            self.check_pieces(out, layout, host, t, b)

    def check_pieces(self, out: SchedulerOutput, layout, host, t: int, b: int) -> None:
        """A piecewise step: token segments padded to the bucket (ids and positions 0,
        token rows -1), the LoRA mapping built over the bucket's rows with the tiled
        variant (``graph_block_m`` rows a tile, ``max_row_tiles`` tiles), sequence and
        sampling segments unpadded."""
        tb = layout.pieces
        want = None if self.pieces_of is None else self.pieces_of(t)
        assert tb == want and layout.num_tokens == tb and layout.bucket == -1
        assert layout.num_seqs == b and len(host["seq_lens"]) == b
        assert (host["ids"][t:] == 0).all() and (host["positions"][t:] == 0).all()
        assert len(host["ids"]) == len(host["token_rows"]) == tb
        slots = [self.lora_slots.get(s.request.lora_int_id, -1)
                 for s in out.scheduled for _ in range(s.num_tokens)]
        if not any(x >= 0 for x in slots):
            assert layout.variant == 0 and "lora" not in dict(segment_sizes(layout, 0))
            return
        assert LORA_VARIANT_CODES[layout.variant] == "tiled" and layout.max_seg_len == tb
        ref = lora_kernel_meta_arrays(np.asarray(slots), self.max_loras, tb)
        m = self.max_loras
        lora = host["lora"]
        assert lora[:tb].tolist() == ref.token_lora_indices.tolist()
        assert lora[tb:2 * tb].tolist() == ref.sorted_rows.tolist()
        assert lora[2 * tb:2 * tb + m].tolist() == ref.active_slots.tolist()
        assert lora[2 * tb + 2 * m:2 * tb + 3 * m].tolist() == ref.seg_len.tolist()
        block_m, nt = layout.lora_block_m, layout.lora_tiles
        assert block_m == graph_block_m(tb, m) and nt == max_row_tiles(tb, m, block_m)
        t0 = 2 * tb + 3 * m
        tile_slot, tile_start, tile_len = (lora[t0 + i * nt:t0 + (i + 1) * nt]
                                           for i in range(3))
        # every slot's rows, in order, in tiles of at most block_m rows; then padding tiles
        rows_of: dict[int, list[int]] = {}
        for i in range(nt):
            if tile_slot[i] < 0:
                assert tile_len[i] == 0
                continue
            assert 1 <= tile_len[i] <= block_m
            rows_of.setdefault(int(tile_slot[i]), []).extend(
                ref.sorted_rows[tile_start[i]:tile_start[i] + tile_len[i]].tolist())
        assert rows_of == {s: [r for r, x in enumerate(slots) if x == s]
                           for s in set(slots) if s >= 0}


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_steps_match_the_reference_through_preemption_and_a_dropped_plan(async_scheduling):
    """A small pool preempts (the request returns to the batch as new); a plan the engine
    drops is sent again by the next one. With async scheduling every decode token comes
    from the previous step's samples, and each request still gets exactly its tokens."""
    h = Harness(num_blocks=14, budget=9, async_scheduling=async_scheduling)
    reqs = [_request(n, m) for n, m in ((9, 6), (5, 9), (11, 4), (3, 12), (7, 7))]
    for r in reqs:
        h.sched.add_request(r)
    for i in range(300):
        if not h.has_work():
            break
        h.step(drop=(i == 3))
    assert not h.has_work()
    assert h.sched.num_preemptions > 0, "the pool is small enough to preempt"
    assert (h.gathered > 0) == async_scheduling
    h.step()                                        # delivers the last finished ids
    assert not h.batch.row_of and not h.batch.requests
    for r in reqs:
        assert r.num_output_tokens == r.max_total_tokens - r.num_prompt_tokens
        assert r.num_output_placeholders == 0


def test_a_plan_sent_again_after_a_failed_step_appends_no_block_twice():
    """The runner applied a plan's new blocks, then the step failed: the scheduler sends
    them again and the table still holds each block once (checked every step)."""
    h = Harness(num_blocks=64, budget=64)
    h.sched.add_request(_request(3, 12))
    h.step()
    sched, failed = h.sched, False
    while sched.has_unfinished_requests():
        req = sched.running[0]                    # does the next plan grow its table?
        grows = sched.kv.blocks_needed(req.num_tokens) > len(sched.kv.block_table(req.request_id))
        h.step(fail=grows and not failed)
        failed |= grows
    assert failed
    h.step()
    assert not h.batch.requests


def test_a_request_left_out_of_a_step_is_parked_and_restored():
    """A running request a plan leaves out gives its row back and keeps its tokens (the
    ones the runner sampled included) and blocks; scheduled again, it gets a row with the
    same contents plus its new blocks."""
    batch = InputBatch(2, MAX_MODEL_LEN, BLOCK_SIZE, 0, 5000, 1)
    buffers = StepBuffers(1 << 12, 2, batch.width, torch.device("cpu"))
    reqs = [_request(n, 20) for n in (5, 3, 4)]
    tables = {reqs[0].request_id: [7, 8], reqs[1].request_id: [2], reqs[2].request_id: [4, 5]}

    def run(scheduled, new=(), cached=((), (), (), ())):
        out = SchedulerOutput(
            [ScheduledRequest(r, st, n, True) for r, st, n in scheduled], [], [], [],
            [NewRequestData(r.request_id, list(r.token_ids), tables[r.request_id], 0, 0,
                            r.sampling_params) for r in new],
            CachedRequestData(*(list(c) for c in cached)))
        ids = batch.update_states(out)
        inputs, info = prepare_inputs(batch, out, ids, {}, _no_bucket, buffers)
        buffers.upload(inputs, 0)
        tokens = [1000 + len(r.token_ids) for r in (s[0] for s in scheduled)]
        batch.append_sampled(info, tokens)
        for (r, _, _), t in zip(scheduled, tokens):
            r.token_ids.append(t)
        return split_segments(inputs.data, inputs.layout, 0)

    a, b, c = reqs
    run([(a, 0, 5), (b, 0, 3), (c, 0, 4)], new=reqs)
    run([(a, 5, 1), (c, 4, 1)],
        cached=([a.request_id, c.request_id], [[], []], [5, 4], [2, 2]))
    assert b.request_id not in batch.row_of
    assert batch.requests[b.request_id].token_ids.tolist() == b.token_ids
    tables[b.request_id].append(11)
    host = run([(b, 3, 1), (a, 6, 1)],
               cached=([b.request_id, a.request_id], [[11], []], [3, 6], [2, 2]))
    assert host["ids"].tolist() == [b.token_ids[3], a.token_ids[6]]
    assert host["positions"].tolist() == [3, 6]
    row = batch.row_of[b.request_id]
    assert buffers.block_table[row, :2].tolist() == [2, 11]
    assert batch.token_ids[row, :batch.num_tokens[row]].tolist() == b.token_ids
    assert batch.requests[b.request_id].token_ids is None


def test_rows_are_reused_and_grow_when_more_requests_join():
    h = Harness(num_blocks=64, budget=64, rows=2)
    first = [_request(4, 2) for _ in range(5)]
    for r in first:
        h.sched.add_request(r)
    h.step()
    assert h.batch.num_rows >= 5 and len(h.batch.row_of) == 5
    assert sorted(h.batch.row_of.values()) == list(range(5))
    while h.sched.has_unfinished_requests():
        h.step()
    h.step()                                        # delivers the finished ids
    assert not h.batch.row_of
    late = _request(6, 3)
    h.sched.add_request(late)
    h.step()
    assert h.batch.row_of[late.request_id] == 0      # the lowest free row again


def test_a_graph_bucket_pads_at_fixed_offsets():
    """Two decode steps of one bucket put every segment a graph reads at the same offsets,
    whatever their block-table writes and sampled rows."""
    h = Harness(num_blocks=64, budget=64, bucket_of=lambda n: 8, rows=8)
    for n in (3, 4, 6):
        h.sched.add_request(_request(n, 10))
    h.step()                                        # prefill: eager layout
    offsets = []
    for _ in range(4):
        _, inputs, _ = h.step()
        layout = inputs.layout
        assert layout.bucket == 8 and layout.num_tokens == 8 and layout.num_seqs == 8
        sizes = segment_sizes(layout, 0)
        cut = [name for name, _ in sizes].index("table_index")
        offsets.append(sizes[:cut])
        host = split_segments(inputs.data, layout, 0)
        assert host["tile_seq"].tolist() == list(range(8))
        assert host["query_start"].tolist() == list(range(8))
        assert host["query_lens"].tolist() == [1] * 8
    assert all(o == offsets[0] for o in offsets)


def test_a_graph_step_that_does_not_fit_the_persistent_buffer_runs_eagerly():
    """A graph reads only the persistent buffer: a decode step too large for it (a burst
    of block-table writes) is packed unpadded, eagerly, into a buffer of its own."""
    h = Harness(num_blocks=64, budget=64, bucket_of=lambda n: 8, rows=8)
    h.buffers = StepBuffers(40, 8, h.width, torch.device("cpu"))
    for n in (3, 4, 6):
        h.sched.add_request(_request(n, 4))
    h.step()
    _, inputs, _ = h.step()                         # 3 decode rows, padded to 8: too big
    assert inputs.layout.bucket == -1 and inputs.layout.num_tokens == 3
    assert inputs.data.size > h.buffers.capacity


def _pieces_of(n):
    return next((size for size in (4, 8, 16) if size >= n), None)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_piece_steps_pad_token_segments_at_offsets_fixed_by_the_bucket(async_scheduling):
    """Steps that are not decode graph steps, up to the largest piece bucket, pad their
    token segments to the bucket (checked against the reference in ``Harness``), through
    chunked prefills, preemption and LoRA rows of several adapters; the segments a piece
    graph reads (ids, positions, token rows, LoRA) sit at the same offsets in every step
    of one bucket; larger steps stay eager and unpadded."""
    h = Harness(num_blocks=14, budget=20, max_loras=3, rows=8, pieces_of=_pieces_of,
                async_scheduling=async_scheduling)
    lora_ids = (0, 5, 9, 7, 0, 5, 9, 0)
    for i, lid in enumerate(lora_ids):
        h.sched.add_request(_request(3 + 2 * i, 6, lora_id=lid))
    offsets, seen = {}, set()
    while h.has_work():
        out, inputs, _ = h.step(lora_slots={5: 2, 9: 0, 7: 1})
        if inputs is None:
            continue
        layout = inputs.layout
        real = sum(s.num_tokens for s in out.scheduled)
        if real > 16:
            assert layout.pieces == -1 and layout.num_tokens == real
            seen.add("eager")
            continue
        seen.add((layout.pieces, layout.variant))
        read = {name: start for name, start, _ in _offsets(layout, 3)[0]
                if name in ("ids", "positions", "token_rows", "lora")}
        assert offsets.setdefault((layout.pieces, layout.variant), read) == read
    assert h.sched.num_preemptions > 0
    assert "eager" in seen
    seen.discard("eager")
    assert len({tb for tb, variant in seen if variant == 3}) >= 2       # LoRA rows
    assert any(variant == 0 for _, variant in seen)                      # base rows only


def test_a_piece_step_that_does_not_fit_the_persistent_buffer_runs_eagerly():
    """Piece graphs read only the persistent buffer: a prefill too large for it once padded
    to its bucket is packed unpadded, eagerly, into a buffer of its own."""
    h = Harness(num_blocks=64, budget=64, rows=8, pieces_of=lambda n: 64 if n > 8 else 8)
    h.buffers = StepBuffers(160, 8, h.width, torch.device("cpu"))
    h.sched.add_request(_request(30, 2))
    _, inputs, _ = h.step()                      # 30 tokens: 3 x 64 padded rows won't fit
    assert inputs.layout.pieces == -1 and inputs.layout.num_tokens == 30
    _, inputs, _ = h.step()                      # one decode row, padded to 8
    assert inputs.layout.pieces == 8 and inputs.layout.num_tokens == 8


def test_lora_mapping_matches_a_python_reference():
    rng = random.Random(0)
    for _ in range(50):
        max_loras = rng.randint(1, 6)
        slots = [rng.randint(-1, max_loras - 1) for _ in range(rng.randint(0, 40))]
        total = len(slots) + rng.randint(0, 5)
        m = lora_kernel_meta_arrays(np.asarray(slots), max_loras, total)
        active = sorted({s for s in slots if s >= 0})
        rows_of = {s: [i for i, x in enumerate(slots) if x == s] for s in active}
        base = [i for i, x in enumerate(slots) if x < 0]
        assert m.sorted_rows.tolist() == ([r for s in active for r in rows_of[s]] + base
                                          + list(range(len(slots), total)))
        lens = [len(rows_of[s]) for s in active]
        pad = max_loras - len(active)
        assert m.active_slots.tolist() == active + [-1] * pad
        assert m.seg_len.tolist() == lens + [0] * pad
        assert m.seg_start.tolist() == [sum(lens[:i]) for i in range(len(active))] + [0] * pad
        assert m.token_lora_indices.tolist() == slots + [-1] * (total - len(slots))
        assert m.max_seg_len == max(lens, default=0)
        assert m.num_lora_rows == sum(lens)
    with pytest.raises(IndexError, match="slot 3"):
        lora_kernel_meta_arrays(np.asarray([0, 3]), 3)


def test_lora_slots_follow_the_rows_and_a_missing_adapter_is_named():
    h = Harness(num_blocks=64, budget=64, max_loras=3)
    reqs = [_request(3, 2, lora_id=lid) for lid in (5, 0, 9, 5)]
    for r in reqs:
        h.sched.add_request(r)
    _, inputs, _ = h.step(lora_slots={5: 2, 9: 0})
    host = split_segments(inputs.data, inputs.layout, 3)
    t = inputs.layout.num_tokens
    lora = host["lora"]
    want = [2] * 3 + [-1] * 3 + [0] * 3 + [2] * 3
    assert lora[:t].tolist() == want
    assert lora[t:2 * t].tolist() == [6, 7, 8, 0, 1, 2, 9, 10, 11, 3, 4, 5]
    assert lora[2 * t:2 * t + 3].tolist() == [0, 2, -1]         # active slots
    with pytest.raises(KeyError, match="adapter 9"):
        h.step(lora_slots={5: 2})


def test_a_plan_the_batch_cannot_follow_is_refused_by_name_and_changes_nothing():
    batch = InputBatch(2, MAX_MODEL_LEN, BLOCK_SIZE, 0, 100, 1)
    ok, unknown = _request(3, 2), _request(3, 2)
    new = NewRequestData(ok.request_id, ok.token_ids, [1], 0, 0, ok.sampling_params)
    out = SchedulerOutput([ScheduledRequest(ok, 0, 3, True),
                           ScheduledRequest(unknown, 2, 1, True)], [], [], [], [new],
                          CachedRequestData([unknown.request_id], [[]], [2], [1]))
    with pytest.raises(ValueError, match="never sent as new"):
        batch.update_states(out)
    assert not batch.requests and not batch.row_of and batch.block_table.num_pending() == 0
    too_long = _request(MAX_MODEL_LEN + 1, 1)
    out = SchedulerOutput([ScheduledRequest(too_long, 0, 4, False)], [], [], [],
                          [NewRequestData(too_long.request_id, too_long.token_ids, [], 0, 0,
                                          too_long.sampling_params)])
    with pytest.raises(ValueError, match="max_model_len"):
        batch.update_states(out)
    assert not batch.requests


def test_cache_loc_matches_the_formula_on_random_tables():
    gen = torch.Generator().manual_seed(0)
    table = torch.randint(0, 1000, (6, 9), generator=gen, dtype=torch.int32)
    rows = torch.tensor([3, 3, 0, -1, 5, 1, -1], dtype=torch.int32)
    pos = torch.tensor([0, 17, 35, 0, 8, 4, 0], dtype=torch.int32)
    got = cache_loc_from_block_table(pos, rows, table, 4).tolist()
    want = [-1 if r < 0 else int(table[r, p // 4]) * 4 + p % 4
            for r, p in zip(rows.tolist(), pos.tolist())]
    assert got == want


# ---------------------------------------------------------------------------------- GPU


def _adapter_ids(demo_set):
    return {name: i + 1 for i, name in enumerate(demo_set.adapters)}


@pytest.mark.gpu
@pytest.mark.parametrize("max_loras", [2, 4])
def test_graph_replay_over_persistent_buffers_equals_eager(demo_set, max_loras):
    """Every decode step the engine replays as a graph gives, over the same persistent
    buffers, the hidden states of the eager pass (float32), with LoRA and base rows in one
    batch and (two slots, four adapters) adapters evicted and loaded between steps."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    ids = _adapter_ids(demo_set)
    names = list(demo_set.adapters) * 3 + [None] * 4
    loras = [None if n is None else LoRARequest(n, ids[n], str(demo_set.adapters[n]))
             for n in names]
    prompts = [{"prompt_token_ids": list(range(3 + i, 9 + 3 * i))} for i in range(len(names))]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    llm = LLM(str(demo_set.base_dir), device="cuda", dtype="float32", max_loras=max_loras,
              max_lora_rank=32, max_num_seqs=8)
    runner = llm.llm_engine.engine_core.executor.runner
    original = runner.forward_step
    compared = []

    def checked(inputs, prev_sampled=None):
        hidden, views = original(inputs, prev_sampled)
        layout = inputs.layout
        if layout.bucket >= 0:
            replayed = hidden.clone()
            eager = runner._forward(views, layout)       # same buffers, same K/V written
            torch.testing.assert_close(replayed, eager, rtol=1e-5, atol=1e-5)
            compared.append(layout.variant)
        return hidden, views

    runner.forward_step = checked
    llm.generate(prompts, params, loras, use_tqdm=False)
    assert len(compared) > 5 and any(compared), "decode steps with LoRA rows were replayed"
    if max_loras == 2:
        assert llm.llm_engine.lora_cache_stats().device_misses >= len(demo_set.adapters)


@pytest.mark.gpu
def test_graph_steps_equal_eager_engine_under_preemption(demo_set):
    """The engine's tokens with graphs equal its tokens without, while a small KV pool
    preempts requests (they return to the input batch as new rows)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    ids = _adapter_ids(demo_set)
    names = list(demo_set.adapters) * 2 + [None] * 4
    loras = [None if n is None else LoRARequest(n, ids[n], str(demo_set.adapters[n]))
             for n in names]
    prompts = [{"prompt_token_ids": list(range(5 + i, 25 + 2 * i))} for i in range(len(names))]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = {}
    for eager in (True, False):
        llm = LLM(str(demo_set.base_dir), device="cuda", dtype="float32", max_loras=4,
                  max_lora_rank=32, max_num_seqs=8, block_size=4, num_kv_blocks=48,
                  enforce_eager=eager)
        outs[eager] = [o.outputs[0].token_ids
                       for o in llm.generate(prompts, params, loras, use_tqdm=False)]
        assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0
        del llm
    assert outs[False] == outs[True]


def test_sampling_columns_match_sampling_tensors_from_params():
    """The sampled rows' columns in the step buffer equal ``SamplingTensors.from_params``
    on the same requests' parameters (greedy rows neutralised, top-k >= V off), and the
    host flags, seeded rows and log-prob rows agree."""
    batch = InputBatch(4, MAX_MODEL_LEN, BLOCK_SIZE, 0, 50, 1)
    buffers = StepBuffers(1 << 12, 4, batch.width, torch.device("cpu"))
    params = [SamplingParams(temperature=0.0, logprobs=2),
              SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=3),
              SamplingParams(temperature=1.3, top_k=80, min_p=0.2, logprobs=0),
              SamplingParams(temperature=0.5, top_p=0.5)]
    reqs = []
    for i, p in enumerate(params):
        reqs.append(Request(f"s{i}", None, [1, 2, 3 + i], p, None, 10))
    new = [NewRequestData(r.request_id, r.token_ids, [i], 0, 0, r.sampling_params)
           for i, r in enumerate(reqs)]
    out = SchedulerOutput([ScheduledRequest(r, 0, 3, True) for r in reqs], [], [], [], new)
    ids = batch.update_states(out)
    inputs, info = prepare_inputs(batch, out, ids, {}, _no_bucket, buffers)
    host = split_segments(inputs.data, inputs.layout, 0)
    ref = SamplingTensors.from_params(params, 50, "cpu")
    assert host["temperature"].tolist() == pytest.approx(ref.temperature.tolist())
    assert host["top_k"].tolist() == ref.top_k.tolist()
    assert host["top_p"].tolist() == pytest.approx(ref.top_p.tolist())
    assert host["min_p"].tolist() == pytest.approx(ref.min_p.tolist())
    assert (info.all_greedy, info.all_random, info.do_top_k, info.do_top_p, info.do_min_p) == (
        ref.all_greedy, ref.all_random, ref.do_top_k, ref.do_top_p, ref.do_min_p)
    assert info.seeded == [1]
    assert info.logprobs == [(0, 2), (2, 0)]
    assert host["sample_rows"].tolist() == [2, 5, 8, 11]
