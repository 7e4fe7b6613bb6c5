"""Continuous batching with a token budget (TurboMind's persistent batch, vLLM v1's scheduler).

There are no prefill or decode phases: every step, each running request's computed tokens
catch up towards its total within the step's token budget, and waiting requests join while
budget, sequence slots, KV blocks and adapter slots last. So prefill chunks and decode
tokens share a step. A waiting request whose adapter would take the step past
``max_loras`` distinct adapters stays queued (vLLM's rule) while others may pass it; which
adapter gets a free slot prefers adapters already resident and ages the others (see
``Scheduler``).

A request joining the batch starts from the longest prefix the KV cache already holds
under its adapter (prefix caching), or from the KV its session kept since its last turn;
a request that still owes prompt log-probabilities takes neither and computes its prompt.
When blocks run out, idle sessions give theirs back first (least recently used), then the
newest running request is preempted: it keeps its tokens and gives back its blocks, whose
full ones stay in the prefix cache, or in swap space when copying them is cheaper than
recomputing; when it returns it recomputes only what was lost (TurboMind's eviction to
token ids).

The scheduler never touches a tensor.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import Counter
from collections.abc import Iterable
from typing import Protocol

from manylora.config import SchedulerConfig
from manylora.request import Request, RequestStatus
from manylora.scheduler.kv_cache_manager import KVCacheManager, PrefixHit
from manylora.scheduler.sessions import Session, SessionTable
from manylora.scheduler.waiting_queue import AdapterQueue
from manylora.scheduler_output import (
    CachedRequestData,
    NewRequestData,
    ScheduledRequest,
    SchedulerOutput,
)


class AdapterResidency(Protocol):
    """What the scheduler may ask the adapter cache (answers only; no tensors)."""

    def is_ready(self, lora_int_id: int) -> bool:
        """Whether a step could use the adapter without reading a disk: it is in a device
        slot or staged in the host tier."""

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
    arrival within each client group. Each step, running requests go first; then waiting
    requests join (in arrival order under ``"fcfs"``, by group under ``"fair"``: below),
    drawn from the queues of adapters the step may use:

    * the base model and adapters the running batch already uses (no slot needed);
    * while fewer than ``max_loras`` adapters are in the step, new adapters, preferring
      those already resident in a device slot (no copy) over those staged in host memory,
      oldest request first. A request that has waited ``lora_aging_steps`` steps is aged:
      aged requests take free slots strictly in arrival order, before any preference.
      Adapters that are not ready (still on disk) are passed over while the cache stages
      them (``wanted_adapters`` tells it which).
    * If an aged request finds no free slot, the running adapter with the fewest running
      requests takes no new requests until it drains, so its slot goes to the aged request:
      no request starves behind adapters that are always busy.

    With the adapter cache's residency (the engine's case) and more adapters waiting than
    slots are free, two more rules pace the slot loads (``benchmarks/sim_churn.py``
    compares them with the rules above alone on a roofline model of the engine):

    * a step admits at most ``lora_new_adapters_per_step`` adapters that are not in the
      running batch; adapters that drain together then re-enter one per step, so their
      prefill and their copies spread over steps instead of one compute-bound step that
      waits on several copies;
    * ``lora_staging_slots`` slots (a quarter of ``max_loras`` at most, none below 4) stay
      free of running adapters: the cache copies the next adapters (``wanted_adapters``)
      into them while steps run, so they join with no copy to wait for.

    Neither rule starves a request: aged requests still take free slots in arrival order
    before any other adapter (and close the least busy running adapter when none is free).

    Fairness between clients (``scheduling_policy="fair"``, the default). One client call
    fans out to many requests (an HTTP request's prompts x n, sharing
    ``Request.client_group``); under arrival order its children, admitted ahead of a later
    client's request, could hold every sequence slot for their whole lifetime. So each
    adapter's queue keeps one FIFO lane per group (``scheduler/waiting_queue.py``), and:

    * waiting requests join least-running group first (ties in arrival order), first come
      first served within a group: a newcomer takes the next free slot ahead of the
      children of any group already running (max-min fairness in sequence slots, the
      running-count form of the Virtual Token Counter of Sheng et al., OSDI'24);
    * a group alone may take the whole batch (work-conserving), but once another group's
      request waits (in an adapter the step may admit) and no slot is free, the group
      running the most gives up its newest requests down to ``max_group_seqs``
      (``max_group_share`` of ``max_num_seqs``), one per such waiting request
      (``_preempt_for_groups``). So a newcomer whose group is under its share joins within
      one step when sequence slots bind; when budget or blocks bind it is the first to join
      when they free, i.e. it waits at most until one running request finishes or the
      blocks it needs free up, never behind the rest of another group's children.
      ``max_group_share=1`` keeps only the order (a wait of one child's lifetime at most).

    Preemption for fairness takes the same path as preemption for blocks: the request keeps
    its tokens, its full blocks stay in the prefix cache (children of one prompt share
    them, so their return mostly hits the cache), sessions are untouched (a session's turn
    is a request like any other), and under async scheduling a preempted request's token in
    flight is kept by ``update``. Only group counts and lane heads are read: no tensors,
    O(lanes) per step, O(running) per preemption. ``scheduling_policy="fcfs"`` keeps
    strict arrival order (vLLM's policy).

    Args:
        config: batch limits (max_num_seqs, max_num_batched_tokens, max_loras,
            lora_aging_steps) and the policy between client groups.
        kv: the block allocator.
        adapters: the adapter cache's residency answers; None: every adapter is ready and
            none resident (the scheduler alone, as in tests).

    Attributes:
        fairness_preemptions: requests preempted to share the batch between client groups
            (also counted in ``kv.stats.preemptions``).
    """

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager,
                 adapters: AdapterResidency | None = None) -> None:
        self.config = config
        self.kv = kv
        self.adapters: AdapterResidency = adapters or _EveryAdapterReady()
        self._pace_loads = adapters is not None    # the cache copies: pace its slot loads
        self._queues: dict[int, AdapterQueue] = {}
        self.running: list[Request] = []
        self._group_running: Counter = Counter()    # group key → its running requests
        self.fairness_preemptions = 0
        self.requests: dict[str, Request] = {}
        self._finished_ids: list[str] = []
        self._seq = itertools.count()
        self._order: dict[str, int] = {}       # request id → arrival order
        self._since: dict[str, int] = {}       # request id → step it started waiting
        self._step = 0
        self._lost: dict[str, int] = {}        # preempted request id → tokens it had computed
        self._sent_blocks: dict[str, int] = {}  # request id → blocks the runner holds for it
        self.sessions = SessionTable()

    @property
    def num_preemptions(self) -> int:
        return self.kv.stats.preemptions

    @property
    def waiting(self) -> list[Request]:
        """Every waiting request, in arrival order."""
        return sorted((r for q in self._queues.values() for r in q),
                      key=lambda r: self._order[r.request_id])

    def waiting_lora_requests(self) -> list:
        """The ``LoRARequest`` of each adapter with waiting requests (None for the base
        model), one per adapter queue; no sorting."""
        return [q.any().lora_request for q in self._queues.values() if q]

    @property
    def num_waiting(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def add_request(self, request: Request) -> None:
        """Queue a request (a session's turn starts with ``sessions.history``)."""
        if request.session_id is not None:
            sess = self.sessions.begin(request)
            turn = sess.last_turn
            if turn is not None and (turn.lora_digest != request.lora_digest
                                     or request.adapter_pending       # (no digest yet)
                                     or request.needs_prompt_logprobs):
                self._release_session_kv(sess)    # KV of another adapter, or prompt
                #                                   log-probabilities to compute: recompute
        self.requests[request.request_id] = request
        self._order[request.request_id] = next(self._seq)
        self._since[request.request_id] = self._step
        self._queue(request.lora_int_id).append(request)

    def _queue(self, lora_int_id: int) -> AdapterQueue:
        queue = self._queues.get(lora_int_id)
        if queue is None:
            queue = self._queues[lora_int_id] = AdapterQueue(self._order)
        return queue

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
        preempted = self._preempt_for_groups()
        out_of_blocks = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            total = req.num_tokens + req.num_output_placeholders
            if req.num_output_placeholders and total >= req.max_total_tokens:
                i += 1             # the tokens in flight end it (length): nothing to compute
                continue
            n = min(total - req.num_computed_tokens, budget)
            while not self.kv.allocate(req.request_id, req.num_computed_tokens + n):
                if self._evict_idle_session():
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
        new_reqs, cached = self._deltas(scheduled)
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
        self._mark_sent(out, 1)

    def _mark_sent(self, out: SchedulerOutput, sign: int) -> None:
        sent_blocks = self._sent_blocks
        for new in out.scheduled_new_reqs:
            if sign < 0:
                sent_blocks.pop(new.req_id, None)
            elif new.req_id in self.requests:
                sent_blocks[new.req_id] = len(new.block_ids)
        cached = out.scheduled_cached_reqs
        for rid, blocks in zip(cached.req_ids, cached.new_block_ids):
            if blocks and rid in sent_blocks:
                sent_blocks[rid] += sign * len(blocks)

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
        self._mark_sent(out, -1)

    def _deltas(self, scheduled: list[ScheduledRequest]
                ) -> tuple[list[NewRequestData], CachedRequestData]:
        """What the runner must learn for this step: whole rows for requests it does not
        hold, the blocks appended since its last step for the others. O(batch + new
        blocks): no table is copied."""
        new_reqs: list[NewRequestData] = []
        cached = CachedRequestData([], [], [], [])
        sent_blocks = self._sent_blocks
        for s in scheduled:
            req = s.request
            rid = req.request_id
            table = self.kv.block_table(rid)
            sent = sent_blocks.get(rid)
            if sent is None:
                new_reqs.append(NewRequestData(rid, req.token_ids, list(table), s.start,
                                               req.lora_int_id, req.sampling_params,
                                               req.num_prompt_tokens))
            else:
                cached.req_ids.append(rid)
                cached.new_block_ids.append(table[sent:] if len(table) > sent else [])
                cached.num_computed_tokens.append(s.start)
                cached.num_blocks.append(len(table))
        return new_reqs, cached

    def _aged(self, req: Request) -> bool:
        return self._step - self._since[req.request_id] >= self.config.lora_aging_steps

    def _new_adapter_order(self, in_step: set[int]) -> list[int]:
        """Adapters with waiting requests that are not in the step, best first."""
        def key(lid: int) -> tuple:
            head = self._queues[lid].head()
            order = self._order[head.request_id]
            if self._aged(head):
                return (0, False, order)
            return (1, not self.adapters.is_resident(lid), order)

        return sorted((lid for lid, q in self._queues.items()
                       if lid and q and lid not in in_step), key=key)

    def wanted_adapters(self, limit: int) -> list:
        """The ``LoRARequest`` of the next ``limit`` adapters waiting requests will need that
        the running batch does not use, in the order they would get slots (for the adapter
        cache to stage ahead of time)."""
        order = self._new_adapter_order(self.running_adapters())[:limit]
        return [self._queues[lid].any().lora_request for lid in order]

    def _allowed_adapters(self) -> set[int]:
        """The adapters whose waiting requests may join this step (0 = base)."""
        config = self.config
        running = self.running_adapters()
        allowed = running | {0}
        order = self._new_adapter_order(running)
        free = config.max_loras - len(running)
        admits, reserve = None, 0
        if self._pace_loads and len(order) > free:    # more adapters wait than slots are free
            admits = config.lora_new_adapters_per_step
            reserve = min(config.lora_staging_slots, config.max_loras // 4)
        for lid in order:
            aged = self._aged(self._queues[lid].head())
            if free - reserve <= 0 or admits == 0:
                if aged and running and free - reserve <= 0:
                    counts = Counter(r.lora_int_id for r in self.running if r.lora_int_id)
                    allowed.discard(min(running, key=lambda a: (counts[a], a)))
                break
            if self.adapters.is_ready(lid):
                allowed.add(lid)
                free -= 1
                if admits is not None:
                    admits -= 1
            elif aged:
                break          # the oldest waits for its adapter: no younger one passes it
        return allowed

    def _admit_waiting(self, scheduled: list[ScheduledRequest], budget: int) -> int:
        """Waiting requests join while sequence slots, budget and blocks last: under
        ``"fair"`` the head of the lane (adapter, group) whose group runs the fewest
        requests first, ties in arrival order; under ``"fcfs"`` in arrival order. A request
        that finds no blocks stops the admission (no later one passes it). O((lanes +
        admitted) log lanes) over the lanes of the adapters the step may use."""
        config = self.config
        if budget <= 0 or len(self.running) >= config.max_num_seqs:
            return budget
        fair = config.scheduling_policy == "fair"
        held, order, queues = self._group_running, self._order, self._queues
        heads = [(held[g] if fair else 0, order[lane[0].request_id], lid, g)
                 for lid in self._allowed_adapters() if (q := queues.get(lid))
                 for g, lane in q.lanes.items()]
        heapq.heapify(heads)
        while heads and budget > 0 and len(self.running) < config.max_num_seqs:
            count, _, lid, g = heads[0]
            if count != (held[g] if fair else 0):   # its group took a slot from another lane
                heapq.heapreplace(heads, (held[g], *heads[0][1:]))
                continue
            queue = queues[lid]
            req = queue.lanes[g][0]
            n = self._join(req, budget)
            while n is None and self._evict_idle_session():
                n = self._join(req, budget)
            if n is None:
                break
            queue.popleft(g)
            held[g] += 1
            lane = queue.lanes.get(g)
            if lane:
                heapq.heapreplace(heads, (held[g] if fair else 0,
                                          order[lane[0].request_id], lid, g))
            else:
                heapq.heappop(heads)
                if not queue:
                    del queues[lid]
            req.status = RequestStatus.RUNNING
            if req.scheduled_time is None:
                req.scheduled_time = time.monotonic()
            self.running.append(req)
            scheduled.append(self._plan(req, n))
            budget -= n
        return budget

    def _preempt_for_groups(self) -> list[str]:
        """Under ``"fair"``, when no sequence slot is free, preempt the newest running
        requests of groups over their share (``SchedulerConfig.max_group_seqs``), the
        group running the most first, one for each waiting request (in the lanes the step
        may admit) of a group under its share, never taking a group below its share; the
        ids preempted. A group over its share is one that filled the batch while alone.

        A preempted request keeps its tokens; its full blocks stay in the prefix cache (or
        go to swap space) and it recomputes the rest when it returns (``_preempt``). The
        roles never swap (the waiting group stays at or under its share, the preempted
        one at or over it), so no two groups preempt each other in turn.
        """
        config = self.config
        held = self._group_running
        cap = config.max_group_seqs
        if (config.scheduling_policy != "fair" or len(self.running) < config.max_num_seqs
                or not held or max(held.values()) <= cap):
            return []
        wants: Counter = Counter()
        for lid in self._allowed_adapters():
            queue = self._queues.get(lid)
            if queue:
                for g, lane in queue.lanes.items():
                    if held[g] < cap:
                        wants[g] += len(lane)
        need = sum(min(n, cap - held[g]) for g, n in wants.items())
        over = [(-n, g) for g, n in held.items() if n > cap]
        heapq.heapify(over)
        preempted = []
        while need > 0 and over:
            _, g = heapq.heappop(over)
            i = next(i for i in range(len(self.running) - 1, -1, -1)
                     if self.running[i].group_key == g)
            victim = self.running.pop(i)
            self._preempt(victim)
            preempted.append(victim.request_id)
            self.fairness_preemptions += 1
            need -= 1
            if held[g] > cap:
                heapq.heappush(over, (-held[g], g))
        return preempted

    def _join(self, req: Request, budget: int) -> int | None:
        """Give a waiting request its blocks: its session's KV, or the longest cached prefix
        under its adapter, then fresh blocks for up to ``budget`` more tokens. Sets
        ``num_computed_tokens``; the tokens to compute this step, or None (nothing taken)
        when the pool is too small."""
        rid, kv, stats = req.request_id, self.kv, self.kv.stats
        sess = self.sessions.get(req.session_id) if req.session_id is not None else None
        if sess is not None and kv.has_blocks(sess.holder):
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
        req.num_computed_tokens = computed
        return n

    def _evict_idle_session(self) -> bool:
        """Release the KV of the least recently used idle session (its full blocks stay in
        the prefix cache or go to swap space); False when no idle session holds any."""
        sess = self.sessions.lru_idle()
        if sess is None:
            return False
        self.kv.swap_out(sess.last_turn, sess.holder)
        sess.lost_tokens = sess.last_turn.num_computed_tokens
        self._release_session_kv(sess)
        self.kv.stats.evicted_sessions += 1
        return True

    def _release_session_kv(self, sess: Session) -> None:
        self.kv.free(sess.holder)
        self.sessions.released(sess)

    def end_session(self, session_id: str) -> bool:
        """Forget a session: the blocks only it held are freed (full ones stay in the prefix
        cache). A turn in flight finishes first. False for an unknown id."""
        sess = self.sessions.get(session_id)
        if sess is None:
            return False
        if sess.active_request is not None:
            sess.ended = True
        else:
            self._release_session_kv(sess)
            self.sessions.drop(sess)
        return True

    def _plan(self, req: Request, n: int) -> ScheduledRequest:
        start = req.num_computed_tokens
        return ScheduledRequest(req, start, n,
                                start + n == req.num_tokens + req.num_output_placeholders)

    def _preempt(self, req: Request) -> None:
        self.kv.swap_out(req)
        self._lost[req.request_id] = req.num_computed_tokens
        self._sent_blocks.pop(req.request_id, None)     # it returns to the runner as new
        self.kv.free(req.request_id)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.kv.stats.preemptions += 1
        req.status = RequestStatus.PREEMPTED
        self._release_group_slot(req)
        self._queue(req.lora_int_id).insert(req)

    def _release_group_slot(self, req: Request) -> None:
        held = self._group_running
        held[req.group_key] -= 1
        if held[req.group_key] <= 0:
            del held[req.group_key]

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
                self._release_group_slot(req)
            else:
                queue = self._queues.get(req.lora_int_id)
                if queue is not None and queue.remove(req) and not queue:
                    del self._queues[req.lora_int_id]
            self._order.pop(rid, None)
            self._since.pop(rid, None)
            self._lost.pop(rid, None)
            self._sent_blocks.pop(rid, None)
            if req.session_id is not None:
                self._end_turn(req, status)
            self.kv.free(rid)
            self._finished_ids.append(rid)

    def _end_turn(self, req: Request, status: RequestStatus) -> None:
        sess = self.sessions.get(req.session_id)
        if sess is None or sess.active_request != req.request_id:
            return
        sess.active_request = None
        # a step launched before the turn stopped may have computed its last token's KV
        # (async scheduling); the session keeps what a synchronous step leaves: all but it
        req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens - 1)
        if sess.ended:
            self._release_session_kv(sess)
            self.sessions.drop(sess)
        elif status is not RequestStatus.FINISHED_ABORTED:
            self._release_session_kv(sess)        # its KV, if any, was not adopted
            self.kv.rename(req.request_id, sess.holder)
            self.sessions.keep(sess, req)
