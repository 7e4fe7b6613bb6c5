"""Host cost of one LoRA op call: ``torch.library.custom_op`` against a direct
``torch.library.Library`` registration against a plain Python call (CPU, microseconds).

Three registrations of the same ``lora_shrink`` schema (eleven arguments, a list of three
tensors) around one trivial body (returns a preallocated buffer), so that only the dispatch
differs; then the real entry point ``lora_shrink_triton`` / ``lora_expand_triton`` with its
Triton kernels stubbed out (argument checks, heuristics and the dispatch; no launch), as the
hot path calls it. An eager LoRA step makes 2 calls per LoRA linear, 4 linears a layer: 256
calls for 32 layers.

    python -m benchmarks.bench_op_dispatch            # --calls N (default 20000)
"""

from __future__ import annotations

import argparse
import time

import torch

from manylora.lora.kernels import sgmv_kernels as lora_kernels
from manylora.lora.kernels import triton_lora
from manylora.lora.kernels.meta import build_lora_kernel_meta

_SCHEMA = ("(Tensor x, Tensor[] lora_a_stacked, Tensor ranks, Tensor token_lora_indices, "
           "Tensor sorted_rows, Tensor active_slots, Tensor seg_start, Tensor seg_len, "
           "SymInt max_seg_len, str variant, SymInt rank_start=0) -> Tensor")


def _per_call_us(fn, args, calls: int) -> float:
    """Median over 5 runs of ``calls`` calls, microseconds per call."""
    for _ in range(min(calls, 1000)):
        fn(*args)
    runs = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn(*args)
        runs.append((time.perf_counter() - t0) / calls * 1e6)
    return sorted(runs)[2]


class _NoLaunch:
    """Stands in for a Triton kernel: ``kernel[grid](...)`` does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--grad-mode", action="store_true",
                        help="call outside torch.inference_mode (the engine runs inside)")
    args = parser.parse_args()

    lora_meta = build_lora_kernel_meta([0, 1, -1, 1], 2, torch.device("cpu"), variant="bgmv")
    x = torch.randn(4, 64)
    a = [torch.randn(2, 8, 64) for _ in range(3)]
    ranks = torch.full((2, 3), 8, dtype=torch.int32)
    result = torch.zeros(4, 3, 8)
    op_args = (x, a, ranks, *lora_meta[:5], lora_meta.max_seg_len, lora_meta.variant, 0)

    def body(x, lora_a_stacked, ranks, token_lora_indices, sorted_rows, active_slots,
             seg_start, seg_len, max_seg_len, variant, rank_start=0):
        return result

    def fake(x, lora_a_stacked, *rest):
        return x.new_empty((x.shape[0], len(lora_a_stacked), lora_a_stacked[0].shape[1]))

    custom = torch.library.custom_op("manylora_bench::shrink_custom_op", body,
                                     mutates_args=(), schema=_SCHEMA)
    custom.register_fake(fake)
    lib = torch.library.Library("manylora_bench", "FRAGMENT")
    for name, key in (("shrink_cea", "CompositeExplicitAutograd"), ("shrink_cpu", "CPU")):
        lib.define(name + _SCHEMA)
        lib.impl(name, body, key)
        torch.library.register_fake(f"manylora_bench::{name}", fake, lib=lib)

    ops = torch.ops.manylora_bench
    rows = [
        ("torch.library.custom_op", ops.shrink_custom_op),
        ("Library.impl, CompositeExplicitAutograd", ops.shrink_cea),
        ("Library.impl, CPU key", ops.shrink_cpu),
        ("plain Python call", body),
    ]
    with torch.inference_mode(not args.grad_mode):
        print(f"dispatch only, trivial body ({args.calls} calls; us per call):")
        for label, fn in rows:
            print(f"  {label:45s} {_per_call_us(fn, op_args, args.calls):8.2f}")

        for name in ("sgmv_shrink_kernel", "bgmv_shrink_kernel", "sgmv_expand_kernel",
                     "bgmv_expand_kernel"):
            setattr(lora_kernels, name, _NoLaunch())
        b = [torch.randn(2, 8, n) for n in (64, 16, 16)]
        y = torch.zeros(4, 96)
        buffer = torch.zeros(4, 3, 8)
        slices = [(0, 64), (64, 16), (80, 16)]
        scales = [torch.ones(2, n) for n in (64, 16, 16)]
        print("entry points, kernels stubbed (us per call):")
        shrink_us = _per_call_us(triton_lora.lora_shrink_triton, (x, a, ranks, lora_meta),
                                 args.calls)
        print(f"  {'lora_shrink_triton':45s} {shrink_us:8.2f}")
        expand_args = (y, buffer, b, ranks, lora_meta, slices, ranks, scales)
        print(f"  {'lora_expand_triton (DoRA stacks)':45s} "
              f"{_per_call_us(triton_lora.lora_expand_triton, expand_args, args.calls):8.2f}")


if __name__ == "__main__":
    main()
