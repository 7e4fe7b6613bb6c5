"""Where a whole offline pass of issue 16's workloads spends its time on the GPU.

One warm-up pass, then one pass under ``torch.profiler`` (CPU + CUDA activity) of W1 or W2
(LoRA disabled) or W3 (64 adapters), the core in this process
(``MANYLORA_ENABLE_MULTIPROCESSING=0``). Each ``EngineCore.step`` call is a window
(``bench_engine.step_timeline``: the kernels' busy time inside it, whichever call launched
them); windows are grouped by the step they plan and launch: one with a prefill chunk
(more tokens than sequences) or decode only. The kernels' time over the whole pass is split
by kind: GEMM (cuBLAS / CUTLASS), attention (the paged-attention, split-combine and KV-write
kernels), LoRA (SGMV / BGMV shrink and expand), other (norms, rotary, activation, sampling,
embedding, elementwise).

    python -m benchmarks.profile_workload --workloads W1 W2 W3     # ~4 min on one H100

Needs CUDA (``--quick``: the tiny model on the CPU, no kernels, no record).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import torch

from benchmarks.bench_engine import (
    NOT_KERNELS,
    SEEDS,
    WARMUP_NEW,
    engine_kwargs,
    in_child,
    offline_pass,
    step_timeline,
    workloads,
    write_setting,
)
from benchmarks.common import command_line, gpu_name, record

#: Kernel kinds by name fragment (lower case), first match wins; the rest is "other".
KINDS = (("LoRA", ("sgmv", "bgmv")),
         ("attention", ("paged_attention", "combine_splits", "write_kv")),
         ("GEMM", ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "splitk")))


def kernel_kind(name: str) -> str:
    """``"GEMM"``, ``"attention"``, ``"LoRA"`` or ``"other"`` for a CUDA kernel's name."""
    low = name.lower()
    return next((kind for kind, parts in KINDS if any(p in low for p in parts)), "other")


def profile_pass(model_dir: Path, adapters: list[Path], name: str, quick: bool,
                 piecewise: bool = True) -> dict:
    """One warm-up pass and one profiled pass of workload ``name`` (``piecewise`` False:
    piecewise CUDA graphs off, every step with a prefill chunk eager); the profiled pass's
    ``seconds``, ``tokens``, per window kind (``prefill``, ``decode``) the ``windows``,
    ``wall`` and ``busy`` seconds, and ``kernels``: seconds of kernel time per kind."""
    os.environ["MANYLORA_ENABLE_MULTIPROCESSING"] = "0"
    import time

    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function

    from manylora import LLM, LoRARequest

    work = workloads(quick)[name]
    off = {} if piecewise else {"piecewise_cuda_graph_sizes": ()}
    llm = LLM(str(model_dir), **engine_kwargs(quick, work.lora), **off)
    core = llm.llm_engine.engine_core
    loras = [LoRARequest(f"a{k}", k + 1, str(p)) for k, p in enumerate(adapters)]

    def run(seed: int, cap: int | None) -> int:
        return offline_pass(llm, work, loras, seed, cap)[0]

    run(SEEDS[name][0], WARMUP_NEW)
    kinds: list[str] = []
    schedule, step = core.scheduler.schedule, core.step

    def spied_schedule():
        out = schedule()
        seqs = len(out.scheduled)
        kinds.append("prefill" if out.num_batched_tokens > seqs else
                     "decode" if seqs else "none")
        return out

    def windowed_step():
        with record_function(f"wl_step_{len(kinds)}"):
            return step()

    core.scheduler.schedule, core.step = spied_schedule, windowed_step
    activities = [ProfilerActivity.CPU] + (
        [ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    try:
        with profile(activities=activities) as prof:
            start = time.perf_counter()
            tokens = run(SEEDS[name][1], None)
            seconds = time.perf_counter() - start
    finally:
        core.scheduler.schedule, core.step = schedule, step
        llm.llm_engine.shutdown()
    result = {"name": name, "seconds": seconds, "tokens": tokens,
              "kernels": {kind: 0.0 for kind in ("GEMM", "attention", "LoRA", "other")}}
    for kind in ("prefill", "decode"):
        result[kind] = {"windows": 0, "wall": 0.0, "busy": 0.0}
    for k, window in zip(kinds, step_timeline(prof, "wl_step_")):
        if k in ("prefill", "decode"):
            agg = result[k]
            agg["windows"] += 1
            agg["wall"] += window["wall"] / 1e3
            agg["busy"] += 0.0 if window["busy"] != window["busy"] else window["busy"] / 1e3
    for e in prof.events():
        if e.device_type == DeviceType.CUDA and not getattr(
                e, "is_user_annotation", False) and not e.name.startswith(NOT_KERNELS):
            result["kernels"][kernel_kind(e.name)] += (e.time_range.end -
                                                       e.time_range.start) / 1e6
    print(result, flush=True)
    return result


def table(results: list[dict]) -> tuple[list[str], list[list]]:
    columns = ["workload", "pass s (profiled)", "tok/s (profiled)",
               "steps with a prefill chunk", "their wall s", "their GPU busy s",
               "decode-only steps", "their wall s", "their GPU busy s", "GPU busy % (all)",
               "GEMM s", "attention s", "LoRA s", "other kernels s"]
    rows = []
    for r in results:
        p, d, k = r["prefill"], r["decode"], r["kernels"]
        wall = p["wall"] + d["wall"]
        rows.append([r["name"], f"{r['seconds']:.2f}", f"{r['tokens'] / r['seconds']:,.0f}",
                     p["windows"], f"{p['wall']:.2f}", f"{p['busy']:.2f}", d["windows"],
                     f"{d['wall']:.2f}", f"{d['busy']:.2f}",
                     f"{(p['busy'] + d['busy']) / wall:.0%}" if wall else "n/a",
                     f"{k['GEMM']:.2f}", f"{k['attention']:.2f}", f"{k['LoRA']:.2f}",
                     f"{k['other']:.2f}"])
    return columns, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", nargs="+", choices=tuple(SEEDS), default=["W1", "W2"])
    ap.add_argument("--quick", action="store_true", help="tiny model on CPU, no record")
    ap.add_argument("--no-piecewise", action="store_true",
                    help="piecewise CUDA graphs off (steps with a prefill chunk run eagerly)")
    args = ap.parse_args()
    quick = args.quick
    if not quick and not torch.cuda.is_available():
        raise SystemExit("profile_workload needs a CUDA GPU (or --quick)")
    device = torch.device("cpu" if quick else "cuda")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, adapters = write_setting(Path(tmp), quick)
        results = [in_child(profile_pass, model_dir, adapters, name, quick,
                            not args.no_piecewise)
                   for name in args.workloads]
    columns, rows = table(results)
    pieces = "off" if args.no_piecewise else "on"
    record(f"Engine v2: where a workload's pass spends the GPU ({gpu_name(device)}), async "
           f"scheduling on, piecewise CUDA graphs {pieces}",
           command_line("benchmarks.profile_workload"), columns, rows,
           notes="One pass of each workload (after a warm-up pass) under torch.profiler, the "
           "core in the measuring process; Llama-3-8B shape, random bf16 weights, W1/W2 with "
           "LoRA disabled, W3 with 64 rank-16 q/k/v/o adapters, max_num_seqs 256, "
           "max_num_batched_tokens 8192, prefix caching on, CUDA graphs for decode (and, unless "
           "--no-piecewise, piecewise graphs for steps of up to 2048 tokens). A step "
           "window is one `EngineCore.step` call, grouped by the step it plans and launches "
           "(with a prefill chunk, or decode only); GPU busy: the union of the kernels' "
           "intervals inside the window. Kernel seconds: summed kernel durations by kind over "
           "the pass (GEMM: cuBLAS/CUTLASS; attention: paged attention, split combine, KV "
           "write; LoRA: SGMV/BGMV; other: norms, rotary, activation, sampling, elementwise).",
           write=not quick, device=device)


if __name__ == "__main__":
    main()
