"""Where the time of the fused MoE op with LoRA on the experts goes, kernel by kernel: the
base op (``fused_experts``) and ``fused_experts_lora_triton`` by each launch plan, at
Qwen3-30B-A3B's expert shape with 16 rank-16 adapters (the operands of
``bench_moe_lora --parts kernel``).

For each token count and op it prints the op's CUDA-graph replay time (L2 cleared,
``common.time_cuda_graph``), then ``torch.profiler``'s device time per kernel name over 10
eager calls (per call, with the launches per call), the six largest. Needs CUDA.

    python -m benchmarks.profile_moe_lora                          # 64 and 256 tokens
    python -m benchmarks.profile_moe_lora --tokens 1024 4096 --paths grouped pairs
"""

from __future__ import annotations

import argparse
import collections

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.bench_moe_lora import QWEN3_30B_A3B, _kernel_operands
from benchmarks.common import time_cuda_graph

CALLS = 10


def kernel_times(fn) -> tuple[float, list[tuple[str, float, float]]]:
    """``(µs of all kernels per call, [(kernel, µs per call, launches per call)])`` of
    ``CALLS`` profiled eager calls of ``fn``, largest first."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            fn()
        torch.cuda.synchronize()
    time_us: dict[str, float] = collections.defaultdict(float)
    launches: collections.Counter = collections.Counter()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            time_us[event.name] += event.device_time_total
            launches[event.name] += 1
    rows = sorted(((name, us / CALLS, launches[name] / CALLS) for name, us in time_us.items()),
                  key=lambda row: -row[1])
    return sum(time_us.values()) / CALLS, rows


def main() -> None:
    from manylora.lora.kernels.fused_moe_lora import fused_experts_lora_triton
    from manylora.ops.fused_moe import fused_experts

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--paths", nargs="+", choices=("pairs", "grouped"),
                    default=["pairs", "grouped"])
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    device = torch.device("cuda")
    for t in args.tokens:
        x, w13, w2, weights, ids, slots, lora = _kernel_operands(t, QWEN3_30B_A3B, device,
                                                                 torch.bfloat16)
        base = (x, w13, w2, weights, ids)
        ops = {"base": lambda base=base: fused_experts(*base)}
        for path in args.paths:
            ops[path] = (lambda base=base, slots=slots, lora=lora, path=path:
                         fused_experts_lora_triton(*base, slots, lora, path=path))
        for name, fn in ops.items():
            graph_ms = time_cuda_graph(fn)
            total, rows = kernel_times(fn)
            print(f"T={t} {name}: graph {graph_ms * 1e3:.1f} µs, sum of kernels {total:.1f} µs")
            for kernel, us, count in rows[:6]:
                print(f"    {us:8.1f} µs  x{count:.0f}  {kernel[:90]}")


if __name__ == "__main__":
    main()
