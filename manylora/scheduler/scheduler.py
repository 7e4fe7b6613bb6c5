"""Continuous batching with a token budget (TurboMind's persistent batch, vLLM v1's scheduler).

There are no prefill or decode phases: every step, each running request's computed tokens
catch up towards its total within the step's token budget, and waiting requests join while
budget, ``max_num_seqs``, KV blocks and adapter slots last. So prefill chunks and decode
tokens share a step. A waiting request whose adapter would take the step past
``max_loras`` distinct adapters stays queued (vLLM's rule) while others may pass it
(``scheduler/adapter_choice.py``).

A request joining the batch starts from the longest prefix the KV cache already holds
under its adapter (prefix caching), or from the KV its session kept since its last turn;
a request that still owes prompt log-probabilities takes neither and computes its prompt.
When blocks run out, idle sessions give theirs back first (least recently used), then the
newest running request is preempted: it keeps its tokens and gives back its blocks, whose
full ones stay in the prefix cache, or in swap space when copying them is cheaper than
recomputing; when it returns it recomputes only what was lost (TurboMind's eviction to
token ids). Under a ``longrope`` model a sequence that grows past the original length is
computed again from its first token, as transformers' Phi-3 ``generate`` does, so that all
its keys rotate with the long factors (``Request.long_rope``).

The scheduler never touches a tensor.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Iterable
from typing import Protocol

from manylora.config import SchedulerConfig
from manylora.request import Request, RequestStatus
from manylora.scheduler.adapter_choice import AdapterChoice
from manylora.scheduler.fairness import GroupShares
from manylora.scheduler.kv_cache_manager import KVCacheManager, PrefixHit
from manylora.scheduler.runner_deltas import RunnerDeltas
from manylora.scheduler.sessions import SessionTable
from manylora.scheduler.waiting_queue import WaitingQueues
from manylora.scheduler_output import ScheduledRequest, SchedulerOutput


class AdapterResidency(Protocol):
    """What the scheduler may ask the adapter cache (answers only; no tensors)."""

    def is_ready(self, lora_int_id: int) -> bool:
        """Whether a step could use the adapter without reading a disk: it is in a device
        slot or staged in the host cache."""

    def is_resident(self, lora_int_id: int) -> bool:
        """Whether the adapter already sits in a device slot (using it copies nothing)."""


class _EveryAdapterReady:
    def is_ready(self, lora_int_id: int) -> bool:
        return True

    def is_resident(self, lora_int_id: int) -> bool:
        return False


class Scheduler:
    """Plans every step of the engine.

    Waiting requests are kept in one queue per adapter (0 = the base model), ordered by
    arrival within each client group (``scheduler/waiting_queue.py``). Each step, running
    requests go first; then waiting requests join while the token budget, ``max_num_seqs``,
    KV blocks and adapter slots last: in arrival order under ``"fcfs"``, least-running
    client group first under ``"fair"`` (``scheduler/fairness.py``, which also preempts a
    group that filled the batch while alone), drawn from the queues of the adapters the
    step may use (``scheduler/adapter_choice.py``: ``max_loras``, resident adapters first,
    ageing, paced copies into adapter slots).

    Args:
        config: batch limits (max_num_seqs, max_num_batched_tokens, max_loras,
            lora_aging_steps) and the policy between client groups.
        kv: the block allocator.
        adapters: the adapter cache's residency answers; None: every adapter is ready and
            none resident (the scheduler alone, as in tests).
        long_rope_after: a ``longrope`` model's ``original_max_position_embeddings``: a
            request that holds more tokens is ``Request.long_rope``; None: another RoPE.

    Attributes:
        fairness_preemptions: requests preempted to share the batch between client groups
            (also counted in ``kv.stats.preemptions``).
    """

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager,
                 adapters: AdapterResidency | None = None,
                 long_rope_after: int | None = None) -> None:
        self.config = config
        self.long_rope_after = long_rope_after
        self.kv = kv
        self.adapters: AdapterResidency = adapters or _EveryAdapterReady()
        self._waiting = WaitingQueues()
        # the adapter cache copies adapters into slots: pace those copies
        self._adapter_choice = AdapterChoice(config, self._waiting, self.adapters.is_ready,
                                             self.adapters.is_resident,
                                             pace_copies=adapters is not None)
        self._groups = GroupShares(config)
        self._deltas = RunnerDeltas(kv)
        self.running: list[Request] = []
        self.fairness_preemptions = 0
        self.requests: dict[str, Request] = {}
        self._finished_ids: list[str] = []
        self._step = 0
        self._lost: dict[str, int] = {}        # preempted request id → tokens it had computed
        self.sessions = SessionTable(kv)

    @property
    def num_preemptions(self) -> int:
        return self.kv.stats.preemptions

    @property
    def waiting(self) -> list[Request]:
        """Every waiting request, in arrival order."""
        return self._waiting.in_arrival_order()

    def waiting_lora_requests(self) -> list:
        """The ``LoRARequest`` of each adapter with waiting requests (None for the base
        model), one per adapter queue; no sorting."""
        return [q.any().lora_request for q in self._waiting.queues.values() if q]

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def add_request(self, request: Request) -> None:
        """Queue a request (a session's turn starts with ``sessions.history``)."""
        if request.session_id is not None:
            sess = self.sessions.begin(request)
            turn = sess.last_turn
            if turn is not None and (turn.lora_digest != request.lora_digest
                                     or request.adapter_pending       # (no digest yet)
                                     or request.needs_prompt_logprobs):
                self.sessions.release_kv(sess)    # KV of another adapter, or prompt
                #                                   log-probabilities to compute: recompute
        self.requests[request.request_id] = request
        self._waiting.add(request, self._step)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def running_adapters(self) -> set[int]:
        """``lora_int_id`` of every adapter in the running batch (0, the base, excluded)."""
        return {r.lora_int_id for r in self.running if r.lora_int_id}

    def schedule(self) -> SchedulerOutput:
        """Plan one step: running requests first, then waiting ones (see the class doc)."""
        self._step += 1
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted = []
        for victim in self._groups.victims(self.running, self._waiting,
                                           self._allowed_adapters()):
            self.running.remove(victim)
            self._preempt(victim)
            preempted.append(victim.request_id)
            self.fairness_preemptions += 1
        out_of_blocks = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            total = req.num_tokens + req.num_output_placeholders
            if req.num_output_placeholders and total >= req.max_total_tokens:
                i += 1             # the tokens in flight end it (length): nothing to compute
                continue
            if self._crosses_long_rope(req, total):
                if not req.num_output_placeholders:   # (else: once its token has arrived)
                    self.running.pop(i)
                    self._preempt(req, rewind=True)
                    preempted.append(req.request_id)
                else:
                    i += 1
                continue
            n = min(total - req.num_computed_tokens, budget)
            while not self.kv.allocate(req.request_id, req.num_computed_tokens + n):
                if self.sessions.evict_lru():
                    continue
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim.request_id)
                out_of_blocks = True
                if victim is req:
                    break
            else:
                scheduled.append(self._plan(req, n))
                budget -= n
                i += 1
                continue
            break
        if not out_of_blocks:
            budget = self._admit_waiting(scheduled, budget)
        finished, self._finished_ids = self._finished_ids, []
        new_reqs, cached = self._deltas.make(scheduled)
        out = SchedulerOutput(scheduled, preempted, finished, self.kv.take_swaps(),
                              new_reqs, cached)
        self._commit(out)
        return out

    def _commit(self, out: SchedulerOutput) -> None:
        """Count the plan as run (vLLM v1's ``_update_after_schedule``): computed tokens
        advance now, each sampling request gets an output placeholder, and the plan's
        deltas count as delivered to the runner, so the next plan can be made before this
        step's tokens reach the host (async scheduling)."""
        for s in out.scheduled:
            s.request.num_computed_tokens += s.num_tokens
            if s.sample:
                s.request.num_output_placeholders += 1
        self._deltas.mark_sent(out, self.requests)

    def revert(self, out: SchedulerOutput) -> None:
        """Undo ``schedule``'s accounting for a plan the engine drops without running it
        (an adapter failed to load): computed tokens and placeholders go back, and the
        next plan sends the runner its deltas again, in full. Requests that finished since
        are skipped."""
        for s in out.scheduled:
            req = s.request
            if self.requests.get(req.request_id) is req:
                req.num_computed_tokens -= s.num_tokens
                if s.sample:
                    req.num_output_placeholders -= 1
        self._deltas.unmark_sent(out)

    def wanted_adapters(self, limit: int) -> list:
        """The ``LoRARequest`` of the next ``limit`` adapters waiting requests will need that
        the running batch does not use, in the order they would get slots (for the adapter
        cache to stage ahead of time)."""
        return self._adapter_choice.wanted(self.running_adapters(), limit, self._step)

    def _allowed_adapters(self) -> set[int]:
        """The adapters whose waiting requests may join this step (0 = base)."""
        return self._adapter_choice.allowed(self.running, self._step)

    def _admit_waiting(self, scheduled: list[ScheduledRequest], budget: int) -> int:
        """Waiting requests join while ``max_num_seqs``, budget and blocks last: under
        ``"fair"`` the head of the lane (adapter, group) whose group runs the fewest
        requests first, ties in arrival order; under ``"fcfs"`` in arrival order. A request
        that finds no blocks stops the admission (no later one passes it). O((lanes +
        admitted) log lanes) over the lanes of the adapters the step may use."""
        config = self.config
        if budget <= 0 or len(self.running) >= config.max_num_seqs:
            return budget
        fair = config.scheduling_policy == "fair"
        groups, waiting = self._groups, self._waiting
        held, order, queues = groups.running, waiting.order, waiting.queues
        heads = [(held[g] if fair else 0, order[lane[0].request_id], lid, g)
                 for lid in self._allowed_adapters() if (q := queues.get(lid))
                 for g, lane in q.lanes.items()]
        heapq.heapify(heads)
        while heads and budget > 0 and len(self.running) < config.max_num_seqs:
            count, _, lid, g = heads[0]
            if count != (held[g] if fair else 0):   # its group took a place from another lane
                heapq.heapreplace(heads, (held[g], *heads[0][1:]))
                continue
            queue = queues[lid]
            req = queue.lanes[g][0]
            n = self._join(req, budget)
            while n is None and self.sessions.evict_lru():
                n = self._join(req, budget)
            if n is None:
                break
            waiting.take(lid, g)
            groups.joined(req)
            lane = queue.lanes.get(g)
            if lane:
                heapq.heapreplace(heads, (held[g] if fair else 0,
                                          order[lane[0].request_id], lid, g))
            else:
                heapq.heappop(heads)
            req.status = RequestStatus.RUNNING
            if req.scheduled_time is None:
                req.scheduled_time = time.monotonic()
            self.running.append(req)
            scheduled.append(self._plan(req, n))
            budget -= n
        return budget

    def _join(self, req: Request, budget: int) -> int | None:
        """Give a waiting request its blocks: its session's KV, or the longest cached prefix
        under its adapter, then fresh blocks for up to ``budget`` more tokens. Sets
        ``num_computed_tokens``; the tokens to compute this step, or None (nothing taken)
        when the pool is too small."""
        rid, kv, stats = req.request_id, self.kv, self.kv.stats
        if self._crosses_long_rope(req, req.num_tokens):
            req.long_rope = True
            req.block_hashes.clear()
        sess = self.sessions.get(req.session_id) if req.session_id is not None else None
        if sess is not None and kv.has_blocks(sess.holder) and (
                sess.last_turn.long_rope == req.long_rope):
            computed = sess.last_turn.num_computed_tokens
            n = min(req.num_tokens - computed, budget)
            kv.rename(sess.holder, rid)
            if not kv.allocate(rid, computed + n):
                kv.rename(rid, sess.holder)
                return None
            self.sessions.released(sess)
        else:
            # prompt log-probabilities still owed: compute the whole prompt (vLLM v1 skips
            # the prefix-cache lookup for such requests too)
            hit = PrefixHit([], []) if req.needs_prompt_logprobs else kv.lookup(req)
            computed = hit.num_blocks() * kv.block_size
            n = min(req.num_tokens - computed, budget)
            if not kv.allocate_with_prefix(rid, computed + n, hit):
                return None
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = computed
        lost = self._lost.pop(rid, 0) or (sess.lost_tokens if sess is not None else 0)
        if sess is not None:
            sess.lost_tokens = 0
        stats.recomputed_tokens += max(0, lost - computed)
        stats.prefix_queries += req.num_tokens
        stats.prefix_hits += computed
        if req.lora_start and req.lora_digest is not None:     # an activated adapter
            shared = min(req.lora_start, req.num_tokens) // kv.block_size * kv.block_size
            stats.prefix_hits_alora += min(computed, shared)
        req.num_computed_tokens = computed
        return n

    def end_session(self, session_id: str) -> bool:
        """Forget a session: the blocks only it held are freed (full ones stay in the prefix
        cache). A turn in flight finishes first. False for an unknown id."""
        return self.sessions.end(session_id)

    def _plan(self, req: Request, n: int) -> ScheduledRequest:
        start = req.num_computed_tokens
        return ScheduledRequest(req, start, n,
                                start + n == req.num_tokens + req.num_output_placeholders)

    def _crosses_long_rope(self, req: Request, length: int) -> bool:
        """Whether ``req``, holding ``length`` tokens, has grown past a ``longrope`` model's
        original length with keys rotated the short way."""
        return (self.long_rope_after is not None and not req.long_rope
                and length > self.long_rope_after)

    def _preempt(self, req: Request, rewind: bool = False) -> None:
        """Give back ``req``'s blocks (its full ones stay cached) and queue it again.
        ``rewind``: it grew past a ``longrope`` model's original length and is computed
        again from its first token, with the long factors (``_join`` marks it); its blocks,
        rotated the short way, are neither swapped out nor counted as a preemption."""
        if not rewind:
            self.kv.swap_out(req)
            req.num_preemptions += 1
            self.kv.stats.preemptions += 1
        self._lost[req.request_id] = req.num_computed_tokens
        self._deltas.forget(req.request_id)     # it returns to the runner as new
        self.kv.free(req.request_id)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        self._groups.left(req)
        self._waiting.requeue(req)

    def update(self, output: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Record a step's sampled tokens (its computed tokens were counted when it was
        planned): each is appended to its request, the request's placeholder goes, and its
        newly computed full blocks enter the prefix cache.

        Under async scheduling this runs after the next step was planned: a request
        finished since (stopped, aborted) is skipped and its token dropped; a request
        preempted since keeps its token (it recomputes from its tokens when it returns).

        Args:
            output: the step's plan.
            sampled: ``{request_id: token_id}`` for the requests that sampled.

        Returns:
            The requests (still unfinished) that got a token, in batch order.
        """
        got = []
        requests = self.requests
        for s in output.scheduled:
            req = s.request
            if requests.get(req.request_id) is not req:
                continue
            if s.sample:
                req.num_output_placeholders -= 1
                token = sampled.get(req.request_id)
                if token is not None:
                    req.token_ids.append(token)
                    got.append(req)
            self.kv.cache_blocks(req)
        return got

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """End requests (stopped, at length, aborted): their blocks go back to the pool,
        except a session turn's that ends normally: the session keeps those while idle.

        Unknown or already finished ids are ignored.
        """
        for rid in request_ids:
            req = self.requests.pop(rid, None)
            if req is None:
                continue
            req.status = status
            if req in self.running:
                self.running.remove(req)
                self._groups.left(req)
            self._waiting.forget(req)
            self._lost.pop(rid, None)
            self._deltas.forget(rid)
            if req.session_id is not None:
                self.sessions.end_turn(req, status)
            self.kv.free(rid)
            self._finished_ids.append(rid)
