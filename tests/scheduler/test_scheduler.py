"""Pure-Python tests of Scheduler + KVCacheManager, driven by hand: ``schedule()`` then
``update(out, {rid: token})`` for every request that sampled, as the engine does.

No model, no tensors: requests are hand-made ``Request`` objects and "sampling" appends a
fixed token id.
"""

from __future__ import annotations

import itertools

import pytest

from manylora.config import SchedulerConfig
from manylora.lora_request import LoRARequest
from manylora.request import Request, RequestStatus
from manylora.sampling_params import SamplingParams
from manylora.scheduler.kv_cache_manager import KVCacheManager
from manylora.scheduler.scheduler import Scheduler
from manylora.scheduler_output import SchedulerOutput

TOKEN = 7  # what every "sampled" token is

_ids = itertools.count()


def make_scheduler(*, num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 16,
                   max_num_batched_tokens: int = 64, max_loras: int = 4) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_loras),
        KVCacheManager(num_blocks, block_size))


def lora(lora_id: int) -> LoRARequest:
    return LoRARequest(f"adapter-{lora_id}", lora_id, f"/dummy/adapter-{lora_id}")


def make_request(num_prompt_tokens: int, lora_id: int = 0, max_tokens: int = 100,
                 rid: str | None = None) -> Request:
    rid = rid if rid is not None else f"r{next(_ids)}"
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    first = 1000 * next(_ids)             # distinct prompts: no prefix-cache hits between tests
    return Request(rid, None, list(range(first, first + num_prompt_tokens)), params,
                   lora(lora_id) if lora_id else None, num_prompt_tokens + max_tokens)


def step(sched: Scheduler) -> SchedulerOutput:
    """One engine step without a model: every request that reaches its last token samples."""
    out = sched.schedule()
    sampled = {s.request.request_id: TOKEN for s in out.scheduled if s.sample}
    sched.update(out, sampled)
    return out


def apply_deltas(tables: dict[str, list[int]], out: SchedulerOutput) -> None:
    """What a model runner does with a plan's block-table deltas (the reference the
    persistent input batch must agree with)."""
    for rid in out.preempted + out.finished_ids:
        tables.pop(rid, None)
    for new in out.scheduled_new_reqs:
        tables[new.req_id] = list(new.block_ids)
    cached = out.scheduled_cached_reqs
    for rid, blocks, total in zip(cached.req_ids, cached.new_block_ids, cached.num_blocks):
        tables[rid].extend(blocks)
        assert len(tables[rid]) == total


def shares(out: SchedulerOutput) -> dict[str, int]:
    return {s.request.request_id: s.num_tokens for s in out.scheduled}


def check_invariants(sched: Scheduler) -> None:
    """Block accounting: every running request holds enough blocks, the rest hold none."""
    kv = sched.kv
    held = 0
    for req in sched.running:
        table = kv.block_table(req.request_id)
        assert len(table) >= kv.blocks_needed(req.num_computed_tokens)
        held += len(table)
    for req in sched.waiting:
        assert kv.block_table(req.request_id) == []
    assert held + kv.num_free_blocks == kv.num_blocks
    all_blocks = [b for r in sched.running for b in kv.block_table(r.request_id)]
    assert len(all_blocks) == len(set(all_blocks)), "a block is shared by two requests"


# ---------------------------------------------------------------------------------------------
# KVCacheManager alone


def test_kv_cache_manager_allocate_grow_free():
    kv = KVCacheManager(num_blocks=5, block_size=4)
    assert kv.blocks_needed(0) == 0 and kv.blocks_needed(1) == 1 and kv.blocks_needed(4) == 1
    assert kv.blocks_needed(5) == 2
    assert kv.allocate("a", 5)
    assert len(kv.block_table("a")) == 2 and kv.num_free_blocks == 3
    assert kv.allocate("a", 8)                       # still fits in 2 blocks
    assert len(kv.block_table("a")) == 2
    assert kv.allocate("b", 12)
    assert kv.num_free_blocks == 0
    assert not kv.allocate("a", 9)                   # would need a third block
    assert len(kv.block_table("a")) == 2             # and nothing was taken
    assert not kv.allocate("c", 1)
    assert kv.block_table("c") == []
    assert sorted(kv.block_table("a") + kv.block_table("b")) == list(range(5))
    kv.free("a")
    kv.free("a")                                     # twice is harmless
    kv.free("unknown")
    assert kv.num_free_blocks == 2 and kv.block_table("a") == []
    kv.free("b")
    assert kv.num_free_blocks == kv.num_blocks


# ---------------------------------------------------------------------------------------------
# Token budget, chunked prefill, decode + prefill in one step


def test_token_budget_chunks_prefill_across_steps():
    sched = make_scheduler(max_num_batched_tokens=8)
    a = make_request(20, rid="a")
    b = make_request(6, rid="b")
    sched.add_request(a)
    sched.add_request(b)

    out = step(sched)                                   # a: 8 of 20, no room for b
    assert shares(out) == {"a": 8}
    assert out.scheduled[0].start == 0 and not out.scheduled[0].sample
    assert a.num_computed_tokens == 8 and a.num_output_tokens == 0
    assert list(sched.waiting) == [b]

    out = step(sched)                                   # a: 8 more
    assert shares(out) == {"a": 8}
    assert out.scheduled[0].start == 8 and not out.scheduled[0].sample

    out = step(sched)                                   # a: last 4 and samples; b: first 4
    assert shares(out) == {"a": 4, "b": 4}
    sa, sb = out.scheduled
    assert sa.start == 16 and sa.sample and a.token_ids[-1] == TOKEN
    assert sb.start == 0 and not sb.sample and b.num_output_tokens == 0

    out = step(sched)                                   # a decodes 1, b finishes its prefill
    assert shares(out) == {"a": 1, "b": 2}
    assert all(s.sample for s in out.scheduled)
    assert a.num_output_tokens == 2 and b.num_output_tokens == 1
    check_invariants(sched)


def test_budget_never_exceeded_and_every_token_computed_once():
    sched = make_scheduler(max_num_batched_tokens=10, num_blocks=256)
    reqs = [make_request(n, max_tokens=5) for n in (13, 1, 7, 25, 3, 9)]
    for r in reqs:
        sched.add_request(r)
    computed: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    runner_tables: dict[str, list[int]] = {}
    for _ in range(100):
        if not sched.has_unfinished_requests():
            break
        out = step(sched)
        apply_deltas(runner_tables, out)
        assert 0 < out.num_batched_tokens <= 10
        for s in out.scheduled:
            computed[s.request.request_id].extend(range(s.start, s.start + s.num_tokens))
            table = runner_tables[s.request.request_id]
            assert table == sched.kv.block_table(s.request.request_id)
            assert len(table) * 4 >= s.start + s.num_tokens
        check_invariants(sched)
        done = [r.request_id for r in sched.running if r.num_output_tokens >= 5]
        sched.finish_requests(done, RequestStatus.FINISHED_LENGTH)
    assert not sched.has_unfinished_requests()
    for r in reqs:
        assert r.num_output_tokens == 5
        # each position is computed exactly once, in order (no preemption here)
        assert computed[r.request_id] == list(range(r.num_prompt_tokens + 4))
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_decode_and_prefill_share_a_step():
    sched = make_scheduler(max_num_batched_tokens=16)
    a = make_request(5, rid="a")
    sched.add_request(a)
    assert shares(step(sched)) == {"a": 5}
    b = make_request(30, rid="b")
    sched.add_request(b)
    out = step(sched)
    assert shares(out) == {"a": 1, "b": 15}             # running first, then the new prefill
    assert [s.request for s in out.scheduled] == [a, b]
    assert out.scheduled[0].sample and not out.scheduled[1].sample
    assert out.num_batched_tokens == 16
    out = step(sched)
    assert shares(out) == {"a": 1, "b": 15}
    assert b.num_computed_tokens == 30 and b.num_output_tokens == 1
    out = step(sched)
    assert shares(out) == {"a": 1, "b": 1}


def test_max_num_seqs():
    sched = make_scheduler(max_num_seqs=2)
    reqs = [make_request(3, rid=f"s{i}") for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    out = step(sched)
    assert shares(out) == {"s0": 3, "s1": 3}
    assert list(sched.waiting) == [reqs[2]] and reqs[2].status == RequestStatus.WAITING
    out = step(sched)
    assert set(shares(out)) == {"s0", "s1"}
    sched.finish_requests(["s0"], RequestStatus.FINISHED_STOPPED)
    out = step(sched)
    assert shares(out) == {"s1": 1, "s2": 3}
    assert len(sched.running) == 2 and reqs[2].status == RequestStatus.RUNNING
    assert out.finished_ids == ["s0"]
    assert step(sched).finished_ids == []               # reported once


# ---------------------------------------------------------------------------------------------
# The max_loras rule


def test_max_loras_rule_lets_later_requests_pass():
    sched = make_scheduler(max_loras=2)
    r1, r2, r3, r1b = (make_request(4, lora_id=i, rid=f"lora{i}-{k}")
                       for k, i in enumerate((1, 2, 3, 1)))
    base = make_request(4, rid="base")
    for r in (r1, r2, r3, r1b, base):
        sched.add_request(r)

    out = step(sched)
    assert [s.request for s in out.scheduled] == [r1, r2, r1b, base]
    assert list(sched.waiting) == [r3] and r3.status == RequestStatus.WAITING
    assert sched.running_adapters() == {1, 2}
    assert sched.kv.block_table(r3.request_id) == []

    for _ in range(3):                                  # r3 keeps waiting while 1 and 2 run
        out = step(sched)
        assert r3 not in [s.request for s in out.scheduled]
        assert len({s.request.lora_int_id for s in out.scheduled} - {0}) <= 2

    sched.finish_requests([r1.request_id], RequestStatus.FINISHED_STOPPED)
    out = step(sched)                                   # adapter 1 still runs (r1b)
    assert r3 not in [s.request for s in out.scheduled]

    sched.finish_requests([r2.request_id], RequestStatus.FINISHED_STOPPED)  # adapter 2 leaves
    out = step(sched)
    assert r3 in [s.request for s in out.scheduled]
    assert shares(out)[r3.request_id] == 4
    assert sched.running_adapters() == {1, 3}
    assert not sched.waiting
    check_invariants(sched)


def test_skipped_lora_requests_keep_their_order():
    sched = make_scheduler(max_loras=1)
    first = make_request(2, lora_id=1, rid="first")
    later = [make_request(2, lora_id=i, rid=f"later{k}") for k, i in enumerate((2, 3, 2))]
    for r in [first, *later]:
        sched.add_request(r)
    out = step(sched)
    assert [s.request for s in out.scheduled] == [first]
    assert list(sched.waiting) == later
    sched.finish_requests(["first"], RequestStatus.FINISHED_STOPPED)
    out = step(sched)
    # adapter 2 takes the only slot: both of its requests run, adapter 3 waits
    assert [s.request for s in out.scheduled] == [later[0], later[2]]
    assert list(sched.waiting) == [later[1]]


# ---------------------------------------------------------------------------------------------
# Preemption by recompute


def test_preemption_picks_the_newest_and_readmits_it():
    # 6 blocks of 4: three 8-token prompts fill the cache exactly.
    sched = make_scheduler(num_blocks=6, block_size=4)
    a, b, c = (make_request(8, rid=rid) for rid in "abc")
    for r in (a, b, c):
        sched.add_request(r)
    out = step(sched)
    assert shares(out) == {"a": 8, "b": 8, "c": 8}
    assert sched.kv.num_free_blocks == 0
    c_tokens = list(c.token_ids)
    assert c.num_output_tokens == 1 and c.num_computed_tokens == 8

    out = step(sched)             # a needs a 3rd block: c (newest) is preempted, not b
    assert out.preempted == ["c"]
    assert shares(out) == {"a": 1, "b": 1}
    assert c.status == RequestStatus.PREEMPTED and c.num_preemptions == 1
    assert c.num_computed_tokens == 0
    assert c.token_ids == c_tokens                     # keeps its prompt and output tokens
    assert sched.waiting[0] is c
    assert sched.kv.block_table("c") == []
    assert sched.running == [a, b]
    assert a.num_preemptions == b.num_preemptions == 0
    check_invariants(sched)

    # a waiting request arrives after c: c stays at the front of the queue
    d = make_request(2, rid="d")
    sched.add_request(d)
    assert list(sched.waiting) == [c, d]
    out = step(sched)             # no room for c (9 tokens = 3 blocks, 0 free): it blocks d too
    assert set(shares(out)) == {"a", "b"} and list(sched.waiting) == [c, d]

    sched.finish_requests(["a"], RequestStatus.FINISHED_LENGTH)
    out = step(sched)             # c is re-prefilled with all of its 9 tokens and samples
    sc = next(s for s in out.scheduled if s.request is c)
    assert sc.start == 0 and sc.num_tokens == len(c_tokens) and sc.sample
    assert c.status == RequestStatus.RUNNING
    assert c.token_ids == c_tokens + [TOKEN]
    assert c.num_computed_tokens == len(c_tokens)
    check_invariants(sched)


def test_preempting_the_request_itself_when_it_is_the_newest():
    sched = make_scheduler(num_blocks=4, block_size=4)
    a, b = make_request(8, rid="a"), make_request(8, rid="b")
    sched.add_request(a)
    sched.add_request(b)
    step(sched)
    for _ in range(10):           # decode until a needs a new block and b is preempted
        out = step(sched)
        if out.preempted:
            break
    assert out.preempted == ["b"]
    assert [s.request for s in out.scheduled] == [a]
    assert b.num_computed_tokens == 0 and sched.waiting[0] is b
    check_invariants(sched)

    # a single request that outgrows the whole cache preempts itself
    sched2 = make_scheduler(num_blocks=2, block_size=4)
    solo = make_request(8, rid="solo")
    sched2.add_request(solo)
    step(sched2)
    out = step(sched2)
    assert out.preempted == ["solo"] and out.scheduled == []
    assert sched2.waiting[0] is solo and sched2.kv.num_free_blocks == 2


# ---------------------------------------------------------------------------------------------
# finish_requests / abort


@pytest.mark.parametrize("status", [RequestStatus.FINISHED_ABORTED,
                                    RequestStatus.FINISHED_STOPPED])
def test_finish_requests_frees_every_block(status):
    sched = make_scheduler(num_blocks=12, block_size=4, max_num_batched_tokens=16)
    reqs = [make_request(n, rid=f"f{i}") for i, n in enumerate((6, 10, 20, 3))]
    for r in reqs:
        sched.add_request(r)
    step(sched)                   # budget 16: f0 (6) and f1 (10)
    step(sched)                   # f0 and f1 decode, f2 gets 14 of 20; f3 waits
    assert sched.running and sched.kv.num_free_blocks < sched.kv.num_blocks
    late = make_request(4, rid="late")
    sched.add_request(late)       # waiting, never scheduled
    running_ids = [r.request_id for r in sched.running]
    waiting_ids = [r.request_id for r in sched.waiting]
    assert running_ids and waiting_ids

    sched.finish_requests(running_ids[:1] + waiting_ids[:1] + ["unknown"], status)
    check_invariants(sched)
    sched.finish_requests([r.request_id for r in [*reqs, late]], status)
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    assert not sched.running and not sched.waiting and not sched.has_unfinished_requests()
    assert all(r.status == status for r in [*reqs, late])
    out = sched.schedule()
    assert out.scheduled == [] and sorted(out.finished_ids) == sorted(
        r.request_id for r in [*reqs, late])
    sched.finish_requests(["f0"], RequestStatus.FINISHED_ABORTED)   # already finished: ignored
    assert reqs[0].status == status


def test_abort_preempted_request():
    sched = make_scheduler(num_blocks=4, block_size=4)
    a, b = make_request(8, rid="a"), make_request(8, rid="b")
    sched.add_request(a)
    sched.add_request(b)
    for _ in range(10):
        if step(sched).preempted:
            break
    assert b.status == RequestStatus.PREEMPTED
    sched.finish_requests(["b", "a"], RequestStatus.FINISHED_ABORTED)
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    assert not sched.has_unfinished_requests()


# ---------------------------------------------------------------------------------------------
# Adapter residency: resident adapters first, aging, staging


class FakeResidency:
    """The adapter cache's answers, set by hand."""

    def __init__(self, resident=(), not_ready=()) -> None:
        self.resident = set(resident)
        self.not_ready = set(not_ready)

    def is_ready(self, lora_int_id: int) -> bool:
        return lora_int_id not in self.not_ready

    def is_resident(self, lora_int_id: int) -> bool:
        return lora_int_id in self.resident


def residency_scheduler(residency: FakeResidency, *, max_loras: int = 1,
                        lora_aging_steps: int = 64) -> Scheduler:
    return Scheduler(SchedulerConfig(16, 64, max_loras, lora_aging_steps),
                     KVCacheManager(64, 4), residency)


def test_free_slot_goes_to_a_resident_adapter_first():
    sched = residency_scheduler(FakeResidency(resident={3}), max_loras=1)
    older, resident = make_request(2, lora_id=2, rid="older"), make_request(2, lora_id=3)
    sched.add_request(older)
    sched.add_request(resident)
    out = step(sched)
    assert [s.request for s in out.scheduled] == [resident]
    assert sched.wanted_adapters(4) == [older.lora_request]


def test_not_ready_adapters_are_passed_over_and_wanted():
    residency = FakeResidency(not_ready={2})
    sched = residency_scheduler(residency, max_loras=2)
    staged_later = make_request(2, lora_id=2, rid="on-disk")
    ready = make_request(2, lora_id=3, rid="ready")
    sched.add_request(staged_later)
    sched.add_request(ready)
    assert sched.wanted_adapters(4) == [staged_later.lora_request, ready.lora_request]
    out = step(sched)
    assert [s.request for s in out.scheduled] == [ready]
    residency.not_ready.clear()                        # staged in host memory
    out = step(sched)
    assert staged_later in [s.request for s in out.scheduled]


def test_aged_request_gets_the_next_slot_before_resident_adapters():
    residency = FakeResidency(resident={1})
    sched = residency_scheduler(residency, max_loras=1, lora_aging_steps=3)
    rare = make_request(2, lora_id=2, rid="rare", max_tokens=100)
    sched.add_request(make_request(2, lora_id=1, max_tokens=2))
    sched.add_request(rare)
    served = []
    for k in range(12):
        # a steady stream of requests for the resident adapter, each short
        sched.add_request(make_request(2, lora_id=1, max_tokens=2, rid=f"hot{k}"))
        out = step(sched)
        served.append({s.request.lora_int_id for s in out.scheduled})
        for s in out.scheduled:
            if s.request.num_output_tokens >= 2:
                sched.finish_requests([s.request.request_id], RequestStatus.FINISHED_LENGTH)
        if rare.status == RequestStatus.RUNNING:
            break
    assert rare.status == RequestStatus.RUNNING, served
    assert all(len(ids) <= 1 for ids in served)        # never two adapters in one slot


def test_busy_adapter_closes_for_an_aged_request():
    # adapter 1 always has running requests; the aged request for adapter 2 still runs
    sched = residency_scheduler(FakeResidency(resident={1}), max_loras=1, lora_aging_steps=2)
    sched.add_request(make_request(2, lora_id=1, max_tokens=3, rid="hot-first"))
    rare = make_request(2, lora_id=2, rid="rare")
    sched.add_request(rare)
    for k in range(20):
        sched.add_request(make_request(2, lora_id=1, max_tokens=3, rid=f"hot{k}"))
        out = step(sched)
        done = [s.request.request_id for s in out.scheduled
                if s.request.num_output_tokens >= 3]
        sched.finish_requests(done, RequestStatus.FINISHED_LENGTH)
        if rare.status == RequestStatus.RUNNING:
            break
    assert rare.status == RequestStatus.RUNNING
    assert sched.running_adapters() == {2}


def test_deltas_rebuild_every_table_through_preemption_and_a_dropped_plan():
    """A runner that only applies the deltas holds every scheduled request's exact table:
    new requests arrive whole, running ones as appended blocks, a preempted one comes back
    whole, and a plan the engine never ran is sent again by the next one."""
    sched = make_scheduler(num_blocks=10, block_size=4, max_num_batched_tokens=16)
    for n in (9, 6, 5):
        sched.add_request(make_request(n, max_tokens=12))
    tables: dict[str, list[int]] = {}
    seen_new: list[str] = []
    preempted: list[str] = []
    dropped = False
    for i in range(60):
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        if i == 1 and out.scheduled and not dropped:
            dropped = True            # the engine drops this plan (as on an adapter failure)
            sched.revert(out)
            continue
        apply_deltas(tables, out)
        seen_new += [n.req_id for n in out.scheduled_new_reqs]
        preempted += out.preempted
        assert ({n.req_id for n in out.scheduled_new_reqs}
                | set(out.scheduled_cached_reqs.req_ids)) == {
                    s.request.request_id for s in out.scheduled}
        for s in out.scheduled:
            assert tables[s.request.request_id] == sched.kv.block_table(s.request.request_id)
        sched.update(out, {s.request.request_id: TOKEN for s in out.scheduled if s.sample})
        done = [r.request_id for r in sched.running if r.num_output_tokens >= 12]
        sched.finish_requests(done, RequestStatus.FINISHED_LENGTH)
    assert not sched.has_unfinished_requests() and dropped
    assert preempted, "the pool is small enough to preempt"
    for rid in preempted:                 # each preempted request came back in full
        assert seen_new.count(rid) >= 2


# ---------------------------------------------------------------------------------------------
# Slot loads paced under churn (more adapters waiting than slots are free)


def paced_scheduler(residency: FakeResidency, *, max_loras: int = 4,
                    lora_aging_steps: int = 64, **config) -> Scheduler:
    return Scheduler(SchedulerConfig(32, 256, max_loras, lora_aging_steps, **config),
                     KVCacheManager(256, 4), residency)


def run_steps(sched: Scheduler, steps: int, finish_after: int | None = None
              ) -> list[set[int]]:
    """``steps`` steps; the adapters of each step's requests (0 excluded). With
    ``finish_after``, a request ends once it has that many output tokens."""
    seen = []
    for _ in range(steps):
        out = step(sched)
        seen.append({s.request.lora_int_id for s in out.scheduled} - {0})
        if finish_after is not None:
            done = [s.request.request_id for s in out.scheduled
                    if s.request.num_output_tokens >= finish_after]
            sched.finish_requests(done, RequestStatus.FINISHED_LENGTH)
    return seen


def test_contended_slots_admit_one_new_adapter_per_step_and_keep_a_staging_slot():
    sched = paced_scheduler(FakeResidency(), max_loras=8)
    reqs = [make_request(2, lora_id=i, rid=f"lora{i}") for i in range(1, 11)]
    for r in reqs:
        sched.add_request(r)
    seen = run_steps(sched, 9)
    # one more adapter per step, in arrival order, up to 8 - 1 slots while 3 others wait
    assert seen == [set(range(1, k + 2)) for k in range(7)] + [set(range(1, 8))] * 2
    assert sched.wanted_adapters(8) == [r.lora_request for r in reqs[7:]]
    check_invariants(sched)


def test_staging_slots_are_at_most_a_quarter_of_the_slots():
    sched = paced_scheduler(FakeResidency(), max_loras=8, lora_staging_slots=5,
                            lora_new_adapters_per_step=None)
    for i in range(1, 11):
        sched.add_request(make_request(2, lora_id=i))
    assert run_steps(sched, 1) == [set(range(1, 7))]              # 8 - 8 // 4
    small = paced_scheduler(FakeResidency(), max_loras=3, lora_new_adapters_per_step=None)
    for i in range(1, 11):
        small.add_request(make_request(2, lora_id=i))
    assert run_steps(small, 1) == [{1, 2, 3}]                    # none below 4 slots


def test_every_waiting_adapter_joins_at_once_when_the_slots_suffice():
    sched = paced_scheduler(FakeResidency(), max_loras=8)
    for i in range(1, 9):
        sched.add_request(make_request(2, lora_id=i))
    assert run_steps(sched, 1) == [set(range(1, 9))]


def test_without_the_adapter_cache_nothing_is_paced():
    sched = Scheduler(SchedulerConfig(32, 256, 4), KVCacheManager(256, 4))
    for i in range(1, 11):
        sched.add_request(make_request(2, lora_id=i))
    assert run_steps(sched, 1) == [{1, 2, 3, 4}]


def test_rules_off_restore_the_max_loras_rule():
    sched = paced_scheduler(FakeResidency(), max_loras=4, lora_new_adapters_per_step=None,
                            lora_staging_slots=0)
    for i in range(1, 11):
        sched.add_request(make_request(2, lora_id=i))
    assert run_steps(sched, 1) == [{1, 2, 3, 4}]


def test_a_drained_adapter_is_replaced_by_one_per_step_all_requests_of_it_together():
    sched = paced_scheduler(FakeResidency(), max_loras=4)        # 1 staging slot
    reqs = [make_request(2, lora_id=i, max_tokens=3) for i in (1, 2, 3, 4, 5, 4, 6, 5, 5)]
    for r in reqs:
        sched.add_request(r)
    first: dict[str, int] = {}
    seen = []
    for k in range(16):
        out = step(sched)
        seen.append({s.request.lora_int_id for s in out.scheduled})
        for s in out.scheduled:
            first.setdefault(s.request.request_id, k)
        done = [s.request.request_id for s in out.scheduled if s.request.num_output_tokens >= 3]
        sched.finish_requests(done, RequestStatus.FINISHED_LENGTH)
    assert not sched.has_unfinished_requests()
    # 3 adapters (4 slots - 1 staging) while more wait than slots are free, one new adapter
    # a step as others drain; once the rest fit (5 and 6 into 2 free slots), both join
    assert seen[:7] == [{1}, {1, 2}, {1, 2, 3}, {2, 3, 4}, {3, 4, 5, 6}, {4, 5, 6}, {5, 6}]
    for lid in (4, 5):      # an adapter's waiting requests all join with it: one load each
        assert len({first[r.request_id] for r in reqs if r.lora_int_id == lid}) == 1


def test_an_aged_request_is_not_bypassed_under_paced_loads():
    # adapter 9 is resident and always has new requests; adapters 2..7 wait; the oldest
    # waiting request (adapter 2) must run once it has aged, before any younger adapter
    residency = FakeResidency(resident={9})
    sched = paced_scheduler(residency, max_loras=4, lora_aging_steps=3)
    rare = make_request(2, lora_id=2, rid="rare", max_tokens=2)
    sched.add_request(rare)
    for i in range(3, 8):
        sched.add_request(make_request(2, lora_id=i, max_tokens=50, rid=f"long{i}"))
    for k in range(12):
        sched.add_request(make_request(2, lora_id=9, max_tokens=2, rid=f"hot{k}"))
        out = step(sched)
        assert len({s.request.lora_int_id for s in out.scheduled} - {0}) <= 3
        done = [s.request.request_id for s in out.scheduled
                if s.request.num_output_tokens >= s.request.sampling_params.max_tokens]
        sched.finish_requests(done, RequestStatus.FINISHED_LENGTH)
        if rare.status != RequestStatus.WAITING:
            break
    assert rare.status != RequestStatus.WAITING, "the aged request never got a slot"
    assert k <= 3 + 2                        # aged after 3 steps, then the next slot


def test_scheduler_config_rejects_bad_pacing():
    with pytest.raises(ValueError, match="lora_new_adapters_per_step"):
        SchedulerConfig(8, 64, 4, lora_new_adapters_per_step=0)
    with pytest.raises(ValueError, match="lora_staging_slots"):
        SchedulerConfig(8, 64, 4, lora_staging_slots=-1)
