"""LoRA kernels of one decode step against the adapter bytes' floor, per variant (issue 17).

Llama-3-8B projections (q/k/v packed 4096 -> 4096 + 1024 + 1024, o 4096 -> 4096, gate/up
packed 4096 -> 2 x 14336, down 14336 -> 4096), 64 distinct rank-16 adapters in 64 slots on all
of them, bf16, decode batches of 64 and 256 rows (1 and 4 rows per adapter). For each
variant (BGMV, the row tiles, SGMV) one layer's shrink + expand of the four projections is
captured ``CALLS`` times in one CUDA graph with the padded (graph) mapping the engine uses, each
call on its own copy of the slot buffers (no L2 reuse between calls), and replayed; the
median per call is one layer's LoRA GPU time; x 32 layers gives the step.

Floor: the adapter bytes one layer must read (each adapter's A and B once) over the copy
bandwidth measured in the same run (``common.measure_copy_bandwidth``). The model's
prediction (``lora/kernels/cost_model.py``, on this GPU's ``gpu_model``) is printed next to each
measurement, and which variant it would pick.

    python -m benchmarks.bench_lora_decode                 # ~2 min on one H100
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from benchmarks.common import (
    command_line,
    gpu_name,
    measure_copy_bandwidth,
    record,
    time_graph_calls,
)

ADAPTERS, RANK, LAYERS = 64, 16, 32
CALLS, REPLAYS = 6, 15
VARIANTS = ("bgmv", "tiled", "sgmv")


class Projection:
    """One projection's slot buffers (``copies`` of them), activations and output."""

    def __init__(self, in_features: int, outs: tuple[int, ...], rows: int, copies: int,
                 device: torch.device) -> None:
        dt = torch.bfloat16
        self.outs = outs
        self.slices = []
        off = 0
        for n in outs:
            self.slices.append((off, n))
            off += n
        self.x = torch.randn(rows, in_features, device=device, dtype=dt)
        self.y = torch.randn(rows, off, device=device, dtype=dt)
        self.a = [[torch.randn(ADAPTERS, RANK, in_features, device=device, dtype=dt) / 64
                   for _ in outs] for _ in range(copies)]
        # rank-major B [slots, R, out], as every variant's expand reads it
        self.b = [[torch.randn(ADAPTERS, RANK, n, device=device, dtype=dt) / 64 for n in outs]
                  for _ in range(copies)]
        self.ranks = torch.full((ADAPTERS, len(outs)), RANK, dtype=torch.int32, device=device)

    def adapter_bytes(self) -> int:
        return sum(a.numel() * a.element_size() for a in self.a[0]) + sum(
            b.numel() * b.element_size() for b in self.b[0])


def _step(projections, lora_meta, variant: str, copy: int) -> None:
    from manylora.lora.kernels.triton_lora import lora_expand_triton, lora_shrink_triton
    from manylora.lora.kernels.triton_lora_tiled import lora_expand_tiled, lora_shrink_tiled

    for p in projections:
        a, b = p.a[copy], p.b[copy]
        if variant == "tiled":
            tiles = (lora_meta.sorted_rows, lora_meta.tile_slot, lora_meta.tile_start,
                     lora_meta.tile_len, lora_meta.block_m)
            buf = lora_shrink_tiled(p.x, a, p.ranks, *tiles)
            lora_expand_tiled(p.y, buf, b, p.ranks, *tiles, [o for o, _ in p.slices])
        else:
            buf = lora_shrink_triton(p.x, a, p.ranks, lora_meta)
            lora_expand_triton(p.y, buf, b, p.ranks, lora_meta, p.slices)


def measure(batch: int, variant: str, device: torch.device, projections) -> float:
    """Median GPU seconds of one layer's LoRA launches at ``batch`` rows under ``variant``."""
    from manylora.lora.kernels.meta import build_lora_kernel_meta

    slots = [r % ADAPTERS for r in range(batch)]
    lora_meta = build_lora_kernel_meta(slots, ADAPTERS, device, pad_to=batch, variant=variant)
    return time_graph_calls(lambda i: _step(projections, lora_meta, variant, i), CALLS, REPLAYS)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", nargs="+", type=int, default=[64, 256])
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_lora_decode needs a CUDA GPU")
    from manylora.lora.kernels.cost_model import (
        LoRAVariantModel,
        gpu_model,
        graph_block_m,
        llama3_8b_shapes,
        variant_time,
    )
    from manylora.lora.kernels.meta import default_variant

    device = torch.device("cuda")
    bandwidth = measure_copy_bandwidth(device)
    gpu = gpu_model(device)._replace(bandwidth=bandwidth)
    model = LoRAVariantModel(llama3_8b_shapes(), RANK, gpu)
    rows = []
    for batch in args.batches:
        projections = [Projection(s.in_features, s.out_sizes, batch, CALLS, device)
                       for s in llama3_8b_shapes()]
        nbytes = sum(p.adapter_bytes() for p in projections)
        floor = nbytes / bandwidth
        seg_len = np.bincount(np.arange(batch) % ADAPTERS, minlength=ADAPTERS)
        pick, _ = default_variant(seg_len, ADAPTERS, padded_rows=batch, model=model)
        for variant in VARIANTS:
            seconds = measure(batch, variant, device, projections)
            predicted = variant_time(seg_len, variant, model.shapes, RANK, ADAPTERS, gpu,
                                      block_m=graph_block_m(batch, ADAPTERS),
                                      padded_rows=batch)
            rows.append([batch, batch // ADAPTERS, variant + (" (model's pick)" if
                                                               variant == pick else ""),
                         f"{seconds * 1e6:,.1f}", f"{predicted * 1e6:,.1f}",
                         f"{floor * 1e6:,.1f}", f"{seconds / floor:.2f}x",
                         f"{seconds * LAYERS * 1e3:,.2f}"])
            print(rows[-1], flush=True)
        del projections
        torch.cuda.empty_cache()
    record(f"LoRA decode kernels per variant vs the adapter bytes ({gpu_name(device)})",
           command_line("benchmarks.bench_lora_decode"),
           ["batch", "rows per adapter", "variant", "GPU µs per layer (median)",
            "model µs per layer", "floor µs (adapter bytes / copy BW)", "x floor",
            "ms per step (x32 layers)"], rows,
           notes=f"{ADAPTERS} distinct rank-{RANK} adapters, slot buffers on q/k/v, o, "
           "gate/up and down (Llama-3-8B shapes), bf16; padded (CUDA-graph) mappings as the "
           f"engine builds them; {CALLS} layer calls in one CUDA graph, each on its own copy "
           f"of the slot buffers, median of {REPLAYS} replays. Floor: one layer's adapter "
           "bytes (every adapter's A and B once) over the copy bandwidth measured in this "
           "run. Target (issue 17): within 1.5x of the floor at batch 64 and 256.",
           write=not args.no_record, device=device)


if __name__ == "__main__":
    main()
