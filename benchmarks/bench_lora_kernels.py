"""LoRA shrink + expand kernels: one LoRA application on Llama-3-8B projections, against its floor.

One LoRA application of a (packed) projection is ``buffer = lora_shrink(x, A, ranks, lora_meta)``
then ``lora_expand(y, buffer, B, ranks, lora_meta, output_slices)``, the engine's public ops
(Triton on CUDA; ``ranks``: the projection's columns of the rank table, B rank-major).
Shapes are Llama-3-8B's: qkv (4096 → 4096/1024/1024), o (4096 → 4096), gate_up
(4096 → 14336/14336), down (14336 → 4096); bf16; ``max_loras = 256`` slots of padded rank
``max_lora_rank = 64``, so ranks 8 and 16 measure rank skipping. Rows are assigned to the
adapters present round-robin (row ``t`` → slot ``t % n``), so each gets ``T / n`` rows.

Each row reports:

* ours: median µs of a CUDA-graph replay of shrink + expand (L2 cleared before each replay);
* floor bytes: x read once (``T*in``), the A and B of the adapters present at their TRUE rank
  for every slice (``n*r*in`` per slice for A, ``n*r*out_s`` for B) and y read and written
  once (``2*T*out``), all bf16. Not counted: the float32 shrink buffer between the two
  kernels (an implementation choice, not a floor) and the int32 index tensors;
* GB/s = floor bytes / time (1 GB = 1e9 B), and that as a % of the measured copy bandwidth;
* gather + bmm: the same work as a user would write it in PyTorch, per slice
  ``h = bmm(x[:, None], A[idx].mT)``, ``y[:, cols] += bmm(h, B[idx].mT)[:, 0]`` in bf16 at
  the padded max rank, timed the same way; speedup = its time / ours;
* rel err: ``||Δ − Δ_ref|| / ||Δ_ref||`` of ours, where ``Δ`` is the change of y and ``Δ_ref``
  the gather + bmm result computed in float32; above 2e-2 the script stops.

    python -m benchmarks.bench_lora_kernels            # appends BENCHMARKS.md (est. 2-3 min, H100)
    python -m benchmarks.bench_lora_kernels --quick    # a few shapes, no record
    python -m benchmarks.bench_lora_kernels --device cpu   # smoke run: TRITON_INTERPRET=1,
                                                           # tiny shapes, perf_counter timing
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from benchmarks.common import (
    command_line,
    do_bench_median,
    gpu_name,
    measure_copy_bandwidth,
    record,
    time_cpu,
    time_cuda_graph,
)

MAX_LORAS = 256
MAX_RANK = 64
DTYPE = torch.bfloat16
ELEM = 2                                    # bytes per bf16 element
REL_TOL = 2e-2

#: name → (in_features, output widths of the packed slices), Llama-3-8B.
PROJECTIONS: dict[str, tuple[int, tuple[int, ...]]] = {
    "qkv": (4096, (4096, 1024, 1024)),
    "o": (4096, (4096,)),
    "gate_up": (4096, (14336, 14336)),
    "down": (14336, (4096,)),
}
#: --tiny-shapes (implied on CPU) divides every width by this.
TINY_DIVISOR = 16

TOKENS = (1, 8, 32, 64, 128, 256)
ADAPTERS = (1, 8, 64, 256)
RANKS = (8, 16, 64)
SWEEP_RANK = 16
SCHEDULE_TOKENS = (8, 64, 256)
SCHEDULE_ROWS_PER_ADAPTER = (1, 2, 4, 8, 16)


@dataclass(frozen=True)
class Case:
    """One measurement: projection, tokens T, distinct adapters n, true rank, variant."""

    proj: str
    tokens: int
    adapters: int
    rank: int
    variant: str | None = None             # None: the one build_lora_kernel_meta picks


class Weights(NamedTuple):
    """Slot buffers of one projection, laid out as the engine's ``LoRASlots``."""

    a_stacked: tuple[torch.Tensor, ...]      # S x [MAX_LORAS, MAX_RANK, in]
    b_stacked: tuple[torch.Tensor, ...]      # S x [MAX_LORAS, MAX_RANK, out_s] (rank-major)
    output_slices: tuple[tuple[int, int], ...]
    ranks: torch.Tensor                      # int32 [MAX_LORAS, S], 0 for empty slots


class Result(NamedTuple):
    """Timings (ms), floor bytes and errors of one case."""

    case: Case
    variant: str
    ours_ms: float
    torch_ms: float | None
    floor_bytes: int
    rel_err: float
    timing: str


def adapters_for(tokens: int) -> list[int]:
    """The adapter counts of the sweep, capped at ``tokens``, deduplicated, ascending."""
    return sorted({min(n, tokens) for n in ADAPTERS})


def full_sweep() -> tuple[list[Case], list[Case], list[Case]]:
    """(main sweep, rank sweep, variant comparison) of the full run."""
    main = [Case(p, t, n, SWEEP_RANK) for p in ("qkv", "down") for t in TOKENS
            for n in adapters_for(t)]
    ranks = [Case(p, 64, 64, r) for p in PROJECTIONS for r in RANKS]
    sched = [Case(p, t, t // rows, SWEEP_RANK, s) for p in ("qkv", "down")
             for t in SCHEDULE_TOKENS for rows in SCHEDULE_ROWS_PER_ADAPTER
             if rows <= t and t // rows <= MAX_LORAS for s in ("sgmv", "bgmv")]
    return main, ranks, sched


def quick_sweep() -> tuple[list[Case], list[Case], list[Case]]:
    """A handful of cases of each kind, to check the script end to end."""
    main = [Case(p, t, n, SWEEP_RANK) for p in ("qkv", "down") for t in (1, 16)
            for n in sorted({1, t})]
    ranks = [Case("o", 16, 16, r) for r in (8, 64)] + [Case("gate_up", 16, 16, SWEEP_RANK)]
    sched = [Case("qkv", 16, n, SWEEP_RANK, s) for n in (16, 4) for s in ("sgmv", "bgmv")]
    return main, ranks, sched


def shapes(proj: str, tiny: bool) -> tuple[int, tuple[int, ...]]:
    """(in_features, slice widths) of ``proj``, divided by TINY_DIVISOR if ``tiny``."""
    fan_in, outs = PROJECTIONS[proj]
    if not tiny:
        return fan_in, outs
    return fan_in // TINY_DIVISOR, tuple(o // TINY_DIVISOR for o in outs)


def make_weights(fan_in: int, outs: Sequence[int], rank: int, filled: int,
                 device: torch.device, seed: int) -> Weights:
    """Slot buffers with ``filled`` random adapters of rank ``rank`` in slots ``0..filled-1``.

    A ~ N(0, 1/in) and B ~ N(0, 1/rank) (so the delta has unit scale); rows of A and B
    past ``rank`` and the other slots are zero (the gather + bmm baseline reads them).
    """
    gen = torch.Generator(device).manual_seed(seed)
    a_stacked, b_stacked, slices, offset = [], [], [], 0
    for out in outs:
        a = torch.zeros(MAX_LORAS, MAX_RANK, fan_in, dtype=DTYPE, device=device)
        a[:filled, :rank] = torch.randn(filled, rank, fan_in, generator=gen, device=device,
                                        dtype=DTYPE) * fan_in ** -0.5
        b = torch.zeros(MAX_LORAS, MAX_RANK, out, dtype=DTYPE, device=device)
        b[:filled, :rank] = torch.randn(filled, rank, out, generator=gen, device=device,
                                        dtype=DTYPE) * rank ** -0.5
        a_stacked.append(a)
        b_stacked.append(b)
        slices.append((offset, out))
        offset += out
    ranks = torch.zeros(MAX_LORAS, len(outs), dtype=torch.int32, device=device)
    ranks[:filled] = rank
    return Weights(tuple(a_stacked), tuple(b_stacked), tuple(slices), ranks)


def floor_bytes(fan_in: int, outs: Sequence[int], tokens: int, adapters: int,
                rank: int) -> int:
    """Bytes one LoRA application must move at least (see the module docstring)."""
    out_total = sum(outs)
    x = tokens * fan_in
    a = adapters * rank * fan_in * len(outs)
    b = adapters * rank * out_total
    y = 2 * tokens * out_total
    return (x + a + b + y) * ELEM


def gather_bmm(x: torch.Tensor, y: torch.Tensor, weights: Weights, idx: torch.Tensor,
               compute_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The PyTorch way: per slice, gather each row's A and B and bmm at the padded rank.

    Adds the delta into ``y`` in place (in ``y``'s dtype) when ``compute_dtype`` is None;
    otherwise computes in ``compute_dtype`` and returns the delta ``[T, out_total]``
    without touching ``y``.
    """
    xb = x.unsqueeze(1)                                              # [T, 1, in]
    if compute_dtype is None:
        for a, b, (off, size) in zip(weights.a_stacked, weights.b_stacked,
                                     weights.output_slices):
            h = torch.bmm(xb, a[idx].transpose(1, 2))                 # [T, 1, R]
            y[:, off: off + size] += torch.bmm(h, b[idx]).squeeze(1)
        return y
    xb = xb.to(compute_dtype)
    delta = torch.zeros(y.shape, dtype=compute_dtype, device=y.device)
    for a, b, (off, size) in zip(weights.a_stacked, weights.b_stacked, weights.output_slices):
        h = torch.bmm(xb, a[idx].to(compute_dtype).transpose(1, 2))
        delta[:, off: off + size] = torch.bmm(h, b[idx].to(compute_dtype)).squeeze(1)
    return delta


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """``||got − want|| / ||want||`` in float64."""
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


class Timer:
    """Median time of a callable, in ms: CUDA-graph replays on CUDA, perf_counter on CPU.

    If a capture fails (the callable does something a graph cannot hold), this and every
    later measurement falls back to eager ``do_bench`` timing, and rows say so.
    """

    def __init__(self, device: torch.device, graph: bool, warmup: int, rep: int) -> None:
        self.device, self.graph, self.warmup, self.rep = device, graph, warmup, rep

    @property
    def mode(self) -> str:
        if self.device.type != "cuda":
            return "cpu"
        return "graph" if self.graph else "eager"

    def __call__(self, fn: Callable[[], object]) -> float:
        if self.device.type != "cuda":
            return time_cpu(fn, reps=3)
        if self.graph:
            try:
                return time_cuda_graph(fn, warmup=self.warmup, rep=self.rep)
            except Exception as exc:                 # any capture failure: time eagerly
                print(f"warning: CUDA-graph capture failed ({type(exc).__name__}: {exc}); "
                      "timing eagerly from here on", file=sys.stderr, flush=True)
                self.graph = False
                torch.cuda.synchronize()
        return do_bench_median(fn, warmup=self.warmup, rep=self.rep)


class Bench:
    """Runs cases, reusing the slot buffers of one (projection, rank) at a time."""

    def __init__(self, ops: dict[str, Any], device: torch.device, tiny: bool, timer: Timer,
                 filled: dict[tuple[str, int], int], seed: int = 0) -> None:
        self.ops, self.device, self.tiny, self.timer = ops, device, tiny, timer
        self.filled, self.seed = filled, seed
        self._weights: tuple[tuple[str, int], Weights] | None = None

    def weights(self, proj: str, rank: int) -> Weights:
        key = (proj, rank)
        if self._weights is None or self._weights[0] != key:
            self._weights = None
            fan_in, outs = shapes(proj, self.tiny)
            self._weights = (key, make_weights(fan_in, outs, rank, self.filled[key],
                                               self.device, self.seed))
        return self._weights[1]

    def run(self, case: Case, with_torch: bool = True) -> Result:
        fan_in, outs = shapes(case.proj, self.tiny)
        w = self.weights(case.proj, case.rank)
        gen = torch.Generator(self.device).manual_seed(self.seed + case.tokens)
        x = torch.randn(case.tokens, fan_in, generator=gen, device=self.device, dtype=DTYPE)
        y0 = torch.randn(case.tokens, sum(outs), generator=gen, device=self.device,
                         dtype=DTYPE) * 0.1
        token_slots = [t % case.adapters for t in range(case.tokens)]
        lora_meta = self.ops["build_lora_kernel_meta"](token_slots, MAX_LORAS, self.device,
                                                     variant=case.variant)
        if case.variant is not None and lora_meta.variant != case.variant:
            raise RuntimeError(f"{case}: build_lora_kernel_meta(variant={case.variant!r}) gave "
                               f"variant {lora_meta.variant!r}")
        idx = torch.tensor(token_slots, dtype=torch.long, device=self.device)
        shrink, expand = self.ops["lora_shrink"], self.ops["lora_expand"]

        def ours(y: torch.Tensor) -> None:
            buffer = shrink(x, w.a_stacked, w.ranks, lora_meta)
            expand(y, buffer, w.b_stacked, w.ranks, lora_meta, w.output_slices)

        want = gather_bmm(x, y0, w, idx, compute_dtype=torch.float32)
        buffer = shrink(x, w.a_stacked, w.ranks, lora_meta)
        expected = (case.tokens, len(outs), MAX_RANK)
        if buffer.dtype != torch.float32 or tuple(buffer.shape) != expected:
            raise RuntimeError(f"{case}: lora_shrink returned {buffer.dtype} "
                               f"{tuple(buffer.shape)}, expected float32 {expected}")
        y = y0.clone()
        ours(y)
        err = rel_err(y.float() - y0.float(), want)
        if not err < REL_TOL:
            raise RuntimeError(f"WRONG RESULT {case} (variant {lora_meta.variant}): rel err "
                               f"{err:.3e} of lora_shrink+lora_expand vs float32 gather+bmm "
                               f"(tolerance {REL_TOL})")
        y_torch = y0.clone()
        gather_bmm(x, y_torch, w, idx)
        err_torch = rel_err(y_torch.float() - y0.float(), want)
        if not err_torch < REL_TOL:
            raise RuntimeError(f"{case}: the bf16 gather+bmm baseline is off by {err_torch:.3e}"
                               " vs float32: the benchmark itself is wrong")

        y_ours, y_base = y0.clone(), y0.clone()
        mode = self.timer.mode
        ours_ms = self.timer(lambda: ours(y_ours))
        torch_ms = self.timer(lambda: gather_bmm(x, y_base, w, idx)) if with_torch else None
        if self.timer.mode != mode:
            mode = f"{mode} / {self.timer.mode}"
        nbytes = floor_bytes(fan_in, outs, case.tokens, case.adapters, case.rank)
        return Result(case, lora_meta.variant, ours_ms, torch_ms, nbytes, err, mode)


def fmt_us(ms: float) -> str:
    return f"{ms * 1e3:.1f}"


def result_row(r: Result, bandwidth: float) -> list[str]:
    """A row of the main and rank tables."""
    c = r.case
    gbps = r.floor_bytes / (r.ours_ms * 1e-3) / 1e9
    pct = f"{gbps * 1e9 / bandwidth:.0%}" if bandwidth == bandwidth else "n/a"
    speedup = f"{r.torch_ms / r.ours_ms:.1f}x" if r.torch_ms is not None else "n/a"
    torch_us = fmt_us(r.torch_ms) if r.torch_ms is not None else "n/a"
    return [c.proj, str(c.tokens), str(c.adapters), str(c.tokens // c.adapters), str(c.rank),
            r.variant, fmt_us(r.ours_ms), f"{r.floor_bytes / 1e6:.2f}", f"{gbps:.0f}", pct,
            torch_us, speedup, f"{r.rel_err:.1e}", r.timing]


RESULT_COLUMNS = ["proj", "T", "adapters", "rows/adapter", "rank", "variant", "ours µs",
                  "floor MB", "GB/s", "% copy BW", "gather+bmm µs", "speedup", "rel err",
                  "timed"]
SCHEDULE_COLUMNS = ["proj", "T", "adapters", "rows/adapter", "sgmv µs", "bgmv µs",
                    "bgmv / sgmv", "default pick", "best % copy BW", "timed"]


def schedule_rows(results: Sequence[Result], bandwidth: float,
                  default_pick: Callable[[Case], str]) -> list[list[str]]:
    """Pairs (sgmv, bgmv) of the same shape → one row each."""
    by_shape: dict[tuple[str, int, int], dict[str, Result]] = {}
    for r in results:
        c = r.case
        by_shape.setdefault((c.proj, c.tokens, c.adapters), {})[c.variant or r.variant] = r
    rows = []
    for (proj, tokens, adapters), pair in by_shape.items():
        sg, bg = pair["sgmv"], pair["bgmv"]
        best = min(sg.ours_ms, bg.ours_ms)
        pct = (f"{sg.floor_bytes / (best * 1e-3) / bandwidth:.0%}"
               if bandwidth == bandwidth else "n/a")
        rows.append([proj, str(tokens), str(adapters), str(tokens // adapters),
                     fmt_us(sg.ours_ms), fmt_us(bg.ours_ms), f"{bg.ours_ms / sg.ours_ms:.2f}",
                     default_pick(sg.case), pct, sg.timing])
    return rows


def load_ops() -> dict[str, Any]:
    """The engine's public LoRA ops (imported late, after TRITON_INTERPRET is settled)."""
    from manylora.lora.kernels.expand import lora_expand
    from manylora.lora.kernels.meta import build_lora_kernel_meta
    from manylora.lora.kernels.shrink import lora_shrink

    return dict(build_lora_kernel_meta=build_lora_kernel_meta, lora_shrink=lora_shrink,
                lora_expand=lora_expand)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="cuda (default when present) or cpu (smoke run: TRITON_INTERPRET=1, "
                    "quick sweep, tiny shapes, perf_counter timing, no record)")
    ap.add_argument("--quick", action="store_true", help="a few shapes only; no record")
    ap.add_argument("--tiny-shapes", action="store_true",
                    help=f"divide every width by {TINY_DIVISOR} (implied on CPU); no record")
    ap.add_argument("--eager", action="store_true",
                    help="time eager calls with do_bench instead of CUDA-graph replays")
    ap.add_argument("--warmup-ms", type=int, default=25, help="do_bench warmup, ms")
    ap.add_argument("--rep-ms", type=int, default=100, help="do_bench timed span, ms")
    ap.add_argument("--no-record", action="store_true", help="do not append to BENCHMARKS.md")
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but torch sees no CUDA device")
    on_cpu = device.type != "cuda"
    if on_cpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    quick, tiny = args.quick or on_cpu, args.tiny_shapes or on_cpu
    write = not (args.no_record or quick or tiny or on_cpu)
    ops = load_ops()
    t_start = time.perf_counter()

    if not on_cpu and device.index is not None:
        torch.cuda.set_device(device)
    bandwidth = float("nan") if on_cpu else measure_copy_bandwidth(device)
    if not on_cpu:
        print(f"{gpu_name(device)}: copy bandwidth {bandwidth / 1e9:.0f} GB/s", flush=True)
    main_cases, rank_cases, sched_cases = quick_sweep() if quick else full_sweep()
    filled: dict[tuple[str, int], int] = {}
    for c in (*main_cases, *rank_cases, *sched_cases):
        filled[(c.proj, c.rank)] = max(filled.get((c.proj, c.rank), 0), c.adapters)
    timer = Timer(device, graph=not args.eager, warmup=args.warmup_ms, rep=args.rep_ms)
    bench = Bench(ops, device, tiny, timer, filled)

    def run_all(cases: Sequence[Case], with_torch: bool) -> list[Result]:
        out = []
        for case in sorted(cases, key=lambda c: (c.proj, c.rank)):
            r = bench.run(case, with_torch)
            out.append(r)
            print(" | ".join(result_row(r, bandwidth)), flush=True)
        order = {c: i for i, c in enumerate(cases)}
        return sorted(out, key=lambda r: order[r.case])

    main_results = run_all(main_cases, True)
    rank_results = run_all(rank_cases, True)
    sched_results = run_all(sched_cases, False)

    def default_pick(case: Case) -> str:
        slots = [t % case.adapters for t in range(case.tokens)]
        return ops["build_lora_kernel_meta"](slots, MAX_LORAS, device).variant

    gpu = gpu_name(device)
    command = command_line("benchmarks.bench_lora_kernels")
    shape = (f"Llama-3-8B / {TINY_DIVISOR} (tiny smoke shapes)" if tiny else "Llama-3-8B")
    r0 = rank_cases[0]
    timing = {
        "graph": "median of CUDA-graph replays of `lora_shrink` + `lora_expand` (the public "
                 "ops), L2 cleared before each replay",
        "eager": "median of eager calls of `lora_shrink` + `lora_expand` (the public ops; a "
                 "CUDA-graph capture failed or --eager), L2 cleared before each call",
        "cpu": "SMOKE RUN ON CPU: median perf_counter wall time of the public ops, not a "
               "measurement",
    }[timer.mode]
    floor_note = (
        f"ours = {timing}. Floor MB = x read once + the A and B of the "
        "adapters present at their true rank, every slice + y read and written once, bf16; "
        "the float32 shrink buffer and the index tensors are not counted. GB/s = floor / "
        "time (1 GB = 1e9 B); % copy BW = that / the measured copy bandwidth. gather+bmm = "
        "per slice `h = bmm(x[:, None], A[idx].mT)`, `y[:, cols] += bmm(h, B[idx].mT)` in "
        "bf16 at the padded rank 64, timed the same way; speedup = its time / ours. rel err "
        "= ‖Δy − Δy_ref‖ / ‖Δy_ref‖ against gather+bmm in float32 (checked < 2e-2 for every "
        f"row). {MAX_LORAS} slots of max_lora_rank {MAX_RANK}; row t uses slot t % adapters; "
        "x ~ N(0, 1), A ~ N(0, 1/in), B ~ N(0, 1/rank), y ~ N(0, 0.01).")
    record(f"LoRA shrink + expand ({gpu}): {shape} qkv and down, rank {SWEEP_RANK}, bf16",
           command, RESULT_COLUMNS, [result_row(r, bandwidth) for r in main_results],
           notes=floor_note + " variant = the one `build_lora_kernel_meta` picks by default.",
           write=write, device=device)
    record(f"LoRA shrink + expand ({gpu}): {shape}, rank sweep, T = {r0.tokens}, "
           f"{r0.adapters} adapters, bf16",
           command, RESULT_COLUMNS, [result_row(r, bandwidth) for r in rank_results],
           notes=floor_note + " Buffers are padded to rank 64 throughout: the rank 8 and 16 "
           "rows show how much work the kernels skip.", write=write, device=device)
    record(f"LoRA shrink + expand ({gpu}): {shape}, SGMV vs BGMV variant, rank {SWEEP_RANK}, "
           "bf16",
           command, SCHEDULE_COLUMNS, schedule_rows(sched_results, bandwidth, default_pick),
           notes=("Both variants forced through `build_lora_kernel_meta(..., variant=...)`, "
                  "timed as above; bgmv / sgmv > 1 means SGMV is faster. The default pick is "
                  "the variant of least modelled time (`default_variant` in "
                  "manylora/lora/punica.py, lora/kernels/cost_model.py; it may be `tiled`, "
                  "benchmarks/bench_lora_decode.py times that one). best % copy BW = "
                  "floor bytes / the faster time / measured copy bandwidth."),
           write=write, device=device)
    print(f"total {time.perf_counter() - t_start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
