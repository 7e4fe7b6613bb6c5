"""Fair sharing of the running batch between client groups (issue 18, finding 8): one HTTP
request's n=128 children must not hold every sequence slot while another client's request
waits. Pure Python, driven by hand as in test_scheduler.py; waits are counted in steps."""

from __future__ import annotations

import itertools

import pytest

from manylora.config import SchedulerConfig
from manylora.engine.arg_utils import EngineArgs
from manylora.lora_request import LoRARequest
from manylora.request import Request, RequestStatus
from manylora.sampling_params import SamplingParams
from manylora.scheduler.kv_cache_manager import KVCacheManager
from manylora.scheduler.scheduler import Scheduler
from manylora.scheduler.waiting_queue import AdapterQueue
from manylora.scheduler_output import SchedulerOutput

TOKEN = 7
_ids = itertools.count()


def make_scheduler(*, max_num_seqs: int = 32, policy: str = "fair", share: float = 0.5,
                   num_blocks: int = 1024, budget: int = 4096, residency=None) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs, budget, 4, scheduling_policy=policy,
                                     max_group_share=share),
                     KVCacheManager(num_blocks, 4), residency)


def make_request(group: str | None, max_tokens: int, prompt_len: int = 6, lora_id: int = 0,
                 rid: str | None = None) -> Request:
    rid = rid if rid is not None else f"r{next(_ids)}"
    first = 1000 * next(_ids)                 # distinct prompts: no prefix-cache hits
    lora = LoRARequest(f"adapter-{lora_id}", lora_id, f"/dummy/{lora_id}") if lora_id else None
    return Request(rid, None, list(range(first, first + prompt_len)),
                   SamplingParams(temperature=0.0, max_tokens=max_tokens), lora,
                   prompt_len + max_tokens, client_group=group)


def fan_out(group: str, n: int, max_tokens: int) -> list[Request]:
    return [make_request(group, max_tokens, rid=f"{group}-{i}") for i in range(n)]


def step(sched: Scheduler) -> SchedulerOutput:
    """One engine step (synchronous): sample for every request at its last token, then end
    the requests that reached ``max_tokens`` (as the engine's stop check does)."""
    out = sched.schedule()
    sched.update(out, {s.request.request_id: TOKEN for s in out.scheduled if s.sample})
    done = [s.request.request_id for s in out.scheduled
            if s.request.num_output_tokens >= s.request.sampling_params.max_tokens]
    sched.finish_requests(done, RequestStatus.FINISHED_LENGTH)
    return out


def steps_until_scheduled(sched: Scheduler, req: Request, limit: int = 1000) -> int:
    for k in range(1, limit + 1):
        if any(s.request is req for s in step(sched).scheduled):
            return k
    raise AssertionError(f"{req.request_id} not scheduled in {limit} steps")


def run_to_end(sched: Scheduler, limit: int = 10_000) -> list[str]:
    """Steps until every request finished; the ids in finishing order."""
    order = []
    for _ in range(limit):
        if not sched.has_unfinished_requests():
            return order
        out = step(sched)
        order += [s.request.request_id for s in out.scheduled
                  if s.request.request_id not in sched.requests]
        check_blocks(sched)
    raise AssertionError("requests still unfinished")


def check_blocks(sched: Scheduler) -> None:
    kv = sched.kv
    for req in sched.running:
        assert len(kv.block_table(req.request_id)) >= kv.blocks_needed(req.num_computed_tokens)
    for req in sched.waiting:
        assert kv.block_table(req.request_id) == []
    assert len(sched.running) <= sched.config.max_num_seqs


def group_counts(sched: Scheduler) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in sched.running:
        counts[r.client_group] = counts.get(r.client_group, 0) + 1
    return counts


# ---------------------------------------------------------------------------------------------
# the finding: a 128-child group holds the batch, another client's request arrives


CHILD_TOKENS = 100


def big_group_running(policy: str, share: float = 0.5) -> Scheduler:
    sched = make_scheduler(policy=policy, share=share)
    for r in fan_out("big", 128, CHILD_TOKENS):
        sched.add_request(r)
    for _ in range(3):
        step(sched)
    assert group_counts(sched) == {"big": 32}        # alone, it takes the whole batch
    return sched


def test_a_group_alone_takes_the_whole_batch():
    sched = big_group_running("fair")
    assert sched.fairness_preemptions == 0
    assert sched.num_waiting == 96


def test_newcomer_joins_the_next_step_under_fair_sharing():
    sched = big_group_running("fair")
    small = make_request("small", 2)
    sched.add_request(small)
    assert steps_until_scheduled(sched, small) == 1
    assert sched.fairness_preemptions == 1              # one child made room, no more
    assert group_counts(sched) == {"big": 31, "small": 1}
    assert steps_until_scheduled(sched, small) == 1     # its second token
    assert "small" not in group_counts(sched)           # done in 2 steps
    step(sched)
    assert group_counts(sched) == {"big": 32}           # the slot goes back the next step
    assert sched.fairness_preemptions == 1


def test_share_one_keeps_the_order_only_newcomer_waits_one_child_lifetime():
    sched = big_group_running("fair", share=1.0)
    small = make_request("small", 2)
    sched.add_request(small)
    waited = steps_until_scheduled(sched, small)
    # the first 32 children ran 3 steps of their 100 tokens: the first slot frees when
    # they end, and goes to the newcomer ahead of the 96 children still waiting
    assert waited == CHILD_TOKENS - 3 + 1
    assert sched.fairness_preemptions == 0
    assert group_counts(sched) == {"big": 31, "small": 1}


def test_fcfs_newcomer_waits_behind_every_child():
    sched = big_group_running("fcfs")
    small = make_request("small", 2)
    sched.add_request(small)
    waited = steps_until_scheduled(sched, small)
    # 128 children, 32 at a time, 100 tokens each: the newcomer joins with the last wave
    assert waited >= 3 * CHILD_TOKENS
    assert sched.fairness_preemptions == 0


@pytest.mark.parametrize("share, cap", [(0.5, 16), (0.25, 8), (1 / 3, 11)])
def test_two_big_groups_split_the_batch_at_the_share_without_ping_pong(share, cap):
    sched = make_scheduler(share=share)
    for r in fan_out("a", 64, 30):
        sched.add_request(r)
    step(sched)
    for r in fan_out("b", 64, 30):
        sched.add_request(r)
    step(sched)
    counts = group_counts(sched)
    assert counts["b"] == cap and counts["a"] == 32 - cap     # b up to its share at once
    assert sched.fairness_preemptions == cap
    finished = run_to_end(sched)
    assert len(finished) == 128
    assert sched.fairness_preemptions == cap                   # nothing preempted again
    run_to_end(sched)
    assert sched.kv.stats.preemptions == cap


def test_free_slots_go_to_the_least_running_group_fcfs_within_a_group():
    sched = make_scheduler(max_num_seqs=4, share=1.0)
    big = [make_request("big", 3 + i, rid=f"big-{i}") for i in range(8)]  # end one by one
    for r in big:
        sched.add_request(r)
    step(sched)
    late = [make_request("x", 2, rid="x0"), make_request("y", 2, rid="y0"),
            make_request("x", 2, rid="x1")]
    for r in late:
        sched.add_request(r)
    admitted = []
    seen = set()
    for _ in range(40):
        for s in step(sched).scheduled:
            if s.request.request_id not in seen:
                seen.add(s.request.request_id)
                admitted.append(s.request.request_id)
    # first wave: big-0..3; as they end one by one, x0 and y0 (no running request) take
    # the slots before big-4, then x1 (x0 done: x runs nothing, big one); big's children
    # in their own order
    assert admitted[:4] == ["big-0", "big-1", "big-2", "big-3"]
    assert admitted[4:7] == ["x0", "y0", "x1"]
    assert [r for r in admitted if r.startswith("big")] == [f"big-{i}" for i in range(8)]


def test_every_request_gets_every_token_through_fairness_preemptions():
    sched = make_scheduler(max_num_seqs=8, num_blocks=64, budget=16)
    reqs = fan_out("a", 20, 12) + fan_out("b", 3, 4)
    for r in reqs[:20]:
        sched.add_request(r)
    for _ in range(4):
        step(sched)
    for r in reqs[20:]:
        sched.add_request(r)
    finished = run_to_end(sched)
    assert sorted(finished) == sorted(r.request_id for r in reqs)
    assert sched.fairness_preemptions >= 3
    for r in reqs:
        assert r.output_token_ids == [TOKEN] * r.sampling_params.max_tokens
    assert sched.kv.snapshot().used_blocks == 0


def test_preemption_with_a_step_in_flight_keeps_the_token_in_flight():
    """Async scheduling: the next plan is made before the previous step's tokens land."""
    sched = make_scheduler(max_num_seqs=4)
    big = fan_out("big", 4, 6)
    for r in big:
        sched.add_request(r)
    first = sched.schedule()
    small = make_request("small", 2)
    sched.add_request(small)
    second = sched.schedule()             # planned while `first` is in flight
    victim = sched.requests[second.preempted[0]]
    assert victim.client_group == "big" and victim.num_output_placeholders == 1
    assert small in [s.request for s in second.scheduled]
    sched.update(first, {s.request.request_id: TOKEN for s in first.scheduled if s.sample})
    assert victim.output_token_ids == [TOKEN]           # its token in flight is kept
    sched.update(second, {s.request.request_id: TOKEN for s in second.scheduled if s.sample})
    while sched.has_unfinished_requests():
        step(sched)
    for r in [*big, small]:
        assert r.output_token_ids == [TOKEN] * r.sampling_params.max_tokens


class NotReady:
    """Adapter residency: ``pending`` adapters are still being read from disk."""

    def __init__(self, pending: set[int]) -> None:
        self.pending = pending

    def is_ready(self, lora_int_id: int) -> bool:
        return lora_int_id not in self.pending

    def is_resident(self, lora_int_id: int) -> bool:
        return False


def test_no_preemption_for_a_request_whose_adapter_is_still_loading():
    residency = NotReady({3})
    sched = make_scheduler(max_num_seqs=8, residency=residency)
    for r in fan_out("big", 16, 50):
        sched.add_request(r)
    step(sched)
    newcomer = make_request("small", 2, lora_id=3)
    sched.add_request(newcomer)
    for _ in range(5):
        step(sched)
    assert sched.fairness_preemptions == 0 and group_counts(sched) == {"big": 8}
    residency.pending.clear()                       # the read is in
    assert steps_until_scheduled(sched, newcomer) == 1
    assert sched.fairness_preemptions == 1


def test_ungrouped_requests_are_groups_of_their_own():
    sched = make_scheduler(max_num_seqs=2, share=0.5)
    reqs = [make_request(None, 3) for _ in range(5)]
    for r in reqs:
        sched.add_request(r)
    finished = run_to_end(sched)
    assert finished == [r.request_id for r in reqs]     # arrival order, nothing preempted
    assert sched.fairness_preemptions == 0
    grouped = make_request(reqs[0].request_id, 1)       # a group named like a request id
    assert grouped.group_key != reqs[0].group_key


def test_abort_and_finish_keep_group_counts():
    sched = make_scheduler(max_num_seqs=4)
    big = fan_out("big", 6, 20)
    for r in big:
        sched.add_request(r)
    step(sched)
    sched.finish_requests([big[0].request_id, big[5].request_id],
                          RequestStatus.FINISHED_ABORTED)       # one running, one waiting
    assert sched._groups.running == {(True, "big"): 3}
    step(sched)
    assert sched._groups.running == {(True, "big"): 4}
    sched.finish_requests([r.request_id for r in big], RequestStatus.FINISHED_ABORTED)
    assert not sched._groups.running and sched.num_waiting == 0 and not sched._waiting.queues


def test_adapter_queue_lanes_keep_arrival_order_per_group():
    order: dict[str, int] = {}
    queue = AdapterQueue(order)
    reqs = [make_request(g, 1, rid=f"{g}{i}") for i, g in enumerate("aabab")]
    for i, r in enumerate(reqs):
        order[r.request_id] = i
    for r in [reqs[0], reqs[2], reqs[3], reqs[4]]:
        queue.append(r)
    queue.insert(reqs[1])                                   # preempted: back in place
    assert len(queue) == 5 and queue.head() is reqs[0]
    assert [r.request_id for r in queue.lanes[(True, "a")]] == ["a0", "a1", "a3"]
    assert queue.popleft((True, "a")) is reqs[0] and queue.head() is reqs[1]
    assert queue.remove(reqs[2]) and not queue.remove(reqs[2])
    assert reqs[4] in queue and reqs[2] not in queue
    assert [r.request_id for r in queue] == ["a1", "a3", "b4"]


def test_configs_reject_bad_fairness_settings():
    with pytest.raises(ValueError, match="scheduling_policy"):
        SchedulerConfig(8, 64, 1, scheduling_policy="priority")
    for share in (0.0, -0.5, 1.5):
        with pytest.raises(ValueError, match="max_group_share"):
            SchedulerConfig(8, 64, 1, max_group_share=share)
        with pytest.raises(ValueError, match="max_group_share"):
            EngineArgs(model="m", max_group_share=share)
    with pytest.raises(ValueError, match="scheduling_policy"):
        EngineArgs(model="m", scheduling_policy="lifo")
    assert SchedulerConfig(128, 64, 1).max_group_seqs == 64
    assert SchedulerConfig(3, 64, 1).max_group_seqs == 2
    assert SchedulerConfig(1, 64, 1, max_group_share=0.1).max_group_seqs == 1
