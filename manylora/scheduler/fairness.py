"""Fairness between clients (``scheduling_policy="fair"``, the default).

One client call fans out to many requests (an HTTP request's prompts x n, sharing
``Request.client_group``); under arrival order its children, admitted ahead of a later
client's request, could hold every place of the running batch (``max_num_seqs``) for their
whole lifetime. So each adapter's queue keeps one FIFO lane per group
(``scheduler/waiting_queue.py``), and:

* waiting requests join least-running group first (ties in arrival order), first come first
  served within a group: a newcomer takes the next free place in the batch ahead of the
  children of any group already running (max-min fairness in running requests, the
  running-count form of the Virtual Token Counter of Sheng et al., OSDI'24);
* a group alone may take the whole batch (work-conserving), but once another group's
  request waits (in an adapter the step may admit) and the batch is full, the group running
  the most gives up its newest requests down to ``max_group_seqs`` (``max_group_share`` of
  ``max_num_seqs``), one per such waiting request (``GroupShares.victims``). So a newcomer
  whose group is under its share joins within one step when ``max_num_seqs`` binds; when
  budget or blocks bind it is the first to join when they free, i.e. it waits at most until
  one running request finishes or the blocks it needs free up, never behind the rest of
  another group's children. ``max_group_share=1`` keeps only the order (a wait of one
  child's lifetime at most).

Preemption for fairness takes the same path as preemption for blocks: the request keeps its
tokens, its full blocks stay in the prefix cache (children of one prompt share them, so
their return mostly hits the prefix cache), sessions are untouched (a session's turn is a request
like any other), and under async scheduling a preempted request's token in flight is kept by
``Scheduler.update``. Only group counts and lane heads are read: no tensors, O(lanes) per
step, O(running) per preemption. ``scheduling_policy="fcfs"`` keeps strict arrival order
(vLLM's policy).
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Hashable, Iterable

from manylora.config import SchedulerConfig
from manylora.request import Request
from manylora.scheduler.waiting_queue import WaitingQueues


class GroupShares:
    """How many running requests each client group (``Request.group_key``) has, and which
    of them give way to waiting groups under their share.

    Args:
        config: ``scheduling_policy``, ``max_num_seqs`` and ``max_group_seqs``.

    Attributes:
        running: group key → its running requests (a group with none has no entry).
    """

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.running: Counter = Counter()

    def joined(self, req: Request) -> None:
        """``req`` started running."""
        self.running[req.group_key] += 1

    def left(self, req: Request) -> None:
        """``req`` stopped running (finished or preempted)."""
        running = self.running
        running[req.group_key] -= 1
        if running[req.group_key] <= 0:
            del running[req.group_key]

    def count(self, group: Hashable) -> int:
        """The running requests of ``group``."""
        return self.running[group]

    def victims(self, running: list[Request], waiting: WaitingQueues,
                allowed: Iterable[int]) -> list[Request]:
        """Under ``"fair"``, when the batch is full (``max_num_seqs``), the running
        requests to preempt so that waiting groups under their share may join: the newest
        requests of groups over their share (``SchedulerConfig.max_group_seqs``), the group
        running the most first, one for each waiting request (in the queues of the
        ``allowed`` adapters) of a group under its share, never taking a group below its
        share. A group over its share is one that filled the batch while alone.

        The roles never swap (the waiting group stays at or under its share, the preempted
        one at or over it), so no two groups preempt each other in turn.

        Args:
            running: the running batch, oldest first.
            waiting: the waiting requests.
            allowed: the adapters whose waiting requests may join this step.

        Returns:
            The victims, in the order to preempt them (the caller preempts each, which
            calls ``left``).
        """
        config = self.config
        held = self.running
        cap = config.max_group_seqs
        if (config.scheduling_policy != "fair" or len(running) < config.max_num_seqs
                or not held or max(held.values()) <= cap):
            return []
        wants: Counter = Counter()
        for lid in allowed:
            queue = waiting.queues.get(lid)
            if queue:
                for g, lane in queue.lanes.items():
                    if held[g] < cap:
                        wants[g] += len(lane)
        need = sum(min(n, cap - held[g]) for g, n in wants.items())
        left = Counter(held)
        over = [(-n, g) for g, n in left.items() if n > cap]
        heapq.heapify(over)
        chosen: list[Request] = []
        taken: set[str] = set()
        while need > 0 and over:
            _, g = heapq.heappop(over)
            victim = next(r for r in reversed(running)
                          if r.group_key == g and r.request_id not in taken)
            chosen.append(victim)
            taken.add(victim.request_id)
            left[g] -= 1
            need -= 1
            if left[g] > cap:
                heapq.heappush(over, (-left[g], g))
        return chosen
