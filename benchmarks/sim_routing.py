"""A simulation of routing LoRA requests over replicas (no GPU, no Ray): how many slot loads
random, least-loaded and adapter-affinity routing cost, and how evenly they spread the load
(issue 20, item 5).

The model:

* **requests**: a Poisson stream over ``--adapters`` adapters drawn from Zipf(``--zipf``)
  (adapter ``i`` with probability ``∝ 1 / i^s``), each holding its replica for an
  exponential service time of mean 1; the arrival rate keeps ``--concurrency`` requests in
  flight per replica on average (Little's law).
* **replicas**: ``N`` engines of ``--slots`` GPU slots each. A request admitted to a
  replica whose slots do not hold its adapter costs one slot load; the slot taken is the
  least recently used one that no in-flight request of that replica uses (when every slot
  is in use, the least recently used one: an overcommit the engine would queue instead,
  counted in ``overflow``). Host tiers and disk reads are not modelled: the counts are
  host → GPU slot loads.
* **routing**, decided at arrival from what each replica holds and its in-flight count:
  ``random`` (uniform); ``least-loaded`` (fewest in flight, ties at random);
  ``resident`` (Ray Serve's model multiplexing with manylora's residency signal: among the
  replicas whose slots hold the adapter, the least loaded one, unless its in-flight count
  exceeds ``(1 + --spill) ×`` the mean, or no replica holds it: then the least loaded
  replica overall); ``affinity`` (``resident``, but an adapter no replica holds goes to the
  first replica of its own rendezvous-hash order whose load is within the bound: each
  adapter has a home, so each replica sees about 1/N of the adapters; bounded-load
  consistent hashing, Mirrokni et al. 2018).

Reported per (N, policy), after ``--warmup`` requests: slot loads per 1,000 requests, their
ratio to random routing's, the busiest replica's share of the requests against the mean
(``max / mean``), and the overflow count. The issue's targets: affinity needs at most 1/N of
random's slot loads, and the busiest replica takes at most 1.25x the mean.

    python -m benchmarks.sim_routing                 # the table (a few seconds per row)
    python -m benchmarks.sim_routing --record        # and append it to BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import heapq
import random
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

POLICIES = ("random", "least-loaded", "resident", "affinity")


@dataclass
class Replica:
    """One engine: its slots (LRU order, oldest first) and in-flight requests per adapter."""

    slots: int
    resident: OrderedDict = field(default_factory=OrderedDict)
    running: dict[int, int] = field(default_factory=dict)
    in_flight: int = 0
    served: int = 0

    def admit(self, adapter: int) -> tuple[bool, bool]:
        """Admit a request of ``adapter``: ``(slot load, overflow)``."""
        self.in_flight += 1
        self.served += 1
        self.running[adapter] = self.running.get(adapter, 0) + 1
        if adapter in self.resident:
            self.resident.move_to_end(adapter)
            return False, False
        overflow = False
        if len(self.resident) >= self.slots:
            victim = next((a for a in self.resident if not self.running.get(a)), None)
            if victim is None:
                victim, overflow = next(iter(self.resident)), True
            del self.resident[victim]
        self.resident[adapter] = True
        return True, overflow

    def finish(self, adapter: int) -> None:
        self.in_flight -= 1
        left = self.running[adapter] - 1
        if left:
            self.running[adapter] = left
        else:
            del self.running[adapter]


@dataclass
class Result:
    """One (N, policy) row: loads per 1,000 requests, max / mean requests, overflow."""

    replicas: int
    policy: str
    loads_per_1k: float
    imbalance: float
    overflow: int


def zipf_probabilities(adapters: int, s: float) -> np.ndarray:
    """float64 ``[adapters]``: Zipf(s) over adapter ranks 1..adapters, summing to 1."""
    weights = 1.0 / np.arange(1, adapters + 1, dtype=np.float64) ** s
    return weights / weights.sum()


def home_order(adapter: int, num_replicas: int) -> list[int]:
    """The replicas in ``adapter``'s rendezvous-hash order (highest random weight first)."""
    weights = random.Random(adapter * 1_000_003 + num_replicas).random
    return sorted(range(num_replicas), key=lambda _: weights())


def route(policy: str, replicas: list[Replica], adapter: int, spill: float,
          rng: random.Random) -> int:
    """The replica index ``policy`` sends a request of ``adapter`` to."""
    if policy == "random":
        return rng.randrange(len(replicas))
    loads = [r.in_flight for r in replicas]
    least = min(loads)
    bound = (1.0 + spill) * (sum(loads) / len(loads))
    if policy in ("resident", "affinity"):
        holders = [i for i, r in enumerate(replicas) if adapter in r.resident]
        if holders:
            best = min(holders, key=lambda i: (loads[i], rng.random()))
            if loads[best] <= bound:
                return best
        if policy == "affinity":
            for i in home_order(adapter, len(replicas)):
                if loads[i] <= bound:
                    return i
    return rng.choice([i for i, load in enumerate(loads) if load == least])


def simulate(num_replicas: int, policy: str, *, adapters: int = 1000, zipf: float = 1.0,
             slots: int = 32, concurrency: float = 32.0, requests: int = 200_000,
             warmup: int = 20_000, spill: float = 0.25, seed: int = 0) -> Result:
    """Replay one request stream (the same for every policy with the same seed) over
    ``num_replicas`` replicas routed by ``policy``; counts start after ``warmup``."""
    rng = random.Random(seed)
    np_rng = np.random.default_rng(seed)
    choice = np_rng.choice(adapters, size=requests, p=zipf_probabilities(adapters, zipf))
    gaps = np_rng.exponential(1.0 / (concurrency * num_replicas), size=requests)
    service = np_rng.exponential(1.0, size=requests)
    replicas = [Replica(slots) for _ in range(num_replicas)]
    ends: list[tuple[float, int, int]] = []
    now, loads, overflow = 0.0, 0, 0
    for k in range(requests):
        now += gaps[k]
        while ends and ends[0][0] <= now:
            _, r, a = heapq.heappop(ends)
            replicas[r].finish(a)
        if k == warmup:
            for r in replicas:
                r.served = 0
        adapter = int(choice[k])
        r = route(policy, replicas, adapter, spill, rng)
        loaded, over = replicas[r].admit(adapter)
        if k >= warmup:
            loads += loaded
            overflow += over
        heapq.heappush(ends, (now + service[k], r, adapter))
    served = [r.served for r in replicas]
    counted = requests - warmup
    return Result(num_replicas, policy, 1000.0 * loads / counted,
                  max(served) / (sum(served) / num_replicas), overflow)


def table(results: list[Result]) -> str:
    """Markdown rows: N, policy, loads / 1k requests, vs random, 1/N, max / mean, overflow."""
    lines = ["| replicas | routing | slot loads / 1k requests | vs random | target (1/N) | "
             "busiest / mean | overflow |", "| --- | --- | --- | --- | --- | --- | --- |"]
    random_loads = {r.replicas: r.loads_per_1k for r in results if r.policy == "random"}
    for r in results:
        ratio = r.loads_per_1k / random_loads[r.replicas]
        lines.append(f"| {r.replicas} | {r.policy} | {r.loads_per_1k:.1f} | {ratio:.3f} | "
                     f"{1 / r.replicas:.3f} | {r.imbalance:.3f} | {r.overflow} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--adapters", type=int, default=1000)
    ap.add_argument("--zipf", type=float, default=1.0)
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--concurrency", type=float, default=32.0,
                    help="mean requests in flight per replica")
    ap.add_argument("--requests", type=int, default=200_000)
    ap.add_argument("--warmup", type=int, default=20_000)
    ap.add_argument("--spill", type=float, default=0.25,
                    help="affinity spills when the holder's load exceeds (1 + spill) x mean")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--record", action="store_true", help="append the table to BENCHMARKS.md")
    args = ap.parse_args()
    results = [simulate(n, p, adapters=args.adapters, zipf=args.zipf, slots=args.slots,
                        concurrency=args.concurrency, requests=args.requests,
                        warmup=args.warmup, spill=args.spill, seed=args.seed)
               for n in args.replicas for p in POLICIES]
    text = table(results)
    print(text)
    if args.record:
        from benchmarks.common import command_line, git_commit, today
        with open("BENCHMARKS.md", "a") as f:
            f.write(f"\n## Routing over replicas: slot loads and balance (simulation, no GPU)"
                    f"\n\ndate: {today()} · commit: `{git_commit()}` · {args.adapters} adapters,"
                    f" Zipf({args.zipf}), {args.slots} slots per replica, {args.concurrency:g}"
                    f" requests in flight per replica on average, {args.requests:,} requests"
                    f" ({args.warmup:,} warm-up), affinity spill at {1 + args.spill:g}x the"
                    f" mean load\n\nCommand: `{command_line('benchmarks.sim_routing')}`\n\n"
                    f"{text}\n")


if __name__ == "__main__":
    main()
