"""A simulation of routing LoRA requests over replicas (no GPU, no Ray): how many slot loads
(host → GPU) and disk loads (disk → host) random, least-loaded, adapter-affinity and Ray
Serve's multiplexed routing cost, how evenly they spread the load, and how far each is from
the lower bound that no router can beat (issue 20, item 5).

The model:

* **requests**: a Poisson stream over ``--adapters`` adapters drawn from Zipf(``--zipf``)
  (adapter ``i`` with probability ``∝ 1 / i^s``), each holding its replica for an
  exponential service time of mean 1; the arrival rate keeps ``--concurrency`` requests in
  flight per replica on average (Little's law).
* **replicas**: ``N`` engines, each with ``--slots`` GPU slots (``max_loras``) over a host
  tier of ``--host-slots`` adapters (``max_cpu_loras``), both LRU as in
  ``manylora.lora.manager.LoRAManager``: every request arriving touches its adapter's host
  copy (``LoRAManager.add``); a request whose adapter is not in a slot costs one slot load
  (``activate``), and, when the adapter is not in the host tier either, one disk load that
  puts it there (``_host_copy``), evicting the least recently used host adapter. The host
  tier counts the slots' adapters too (``max_cpu_loras ≥ max_loras``), so a replica holds at
  most ``max(slots, host_slots)`` distinct adapters. The slot taken is the least recently
  used one that no in-flight request of that replica uses (when every slot is in use, the
  least recently used one: an overcommit the engine would queue instead, counted in
  ``overflow``). ``--host-slots 0`` is the GPU-only model: every slot load reads the disk.
* **routing**, decided at arrival from what each replica holds and its in-flight count:

  - ``random``: uniform.
  - ``least-loaded``: fewest in flight, ties at random.
  - ``affinity``: among the replicas whose slots hold the adapter, else those whose host
    tier holds it, the least loaded one, unless its in-flight count exceeds
    ``(1 + --spill) ×`` the mean; otherwise the first replica of the adapter's
    rendezvous-hash order within that bound (bounded-load consistent hashing, Mirrokni et
    al. 2018), so each adapter has a home and each replica sees about 1/N of the adapters.
  - ``ray``: what ``manylora serve-ray`` ships, Ray Serve's model multiplexing with the
    adapter name as the multiplexed model id, as Ray Serve 2.60.0 routes it
    (``ray/serve/_private/request_router/``): each replica reports the ids in its
    ``@serve.multiplexed`` cache, the ``--max-models`` adapters it used most recently
    (``max_num_models_per_replica``; default ``max_cpu_loras``, which
    ``manylora.entrypoints.ray_serve.replica`` passes). ``MultiplexMixin.
    apply_multiplex_routing``'s first try takes the replicas reporting the id, or, when none
    does, ``_get_replica_ids_with_fewest_multiplexed_models``; ``PowerOfTwoChoicesRequestRouter.
    choose_replicas`` samples two of them (one when there is one) and ``RequestRouter.
    _select_from_candidate_replicas`` takes the one with the shorter queue among those whose
    queue is below ``max_ongoing_requests`` (``--max-ongoing``; serve-ray's default is
    ``2 × max_num_seqs`` = 512). When neither accepts, the retry (``tried_first_multiplexed_
    models``) samples the fewest-models replicas, then, after the matching timeout, all
    replicas until one accepts. Two simplifications: the ids a replica reports reach the
    router at once (Ray pushes them on change), and the retries happen at the arrival
    instant (Ray backs off from 25 ms); a request no replica accepts goes to the least
    loaded one (Ray would hold it until a place frees).

**The floor.** At any instant the N replicas' slots hold at most ``slots · N`` distinct
adapters, so under an independent-reference stream (each request's adapter drawn afresh)
any router misses the slots with probability at least ``1 - H(slots · N) / H(A)``, where
``H(n) = Σ_{i ≤ n} i^-s`` is the generalized harmonic number and ``A`` the number of
adapters: the mass outside the hottest ``slots · N`` adapters. Likewise the host tiers hold
at most ``max(slots, host_slots) · N`` adapters, which bounds disk loads by
``1 - H(min(A, max(slots, host_slots) · N)) / H(A)``: zero once the host tiers together
can hold every adapter.

Reported per (N, policy), after ``--warmup`` requests: slot loads and disk loads per 1,000
requests with their ratios to random routing's, the busiest replica's share of the requests
against the mean (``max / mean``), and the overflow count; and per N the two floors. The
issue's targets: affinity needs at most 1/N of random's loads, and the busiest replica takes
at most 1.25x the mean.

    python -m benchmarks.sim_routing                 # the table (a few seconds per row)
    python -m benchmarks.sim_routing --record        # and append it to BENCHMARKS.md
    python -m benchmarks.sim_routing --policies ray --max-ongoing 48   # ray's load bound
"""

from __future__ import annotations

import argparse
import functools
import heapq
import random
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

POLICIES = ("random", "least-loaded", "affinity", "ray")


@dataclass
class Replica:
    """One engine: its GPU slots and host tier (LRU order, oldest first), its Ray Serve
    multiplexed cache (LRU on use), and its in-flight requests per adapter.

    ``slots`` and ``host_slots`` are counts of adapters; ``host_slots`` is 0 (no host tier)
    or at least ``slots``; ``max_models`` is ``max_num_models_per_replica``.
    """

    slots: int
    host_slots: int = 0
    max_models: int = 0
    resident: OrderedDict = field(default_factory=OrderedDict)
    host: OrderedDict = field(default_factory=OrderedDict)
    models: OrderedDict = field(default_factory=OrderedDict)
    running: dict[int, int] = field(default_factory=dict)
    in_flight: int = 0
    served: int = 0

    def admit(self, adapter: int) -> tuple[bool, bool, bool]:
        """Admit a request of ``adapter``: ``(slot load, disk load, overflow)``."""
        self.in_flight += 1
        self.served += 1
        self.running[adapter] = self.running.get(adapter, 0) + 1
        _use(self.models, adapter, self.max_models)
        if adapter in self.host:
            self.host.move_to_end(adapter)
        if adapter in self.resident:
            self.resident.move_to_end(adapter)
            return False, False, False
        disk = adapter not in self.host
        if disk and self.host_slots:
            _use(self.host, adapter, self.host_slots)
        overflow = False
        if len(self.resident) >= self.slots:
            victim = next((a for a in self.resident if not self.running.get(a)), None)
            if victim is None:
                victim, overflow = next(iter(self.resident)), True
            del self.resident[victim]
        self.resident[adapter] = True
        return True, disk, overflow

    def finish(self, adapter: int) -> None:
        """A request of ``adapter`` leaves the replica."""
        self.in_flight -= 1
        left = self.running[adapter] - 1
        if left:
            self.running[adapter] = left
        else:
            del self.running[adapter]


def _use(lru: OrderedDict, key: int, capacity: int) -> None:
    """Mark ``key`` most recently used in ``lru``, evicting the oldest beyond ``capacity``."""
    if capacity <= 0:
        return
    if key in lru:
        lru.move_to_end(key)
        return
    lru[key] = True
    if len(lru) > capacity:
        lru.popitem(last=False)


@dataclass
class Result:
    """One (N, policy) row: slot and disk loads per 1,000 requests, busiest / mean requests
    served, overflow count; for the ``floor`` row the last two are None."""

    replicas: int
    policy: str
    slot_loads_per_1k: float
    disk_loads_per_1k: float
    imbalance: float | None
    overflow: int | None


@dataclass
class Stream:
    """A request stream: ``adapter`` int64 ``[requests]`` (0-based Zipf rank), ``gaps`` and
    ``service`` float64 ``[requests]`` (inter-arrival and service times, in mean service
    times)."""

    adapter: np.ndarray
    gaps: np.ndarray
    service: np.ndarray


def zipf_probabilities(adapters: int, s: float) -> np.ndarray:
    """float64 ``[adapters]``: Zipf(s) over adapter ranks 1..adapters, summing to 1."""
    weights = 1.0 / np.arange(1, adapters + 1, dtype=np.float64) ** s
    return weights / weights.sum()


def harmonic(n: int, s: float) -> float:
    """The generalized harmonic number ``H(n, s) = Σ_{i=1..n} i^-s`` (0 for ``n ≤ 0``)."""
    if n <= 0:
        return 0.0
    return float(np.sum(1.0 / np.arange(1, n + 1, dtype=np.float64) ** s))


def floors(num_replicas: int, *, adapters: int, zipf: float, slots: int,
           host_slots: int) -> tuple[float, float]:
    """The lower bounds on ``(slot loads, disk loads)`` per 1,000 requests that any router
    meets under an independent-reference Zipf(``zipf``) stream: ``1000 · (1 - H(C) / H(A))``
    with ``C = min(A, slots · N)`` for slot loads and ``C = min(A, max(slots, host_slots) ·
    N)`` for disk loads (the most distinct adapters the replicas' slots, or host tiers, hold
    at once)."""
    total = harmonic(adapters, zipf)
    held_gpu = min(adapters, slots * num_replicas)
    held_host = min(adapters, max(slots, host_slots) * num_replicas)
    return (1000.0 * (1.0 - harmonic(held_gpu, zipf) / total),
            1000.0 * (1.0 - harmonic(held_host, zipf) / total))


@functools.lru_cache(maxsize=65536)
def home_order(adapter: int, num_replicas: int) -> tuple[int, ...]:
    """The replicas in ``adapter``'s rendezvous-hash order (highest random weight first)."""
    weights = random.Random(adapter * 1_000_003 + num_replicas).random
    return tuple(sorted(range(num_replicas), key=lambda _: weights()))


def _power_of_two(candidates: list[int], replicas: list[Replica], max_ongoing: int,
                  rng: random.Random) -> int | None:
    """One round of Ray Serve's power of two choices (``PowerOfTwoChoicesRequestRouter.
    choose_replicas`` then ``RequestRouter._select_from_candidate_replicas``): sample two
    distinct candidates (the one when there is one), keep those whose queue is below
    ``max_ongoing``, take the shorter queue (the first sampled on a tie); None when neither
    accepts."""
    n = len(candidates)
    if n == 0:
        return None
    if n == 1:
        chosen = [candidates[0]]
    elif n == 2:
        chosen = candidates if rng.getrandbits(1) else candidates[::-1]
    else:
        i = rng.randrange(n)
        j = rng.randrange(n - 1)
        if j >= i:
            j += 1
        chosen = [candidates[i], candidates[j]]
    best, lowest = None, max_ongoing
    for c in chosen:
        if replicas[c].in_flight < lowest:
            best, lowest = c, replicas[c].in_flight
    return best


def route_ray(replicas: list[Replica], adapter: int, max_ongoing: int,
              rng: random.Random) -> int:
    """The replica Ray Serve 2.60's multiplexed routing sends a request of ``adapter`` to
    (the module docstring says which functions it follows)."""
    holders = [i for i, r in enumerate(replicas) if adapter in r.models]
    fewest = min(len(r.models) for r in replicas)
    fewest_ids = [i for i, r in enumerate(replicas) if len(r.models) == fewest]
    if holders:
        pick = _power_of_two(holders, replicas, max_ongoing, rng)
        if pick is not None:
            return pick
    pick = _power_of_two(fewest_ids, replicas, max_ongoing, rng)
    if pick is not None:
        return pick
    if any(r.in_flight < max_ongoing for r in replicas):
        everyone = list(range(len(replicas)))
        while (pick := _power_of_two(everyone, replicas, max_ongoing, rng)) is None:
            pass
        return pick
    least = min(r.in_flight for r in replicas)
    return rng.choice([i for i, r in enumerate(replicas) if r.in_flight == least])


def route(policy: str, replicas: list[Replica], adapter: int, spill: float,
          rng: random.Random, max_ongoing: int = 512) -> int:
    """The replica index ``policy`` sends a request of ``adapter`` to.

    Raises:
        ValueError: an unknown policy.
    """
    if policy == "random":
        return rng.randrange(len(replicas))
    if policy == "ray":
        return route_ray(replicas, adapter, max_ongoing, rng)
    if policy not in ("least-loaded", "affinity"):
        raise ValueError(f"unknown routing policy {policy!r}; known: {', '.join(POLICIES)}")
    loads = [r.in_flight for r in replicas]
    least = min(loads)
    if policy == "affinity":
        bound = (1.0 + spill) * (sum(loads) / len(loads))
        for tier in ("resident", "host"):
            holders = [i for i, r in enumerate(replicas) if adapter in getattr(r, tier)]
            if holders:
                best = min(holders, key=lambda i: (loads[i], rng.random()))
                if loads[best] <= bound:
                    return best
        for i in home_order(adapter, len(replicas)):
            if loads[i] <= bound:
                return i
    return rng.choice([i for i, load in enumerate(loads) if load == least])


def draw_stream(num_replicas: int, *, adapters: int = 1000, zipf: float = 1.0,
                concurrency: float = 32.0, requests: int = 200_000, seed: int = 0) -> Stream:
    """The request stream of one run (the same for every policy with the same seed)."""
    np_rng = np.random.default_rng(seed)
    return Stream(np_rng.choice(adapters, size=requests, p=zipf_probabilities(adapters, zipf)),
                  np_rng.exponential(1.0 / (concurrency * num_replicas), size=requests),
                  np_rng.exponential(1.0, size=requests))


def simulate(num_replicas: int, policy: str, *, adapters: int = 1000, zipf: float = 1.0,
             slots: int = 32, host_slots: int = 256, max_models: int | None = None,
             max_ongoing: int = 512, concurrency: float = 32.0, requests: int = 200_000,
             warmup: int = 20_000, spill: float = 0.25, seed: int = 0,
             stream: Stream | None = None) -> Result:
    """Replay one request stream over ``num_replicas`` replicas routed by ``policy``; counts
    start after ``warmup`` requests. ``stream`` replaces the one drawn from the other
    arguments (its length is then the number of requests).

    Raises:
        ValueError: ``host_slots`` neither 0 nor at least ``slots`` (``max_cpu_loras ≥
            max_loras``), or an unknown policy.
    """
    if host_slots and host_slots < slots:
        raise ValueError(f"--host-slots {host_slots} must be 0 or at least --slots {slots} "
                         "(the host tier holds the slots' adapters too)")
    if max_models is None:
        max_models = max(slots, host_slots)
    rng = random.Random(seed)
    if stream is None:
        stream = draw_stream(num_replicas, adapters=adapters, zipf=zipf,
                             concurrency=concurrency, requests=requests, seed=seed)
    requests = len(stream.adapter)
    choice, gaps, service = stream.adapter, stream.gaps, stream.service
    replicas = [Replica(slots, host_slots, max_models) for _ in range(num_replicas)]
    ends: list[tuple[float, int, int]] = []
    now, slot_loads, disk_loads, overflow = 0.0, 0, 0, 0
    for k in range(requests):
        now += gaps[k]
        while ends and ends[0][0] <= now:
            _, r, a = heapq.heappop(ends)
            replicas[r].finish(a)
        if k == warmup:
            for r in replicas:
                r.served = 0
        adapter = int(choice[k])
        r = route(policy, replicas, adapter, spill, rng, max_ongoing)
        loaded, read, over = replicas[r].admit(adapter)
        if k >= warmup:
            slot_loads += loaded
            disk_loads += read
            overflow += over
        heapq.heappush(ends, (now + service[k], r, adapter))
    served = [r.served for r in replicas]
    counted = requests - warmup
    return Result(num_replicas, policy, 1000.0 * slot_loads / counted,
                  1000.0 * disk_loads / counted,
                  max(served) / (sum(served) / num_replicas), overflow)


def table(results: list[Result]) -> str:
    """Markdown rows: N, policy, slot and disk loads / 1k requests each with its ratio to
    random's, the 1/N target, busiest / mean, overflow (— for the floor rows)."""
    lines = ["| replicas | routing | slot loads / 1k | vs random | disk loads / 1k | vs random | "
             "target (1/N) | busiest / mean | overflow |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    base = {r.replicas: r for r in results if r.policy == "random"}
    for r in results:
        rand = base[r.replicas]
        slot_ratio = r.slot_loads_per_1k / rand.slot_loads_per_1k
        disk_ratio = (f"{r.disk_loads_per_1k / rand.disk_loads_per_1k:.3f}"
                      if rand.disk_loads_per_1k else "—")
        busiest = "—" if r.imbalance is None else f"{r.imbalance:.3f}"
        overflow = "—" if r.overflow is None else str(r.overflow)
        lines.append(f"| {r.replicas} | {r.policy} | {r.slot_loads_per_1k:.1f} | "
                     f"{slot_ratio:.3f} | {r.disk_loads_per_1k:.1f} | {disk_ratio} | "
                     f"{1 / r.replicas:.3f} | {busiest} | {overflow} |")
    return "\n".join(lines)


def main() -> None:
    """Run the table over ``--replicas`` and print it (``--record``: append to BENCHMARKS.md)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES),
                    help="routing policies to run (random is always run: the ratios' base)")
    ap.add_argument("--adapters", type=int, default=1000)
    ap.add_argument("--zipf", type=float, default=1.0)
    ap.add_argument("--slots", type=int, default=32, help="GPU slots per replica (max_loras)")
    ap.add_argument("--host-slots", type=int, default=256,
                    help="host tier per replica (max_cpu_loras, counting the slots' adapters); "
                         "0: no host tier, every slot load reads the disk")
    ap.add_argument("--max-models", type=int, default=None,
                    help="ray: max_num_models_per_replica (default: max(slots, host-slots), "
                         "the max_cpu_loras serve-ray passes)")
    ap.add_argument("--max-ongoing", type=int, default=512,
                    help="ray: max_ongoing_requests per replica (serve-ray: 2 x max_num_seqs)")
    ap.add_argument("--concurrency", type=float, default=32.0,
                    help="mean requests in flight per replica")
    ap.add_argument("--requests", type=int, default=200_000)
    ap.add_argument("--warmup", type=int, default=20_000)
    ap.add_argument("--spill", type=float, default=0.25,
                    help="affinity spills when the holder's load exceeds (1 + spill) x mean")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--record", action="store_true", help="append the table to BENCHMARKS.md")
    args = ap.parse_args()
    if args.host_slots and args.host_slots < args.slots:
        ap.error(f"--host-slots {args.host_slots} must be 0 or at least --slots {args.slots}")
    max_models = args.max_models or max(args.slots, args.host_slots)
    policies = ["random", *(p for p in POLICIES if p in args.policies and p != "random")]
    results = []
    for n in args.replicas:
        results += [simulate(n, p, adapters=args.adapters, zipf=args.zipf, slots=args.slots,
                             host_slots=args.host_slots, max_models=max_models,
                             max_ongoing=args.max_ongoing, concurrency=args.concurrency,
                             requests=args.requests, warmup=args.warmup, spill=args.spill,
                             seed=args.seed)
                    for p in policies]
        slot_floor, disk_floor = floors(n, adapters=args.adapters, zipf=args.zipf,
                                        slots=args.slots, host_slots=args.host_slots)
        results.append(Result(n, "floor", slot_floor, disk_floor, None, None))
    text = table(results)
    print(text)
    if args.record:
        from benchmarks.common import command_line, git_commit, today
        with open("BENCHMARKS.md", "a") as f:
            f.write(f"\n## Routing over replicas with the host tier and Ray Serve's multiplexed"
                    f" routing (simulation, no GPU)\n\ndate: {today()} · commit:"
                    f" `{git_commit()}` · {args.adapters} adapters, Zipf({args.zipf}),"
                    f" {args.slots} GPU slots and a host tier of {args.host_slots} adapters per"
                    f" replica, {args.concurrency:g} requests in flight per replica on average,"
                    f" {args.requests:,} requests ({args.warmup:,} warm-up), affinity spill at"
                    f" {1 + args.spill:g}x the mean load, ray: {max_models} multiplexed models"
                    f" and max_ongoing_requests {args.max_ongoing} per replica (Ray Serve"
                    f" 2.60.0's router)\n\nCommand: `{command_line('benchmarks.sim_routing')}`"
                    f"\n\n{text}\n")


if __name__ == "__main__":
    main()
