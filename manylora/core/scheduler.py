"""Continuous batching with a token budget (TurboMind's persistent batch, vLLM v1's scheduler).

There are no prefill or decode phases: every step, each running request's computed tokens
catch up towards its total within the step's token budget, and waiting requests join while
budget, sequence slots, KV blocks and adapter slots last. So prefill chunks and decode
tokens share a step. A waiting request whose adapter would take the step past
``max_loras`` distinct adapters stays queued (vLLM's rule) while others may pass it. When
blocks run out, the newest running request is preempted by recompute: it keeps its tokens,
gives back its blocks and is re-prefilled later (TurboMind's eviction to token ids).

The scheduler never touches a tensor.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import NamedTuple

from manylora.config import SchedulerConfig
from manylora.core.kv_cache_manager import KVCacheManager
from manylora.engine.request import Request, RequestStatus


class ScheduledRequest(NamedTuple):
    """One request's share of a step.

    Attributes:
        request: the request (the runner reads its tokens and sampling parameters).
        start: position of the first token computed this step (= tokens already cached).
        num_tokens: tokens computed this step, ``request.token_ids[start:start + num_tokens]``.
        block_table: the request's physical blocks.
        sample: whether this step reaches the request's last token, so a token is sampled.
    """

    request: Request
    start: int
    num_tokens: int
    block_table: list[int]
    sample: bool


class SchedulerOutput(NamedTuple):
    """A step's plan.

    Attributes:
        scheduled: the requests computed this step, in batch order.
        preempted: ids of requests preempted while planning it.
        finished_ids: ids of requests that finished since the last step (the runner drops
            their per-request state).
    """

    scheduled: list[ScheduledRequest]
    preempted: list[str]
    finished_ids: list[str]

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


class Scheduler:
    """Plans every step of the engine.

    Args:
        config: batch limits (max_num_seqs, max_num_batched_tokens, max_loras).
        kv: the block allocator.
    """

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_ids: list[str] = []
        self.num_preemptions = 0

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def running_adapters(self) -> set[int]:
        """``lora_int_id`` of every adapter in the running batch (0, the base, excluded)."""
        return {r.lora_int_id for r in self.running if r.lora_int_id}

    def schedule(self) -> SchedulerOutput:
        """Plan one step: running requests first, then waiting ones in arrival order."""
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.kv.allocate(req.request_id, req.num_computed_tokens + n):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    break
            else:
                scheduled.append(self._plan(req, n))
                budget -= n
                i += 1
                continue
            break
        if not preempted:
            budget = self._admit_waiting(scheduled, budget)
        finished, self._finished_ids = self._finished_ids, []
        return SchedulerOutput(scheduled, preempted, finished)

    def _admit_waiting(self, scheduled: list[ScheduledRequest], budget: int) -> int:
        adapters = self.running_adapters()
        skipped: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            lora = req.lora_int_id
            if lora and lora not in adapters and len(adapters) >= self.config.max_loras:
                skipped.append(self.waiting.popleft())
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self.kv.allocate(req.request_id, req.num_computed_tokens + n):
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            if lora:
                adapters.add(lora)
            scheduled.append(self._plan(req, n))
            budget -= n
        self.waiting.extendleft(reversed(skipped))
        return budget

    def _plan(self, req: Request, n: int) -> ScheduledRequest:
        start = req.num_computed_tokens
        return ScheduledRequest(req, start, n, self.kv.block_table(req.request_id),
                                start + n == req.num_tokens)

    def _preempt(self, req: Request) -> None:
        self.kv.free(req.request_id)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        req.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(req)

    def update(self, output: SchedulerOutput, sampled: dict[str, int]) -> None:
        """Record a finished step: computed tokens advance, sampled tokens are appended.

        Args:
            output: the step's plan.
            sampled: ``{request_id: token_id}`` for the requests that sampled.
        """
        for s in output.scheduled:
            s.request.num_computed_tokens += s.num_tokens
            token = sampled.get(s.request.request_id)
            if token is not None:
                s.request.token_ids.append(token)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """End requests (stopped, at length, aborted): their blocks go back to the pool.

        Unknown or already finished ids are ignored.
        """
        for rid in request_ids:
            req = self.requests.pop(rid, None)
            if req is None:
                continue
            req.status = status
            if req in self.running:
                self.running.remove(req)
            elif req in self.waiting:
                self.waiting.remove(req)
            self.kv.free(rid)
            self._finished_ids.append(rid)
