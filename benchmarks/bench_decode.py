"""Decode roofline: one decode step of a Llama-3-8B-shaped model against the bytes it must read.

For batch B at context C, a decode step must read every weight once (the embedding table
only for B rows), the K/V of B × C cached tokens, and with LoRA each distinct adapter's A
and B (true rank, all seven projections); its floor is those bytes over the measured copy
bandwidth. We time the engine's own decode path: ``ModelRunner.execute`` on a scheduled
batch (host preparation, the CUDA-graph replay of the forward, logits and greedy sampling),
and the graph replay alone.

    python -m benchmarks.bench_decode             # H100: batch 1..128, context 512
    python -m benchmarks.bench_decode --kv-cache-dtype int8    # the same, int8 KV cache
    python -m benchmarks.bench_decode --quick     # a tiny model, to check the script runs
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from transformers import AutoConfig

from benchmarks.common import (
    gpu_name,
    measure_copy_bandwidth,
    record,
)
from benchmarks.llama3_8b import LLAMA3_8B, TINY, module_dims, write_config
from manylora.config import KV_CACHE_DTYPES, LORA_TARGET_MODULES, LoRAConfig, ModelConfig
from manylora.lora_request import LoRARequest
from manylora.model.loader import load_model
from manylora.ops.paged_kv import KVCache, quantize_kv
from manylora.request import Request
from manylora.sampling_params import SamplingParams
from manylora.scheduler_output import (
    CachedRequestData,
    NewRequestData,
    ScheduledRequest,
    SchedulerOutput,
)
from manylora.worker.cuda_graph import DEFAULT_CAPTURE_SIZES
from manylora.worker.kv_cache import allocate_kv_caches, block_bytes
from manylora.worker.model_runner import ModelRunner

BLOCK_SIZE = 16


def step_bytes(model, config: dict, batch: int, context: int, rank: int, adapters: int,
               kv_cache_dtype: str = "auto") -> int:
    """Bytes a decode step must read: weights, the batch's KV (codes and scales when
    quantized), the adapters present."""
    weights = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                  if "embed_tokens" not in n)
    elem = 2 if model.cfg.dtype != torch.float32 else 4
    weights += batch * config["hidden_size"] * elem                   # embedding rows
    kv = batch * context * block_bytes(model.cfg, 1, kv_cache_dtype)  # all layers, K and V
    per_adapter = sum(rank * (i + o) for i, o in module_dims(config).values()) * elem \
        * config["num_hidden_layers"]
    return weights + kv + adapters * per_adapter


def fill_random(kv: KVCache, gen: torch.Generator, dtype: torch.dtype) -> None:
    """Random keys/values N(0, 1) in ``kv``, quantized (codes and scales) when it is."""
    if not kv.quantized:
        kv.data.normal_(generator=gen)
        return
    rows = kv.data.view(-1, *kv.data.shape[-2:])
    x = torch.randn(rows.shape, generator=gen, device=rows.device, dtype=dtype)
    codes, scale = quantize_kv(x, kv.data.dtype)
    rows.copy_(codes)
    kv.scale.view(-1, kv.scale.shape[-1]).copy_(scale)


#: Decode steps run before the timed ones (the first adds the requests to the input batch).
WARMUP_STEPS = 3


def decode_plans(reqs: list[Request], tables: list[list[int]], context: int,
                 steps: int) -> list[SchedulerOutput]:
    """``steps`` consecutive decode plans for ``reqs`` from position ``context - 1``: the
    first sends the requests (and their whole tables, which cover every step) as new, the
    others as cached with no new block, as the scheduler would."""
    plans = []
    for i in range(steps):
        start = context - 1 + i
        scheduled = [ScheduledRequest(r, start, 1, True) for r in reqs]
        if i == 0:
            new = [NewRequestData(r.request_id, r.token_ids, t, start, r.lora_int_id,
                                  r.sampling_params) for r, t in zip(reqs, tables)]
            plans.append(SchedulerOutput(scheduled, [], [], [], new))
        else:
            cached = CachedRequestData([r.request_id for r in reqs], [[] for _ in reqs],
                                       [start] * len(reqs), [len(t) for t in tables])
            plans.append(SchedulerOutput(scheduled, [], [], [], [], cached))
    return plans


def time_execute(runner, plans, lora_slots) -> float:
    """Median wall time of ``runner.execute`` over ``plans[WARMUP_STEPS:]`` (each ends in a
    host read of the tokens), s."""
    times = []
    for i, out in enumerate(plans):
        t0 = time.perf_counter()
        runner.execute(out, lora_slots)
        if i >= WARMUP_STEPS:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_execute_async(runner, plans, lora_slots) -> float:
    """Median wall time per step of ``plans[WARMUP_STEPS:]`` pipelined as the engine runs
    them under async scheduling: step i+1 is launched (its decode tokens gathered from
    step i's samples on the device) before step i's tokens are read, s."""
    times, launched = [], None
    for i, out in enumerate(plans):
        t0 = time.perf_counter()
        step = runner.execute_async(out, lora_slots)
        runner.get_output(launched)
        launched = step
        if i >= WARMUP_STEPS:
            times.append(time.perf_counter() - t0)
    runner.get_output(launched)
    return statistics.median(times)


def measure_decode(batches: Sequence[int], context: int = 512, rank: int = 16, iters: int = 30,
                   kv_cache_dtype: str = "auto", quick: bool = False,
                   loras: Sequence[bool] = (False, True),
                   quantization_config: dict | None = None,
                   quantization: str | None = None) -> list[dict]:
    """Decode steps of a Llama-3-8B-shaped model (``TINY`` with ``quick`` or without CUDA)
    against the bytes they must read, built in this process.

    Args:
        batches: batch sizes (sequences per step).
        context: tokens of context per sequence.
        rank: the adapters' rank (one distinct adapter per sequence when LoRA is on).
        iters: timed steps per case (the median is reported).
        kv_cache_dtype: ``"auto"`` or one of ``KV_CACHE_DTYPES``.
        quick: the tiny model.
        loras: LoRA off (False) and/or on (True), each a case per batch.
        quantization_config: written into the dummy checkpoint's config.json (a quantized
            base of that format, dummy weights in its layout); None: bf16.
        quantization: the engine's ``quantization`` (``"fp8"``: the bf16 dummy weights
            quantized online as they load).

    Returns:
        One dict per (batch, LoRA) case: ``batch``, ``lora`` (bool), ``step_s`` (median
        ``ModelRunner.execute`` wall time, s), ``step_async_s`` (median step period
        pipelined as under async scheduling, ``time_execute_async``, s), ``bytes``
        (``step_bytes``), ``bandwidth`` (measured copy bandwidth, bytes/s; nan off CUDA),
        ``floor_s`` (bytes / bandwidth).
    """
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = TINY if quick or device.type == "cpu" else LLAMA3_8B
    dtype = torch.float32 if config is TINY else torch.bfloat16
    max_batch = max(batches)
    if quantization_config is not None:
        config = dict(config, quantization_config=quantization_config)
    with tempfile.TemporaryDirectory() as tmp:
        hf_config = AutoConfig.from_pretrained(write_config(Path(tmp), config))
    cfg = ModelConfig.from_hf(hf_config, dtype, 2 * (context + WARMUP_STEPS + iters),
                              quantization)
    model = load_model(Path(tmp), cfg, device, load_format="dummy")
    lora_config = LoRAConfig(max_batch, rank, max_batch, LORA_TARGET_MODULES)
    slots = model.create_lora_slots(lora_config)
    gen = torch.Generator(device).manual_seed(0)
    for s in set(slots.values()):
        for t in (*s.lora_a_stacked, *s.lora_b_stacked):
            t.copy_(torch.randn(t.shape, generator=gen, device=device) * 0.01)
    table = model.slot_table            # every slot: an adapter of ``rank`` on every module
    for slot in range(max_batch):
        table.write_row(slot, np.full(table.num_columns, rank), np.zeros(table.num_columns))
    blocks_per_seq = -(-(context + 2 * (WARMUP_STEPS + iters)) // BLOCK_SIZE)
    kv_caches = allocate_kv_caches(cfg, max_batch * blocks_per_seq, BLOCK_SIZE, device,
                                   kv_cache_dtype)
    for kv in kv_caches:
        fill_random(kv, gen, dtype)
    # the buckets up to the one the largest batch runs in (larger ones are never replayed)
    bucket = min((n for n in DEFAULT_CAPTURE_SIZES if n >= max_batch),
                 default=max(DEFAULT_CAPTURE_SIZES))
    sizes = tuple(n for n in DEFAULT_CAPTURE_SIZES if n <= bucket) \
        if device.type == "cuda" else ()
    runner = ModelRunner(model, kv_caches, BLOCK_SIZE, max_batch, cfg.max_model_len, sizes)
    runner.capture_graphs()
    bandwidth = measure_copy_bandwidth(device) if device.type == "cuda" else float("nan")
    params = SamplingParams(temperature=0.0, max_tokens=1)
    results = []
    for batch in batches:
        for lora in loras:
            reqs, tables = [], []
            for b in range(batch):
                ids = torch.randint(0, config["vocab_size"], (context,)).tolist()
                reqs.append(Request(f"r{b}", None, ids, params,
                                    LoRARequest(f"a{b}", b + 1, "unused") if lora else None,
                                    context + 2 * (WARMUP_STEPS + iters)))
                tables.append(list(range(b * blocks_per_seq, (b + 1) * blocks_per_seq)))
            n = WARMUP_STEPS + iters
            plans = decode_plans(reqs, tables, context, 2 * n)
            lora_slots = {b + 1: b for b in range(batch)} if lora else {}
            runner.release([r.request_id for r in reqs])      # the last case's rows
            step = time_execute(runner, plans[:n], lora_slots)
            step_async = time_execute_async(runner, plans[n:], lora_slots)
            nbytes = step_bytes(model, config, batch, context, rank, batch if lora else 0,
                                kv_cache_dtype)
            results.append({"batch": batch, "lora": lora, "step_s": step,
                            "step_async_s": step_async, "bytes": nbytes,
                            "bandwidth": bandwidth, "floor_s": nbytes / bandwidth})
            print(results[-1], flush=True)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64, 128])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto")
    ap.add_argument("--quick", action="store_true", help="tiny model, CPU allowed, no record")
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    batches = [b for b in args.batches if not args.quick or b <= 8]
    rows = []
    for r in measure_decode(batches, args.context, args.rank, args.iters, args.kv_cache_dtype,
                            args.quick):
        step, floor = r["step_s"], r["floor_s"]
        rows.append([r["batch"], f"rank-{args.rank} x{r['batch']}" if r["lora"] else "off",
                     f"{step * 1e3:.3f}", f"{r['bytes'] / 1e9:.2f}", f"{floor * 1e3:.3f}",
                     f"{r['bytes'] / step / 1e12:.2f}", f"{floor / step:.0%}",
                     f"{step / floor:.3f}"])
    kv_note = "" if args.kv_cache_dtype == "auto" else f", {args.kv_cache_dtype} KV cache"
    title = (f"Decode roofline ({gpu_name(device)}): Llama-3-8B shape, bf16{kv_note}, "
             f"context {args.context}")
    columns = ["batch", "LoRA", "step ms (median)", "GB read", "floor ms", "TB/s",
               "% of copy BW", "step / floor"]
    notes = ("Step = `ModelRunner.execute` wall time: host preparation, CUDA-graph replay of the "
             "32 layers, logits, greedy sampling and the host read of the tokens. GB read = "
             "weights (embedding rows only) + KV of batch × context tokens (codes and scales when "
             "quantized) + the distinct adapters' A and B at their true rank; floor = GB read / "
             "measured copy bandwidth.")
    record(title, "python -m benchmarks.bench_decode " + " ".join(sys.argv[1:]), columns, rows,
           notes=notes, write=not (args.no_record or args.quick or device.type == "cpu"))


if __name__ == "__main__":
    main()
