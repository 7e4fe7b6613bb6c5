"""The decode projections of Llama-3-8B over few rows on quantized weights: the W4A16 kernel
(``manylora.ops.quant.w4a16``) and the FP8 skinny kernel (``manylora.ops.quant.fp8_skinny``,
per-row and 128-block scales), each config of a sweep against the weight's bytes over the
copy bandwidth and against bf16 (``torch.nn.functional.linear``).

For each kernel and row bucket the config with the least time summed over the four
projections (the decode step's share) is reported, per projection and row count; ``--apply``
writes them into the tables the engine uses (``w4a16.DECODE_CONFIGS``,
``fp8_skinny.ROW_SCALE_CONFIGS`` and ``BLOCK_SCALE_CONFIGS``). Times are GPU times of 5
calls captured in one CUDA graph (median of 10 replays), each call on another copy of the
weight (none is served from L2). The activations are given already quantized to the FP8
kernel: its quantizer is timed by ``bench_quant --parts gemm``.

    python -m benchmarks.bench_quant_kernels --apply         # ~3 min on one H100
    python -m benchmarks.bench_quant_kernels --kernels int4  # one kernel's sweep
"""

from __future__ import annotations

import argparse
import itertools
import re
from pathlib import Path

import torch
from triton.runtime.errors import OutOfResources

from benchmarks.bench_skinny_gemm import SHAPES as SKINNY_SHAPES
from benchmarks.common import (
    command_line,
    gpu_name,
    measure_copy_bandwidth,
    record,
    time_graph_calls,
)

#: Llama-3-8B's projections as manylora fuses them: (name, N, K), the LM head left out (it
#: stays in 16 bits).
SHAPES = SKINNY_SHAPES[:4]
CALLS, REPLAYS = 5, 10
KERNELS = ("int4", "fp8", "fp8-block")
#: W4A16 sweep: bucket (BLOCK_M) → row counts, then per bucket (BLOCK_N, BLOCK_KW, warps,
#: stages) × programs per SM.
INT4_ROWS = {16: (1, 16), 32: (32,), 64: (64,)}
INT4_TILES = {
    16: ((64, 32, 4, 3), (64, 64, 4, 2), (64, 64, 4, 3), (128, 32, 4, 2), (64, 128, 4, 2)),
    32: ((64, 32, 4, 3), (64, 64, 4, 2), (64, 64, 4, 3), (128, 32, 4, 2)),
    64: ((64, 32, 4, 2), (64, 32, 4, 3), (64, 64, 4, 2), (128, 32, 4, 2)),
}
PER_SM = (2, 4)
#: FP8 sweep: bucket → row counts; per-row scales (BLOCK_N, BLOCK_K) × stages, block
#: scales BLOCK_N × stages (BLOCK_K 128), programs per SM (0: no split), 4 warps.
FP8_ROWS = {16: (1, 16), 32: (32,), 64: (64,)}
FP8_TILES = ((32, 256), (32, 512), (64, 256), (64, 512), (128, 256))
FP8_BLOCK_N = (32, 64, 128)
FP8_STAGES = (4,)
FP8_PER_SM = (0, 4, 8)


def _int4_weights(n: int, k: int, device: torch.device, gen: torch.Generator) -> dict:
    return {"qweight": torch.randint(-2 ** 31, 2 ** 31 - 1, (k // 8, n), dtype=torch.int32,
                                     device=device, generator=gen),
            "scales": torch.rand(k // 128, n, device=device, generator=gen).to(torch.bfloat16)
            / 64,
            "zeros": torch.full((k // 128, n), 8.0, dtype=torch.bfloat16, device=device)}


def _fp8_weights(n: int, k: int, block: bool, device: torch.device,
                 gen: torch.Generator) -> dict:
    wq = torch.randn(n, k, device=device, generator=gen).to(torch.float8_e4m3fn)
    sw = torch.rand((n, k // 128) if block else (n,), device=device, generator=gen) / 64
    return {"wq": wq, "sw": sw}


def _sweep(kind: str, device: torch.device, gen: torch.Generator, bandwidth: float,
           bf16: dict) -> tuple[list, dict]:
    from manylora.ops.quant.fp8_skinny import fp8_skinny_linear
    from manylora.ops.quant.w4a16 import w4a16_gemv

    weights = {name: [(_int4_weights(n, k, device, gen) if kind == "int4"
                       else _fp8_weights(n, k, kind == "fp8-block", device, gen))
                      for _ in range(CALLS)] for name, n, k in SHAPES}
    buckets = INT4_ROWS if kind == "int4" else FP8_ROWS
    rows_out, table = [], {}
    for bucket, counts in buckets.items():
        xs = {}
        for m in counts:
            for _, _, k in SHAPES:
                x = torch.randn(m, k, device=device, generator=gen).to(torch.bfloat16)
                groups = k // 128 if kind == "fp8-block" else 1
                xs[(m, k)] = (x if kind == "int4" else
                              (x.to(torch.float8_e4m3fn), torch.ones(m, groups, device=device)))
        if kind == "int4":
            configs = [(bucket, bn, bkw, warps, st, ps) for (bn, bkw, warps, st), ps in
                       itertools.product(INT4_TILES[bucket], PER_SM)]
        elif kind == "fp8":
            configs = [(bucket, bn, bk, 4, st, ps) for (bn, bk), st, ps in
                       itertools.product(FP8_TILES, FP8_STAGES, FP8_PER_SM)]
        else:
            configs = [(bucket, bn, 128, 4, st, ps) for bn, st, ps in
                       itertools.product(FP8_BLOCK_N, FP8_STAGES, FP8_PER_SM)]

        def call(x, name, config, i):
            w = weights[name][i]
            if kind == "int4":
                return w4a16_gemv(x, w["qweight"], w["scales"], w["zeros"], None, 128,
                                  config=config)
            return fp8_skinny_linear(*x, w["wq"], w["sw"], torch.bfloat16,
                                     128 if kind == "fp8-block" else None, config=config)

        best = None
        for config in configs:
            try:
                times = {(m, name): time_graph_calls(
                    lambda i, x=xs[(m, k)], name=name, c=config: call(x, name, c, i),
                    CALLS, REPLAYS) for m in counts for name, _, k in SHAPES}
            except OutOfResources:
                continue
            if best is None or sum(times.values()) < sum(best[1].values()):
                best = (config, times)
        config, times = best
        table[bucket] = config
        for m in counts:
            for name, n, k in SHAPES:
                w = weights[name][0]
                nbytes = sum(t.numel() * t.element_size() for t in w.values())
                floor = nbytes / bandwidth
                t, ref = times[(m, name)], bf16[(m, name)]
                rows_out.append([kind, m, name, f"{n}×{k}", f"{ref * 1e6:,.1f}",
                                 f"{t * 1e6:,.1f}", f"{floor * 1e6:,.1f}", f"{floor / t:.0%}",
                                 f"{ref / t:.2f}x", str(config)])
                print(rows_out[-1], flush=True)
    return rows_out, table


def _write_table(path: Path, name: str, table: dict) -> None:
    """Replace the dict literal assigned to ``name`` in ``path`` by ``table``."""
    src = path.read_text()
    match = re.search(rf"^{name}(: [^=]+)? = \{{[^}}]*\}}\n", src, flags=re.M)
    if match is None:
        raise SystemExit(f"{path}: no table {name}")
    lines = "".join(f"    {key}: {value},\n" for key, value in sorted(table.items()))
    head = match.group(0).split("{", 1)[0]
    path.write_text(src[:match.start()] + head + "{\n" + lines + "}\n" + src[match.end():])
    print(f"wrote {name} in {path}")


def _apply(kind: str, table: dict) -> None:
    quant = Path(__file__).resolve().parents[1] / "manylora" / "ops" / "quant"
    if kind == "int4":
        _write_table(quant / "w4a16.py", "DECODE_CONFIGS", table)
    elif kind == "fp8":
        _write_table(quant / "fp8_skinny.py", "ROW_SCALE_CONFIGS",
                     {c[0]: c[1:] for c in table.values()})
    else:
        _write_table(quant / "fp8_skinny.py", "BLOCK_SCALE_CONFIGS",
                     {c[0]: (c[1], *c[3:]) for c in table.values()})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", nargs="+", choices=KERNELS, default=list(KERNELS))
    ap.add_argument("--no-record", action="store_true")
    ap.add_argument("--apply", action="store_true",
                    help="write the best configs into the engine's tables")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_quant_kernels needs a CUDA GPU")
    device = torch.device("cuda")
    bandwidth = measure_copy_bandwidth(device)
    gen = torch.Generator(device).manual_seed(0)
    dense = {name: [torch.randn(n, k, device=device, dtype=torch.bfloat16, generator=gen)
                    for _ in range(CALLS)] for name, n, k in SHAPES}
    rows = sorted({m for b in (INT4_ROWS, FP8_ROWS) for c in b.values() for m in c})
    bf16 = {}
    for m in rows:
        for name, _, k in SHAPES:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16, generator=gen)
            bf16[(m, name)] = time_graph_calls(
                lambda i, x=x, w=dense[name]: torch.nn.functional.linear(x, w[i]),
                CALLS, REPLAYS)
    del dense
    rows_out = []
    for kind in args.kernels:
        out, table = _sweep(kind, device, gen, bandwidth, bf16)
        rows_out += out
        print(f"{kind} best configs by bucket:")
        for bucket, config in table.items():
            print(f"    {bucket}: {config},")
        if args.apply:
            _apply(kind, table)
    record(f"Quantized decode kernels: config sweep ({gpu_name(device)})",
           command_line("benchmarks.bench_quant_kernels"),
           ["kernel", "rows", "projection", "N×K", "bf16 µs", "µs", "floor µs",
            "% of copy BW", "vs bf16", "config"], rows_out,
           notes="Llama-3-8B projections, random weights (INT4: group 128; FP8: e4m3fn, "
           "per-row or 128x128 block scales), bf16 activations (FP8: given quantized). GPU "
           f"time of {CALLS} calls in one CUDA graph, median of {REPLAYS} replays, each call "
           "on another copy of the weight; floor: the weight's bytes (codes, scales, zero "
           "points) over the measured copy bandwidth; bf16: cuBLAS on the bf16 weight. "
           "Config: the best of the sweep for the row bucket, summed over the four "
           "projections. INT4 config: (BLOCK_M, BLOCK_N, BLOCK_KW, warps, stages, programs "
           "per SM); FP8: (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, programs per "
           "SM, 0 = no split).",
           write=not args.no_record, device=device)


if __name__ == "__main__":
    main()
