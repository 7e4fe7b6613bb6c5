"""The projections of Llama-3-8B (q/k/v, o, gate/up, down) by INT4 weights (the W4A16
kernels of ``manylora.ops.quant.w4a16``, groups of 128) against bf16 cuBLAS, each against
its weight bytes over the copy bandwidth.

Up to ``DECODE_MAX_ROWS`` rows run the split-K GEMV kernel, more the GEMM kernel (what
``w4a16_linear`` picks). Times are GPU times of 5 calls captured in one CUDA graph (median
of 10 replays), each call on another copy of the weight (none is served from L2).

    python -m benchmarks.bench_w4a16              # ~1 min on one H100
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import (
    command_line,
    gpu_name,
    measure_copy_bandwidth,
    record,
    time_graph_calls,
)

#: Llama-3-8B's projections: (name, N, K).
SHAPES = (("qkv_proj", 6144, 4096), ("o_proj", 4096, 4096), ("gate_up_proj", 28672, 4096),
          ("down_proj", 4096, 14336))
ROWS = (1, 16, 64, 512)
GROUP = 128
CALLS, REPLAYS = 5, 10


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_w4a16 needs a CUDA GPU")
    from manylora.ops.quant.w4a16 import w4a16_linear

    device = torch.device("cuda")
    bandwidth = measure_copy_bandwidth(device)
    gen = torch.Generator(device).manual_seed(0)
    rows_out = []
    for name, n, k in SHAPES:
        dense = [torch.randn(n, k, device=device, dtype=torch.bfloat16, generator=gen) / 64
                 for _ in range(CALLS)]
        quant = [(torch.randint(-2 ** 31, 2 ** 31 - 1, (k // 8, n), device=device,
                                dtype=torch.int32, generator=gen),
                  torch.rand(k // GROUP, n, device=device, generator=gen).to(torch.bfloat16)
                  / 64,
                  torch.randint(0, 16, (k // GROUP, n), device=device,
                                generator=gen).to(torch.bfloat16))
                 for _ in range(CALLS)]
        int4_bytes = k * n // 2 + 2 * 2 * (k // GROUP) * n
        for m in ROWS:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16, generator=gen)
            t16 = time_graph_calls(lambda i, x=x, w=dense: torch.nn.functional.linear(x, w[i]),
                                   CALLS, REPLAYS)
            t4 = time_graph_calls(lambda i, x=x, q=quant: w4a16_linear(x, *q[i], None, GROUP),
                                  CALLS, REPLAYS)
            floor16, floor4 = 2 * n * k / bandwidth, int4_bytes / bandwidth
            rows_out.append([m, name, f"{n}×{k}", f"{t16 * 1e6:,.1f}", f"{floor16 / t16:.0%}",
                             f"{t4 * 1e6:,.1f}", f"{floor4 / t4:.0%}", f"{t16 / t4:.2f}"])
            print(rows_out[-1], flush=True)
    record(f"W4A16 (INT4 weights, groups of {GROUP}) vs bf16 cuBLAS ({gpu_name(device)})",
           command_line("benchmarks.bench_w4a16"),
           ["rows", "projection", "N×K", "bf16 cuBLAS µs", "bf16 % of copy BW", "W4A16 µs",
            "W4A16 % of copy BW", "speed-up"], rows_out,
           notes="Llama-3-8B shapes, random weights and codes; GPU time of "
           f"{CALLS} calls in one CUDA graph, median of {REPLAYS} replays; floor: the "
           "weight's bytes (INT4: codes plus bf16 scales and zeros) over the measured copy "
           "bandwidth. Each call reads another copy of the weight, so none is served from L2.",
           write=not args.no_record, device=device)


if __name__ == "__main__":
    main()
