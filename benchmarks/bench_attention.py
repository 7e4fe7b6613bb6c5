"""Decode paged attention against the KV bytes it must read (Llama-3-8B heads: 32 query
heads over 8 KV heads, head_dim 128, bf16 KV, block_size 16, tables shuffled over the
pool), one layer per call.

Each case times ``paged_attention_triton`` on decode rows only (one query token per
sequence, every sequence at the same context), 10 calls captured in one CUDA graph and
replayed (median over replays), so the figure is the kernels' GPU time, not the host's
launch; the launch's own heuristics pick the tile and the key-range splits. Floor: the KV
bytes (``batch x context x 8 heads x 128 x 2 (K and V) x 2 bytes``) over the measured copy
bandwidth.

    python -m benchmarks.bench_attention                 # ~1 min on one H100
    python -m benchmarks.bench_attention --softcap 50    # Gemma 2's attention soft cap
"""

from __future__ import annotations

import argparse
import random

import torch

from benchmarks.common import (
    command_line,
    gpu_name,
    measure_copy_bandwidth,
    record,
    time_graph_calls,
)

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
CALLS, REPLAYS = 10, 15


def measure(batch: int, context: int, device: torch.device,
            softcap: float | None = None) -> float:
    """Median GPU seconds of one decode ``paged_attention_triton`` call at ``batch``
    sequences of ``context`` tokens (logits soft-capped at ``softcap`` when given)."""
    from manylora.ops.attention_metadata import build_attention_metadata
    from manylora.ops.paged_kv import KVCache
    from manylora.ops.triton_attention import paged_attention_triton

    blocks = -(-context // BLOCK_SIZE)
    order = list(range(batch * blocks))
    random.Random(0).shuffle(order)
    tables = [order[i * blocks:(i + 1) * blocks] for i in range(batch)]
    data = torch.randn(2, batch * blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, device=device,
                       dtype=torch.bfloat16)
    meta = build_attention_metadata([1] * batch, [context] * batch, tables, BLOCK_SIZE,
                                    HEADS // KV_HEADS, device, pad_to=batch,
                                    max_blocks_per_seq=blocks)
    q = torch.randn(batch, HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    kv = KVCache(data, None)

    def call():
        paged_attention_triton(q, kv, meta, HEAD_DIM ** -0.5, out=out, softcap=softcap)

    return time_graph_calls(lambda i: call(), CALLS, REPLAYS)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", default=["1x512", "64x700", "256x700", "256x2000"],
                    help="BATCHxCONTEXT")
    ap.add_argument("--softcap", type=float, default=None,
                    help="soft-cap the attention logits at this value (Gemma 2: 50)")
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_attention needs a CUDA GPU")
    device = torch.device("cuda")
    bandwidth = measure_copy_bandwidth(device)
    rows = []
    for case in args.cases:
        batch, context = (int(v) for v in case.split("x"))
        seconds = measure(batch, context, device, args.softcap)
        nbytes = batch * context * KV_HEADS * HEAD_DIM * 2 * 2
        rows.append([batch, context, f"{nbytes / 1e6:,.1f}", f"{seconds * 1e6:,.1f}",
                     f"{nbytes / bandwidth * 1e6:,.1f}",
                     f"{nbytes / seconds / 1e9:,.0f}", f"{nbytes / seconds / bandwidth:.0%}"])
        print(rows[-1], flush=True)
        torch.cuda.empty_cache()
    capped = "" if args.softcap is None else f", logits soft-capped at {args.softcap:g}"
    record(f"Decode paged attention vs the KV bytes ({gpu_name(device)}{capped})",
           command_line("benchmarks.bench_attention"),
           ["batch", "context (tokens)", "KV MB per layer", "GPU µs per layer (median)",
            "floor µs (bytes / copy BW)", "achieved GB/s", "% of copy BW"], rows,
           notes="One layer of Llama-3-8B's attention (32 query heads, 8 KV heads, head_dim "
           "128, bf16 KV, block_size 16, block tables shuffled over the pool), decode rows "
           f"only; {CALLS} calls in one CUDA graph, median of {REPLAYS} replays (GPU time, "
           "no launch overhead); tile and split heuristics as the engine launches them.",
           write=not args.no_record, device=device)


if __name__ == "__main__":
    main()
