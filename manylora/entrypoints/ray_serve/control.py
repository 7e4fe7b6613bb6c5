"""The control replica of ``manylora serve-ray``: which adapters were loaded or unloaded at run
time, which engine replicas are alive, and their latest metrics.

Ray Serve routes each request to one replica and has no public call that reaches every
replica of a deployment (nor one that says what each replica serves), while ``POST
/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` must reach all of them, replicas
started later included, and ``GET /metrics`` must show each one. So every engine replica
long-polls this one (:meth:`AdapterControl.poll`, at least once per ``POLL_S``): each poll
carries the replica's metrics and the last change it applied, and returns as soon as there
is a newer change, and only then (another replica's poll wakes no one but a waiting
:meth:`AdapterControl.publish`), so an idle application makes one call per replica per
``POLL_S``. A replica that has applied a change says so at once with a poll that does not
wait. A change is a new version of the **desired adapter set**: per name the
path it is served from, or a tombstone for a name unloaded (a ``--lora-modules`` adapter
unloaded at run time stays unloaded on a replica that restarts).
:meth:`AdapterControl.publish` makes a change and waits until every live replica has applied
it.

A replica is live while it polls: one not heard from for ``LIVE_S`` seconds (dead, or being
restarted by Ray Serve) is dropped from the wait and from ``/metrics``; it gets the whole
desired set when it comes back. If this replica itself restarts, it starts with an empty set
and a new ``epoch``; each engine replica then reports what it loaded at run time, and the
union becomes the desired set again.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

#: Seconds an engine replica's poll waits for a change before it returns (and the replica
#: polls again with fresh metrics): how old a replica's ``/metrics`` may be. Each poll costs
#: a Ray Serve call (a few ms of CPU on each side).
POLL_S = 2.0
#: Seconds without a poll after which an engine replica counts as gone.
LIVE_S = 8.0


@dataclass(frozen=True)
class AdapterEntry:
    """One name in the desired adapter set.

    Attributes:
        path: the adapter directory as the load request gave it; None: unloaded.
        version: the set's version when this entry last changed.
        origin: the replica that already applied it (the one that answered the HTTP
            request), or "".
    """

    path: str | None
    version: int
    origin: str = ""


@dataclass(frozen=True)
class DesiredAdapters:
    """What a poll returns: the set at ``version`` of the control replica's ``epoch``."""

    epoch: str
    version: int
    adapters: dict[str, AdapterEntry]


@dataclass
class _Seen:
    last: float
    applied: int = -1
    errors: dict[int, tuple[int, str]] = field(default_factory=dict)
    metrics: str = ""
    served: list[str] = field(default_factory=list)


class AdapterControl:
    """The control replica (one; a Ray Serve deployment class).

    Engine replicas call :meth:`poll`; the ingress calls :meth:`publish`, :meth:`metrics`
    and :meth:`replicas`. Every method runs on the replica's event loop, so no lock is
    needed.

    Args:
        clock: seconds, monotonic (``time.monotonic``; tests pass their own).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.epoch = uuid.uuid4().hex
        self.version = 0
        self.adapters: dict[str, AdapterEntry] = {}
        self.seen: dict[str, _Seen] = {}
        self._changed = asyncio.Event()     # set, then replaced, at each new version
        self._reported = asyncio.Event()    # set, then replaced, at each poll

    def _snapshot(self) -> DesiredAdapters:
        return DesiredAdapters(self.epoch, self.version, dict(self.adapters))

    def _live(self) -> dict[str, _Seen]:
        """The replicas heard from within ``LIVE_S``; the others are forgotten."""
        now = self.clock()
        self.seen = {r: s for r, s in self.seen.items() if now - s.last < LIVE_S}
        return self.seen

    async def poll(self, replica_id: str, epoch: str, received: int, applied: int,
                   metrics: str,
                   errors: dict[int, tuple[int, str]] | None = None,
                   held: dict[str, str] | None = None,
                   served: list[str] | None = None,
                   wait: bool = True) -> DesiredAdapters:
        """An engine replica's heartbeat: record what it says, then return the desired set
        at once if the replica has not received the newest version of this epoch (or
        ``wait`` is false), else at the next change or after ``POLL_S`` seconds, whichever
        comes first. Polls of other replicas do not end the wait.

        Args:
            replica_id: the engine replica's id (Ray Serve's ``unique_id``).
            epoch: the epoch the replica's versions belong to ("" for none yet).
            received: the newest version the replica has been given (-1 for none).
            applied: the newest version the replica has applied (-1 for none).
            metrics: its ``/metrics`` text (Prometheus exposition format).
            errors: per version, the (HTTP status, message) of a change it could not
                apply.
            held: on a new epoch, the adapters it loaded at run time (name → path): they
                rejoin the set when this replica restarted and lost it.
            served: the adapter names its server answers to now.
            wait: False to report only (a replica that has just applied a change).
        """
        now = self.clock()
        seen = self.seen.setdefault(replica_id, _Seen(now))
        seen.last, seen.metrics = now, metrics
        if served is not None:
            seen.served = sorted(served)
        if epoch == self.epoch:
            seen.applied = max(seen.applied, applied)
            seen.errors.update(errors or {})
        elif held:
            self._claim(held)
        self._reported.set()                # publish() re-checks who has applied
        self._reported = asyncio.Event()
        if wait and epoch == self.epoch and received >= self.version:
            try:
                await asyncio.wait_for(self._changed.wait(), POLL_S)
            except TimeoutError:
                pass
        return self._snapshot()

    def _new_version(self) -> int:
        """Count one more change and end the waiting polls; the new version."""
        self.version += 1
        self._changed.set()
        self._changed = asyncio.Event()
        return self.version

    def _claim(self, held: dict[str, str]) -> None:
        new = {name: path for name, path in held.items() if name not in self.adapters}
        if new:
            version = self._new_version()
            self.adapters.update({n: AdapterEntry(p, version) for n, p in new.items()})

    async def publish(self, name: str, path: str | None, origin: str,
                      timeout: float) -> dict[str, tuple[int, str]]:
        """Set ``name`` to ``path`` (None: unload it) in the desired set, and wait until
        every live engine replica has applied the change, or ``timeout`` seconds.

        Args:
            name: the adapter's name.
            path: its directory as the load request gave it; None to unload.
            origin: the replica that already applied the change ("" for none).
            timeout: the longest wait, seconds.

        Returns:
            Per replica that could not apply the change: (HTTP status, message); empty
            when all did. A replica still working on it at ``timeout`` is reported with 504.
        """
        version = self._new_version()
        self.adapters[name] = AdapterEntry(path, version, origin)
        deadline = self.clock() + timeout
        while True:
            live = self._live()
            pending = [r for r, s in live.items() if s.applied < version]
            left = deadline - self.clock()
            if not pending or left <= 0:
                break
            try:
                await asyncio.wait_for(self._reported.wait(), min(left, POLL_S))
            except TimeoutError:
                pass
        failed = {r: s.errors[version] for r, s in live.items() if version in s.errors}
        failed.update({r: (504, f"replica {r} did not apply the change within {timeout:g} "
                                "s") for r in pending})
        return failed

    def metrics(self) -> dict[str, str]:
        """The latest ``/metrics`` text of each live engine replica, by replica id."""
        return {r: s.metrics for r, s in sorted(self._live().items())}

    def served(self) -> dict[str, list[str]]:
        """The adapter names each live engine replica answers to, as it last reported them
        (after the newest change it has applied)."""
        return {r: list(s.served) for r, s in sorted(self._live().items())}

    def replicas(self) -> list[str]:
        """The ids of the live engine replicas."""
        return sorted(self._live())

    def desired(self) -> DesiredAdapters:
        """The desired adapter set now."""
        return self._snapshot()
