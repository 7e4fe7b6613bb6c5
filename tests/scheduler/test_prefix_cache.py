"""Prefix caching, LRU eviction, sessions and swap planning in the KV cache manager and the
scheduler, driven by hand without a model (the engine-level tests compare outputs).

Invariant checked throughout: every block is exactly one of used, cached or free, and a
block is reused only when no holder has it.
"""

from __future__ import annotations

import itertools

import pytest

from manylora.config import SchedulerConfig
from manylora.lora_request import LoRARequest
from manylora.request import Request, RequestStatus
from manylora.sampling_params import SamplingParams
from manylora.scheduler.block_pool import extend_block_hashes, root_hash
from manylora.scheduler.kv_cache_manager import KVCacheManager
from manylora.scheduler.scheduler import Scheduler
from manylora.scheduler_output import PreemptionCost, SchedulerOutput, SwapOp

BS = 4
TOKEN = 7
_ids = itertools.count()


def make_request(tokens, lora_id: int = 0, digest: str | None = None, max_tokens: int = 8,
                 session_id: str | None = None, rid: str | None = None) -> Request:
    lora = LoRARequest(f"a{lora_id}", lora_id, f"/dummy/{lora_id}") if lora_id else None
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return Request(rid or f"r{next(_ids)}", None, list(tokens), params, lora,
                   len(tokens) + max_tokens, lora_digest=digest, session_id=session_id)


def make_scheduler(num_blocks=32, budget=64, **kv_kwargs) -> Scheduler:
    return Scheduler(SchedulerConfig(8, budget, 4), KVCacheManager(num_blocks, BS, **kv_kwargs))


def step(sched: Scheduler) -> SchedulerOutput:
    out = sched.schedule()
    sched.update(out, {s.request.request_id: TOKEN for s in out.scheduled if s.sample})
    return out


def run_to_end(sched: Scheduler, req: Request) -> list[SchedulerOutput]:
    """Step until ``req`` has all its tokens, then finish it as the engine would."""
    outs = []
    while req.num_tokens < req.max_total_tokens:
        outs.append(step(sched))
    sched.finish_requests([req.request_id], RequestStatus.FINISHED_LENGTH)
    return outs


def check_blocks(kv: KVCacheManager) -> None:
    s = kv.snapshot()
    assert s.used_blocks + s.cached_blocks + s.free_blocks == s.num_blocks
    assert all(r >= 0 for r in kv.pool.ref)


def prompt(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


# block hashes

def test_block_hash_chains_over_tokens_and_adapter_digest():
    toks = prompt(12)
    base = extend_block_hashes([], toks, BS, None)
    assert len(base) == 3 and len(set(base)) == 3
    assert extend_block_hashes([], toks, BS, None) == base              # deterministic
    assert extend_block_hashes([], toks + [1, 2], BS, None) == base     # partial block: none
    lora = extend_block_hashes([], toks, BS, "d1")
    assert not set(lora) & set(base)                                    # adapter ≠ base
    assert not set(extend_block_hashes([], toks, BS, "d2")) & set(lora)  # other weights
    changed = extend_block_hashes([], [0] + toks[1:], BS, None)
    assert all(a != b for a, b in zip(changed, base))                   # chained
    grown = extend_block_hashes(base[:1], toks, BS, None)
    assert grown == base                                                 # extended in place
    assert root_hash(None) != root_hash("d1")


# the manager alone

def _compute(kv: KVCacheManager, req: Request, n: int | None = None) -> None:
    """Allocate and 'compute' ``n`` (default all) of the request's tokens."""
    hit = kv.lookup(req)
    req.num_computed_tokens = hit.num_blocks() * BS
    n = req.num_tokens if n is None else n
    assert kv.allocate_with_prefix(req.request_id, n, hit)
    req.num_computed_tokens = n
    kv.cache_blocks(req)


def test_same_prefix_same_adapter_hits_others_do_not():
    kv = KVCacheManager(16, BS)
    a = make_request(prompt(10), 1, "d1")
    _compute(kv, a)
    kv.free(a.request_id)
    assert kv.snapshot().cached_blocks == 2                     # the two full blocks
    same = make_request(prompt(9) + [5], 1, "d1")
    assert len(kv.lookup(same).device_blocks) == 2
    assert kv.lookup(make_request(prompt(10), 2, "d1")).num_blocks() == 2   # same weights
    for other in (make_request(prompt(10), 0, None), make_request(prompt(10), 1, "d2"),
                  make_request(prompt(10), 3, "d3"), make_request([1] + prompt(9), 1, "d1")):
        assert kv.lookup(other).num_blocks() == 0
    # the last token is always computed: an 8-token prompt hits only its first block
    assert kv.lookup(make_request(prompt(8), 1, "d1")).num_blocks() == 1
    check_blocks(kv)


def test_lru_eviction_never_takes_a_used_block():
    kv = KVCacheManager(6, BS)
    reqs = [make_request(prompt(8, 100 * i), 0, None) for i in range(3)]
    for r in reqs:
        _compute(kv, r)
    kv.free(reqs[0].request_id)
    kv.free(reqs[1].request_id)                                  # released later: younger
    assert kv.snapshot().cached_blocks == 4 and kv.num_free_blocks == 4
    new = make_request(prompt(8, 900), 0, None)
    assert kv.allocate(new.request_id, 8)                        # takes 2: reqs[0]'s
    assert kv.lookup(make_request(prompt(9, 0), 0, None)).num_blocks() == 0
    assert kv.lookup(make_request(prompt(9, 100), 0, None)).num_blocks() == 2
    assert not set(kv.block_table(new.request_id)) & set(kv.block_table(reqs[2].request_id))
    assert not kv.allocate("more", 12)                           # 2 cached left, 3 needed
    assert kv.lookup(make_request(prompt(9, 100), 0, None)).num_blocks() == 2   # untouched
    check_blocks(kv)


def test_tail_blocks_are_evicted_before_the_head():
    kv = KVCacheManager(4, BS)
    a = make_request(prompt(16), 0, None)
    _compute(kv, a)
    kv.free(a.request_id)
    assert kv.allocate("x", 4)                                    # evicts a's last block
    assert kv.lookup(make_request(prompt(17), 0, None)).num_blocks() == 3


def test_shared_blocks_are_counted_once_and_freed_last():
    kv = KVCacheManager(8, BS)
    a = make_request(prompt(9), 0, None)
    _compute(kv, a)
    b = make_request(prompt(9), 0, None)
    _compute(kv, b)
    assert kv.block_table(a.request_id)[:2] == kv.block_table(b.request_id)[:2]
    assert kv.snapshot().used_blocks == 4                         # 2 shared + 2 tails
    kv.free(a.request_id)
    assert kv.snapshot().used_blocks == 3                         # b still holds the prefix
    kv.free(b.request_id)
    s = kv.snapshot()
    assert s.used_blocks == 0 and s.cached_blocks == 2 and s.free_blocks == 6


def test_prefix_caching_off_never_hits():
    kv = KVCacheManager(8, BS, enable_prefix_caching=False)
    a = make_request(prompt(9), 0, None)
    _compute(kv, a)
    kv.free(a.request_id)
    assert kv.lookup(make_request(prompt(9), 0, None)).num_blocks() == 0
    assert kv.snapshot().free_blocks == 8


def test_swap_space_requires_a_cost_model():
    with pytest.raises(ValueError, match="PreemptionCost"):
        KVCacheManager(8, BS, num_host_blocks=4)


def test_preemption_cost_prefers_swap_for_long_contexts():
    cost = PreemptionCost(per_token=1e-6, per_token_pair=1e-9, per_block=1e-4)
    assert not cost.prefer_swap(16, 1)          # recompute 16.3 µs < copy 100 µs
    assert not cost.prefer_swap(4096, 256)      # recompute 20.9 ms < copy 25.6 ms
    assert cost.prefer_swap(8192, 512)          # recompute 75.3 ms > copy 51.2 ms


# the scheduler

def test_second_request_prefills_only_the_uncached_suffix():
    sched = make_scheduler()
    a = make_request(prompt(10), 1, "d1", max_tokens=2)
    sched.add_request(a)
    run_to_end(sched, a)
    b = make_request(prompt(10) + [1, 2, 3], 1, "d1", max_tokens=2)
    sched.add_request(b)
    out = step(sched)
    assert out.scheduled[0].start == 8 and out.scheduled[0].num_tokens == 5
    s = sched.kv.snapshot()
    assert s.prefix_hits == 8 and s.prefix_queries == 10 + 13


def test_preempted_request_recomputes_only_what_was_evicted():
    # 6 blocks: a (12 tokens + 8 out = 5 blocks) and b force a preemption of b
    sched = make_scheduler(num_blocks=6, budget=32)
    a = make_request(prompt(12), max_tokens=8)
    b = make_request(prompt(6, 500), max_tokens=8)
    sched.add_request(a)
    sched.add_request(b)
    preempted = []
    while b.num_output_tokens < 8:
        out = step(sched)
        preempted += out.preempted
        for r in (a, b):
            if r.num_tokens >= r.max_total_tokens and r.request_id in sched.requests:
                sched.finish_requests([r.request_id], RequestStatus.FINISHED_LENGTH)
    assert b.request_id in preempted
    s = sched.kv.snapshot()
    assert s.preemptions == 1
    # b had computed at least its prompt; what it recomputed excludes what the cache kept
    assert 0 <= s.recomputed_tokens < 6 + 8
    assert s.used_blocks == 0
    check_blocks(sched.kv)


def test_swap_out_then_in_in_order():
    cost = PreemptionCost(per_token=1.0, per_token_pair=0.0, per_block=0.0)   # always swap
    kv = KVCacheManager(4, BS, num_host_blocks=8, cost=cost)
    a = make_request(prompt(9), 0, None)
    _compute(kv, a)
    assert kv.swap_out(a) == 2
    kv.free(a.request_id)
    assert kv.allocate("other", 16)                               # evicts a's cached blocks
    kv.free("other")
    again = make_request(prompt(9), 0, None, rid="again")
    hit = kv.lookup(again)
    assert hit.device_blocks == [] and len(hit.host_blocks) == 2
    assert kv.allocate_with_prefix("again", 9, hit)
    ops = kv.take_swaps()
    assert [op.to_host for op in ops] == [True, True, False, False]
    outs = {op.host_block for op in ops[:2]}
    assert {op.host_block for op in ops[2:]} == outs
    assert [op.device_block for op in ops[2:]] == kv.block_table("again")[:2]
    assert kv.take_swaps() == []
    s = kv.snapshot()
    assert s.swapped_out_blocks == 2 and s.swapped_in_blocks == 2
    assert kv.swap_out(a) == 0                                     # a holds nothing now


def test_scheduler_emits_swaps_for_a_preempted_request():
    cost = PreemptionCost(per_token=1.0, per_token_pair=0.0, per_block=0.0)
    sched = make_scheduler(num_blocks=6, budget=32, num_host_blocks=16, cost=cost)
    a = make_request(prompt(12), max_tokens=8)
    b = make_request(prompt(6, 500), max_tokens=8)
    sched.add_request(a)
    sched.add_request(b)
    swaps: list[SwapOp] = []
    while sched.requests:
        out = step(sched)
        swaps += out.swaps
        for r in (a, b):
            if r.num_tokens >= r.max_total_tokens and r.request_id in sched.requests:
                sched.finish_requests([r.request_id], RequestStatus.FINISHED_LENGTH)
    assert any(op.to_host for op in swaps)
    s = sched.kv.snapshot()
    assert s.swapped_out_blocks > 0 and s.preemptions > 0
    assert s.used_blocks == 0
    check_blocks(sched.kv)


def _turn(sched: Scheduler, sid: str, new: list[int], lora_id=0, digest=None, max_tokens=3):
    req = make_request(sched.sessions.history(sid) + new, lora_id, digest, max_tokens, sid)
    sched.add_request(req)
    outs = run_to_end(sched, req)
    prefill = outs[0].scheduled[0]
    return req, prefill


def test_three_turn_session_prefills_only_the_new_turn():
    sched = make_scheduler()
    r1, p1 = _turn(sched, "s", prompt(5))
    assert (p1.start, p1.num_tokens) == (0, 5)
    r2, p2 = _turn(sched, "s", prompt(6, 300))
    # the history's KV is kept; only the last reply token (never fed back) and the new turn
    assert p2.start == r1.num_tokens - 1 and p2.num_tokens == 1 + 6
    r3, p3 = _turn(sched, "s", prompt(2, 400))
    assert p3.start == r2.num_tokens - 1 and p3.num_tokens == 1 + 2
    assert r3.token_ids[:r2.num_tokens] == r2.token_ids
    s = sched.kv.snapshot()
    assert s.used_blocks == sched.kv.blocks_needed(r3.num_tokens - 1)   # the session's KV
    assert sched.end_session("s") and not sched.end_session("s")
    s = sched.kv.snapshot()
    assert s.used_blocks == 0 and s.recomputed_tokens == 0
    check_blocks(sched.kv)


def test_session_turn_in_flight_is_refused_and_end_waits_for_it():
    sched = make_scheduler()
    req = make_request(prompt(5), session_id="s")
    sched.add_request(req)
    with pytest.raises(ValueError, match="in flight"):
        sched.sessions.history("s")
    step(sched)
    assert sched.end_session("s")                                 # ends after the turn
    sched.finish_requests([req.request_id], RequestStatus.FINISHED_STOPPED)
    assert sched.sessions.get("s") is None
    assert sched.kv.snapshot().used_blocks == 0


def test_idle_session_is_evicted_to_token_ids_and_comes_back():
    sched = make_scheduler(num_blocks=6, enable_prefix_caching=False)
    r1, _ = _turn(sched, "s", prompt(9), max_tokens=3)           # holds 3 blocks (11 KV)
    assert sched.kv.snapshot().used_blocks == 3
    other = make_request(prompt(16, 700), max_tokens=4)           # needs 5 blocks
    sched.add_request(other)
    run_to_end(sched, other)
    s = sched.kv.snapshot()
    assert s.evicted_sessions == 1
    r2, p2 = _turn(sched, "s", prompt(2, 400))
    assert p2.start == 0                                          # no prefix cache: recompute
    assert r2.token_ids[:r1.num_tokens] == r1.token_ids
    assert sched.kv.snapshot().recomputed_tokens == r1.num_tokens - 1
    sched.end_session("s")
    assert sched.kv.snapshot().used_blocks == 0


def test_evicted_session_finds_its_full_blocks_in_the_prefix_cache():
    sched = make_scheduler(num_blocks=8)
    r1, _ = _turn(sched, "s", prompt(9), max_tokens=3)           # 11 computed: 2 full blocks
    sched.sessions.evict_lru()
    r2, p2 = _turn(sched, "s", prompt(2, 400))
    assert p2.start == 8                                          # the full blocks hit
    assert sched.kv.snapshot().recomputed_tokens == (r1.num_tokens - 1) - 8


def test_session_changing_adapter_recomputes_its_history():
    sched = make_scheduler()
    _turn(sched, "s", prompt(9), lora_id=1, digest="d1")
    r2, p2 = _turn(sched, "s", prompt(2, 400), lora_id=2, digest="d2")
    assert p2.start == 0
    sched.end_session("s")
    assert sched.kv.snapshot().used_blocks == 0


def test_aborted_session_turn_keeps_the_history():
    sched = make_scheduler()
    r1, _ = _turn(sched, "s", prompt(9))
    req = make_request(sched.sessions.history("s") + [1, 2], session_id="s")
    sched.add_request(req)
    step(sched)
    sched.finish_requests([req.request_id], RequestStatus.FINISHED_ABORTED)
    assert sched.sessions.history("s") == r1.token_ids
    r3, p3 = _turn(sched, "s", prompt(2, 400))
    # the aborted turn computed the whole 12-token history: its 3 full blocks stay cached
    assert p3.start == 12
    sched.end_session("s")
    assert sched.kv.snapshot().used_blocks == 0
    check_blocks(sched.kv)
