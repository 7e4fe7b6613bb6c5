"""The routing simulation (benchmarks/sim_routing.py) against counts made independently of
it: hand-computable streams, the floor as a lower bound, and Ray Serve's routing rules."""

from __future__ import annotations

import random
from fractions import Fraction

import numpy as np
import pytest

from benchmarks.sim_routing import (
    POLICIES,
    Replica,
    Stream,
    draw_stream,
    floors,
    harmonic,
    route_ray,
    simulate,
)

SMALL = dict(adapters=60, zipf=1.0, slots=2, host_slots=8, concurrency=4.0, requests=6000,
             warmup=600)


def test_one_replica_every_policy_counts_the_same():
    results = [simulate(1, p, **SMALL) for p in POLICIES]
    first = results[0]
    for r in results[1:]:
        assert (r.slot_loads_per_1k, r.disk_loads_per_1k, r.overflow) == (
            first.slot_loads_per_1k, first.disk_loads_per_1k, first.overflow)
        assert r.imbalance == 1.0


def _sequential(adapters: list[int]) -> Stream:
    """One request at a time: each ends long before the next arrives."""
    n = len(adapters)
    return Stream(np.array(adapters), np.full(n, 10.0), np.full(n, 1.0))


def test_two_adapters_one_slot_counts_by_hand():
    seq = [0, 0, 1, 0, 1, 1, 1, 0, 0, 1]       # switches at 2, 3, 4, 7, 9: five after warm-up 1
    common = dict(slots=1, warmup=1, stream=_sequential(seq))
    gpu_only = simulate(1, "random", host_slots=0, **common)
    assert gpu_only.slot_loads_per_1k == pytest.approx(1000 * 5 / 9)
    assert gpu_only.disk_loads_per_1k == gpu_only.slot_loads_per_1k
    host_one = simulate(1, "random", host_slots=1, **common)
    assert host_one.disk_loads_per_1k == pytest.approx(1000 * 5 / 9)
    host_two = simulate(1, "random", host_slots=2, **common)   # both read once, at 0 and 2
    assert host_two.slot_loads_per_1k == pytest.approx(1000 * 5 / 9)
    assert host_two.disk_loads_per_1k == pytest.approx(1000 * 1 / 9)
    assert gpu_only.overflow == 0


def test_host_tier_is_lru_on_every_request():
    # host of 2: 0 and 1 read, 0 touched by its request, so 2 evicts 1 and the last 0 hits
    # the host (first-in-first-out would have evicted 0 and read it again)
    result = simulate(1, "random", slots=1, host_slots=2, warmup=0,
                      stream=_sequential([0, 1, 0, 2, 0]))
    assert result.slot_loads_per_1k == pytest.approx(1000.0)
    assert result.disk_loads_per_1k == pytest.approx(1000 * 3 / 5)


def test_slot_loads_match_an_independent_lru_count_on_a_drawn_stream():
    stream = draw_stream(1, adapters=5, zipf=1.0, concurrency=1.0, requests=3000, seed=3)
    stream.gaps[:] = 10.0                                   # one request in flight at a time
    adapters = stream.adapter.tolist()
    switches = sum(a != b for a, b in zip(adapters[1000:], adapters[999:-1]))
    result = simulate(1, "least-loaded", slots=1, host_slots=0, warmup=1000, stream=stream)
    assert result.slot_loads_per_1k == pytest.approx(1000 * switches / 2000)


def test_host_tier_changes_disk_loads_not_slot_loads_of_load_blind_routing():
    for policy in ("random", "least-loaded"):
        gpu_only = simulate(2, policy, **{**SMALL, "host_slots": 0})
        with_host = simulate(2, policy, **SMALL)
        assert with_host.slot_loads_per_1k == gpu_only.slot_loads_per_1k
        assert gpu_only.disk_loads_per_1k == gpu_only.slot_loads_per_1k
        assert with_host.disk_loads_per_1k < with_host.slot_loads_per_1k


def test_host_tier_smaller_than_the_slots_is_refused():
    with pytest.raises(ValueError, match="host-slots 1 must be 0 or at least --slots 2"):
        simulate(1, "random", adapters=4, slots=2, host_slots=1, requests=10, warmup=0)


def test_harmonic_and_floors_against_exact_fractions():
    exact = sum(Fraction(1, i * i) for i in range(1, 11))
    assert harmonic(10, 2.0) == pytest.approx(float(exact), rel=1e-12)
    slot_floor, disk_floor = floors(2, adapters=10, zipf=1.0, slots=2, host_slots=4)
    h = [sum(Fraction(1, i) for i in range(1, n + 1)) for n in (4, 8, 10)]
    assert slot_floor == pytest.approx(1000 * float(1 - h[0] / h[2]), rel=1e-12)
    assert disk_floor == pytest.approx(1000 * float(1 - h[1] / h[2]), rel=1e-12)
    assert floors(3, adapters=10, zipf=1.0, slots=2, host_slots=4)[1] == 0.0


@pytest.mark.parametrize("replicas", [2, 3])
def test_floor_is_below_every_policy(replicas):
    slot_floor, disk_floor = floors(replicas, adapters=SMALL["adapters"], zipf=1.0,
                                    slots=SMALL["slots"], host_slots=SMALL["host_slots"])
    assert 0 < disk_floor < slot_floor
    for policy in POLICIES:
        r = simulate(replicas, policy, **SMALL)
        assert r.slot_loads_per_1k >= slot_floor, policy
        assert r.disk_loads_per_1k >= disk_floor, policy


def _random_replicas(rng: random.Random, n: int, max_ongoing: int) -> list[Replica]:
    replicas = []
    for _ in range(n):
        r = Replica(slots=1, host_slots=0, max_models=4)
        for a in rng.sample(range(6), rng.randint(0, 4)):
            r.models[a] = True
        r.in_flight = rng.randint(max_ongoing - 3, max_ongoing)
        replicas.append(r)
    return replicas


def test_ray_routing_follows_the_ray_serve_rules():
    rng = random.Random(0)
    max_ongoing = 4
    seen_holder_full = False
    for trial in range(3000):
        replicas = _random_replicas(rng, rng.randint(1, 5), max_ongoing)
        adapter = rng.randrange(6)
        holders = [i for i, r in enumerate(replicas) if adapter in r.models]
        open_ = [i for i, r in enumerate(replicas) if r.in_flight < max_ongoing]
        open_holders = [i for i in holders if i in open_]
        chosen = route_ray(replicas, adapter, max_ongoing, random.Random(trial))
        if open_:
            assert chosen in open_                       # never past max_ongoing_requests
        else:
            assert replicas[chosen].in_flight == min(r.in_flight for r in replicas)
        # power of two choices over the holders: a holder with room is always sampled
        # when at most two hold the id or at most one holder is full
        if open_holders and (len(holders) <= 2 or len(holders) - len(open_holders) <= 1):
            assert chosen in holders
            if len(holders) <= 2:
                assert replicas[chosen].in_flight == min(replicas[i].in_flight
                                                         for i in open_holders)
        if holders and not open_holders:
            seen_holder_full = True
            fewest = min(len(r.models) for r in replicas)
            open_fewest = [i for i in open_ if len(replicas[i].models) == fewest]
            if len(open_fewest) == len([r for r in replicas if len(r.models) == fewest]):
                assert chosen in open_fewest             # the retry: fewest models first
    assert seen_holder_full


def test_ray_routing_without_holders_goes_to_the_replicas_with_fewest_models():
    replicas = [Replica(1, 0, 8) for _ in range(4)]
    for i, r in enumerate(replicas):
        for a in range(10 * i, 10 * i + (3 if i in (1, 3) else 5)):
            r.models[a] = True
    for seed in range(50):
        assert route_ray(replicas, 99, 512, random.Random(seed)) in (1, 3)


def test_multiplexed_cache_reports_the_most_recently_used_adapters():
    replica = Replica(slots=1, host_slots=2, max_models=2)
    for adapter in (0, 1, 0, 2):
        replica.admit(adapter)
        replica.finish(adapter)
    assert list(replica.models) == [0, 2]
    assert list(replica.host) == [0, 2]
    assert list(replica.resident) == [2]
