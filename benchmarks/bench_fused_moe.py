"""The fused MoE op (``manylora.ops.triton_fused_moe.fused_experts_triton``) against its byte
floor, at Qwen3-30B-A3B's expert shape: hidden 2048, moe_intermediate 768, 128 experts, top-8,
bfloat16.

Routing is uniform (each token's 8 experts drawn without replacement, softmax weights), at
T = 1, 64 and 256 tokens. Time: one replay of the whole op (alignment, both grouped GEMMs,
SiLU-and-mul, the sum over k) captured in a CUDA graph (``common.time_cuda_graph``, L2
cleared before each replay). Floor: the bytes of the experts actually hit (distinct experts
× their ``w13`` + ``w2`` bytes; activations are negligible) over the device-to-device copy
bandwidth measured in the same process. At T = 1 eight experts are read; from T = 64 on
nearly all 128.

    python -m benchmarks.bench_fused_moe            # ~1 min on one H100; records BENCHMARKS.md
    python -m benchmarks.bench_fused_moe --quick    # tiny shape on CPU (interpreter), no record
"""

from __future__ import annotations

import argparse
import os

import torch

from benchmarks.common import (
    command_line,
    gpu_name,
    measure_copy_bandwidth,
    record,
    time_cpu,
    time_cuda_graph,
)

#: (hidden, moe_intermediate, experts, top-k) of Qwen3-30B-A3B.
FULL = (2048, 768, 128, 8)
QUICK = (64, 48, 8, 2)
TOKENS = (1, 64, 256)
QUICK_TOKENS = (1, 17)


def _operands(t: int, hidden: int, inter: int, experts: int, top_k: int,
              device: torch.device, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator(device).manual_seed(seed)
    x = torch.randn(t, hidden, device=device, generator=gen).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, device=device, generator=gen)
           / hidden ** 0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, device=device, generator=gen)
          / inter ** 0.5).to(dtype)
    scores = torch.rand(t, experts, device=device, generator=gen)
    ids = scores.topk(top_k, dim=-1).indices
    weights = torch.randn(t, top_k, device=device, generator=gen).softmax(-1)
    return x, w13, w2, weights, ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="tiny shape on CPU through TRITON_INTERPRET=1, no record")
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    if args.quick:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        device, dtype, shape, tokens = torch.device("cpu"), torch.float32, QUICK, QUICK_TOKENS
    elif torch.cuda.is_available():
        device, dtype, shape, tokens = torch.device("cuda"), torch.bfloat16, FULL, TOKENS
    else:
        raise SystemExit("needs a CUDA GPU (or --quick)")
    from manylora.ops.triton_fused_moe import fused_experts_triton, moe_config

    hidden, inter, experts, top_k = shape
    expert_bytes = 3 * hidden * inter * torch.finfo(dtype).bits // 8
    bandwidth = None if args.quick else measure_copy_bandwidth(device)
    rows = []
    for t in tokens:
        x, w13, w2, weights, ids = _operands(t, hidden, inter, experts, top_k, device, dtype)
        hit = int(ids.unique().numel())
        nbytes = hit * expert_bytes
        config = moe_config(t, top_k, experts)

        def call(x=x, w13=w13, w2=w2, weights=weights, ids=ids):
            return fused_experts_triton(x, w13, w2, weights, ids)

        if args.quick:
            rows.append([t, hit, f"{nbytes / 2**20:.2f}", f"{time_cpu(call, reps=1) * 1e3:.0f}",
                         "-", "-", config])
            continue
        ms = time_cuda_graph(call)
        floor_ms = nbytes / bandwidth * 1e3
        rows.append([t, hit, f"{nbytes / 2**20:.1f}", f"{ms * 1e3:.1f}",
                     f"{floor_ms * 1e3:.1f}", f"{floor_ms / ms:.0%}", config])
    columns = ["tokens", "experts hit", "expert MiB read", "fused MoE µs", "floor µs",
               "floor / time", "config (BLOCK_M, N, K, warps, stages)"]
    hidden_s = f"H {hidden}, I {inter}, E {experts}, top-{top_k}"
    record(f"Fused MoE vs its byte floor, {hidden_s} ({gpu_name(device)})",
           command_line("benchmarks.bench_fused_moe"), columns, rows,
           notes="Floor: distinct experts hit × (w13 + w2 bytes) over the measured copy "
                 "bandwidth. Time: CUDA-graph replay of the whole op, L2 cleared.",
           write=not (args.quick or args.no_record), device=device)


if __name__ == "__main__":
    main()
