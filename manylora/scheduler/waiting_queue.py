"""One adapter's waiting requests, kept as one FIFO lane per fairness group.

The scheduler holds one ``AdapterQueue`` per adapter (0 = the base model). A group is what
``Request.group_key`` names: the requests one client call fanned out to (an HTTP request's
prompts x n), or the request alone. Lanes let the scheduler admit across groups
(least-running group first) while each group stays first-come first-served, without scanning
the requests of a group that may not join now. ``WaitingQueues`` holds the queues of every
adapter.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Hashable, Iterator

from manylora.request import Request


class AdapterQueue:
    """The waiting requests of one adapter, one arrival-ordered lane per group.

    Args:
        order: request id → arrival number (the scheduler's; read, never written).

    Attributes:
        lanes: group key → that group's waiting requests of this adapter, oldest first; a
            group without waiting requests has no lane.
    """

    __slots__ = ("lanes", "_order", "_len")

    def __init__(self, order: dict[str, int]) -> None:
        self.lanes: dict[Hashable, deque[Request]] = {}
        self._order = order
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __iter__(self) -> Iterator[Request]:
        """Every waiting request, lane by lane (not in arrival order)."""
        for lane in self.lanes.values():
            yield from lane

    def __contains__(self, req: Request) -> bool:
        lane = self.lanes.get(req.group_key)
        return lane is not None and req in lane

    def head(self) -> Request:
        """The oldest waiting request (O(lanes)).

        Raises:
            ValueError: the queue is empty.
        """
        order = self._order
        return min((lane[0] for lane in self.lanes.values()),
                   key=lambda r: order[r.request_id])

    def any(self) -> Request:
        """Some waiting request, in O(1) (for what every request of the adapter shares).

        Raises:
            StopIteration: the queue is empty.
        """
        return next(iter(self.lanes.values()))[0]

    def append(self, req: Request) -> None:
        """Queue ``req`` as the newest of its group (it arrived last)."""
        self.lanes.setdefault(req.group_key, deque()).append(req)
        self._len += 1

    def insert(self, req: Request) -> None:
        """Queue ``req`` at its arrival position within its group (a preempted request
        goes back ahead of its group's later arrivals)."""
        lane = self.lanes.setdefault(req.group_key, deque())
        order = self._order
        mine = order[req.request_id]
        pos = next((i for i, r in enumerate(lane) if order[r.request_id] > mine), len(lane))
        lane.insert(pos, req)
        self._len += 1

    def popleft(self, group: Hashable) -> Request:
        """Take the oldest request of ``group``'s lane (the lane goes when it empties).

        Raises:
            KeyError: no lane for ``group``.
        """
        lane = self.lanes[group]
        req = lane.popleft()
        if not lane:
            del self.lanes[group]
        self._len -= 1
        return req

    def remove(self, req: Request) -> bool:
        """Drop ``req`` if it waits here; whether it did."""
        lane = self.lanes.get(req.group_key)
        if lane is None or req not in lane:
            return False
        lane.remove(req)
        if not lane:
            del self.lanes[req.group_key]
        self._len -= 1
        return True


class WaitingQueues:
    """Every request waiting in the scheduler: one ``AdapterQueue`` per adapter (0 = the
    base model), each request's arrival number and the step it was queued in.

    A preempted request goes back to its adapter's queue at its arrival position and keeps
    the step it was first queued in (so its wait keeps ageing it).

    Attributes:
        queues: adapter id → its waiting requests; an adapter with none has no queue.
        order: request id → arrival number, for every request the scheduler holds (waiting
            or running).
        since: request id → the scheduler step it was queued in.
    """

    def __init__(self) -> None:
        self.queues: dict[int, AdapterQueue] = {}
        self.order: dict[str, int] = {}
        self.since: dict[str, int] = {}
        self._arrivals = itertools.count()

    def __len__(self) -> int:
        return sum(len(q) for q in self.queues.values())

    def in_arrival_order(self) -> list[Request]:
        """Every waiting request, oldest first (O(n log n))."""
        order = self.order
        return sorted((r for q in self.queues.values() for r in q),
                      key=lambda r: order[r.request_id])

    def add(self, req: Request, step: int) -> None:
        """Queue a request that just arrived, at scheduler step ``step``."""
        self.order[req.request_id] = next(self._arrivals)
        self.since[req.request_id] = step
        self._queue(req.lora_int_id).append(req)

    def requeue(self, req: Request) -> None:
        """Queue a preempted request again, ahead of its group's later arrivals."""
        self._queue(req.lora_int_id).insert(req)

    def take(self, lora_int_id: int, group: Hashable) -> Request:
        """Take the oldest request of ``group`` waiting for adapter ``lora_int_id`` (the
        adapter's queue goes when it empties).

        Raises:
            KeyError: no such adapter queue or group lane.
        """
        queue = self.queues[lora_int_id]
        req = queue.popleft(group)
        if not queue:
            del self.queues[lora_int_id]
        return req

    def forget(self, req: Request) -> None:
        """Drop a request that ended: from its queue if it waits, and its numbers."""
        queue = self.queues.get(req.lora_int_id)
        if queue is not None and queue.remove(req) and not queue:
            del self.queues[req.lora_int_id]
        self.order.pop(req.request_id, None)
        self.since.pop(req.request_id, None)

    def _queue(self, lora_int_id: int) -> AdapterQueue:
        queue = self.queues.get(lora_int_id)
        if queue is None:
            queue = self.queues[lora_int_id] = AdapterQueue(self.order)
        return queue
