"""A roofline simulation of the engine under adapter churn (no GPU): which scheduling policy
keeps a Zipf working set far larger than the slots near the all-fit rate.

The real ``Scheduler`` (``manylora.scheduler.scheduler``, with a real ``KVCacheManager``) plans
every step, so today's policy is replayed as the engine runs it; alternatives are small
subclasses that change one decision (which adapter gets a free slot, how many slots may be
taken per step, how many requests of one adapter may run). Around it, a model of the GPU:

* **step time** (roofline): ``max(bytes / HBM bandwidth, FLOPs / matmul rate) +
  overhead``. Bytes: the base weights (15.08 GB for the Llama-3-8B shape, embedding
  excepted), the KV cache the decode rows read (context × 128 KiB per token), and the
  adapters of the step, each read once (``adapter_bytes``: A and B of q/k/v/o at rank 16
  over 32 layers, 27.3 MB). FLOPs: ``2 × 6.98e9`` per computed token plus ``2 × 0.53e9``
  (LM head) per sampled row; attention's FLOPs are left out (short contexts).
* **slot loads**: an adapter that a step uses and no slot holds is copied on demand; the
  adapters ``Scheduler.wanted_adapters`` names are copied ahead into slots no running
  request uses (``LoRAManager.prefetch``'s rule). Copies run one after the other on a copy
  stream that overlaps compute; a copy starts no earlier than the planning of its step
  (the manager's copy stream waits for the compute queued before it), and a step starts once
  the copies of its adapters are done (the wait is a stall). A copy takes ``adapter bytes /
  PCIe bandwidth`` (one-copy slot loads, issue 17 item 2) or a fixed measured time.
* **host tier**: every adapter is in host memory (``max_cpu_loras`` = all), as in the
  benchmark's timed pass after its warm-up: no disk reads.
* **host**: the engine's host work is hidden by async scheduling; what is left of it is in
  ``overhead`` per step.

The defaults are the H100's measured figures (BENCHMARKS.md: copy bandwidth 3,020 GB/s of
which a batch-1 decode step reaches 82%, bf16 matmul 685 TFLOP/s of which the engine's GEMMs
reach about 75%, pinned host → device about 25 GB/s, today's slot load 9.4 ms). Requests
arrive all at once; every request is prompt ``PROMPT`` + ``NEW`` tokens (``churn_workload``).
Reported per policy: simulated output tok/s, against the same model with every adapter in a
slot (all fit), steps, mean rows per step, slot loads and stall time.

    python -m benchmarks.sim_churn                 # the table, about a minute on one core
    python -m benchmarks.sim_churn --record        # and append it to BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import os
import subprocess
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from benchmarks.churn_workload import ADAPTERS, NEW, PROMPT, zipf_adapters
from manylora.config import SchedulerConfig
from manylora.lora_request import LoRARequest
from manylora.request import Request, RequestStatus
from manylora.sampling_params import SamplingParams
from manylora.scheduler.kv_cache_manager import KVCacheManager
from manylora.scheduler.scheduler import Scheduler

#: Llama-3-8B shape: hidden 4096, 32 layers, 8 KV heads of 128, intermediate 14336.
HIDDEN, LAYERS, KV_DIM = 4096, 32, 1024
BASE_BYTES = 15.08e9                  # weights read by a decode step, bf16, embedding excepted
BODY_PARAMS = 6.98e9                  # parameters every computed token multiplies
HEAD_PARAMS = 0.525e9                 # the LM head, per sampled row
KV_BYTES_PER_TOKEN = 2 * LAYERS * KV_DIM * 2          # K and V, bf16: 128 KiB


def adapter_bytes(rank: int = 16) -> int:
    """Bytes of one rank-``rank`` q/k/v/o adapter's A and B over every layer (bf16)."""
    per_rank = 2 * (HIDDEN + HIDDEN) + 2 * (HIDDEN + KV_DIM)       # q, o; k, v
    return LAYERS * per_rank * rank * 2


@dataclass(frozen=True)
class GPU:
    """The roofline's constants (bytes/s, FLOP/s, seconds)."""

    hbm: float = 3.02e12 * 0.82
    flops: float = 685e12 * 0.75
    overhead: float = 0.3e-3
    pcie: float = 25e9
    load_seconds: float | None = None        # a fixed slot-load time instead of bytes / pcie

    def load_time(self, nbytes: int) -> float:
        return self.load_seconds if self.load_seconds is not None else nbytes / self.pcie

    def step_time(self, tokens: int, sampled: int, kv_tokens: int, adapters: int,
                  nbytes_adapter: int) -> float:
        """Seconds of one step: ``tokens`` computed, ``sampled`` rows through the LM head,
        ``kv_tokens`` of context read, ``adapters`` distinct adapters read once each."""
        nbytes = BASE_BYTES + kv_tokens * KV_BYTES_PER_TOKEN + adapters * nbytes_adapter
        work = 2 * BODY_PARAMS * tokens + 2 * HEAD_PARAMS * sampled
        return max(nbytes / self.hbm, work / self.flops) + self.overhead


class SimSlots:
    """The adapter cache's device tier as the engine drives it (``LoRAManager.activate`` and
    ``prefetch``), with the copy stream's timing; every adapter is in the host tier.

    Implements the scheduler's ``AdapterResidency``: ``is_ready`` always (host tier),
    ``is_resident`` once a copy into a slot was issued.
    """

    def __init__(self, slots: int, load_seconds: float) -> None:
        self.slots = slots
        self.load_seconds = load_seconds
        self.device: OrderedDict[int, float] = OrderedDict()   # adapter → copy done (s), LRU
        self.copy_free = 0.0
        self.loads = 0
        self.wanted: set[int] = set()

    def is_ready(self, lora_int_id: int) -> bool:
        return True

    def is_resident(self, lora_int_id: int) -> bool:
        return lora_int_id in self.device

    def _copy(self, lid: int, now: float) -> None:
        self.copy_free = max(self.copy_free, now) + self.load_seconds
        self.device[lid] = self.copy_free
        self.loads += 1

    def _free_slot(self, keep: set[int]) -> bool:
        if len(self.device) < self.slots:
            return True
        victim = next((lid for lid in self.device if lid not in keep), None)
        if victim is None:
            return False
        del self.device[victim]
        return True

    def activate(self, lids: set[int], now: float) -> float:
        """Bind the step's adapters to slots; when the last of their copies is done."""
        ready = now
        for lid in lids:
            if lid in self.device:
                self.device.move_to_end(lid)
            else:
                if not self._free_slot(lids):
                    raise RuntimeError(f"{len(lids)} adapters exceed {self.slots} slots")
                self._copy(lid, now)
            ready = max(ready, self.device[lid])
        return ready

    def prefetch(self, wanted: list[int], in_use: set[int], now: float) -> None:
        self.wanted = set(wanted)
        keep = set(in_use) | {lid for lid in self.wanted if lid in self.device}
        for lid in wanted:
            if lid in self.device:
                continue
            if not self._free_slot(keep):
                break
            self._copy(lid, now)
            keep.add(lid)


@dataclass
class Result:
    """One simulated run: ``seconds`` of simulated time for ``tokens`` output tokens in
    ``steps`` steps of ``rows`` requests on average; ``loads`` slot copies, ``stall``
    seconds steps waited on copies, ``max_wait_steps`` the step at which the last request
    was first scheduled (how long the most bypassed request waited)."""

    policy: str
    slots: int
    seconds: float
    tokens: int
    steps: int
    rows: float
    loads: int
    stall: float
    max_wait_steps: int

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds


def simulate(make: Callable[[SchedulerConfig, KVCacheManager, SimSlots], Scheduler],
             name: str, slots: int, gpu: GPU, picks: list[int], prompt: int = PROMPT,
             new: int = NEW, max_num_seqs: int = 256, max_num_batched_tokens: int = 8192,
             prefetch_depth: int | None = None, num_blocks: int = 26_000,
             block_size: int = 16, **config: int | None) -> Result:
    """Replay ``picks`` (request i on adapter ``picks[i] + 1``, all arriving at time 0)
    through the scheduler ``make`` builds and the roofline ``gpu``; ``prefetch_depth``
    adapters are staged ahead each step (None: ``slots``, as the engine does); ``config``:
    more ``SchedulerConfig`` fields (``lora_new_adapters_per_step``, ...). The KV cache
    (26,000 blocks of 16 tokens, about the H100's) holds every request: no preemption.

    Raises:
        RuntimeError: the scheduler stopped making progress.
    """
    nbytes = adapter_bytes()
    residency = SimSlots(slots, gpu.load_time(nbytes))
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)
    sched = make(SchedulerConfig(max_num_seqs, max_num_batched_tokens, slots, **config), kv,
                 residency)
    loras = {a: LoRARequest(f"a{a}", a + 1, f"/sim/a{a}") for a in set(picks)}
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    ids = itertools.count()
    for i, a in enumerate(picks):
        first = next(ids) * prompt
        sched.add_request(Request(f"r{i}", None, list(range(first, first + prompt)), params,
                                  loras[a], prompt + new))
    now = stall = 0.0
    steps = rows = tokens = 0
    joined: dict[str, int] = {}
    while sched.has_unfinished_requests():
        out = sched.schedule()
        if not out.scheduled:
            raise RuntimeError(f"{name}: nothing scheduled with {sched.num_waiting} waiting")
        steps += 1
        lids = {s.request.lora_int_id for s in out.scheduled if s.request.lora_int_id}
        ready = residency.activate(lids, now)
        residency.prefetch([r.lora_int_id for r in sched.wanted_adapters(
            slots if prefetch_depth is None else prefetch_depth)],
                           sched.running_adapters(), now)
        stall += ready - now
        sampled = [s for s in out.scheduled if s.sample]
        kv_tokens = sum(s.start for s in out.scheduled if s.num_tokens == 1)
        now = ready + gpu.step_time(out.num_batched_tokens, len(sampled), kv_tokens,
                                    len(lids), nbytes)
        rows += len(out.scheduled)
        for s in out.scheduled:
            joined.setdefault(s.request.request_id, steps)
        sched.update(out, {s.request.request_id: 0 for s in sampled})
        done = [s.request.request_id for s in sampled if s.request.num_output_tokens >= new]
        tokens += len(sampled)
        sched.finish_requests(done, RequestStatus.FINISHED_LENGTH)
    return Result(name, slots, now, tokens, steps, rows / steps, residency.loads, stall,
                  max(joined.values()))


# ---------------------------------------------------------------------------------------------
# Policies: the real scheduler, and variants that change one decision


def today(config, kv, residency) -> Scheduler:
    """The engine's scheduler (``SchedulerConfig`` decides its rules)."""
    return Scheduler(config, kv, residency)


#: The rules before slot loads were paced (issue 17): no load limit, no staging slot.
BEFORE = {"lora_new_adapters_per_step": None, "lora_staging_slots": 0}


class Variant(Scheduler):
    """The engine's scheduler with the rules before this change (``BEFORE``) and one or
    more decisions changed.

    Args:
        order: which waiting adapter gets a free slot (aged requests first, as today):
            ``"arrival"`` (today: resident first, then the oldest waiting request),
            ``"most"`` (the adapter with the most waiting requests: one load serves the
            most requests), ``"fewest"`` (the fewest).
        reserve: slots kept free of running adapters, for copies staged ahead.
        new_per_step: new adapters a step may admit (None: as many as slots allow).
        cap: requests of one adapter running at once (None: no cap): spreads a popular
            adapter's requests over the run, so they fill the batch while the rare
            adapters take turns in the other slots.
    """

    def __init__(self, config, kv, residency, *, order: str = "arrival", reserve: int = 0,
                 new_per_step: int | None = None, cap: int | None = None) -> None:
        config = dataclasses.replace(config, **BEFORE)
        super().__init__(config, kv, residency)
        self.order, self.reserve, self.new_per_step, self.cap = order, reserve, new_per_step, cap

    def _new_adapter_order(self, in_step: set[int]) -> list[int]:
        if self.order == "arrival":
            return super()._new_adapter_order(in_step)
        sign = -1 if self.order == "most" else 1

        def key(lid: int) -> tuple:
            queue = self._queues[lid]
            head = queue.head()
            order = self._order[head.request_id]
            return (0, 0, order) if self._aged(head) else (1, sign * len(queue), order)

        return sorted((lid for lid, q in self._queues.items()
                       if lid and q and lid not in in_step), key=key)

    def _allowed_adapters(self) -> set[int]:
        running = self.running_adapters()
        allowed = running | {0}
        free = self.config.max_loras - self.reserve - len(running)
        if self.new_per_step is not None:
            free = min(free, self.new_per_step)
        for lid in self._new_adapter_order(running):
            if free <= 0:
                break
            allowed.add(lid)
            free -= 1
        return allowed

    def _admit_waiting(self, scheduled, budget: int) -> int:
        if self.cap is None:
            return super()._admit_waiting(scheduled, budget)
        running = Counter(r.lora_int_id for r in self.running)
        held = {}
        for lid, queue in list(self._queues.items()):
            room = max(0, self.cap - running[lid]) if lid else len(queue)
            if room < len(queue):
                newest = sorted(queue, key=lambda r: self._order[r.request_id])[room:]
                for req in newest:
                    queue.remove(req)
                held[lid] = newest
                if not queue:
                    del self._queues[lid]
        try:
            return super()._admit_waiting(scheduled, budget)
        finally:
            for lid, tail in held.items():
                queue = self._queue(lid)
                for req in tail:
                    queue.insert(req)


def variant(**kw) -> Callable:
    """A factory of ``Variant(config, kv, residency, **kw)``."""
    return lambda config, kv, residency: Variant(config, kv, residency, **kw)


#: name → (what it changes, scheduler factory, simulate() keyword arguments).
POLICIES: dict[str, tuple[str, Callable, dict]] = {
    "before": ("the scheduler before this change: a free slot goes to an aged request's "
               "adapter, then a resident one, then the oldest waiting request's; every "
               "waiting request of an admitted adapter joins (one load serves them all); the "
               "next max_loras adapters are staged ahead into free slots", today, BEFORE),
    "most queued first": ("a free slot goes to the adapter with the most waiting requests",
                          variant(order="most"), {}),
    "fewest queued first": ("... with the fewest waiting requests", variant(order="fewest"),
                            {}),
    "1 new adapter per step": ("at most one new adapter admitted per step",
                               variant(new_per_step=1), {}),
    "2 new adapters per step": ("at most two", variant(new_per_step=2), {}),
    "1 slot reserved": ("running adapters use at most max_loras - 1 slots: the free one "
                        "takes the next adapter's copy ahead", variant(reserve=1), {}),
    "2 slots reserved": ("max_loras - 2", variant(reserve=2), {}),
    "1 new per step, 1 reserved": ("both", variant(new_per_step=1, reserve=1), {}),
    "no prefetch": ("before, nothing staged ahead (copies only on demand)", today,
                    dict(BEFORE, prefetch_depth=0)),
    "prefetch depth 2": ("before, the next 2 adapters staged ahead", today,
                         dict(BEFORE, prefetch_depth=2)),
    "16 running per adapter": ("at most 16 requests of one adapter run at once",
                               variant(cap=16), {}),
    "32 running per adapter": ("at most 32", variant(cap=32), {}),
    "token budget 512": ("before, with max_num_batched_tokens 512 (prefill in small chunks, "
                         "under the weight-bound decode steps)", today,
                         dict(BEFORE, max_num_batched_tokens=512)),
    "token budget 256": ("before, with max_num_batched_tokens 256", today,
                         dict(BEFORE, max_num_batched_tokens=256)),
    "after (this commit)": ("the engine's scheduler now: while more adapters wait than "
                            "slots are free, at most lora_new_adapters_per_step = 1 new "
                            "adapter per step and lora_staging_slots = 1 slot kept for "
                            "staged copies; aging as before", today, {}),
}


def run_all(policies: list[str], load_ms: list[float | None]) -> list[dict]:
    """Every policy at 16 slots and the all-fit run (256 slots, today's scheduler, the same
    keyword arguments), for each slot-load time (None: bytes / PCIe)."""
    picks = zipf_adapters()
    rows = []
    for ms in load_ms:
        gpu = GPU(load_seconds=None if ms is None else ms / 1e3)
        fits: dict[tuple, Result] = {}
        for name in policies:
            _, make, kw = POLICIES[name]
            key = tuple(sorted((k, v) for k, v in kw.items()
                               if k == "max_num_batched_tokens"))
            if key not in fits:
                fits[key] = simulate(today, "all fit", ADAPTERS, gpu, picks, **dict(key))
            r = simulate(make, name, 16, gpu, picks, **kw)
            rows.append({"load_ms": gpu.load_time(adapter_bytes()) * 1e3, "result": r,
                         "fit": fits[key]})
            print(f"{name} ({rows[-1]['load_ms']:.1f} ms loads): {r.rate:,.0f} tok/s, "
                  f"{r.rate / fits[key].rate:.0%} of all fit ({fits[key].rate:,.0f})",
                  flush=True)
    return rows


def table(rows: list[dict]) -> tuple[list[str], list[list]]:
    """``run_all``'s rows as markdown table columns and cells."""
    columns = ["policy (16 slots)", "slot load ms", "simulated tok/s", "all fit tok/s",
               "vs all fit", "vs vLLM 0.26 (3,136)", "steps", "rows per step (mean)",
               "slot loads", "stall s", "last request's first step"]
    out = []
    for row in rows:
        r, fit = row["result"], row["fit"]
        out.append([r.policy, f"{row['load_ms']:.1f}", f"{r.rate:,.0f}", f"{fit.rate:,.0f}",
                    f"{r.rate / fit.rate:.0%}", f"{r.rate / 3136:.2f}x", r.steps,
                    f"{r.rows:.0f}", r.loads, f"{r.stall:.2f}", r.max_wait_steps])
    return columns, out


def _commit() -> str:
    override = os.environ.get("MANYLORA_COMMIT")
    if override:
        return override
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True, cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policies", nargs="+", choices=list(POLICIES), default=list(POLICIES))
    ap.add_argument("--load-ms", nargs="+", type=float, default=[0.0, 9.4],
                    help="slot-load times to simulate, ms (0: the adapter's bytes over PCIe)")
    ap.add_argument("--record", action="store_true", help="append the table to BENCHMARKS.md")
    args = ap.parse_args()
    rows = run_all(args.policies, [ms or None for ms in args.load_ms])
    columns, cells = table(rows)
    lines = ["| " + " | ".join(columns) + " |", "| " + " | ".join("---" for _ in columns) + " |"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in cells]
    text = "\n".join(lines)
    print(text)
    if args.record:
        from benchmarks.common import BENCHMARKS_MD

        gpu = GPU()
        section = (f"\n## Scheduling under churn: roofline simulation (no GPU; H100 constants)\n\n"
                   f"date: {datetime.date.today().isoformat()} · commit: `{_commit()}`\n\n"
                   f"Command: `python -m benchmarks.sim_churn --record`\n\n{text}\n\n"
                   f"Policies: " + "; ".join(f"**{n}**: {POLICIES[n][0]}" for n in args.policies)
                   + f". Model: HBM {gpu.hbm / 1e12:.2f} TB/s, matmul {gpu.flops / 1e12:.0f} "
                   f"TFLOP/s, {gpu.overhead * 1e3:.1f} ms per step, PCIe {gpu.pcie / 1e9:.0f} "
                   "GB/s (see the module's docstring).\n")
        with BENCHMARKS_MD.open("a") as f:
            f.write(section)


if __name__ == "__main__":
    main()
