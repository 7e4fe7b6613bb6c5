"""Issue 17's LoRA targets in one run: slot churn, slot buffers on seven projections vs
q/k/v/o, the LoRA kernels' GPU time per decode step against the adapter bytes, and the time
to first token of an adapter that is only on disk while other streams run.

The model and settings of issue 16's benchmarks (``bench_engine.write_setting`` /
``engine_kwargs``): a Llama-3-8B-shaped model with random bf16 weights (``load_format=
"dummy"``, token ids in and out), rank-16 q/k/v/o adapters in PEFT's format
(``llama3_8b.write_peft_adapters``), ``max_num_seqs`` 256, ``max_num_batched_tokens`` 8192,
prefix caching on, CUDA graphs for decode. ``--arch qwen3`` / ``gemma2`` / ``granite`` run
the same parts on a Qwen3-8B-, Gemma-2-9B- or Granite-3.1-8B-shaped model instead
(``shapes.SHAPES``; Gemma 2 needs its family in the model registry). Only public engine
APIs are used (``LLM``, ``LLMEngine``, ``AsyncLLM``, ``EngineArgs``, ``LoRARequest``, the
stats accessors), so the script runs on any commit that keeps them. Every timed pass has
token ids of its own: no prompt a warm-up pass ran is found in the prefix cache (the tables
show the prefix-hit tokens; 0 expected).

Parts (``--parts``, several allowed, run in this order; each engine in a fresh process):

* ``churn``: 1,024 requests (prompt 128, 64 new, greedy, ignore_eos) at once, adapters
  drawn Zipf(1.0) over 256 (``churn_workload``, seed 0), one ``LLM.generate`` call, with 16
  slots and a host tier of 256 (``max_loras=16, max_cpu_loras=256``) and with 256 slots
  (all fit). Untimed first: every adapter is registered with ``add_lora_async`` at once, so
  the engine's loader threads read them from disk into the host tier in parallel (the
  wall time is printed); then a warm-up pass (256 requests on Zipf draws, other token ids,
  request i stopping after ``4 + i`` tokens, so the decode batch drains through every
  CUDA-graph batch size and each decode graph the timed pass replays, masked ones included,
  is captured before it). Timed: the ``generate`` call alone. Reported: output
  tok/s, against vLLM 0.26's 3,136 (target >= 1.4x) and the all-fit run (target >= 90%);
  the adapter cache's counters over the timed pass (slot loads, evictions, disk reads, reads
  a step waited on); the mean slot-load time against the adapter's bytes over the pinned
  host-to-device bandwidth measured in the same process.
* ``batch``: 64 requests on 64 distinct adapters (prompt 128, 64 new), 64 slots, slot
  buffers on all seven projections (the default) and on q/k/v/o only
  (``lora_target_modules``): output tok/s, median of ``--repeats`` passes (target: within
  3%); and the same passes on the base model with LoRA disabled (``enable_lora=False``),
  the ratio to which a family's adapters should keep as Llama's do.
* ``kernels``: on the same two engines, decode steps at batch 64 and 256 with 64 distinct
  adapters (request i on adapter i % 64, prompt 128) under ``torch.profiler``: the LoRA
  kernels' GPU time per step (every kernel whose name holds sgmv, bgmv, lora, shrink or
  expand), and all kernels' time per step with LoRA and with the same requests on the base
  model. Floor: the 64 adapters' bytes (A and B of the modules they target, bf16) over the
  device-to-device copy bandwidth measured in the same process (target <= 1.5x).
* ``ttft``: ``AsyncLLM`` (core in its own process), 64 streams on 16 adapters in slots
  decoding; then, one after the other, ``--cold`` requests for adapters written to disk and
  never seen (new paths): the time to the first token of each, and the streams' median
  inter-token latency while it loads (from its arrival to its first token) against the
  second before (target: up by <= 10%); for reference the same for a request on an adapter
  already in a slot.

The engines with the core in the measuring process (``batch``, ``kernels``) say so in
their table. Estimated durations on one H100 (start-ups and the 256 adapters' reads
included; not yet timed), each under one device call's 10 minutes:

    python -m benchmarks.bench_lora --parts churn                  # ~4 min, both rows
    python -m benchmarks.bench_lora --parts batch kernels ttft     # ~3 min
    python -m benchmarks.bench_lora --parts batch --arch qwen3     # ~3 min, three engines
    python -m benchmarks.bench_lora --parts batch --arch gemma2    # ~3 min
    python -m benchmarks.bench_lora --parts batch --arch granite   # ~3 min
    python -m benchmarks.bench_lora --quick                        # every part, tiny, CPU

Each part prints and records (``common.record``: GPU, date, commit — ``$MANYLORA_COMMIT``
when set —, the exact command) its table to BENCHMARKS.md unless ``--no-record``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import os
import random
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.bench_engine import LORA_TARGETS, RANK, engine_kwargs, in_child
from benchmarks.churn_workload import zipf_adapters
from benchmarks.common import (
    command_line,
    gpu_name,
    measure_copy_bandwidth,
    pinned_h2d_bandwidth,
    prefix_hit_tokens,
    record,
)
from benchmarks.llama3_8b import module_dims, write_config, write_peft_adapters
from benchmarks.shapes import SHAPES

PARTS = ("churn", "batch", "kernels", "ttft")
#: vLLM 0.26's churn figure on an H100 (issue 17) and the targets.
VLLM_CHURN = 3136
CHURN_VS_VLLM = 1.4
CHURN_VS_FIT = 0.90
BATCH_TOLERANCE = 0.03
KERNEL_FLOOR_RATIO = 1.5
ITL_RISE = 0.10
#: Kernel-name fragments (lower case) of the LoRA shrink / expand kernels.
LORA_KERNELS = ("sgmv", "bgmv", "lora", "shrink", "expand")
#: GPU activity that is not a kernel, by name prefix.
NOT_KERNELS = ("Memcpy", "Memset", "gpu_user_annotation")
SEVEN = "all seven (default)"
QKVO = "q/k/v/o"
OFF = "LoRA off (enable_lora=False)"
SETTING = ("{shape} shape, random bf16 weights, token ids in and out, rank-16 q/k/v/o "
           "PEFT adapters, max_num_seqs 256, max_num_batched_tokens 8192, max_lora_rank 16, "
           "prefix caching on, CUDA graphs for decode, greedy, ignore_eos.")


@dataclass(frozen=True)
class Sizes:
    """Every size of the benchmark (the issue's, or tiny ones with ``--quick``)."""

    churn_requests: int
    churn_adapters: int
    churn_slots: int
    prompt: int
    new: int
    distinct: int                 # adapters of the batch / kernels parts
    kernel_batches: tuple[int, ...]
    streams: int
    stream_adapters: int
    stream_tokens: int            # the most a ttft stream asks (it is restarted if it ends)
    drain: int                    # requests of the churn warm-up (``drain_warm_up``)


FULL = Sizes(1024, 256, 16, 128, 64, 64, (64, 256), 64, 16, 1900, 256)
QUICK = Sizes(48, 12, 4, 8, 4, 4, (4, 8), 4, 2, 1500, 16)


def _median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _fmt(x: float, spec: str = ",.0f") -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def _verdict(ok: bool | None, miss: str) -> str:
    return "n/a" if ok is None else ("yes" if ok else f"no ({miss})")


def _prompts(count: int, length: int, vocab: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(length)]}
            for _ in range(count)]


def _engine(quick: bool, **override) -> dict:
    """``bench_engine.engine_kwargs`` (the issue-16 setting) with ``override``; a
    ``lora_target_modules`` of None means the engine's default (all seven)."""
    kw = dict(engine_kwargs(quick), **override)
    if kw.get("lora_target_modules") is None:
        kw.pop("lora_target_modules", None)
    return kw


def _loras(paths: Sequence[Path], first_id: int = 1, prefix: str = "a") -> list:
    from manylora import LoRARequest

    return [LoRARequest(f"{prefix}{k}", first_id + k, str(p)) for k, p in enumerate(paths)]


def _stats_delta(before, after) -> dict[str, float]:
    """Numeric fields of two ``LoRACacheStats`` (any version of the dataclass): after -
    before."""
    out = {}
    for f in dataclasses.fields(after):
        a, b = getattr(after, f.name), getattr(before, f.name, 0)
        if isinstance(a, (int, float)) and not isinstance(a, bool):
            out[f.name] = a - b
    return out


def adapter_bytes(config: dict, rank: int, targets: Sequence[str], itemsize: int = 2) -> int:
    """Bytes of one adapter's A and B over every layer: ``sum (in + out) * rank *
    itemsize`` over the targeted modules."""
    dims = module_dims(config)
    return config["num_hidden_layers"] * sum((dims[m][0] + dims[m][1]) * rank * itemsize
                                             for m in targets)


# ---------------------------------------------------------------------------------------------
# (a) churn


def run_churn(model_dir: Path, config: dict, adapters: list[Path], slots: int, sizes: Sizes,
              quick: bool) -> dict:
    """One engine with ``slots`` slots and a host tier of every adapter: every adapter read
    into the host tier (``preload``), a warm-up pass through every decode batch size
    (``drain_warm_up``), then the timed Zipf pass; its tokens, seconds, the adapter cache's
    counters over it, prefix hits, preemptions, the preload's seconds, and (CUDA) the
    pinned H2D bandwidth for one adapter's bytes.

    Raises:
        RuntimeError: the pass generated another number of tokens than it asked for.
    """
    from manylora import LLM, SamplingParams

    h2d = float("nan")
    one = adapter_bytes(config, RANK, LORA_TARGETS)
    if torch.cuda.is_available() and not quick:
        h2d = pinned_h2d_bandwidth(max(one, 64 << 20))
    llm = LLM(str(model_dir), **_engine(quick, max_loras=slots,
                                        max_cpu_loras=sizes.churn_adapters))
    engine = llm.llm_engine
    loras = _loras(adapters)
    vocab = engine.vocab_size
    try:
        preload_s = preload(engine, loras)
        print(f"churn ({slots} slots): {len(loras)} adapters read into the host tier in "
              f"{preload_s:.1f} s (not timed)", flush=True)
        drain_warm_up(llm, loras, sizes, vocab)
        picks = zipf_adapters(sizes.churn_requests, sizes.churn_adapters)
        prompts = _prompts(len(picks), sizes.prompt, vocab, seed=202)
        params = SamplingParams(temperature=0.0, max_tokens=sizes.new, ignore_eos=True)
        before, hits = engine.lora_cache_stats(), prefix_hit_tokens(llm)
        preempted = engine.kv_cache_stats().preemptions
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, [loras[k] for k in picks], use_tqdm=False)
        seconds = time.perf_counter() - t0
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        if tokens != sizes.new * len(picks):
            raise RuntimeError(f"churn: generated {tokens} tokens, asked "
                               f"{sizes.new * len(picks)}")
        result = {"slots": slots, "host": sizes.churn_adapters, "tokens": tokens,
                  "seconds": seconds,
                  "stats": _stats_delta(before, engine.lora_cache_stats()),
                  "prefix_hits": prefix_hit_tokens(llm) - hits,
                  "preemptions": engine.kv_cache_stats().preemptions - preempted,
                  "adapter_bytes": one, "h2d": h2d, "distinct": len(set(picks)),
                  "preload_s": preload_s}
    finally:
        engine.shutdown()
    print(f"churn ({slots} slots): {result}", flush=True)
    return result


def preload(engine, loras: Sequence) -> float:
    """Register every adapter at once (``LLMEngine.add_lora_async``: the core reads them on
    its loader threads, in parallel) and step until all are in the host tier; seconds.

    Raises:
        Exception: what a read raised.
    """
    t0 = time.perf_counter()
    futures = [engine.add_lora_async(lora) for lora in loras]
    while not all(f.done() for f in futures):
        engine.step()
    for f in futures:
        f.result()
    return time.perf_counter() - t0


def drain_warm_up(llm, loras: Sequence, sizes: Sizes, vocab: int) -> None:
    """An untimed pass of ``sizes.drain`` (``max_num_seqs``) requests on Zipf draws (token
    ids of its own) where request i stops after ``4 + i`` tokens: the decode batch shrinks
    by one per step through every size, so every (batch size, LoRA variant, projection
    mask) decode graph the timed pass needs is captured here, not in the timed window."""
    from manylora import SamplingParams

    count = sizes.drain
    picks = zipf_adapters(count, len(loras), seed=7)
    prompts = _prompts(count, sizes.prompt, vocab, seed=101)
    params = [SamplingParams(temperature=0.0, max_tokens=4 + i, ignore_eos=True)
              for i in range(count)]
    llm.generate(prompts, params, [loras[k] for k in picks], use_tqdm=False)


def churn_table(results: list[dict]) -> tuple[list[str], list[list]]:
    fit = max(results, key=lambda r: r["slots"])
    fit_rate = fit["tokens"] / fit["seconds"]
    columns = ["max_loras", "max_cpu_loras", "tok/s", "seconds", "vs all-fit",
               f"vs vLLM 0.26 ({VLLM_CHURN:,})", f">= {CHURN_VS_VLLM}x vLLM",
               f">= {CHURN_VS_FIT:.0%} of all-fit", "slot loads", "slot evictions",
               "disk reads", "disk reads waited on", "other stall counters",
               "ms per slot load", "floor ms (bytes / pinned H2D)", "prefix-hit tokens",
               "preemptions", "host-tier preload s (untimed)"]
    rows = []
    for r in results:
        s = r["stats"]
        rate = r["tokens"] / r["seconds"]
        loads = s.get("device_misses", 0)
        per_load = s.get("device_load_seconds", 0.0) / loads if loads else float("nan")
        floor = r["adapter_bytes"] / r["h2d"] if r["h2d"] == r["h2d"] else float("nan")
        stalls = {k: v for k, v in s.items() if "stall" in k and v}
        is_fit = r is fit
        rows.append([
            r["slots"], r["host"],
            _fmt(rate), f"{r['seconds']:.2f}", f"{rate / fit_rate:.0%}",
            f"{rate / VLLM_CHURN:.2f}x",
            "-" if is_fit else _verdict(rate >= CHURN_VS_VLLM * VLLM_CHURN,
                                        f"{rate / (CHURN_VS_VLLM * VLLM_CHURN):.0%} of it"),
            "-" if is_fit else _verdict(rate >= CHURN_VS_FIT * fit_rate,
                                        f"{rate / fit_rate:.0%}"),
            f"{loads:,.0f}", f"{s.get('device_evictions', 0):,.0f}",
            f"{s.get('host_misses', 0):,.0f}", f"{s.get('sync_disk_loads', 0):,.0f}",
            ", ".join(f"{k} {v:,.3g}" for k, v in stalls.items()) or "-",
            _fmt(per_load * 1e3, ".2f"), _fmt(floor * 1e3, ".2f"),
            f"{r['prefix_hits']:,}", r["preemptions"], f"{r['preload_s']:.1f}"])
    return columns, rows


# ---------------------------------------------------------------------------------------------
# (b) 64 distinct adapters at batch 64, and (c) the LoRA kernels per decode step


def run_batch_and_kernels(model_dir: Path, adapters: list[Path], targets: tuple | None,
                          parts: Sequence[str], sizes: Sizes, repeats: int, steps: int,
                          quick: bool, lora: bool = True, **engine_override) -> dict:
    """One engine (core in this process) with ``sizes.distinct`` slots and slot buffers on
    ``targets`` (None: all seven): with ``batch`` in ``parts``, a warm-up pass and
    ``repeats`` timed passes of the batch (``tokens``, ``seconds`` per pass, prefix hits);
    with ``kernels``, ``profile_decode`` at each batch of ``sizes.kernel_batches``, with
    adapters and on the base model; on CUDA the copy bandwidth, measured first. ``lora``
    False: the engine has LoRA disabled (``enable_lora=False``, no slots) and runs the same
    passes on the base model (``targets`` and ``adapters`` unused). ``engine_override``:
    further ``EngineArgs`` fields (e.g. ``quantization``)."""
    os.environ["MANYLORA_ENABLE_MULTIPROCESSING"] = "0"
    from manylora import LLM, SamplingParams

    bandwidth = measure_copy_bandwidth("cuda") \
        if torch.cuda.is_available() and not quick and "kernels" in parts else float("nan")
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    n = sizes.distinct
    engine = _engine(quick, max_loras=n, max_cpu_loras=n, lora_target_modules=targets) \
        if lora else engine_kwargs(quick, lora=False)
    engine.update(engine_override)
    llm = LLM(str(model_dir), **engine)
    loras = _loras(adapters[:n]) if lora else None
    label = "LoRA off" if not lora else targets or "seven"
    vocab = llm.llm_engine.vocab_size
    result: dict = {"targets": targets, "bandwidth": bandwidth, "passes": [], "kernels": []}
    try:
        if "batch" in parts:
            params = SamplingParams(temperature=0.0, max_tokens=sizes.new, ignore_eos=True)
            warm = SamplingParams(temperature=0.0, max_tokens=min(16, sizes.new),
                                  ignore_eos=True)
            llm.generate(_prompts(n, sizes.prompt, vocab, 301), warm, loras, use_tqdm=False)
            for r in range(repeats):
                hits = prefix_hit_tokens(llm)
                t0 = time.perf_counter()
                outs = llm.generate(_prompts(n, sizes.prompt, vocab, 400 + r), params, loras,
                                    use_tqdm=False)
                seconds = time.perf_counter() - t0
                tokens = sum(len(o.outputs[0].token_ids) for o in outs)
                if tokens != n * sizes.new:
                    raise RuntimeError(f"batch: {tokens} tokens, asked {n * sizes.new}")
                result["passes"].append({"tokens": tokens, "seconds": seconds,
                                         "prefix_hits": prefix_hit_tokens(llm) - hits})
                print(f"batch ({label}): {result['passes'][-1]}", flush=True)
        if "kernels" in parts:
            for batch in sizes.kernel_batches:
                for with_lora in (True, False):
                    result["kernels"].append(profile_decode(
                        llm.llm_engine, loras if with_lora else None, batch, sizes.prompt,
                        steps))
                    print(f"kernels ({label}): {result['kernels'][-1]}", flush=True)
    finally:
        llm.llm_engine.shutdown()
    return result


def profile_decode(engine, loras: list | None, batch: int, prompt: int, steps: int) -> dict:
    """``batch`` requests (request i on ``loras[i % len(loras)]``, or on the base model)
    brought to steady decode on an in-process engine, then ``steps`` ``step()`` calls under
    ``torch.profiler``: per step the LoRA kernels' and all kernels' GPU time (ms, from the
    CUDA activity; NaN without CUDA). The requests are aborted after.

    Raises:
        RuntimeError: a profiled step did not decode every request.
    """
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from manylora import SamplingParams

    rng = random.Random(batch * 7 + (0 if loras else 1))
    params = SamplingParams(temperature=0.0, max_tokens=steps + 64, ignore_eos=True)
    ids = [engine.add_request(None, {"prompt_token_ids": [rng.randrange(engine.vocab_size)
                                                          for _ in range(prompt)]},
                              params, loras[i % len(loras)] if loras else None)
           for i in range(batch)]
    try:
        seen: set[str] = set()
        while len(seen) < batch:                      # prefill: every request decodes
            seen.update(o.request_id for o in engine.step())
        for _ in range(5):
            engine.step()
        activities = [ProfilerActivity.CPU] + (
            [ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        rows = []
        with profile(activities=activities) as prof:
            for _ in range(steps):
                rows.append(len(engine.step()))
        if any(r != batch for r in rows):
            raise RuntimeError(f"a profiled decode step gave {rows} rows, expected {batch}")
    finally:
        engine.abort_request(ids)
    lora_us = all_us = 0.0
    names: set[str] = set()
    for e in prof.events():
        if e.device_type != DeviceType.CUDA or getattr(e, "is_user_annotation", False) \
                or e.name.startswith(NOT_KERNELS):
            continue
        us = e.time_range.end - e.time_range.start
        all_us += us
        if any(p in e.name.lower() for p in LORA_KERNELS):
            lora_us += us
            names.add(e.name)
    nan = float("nan")
    cuda = torch.cuda.is_available()
    return {"batch": batch, "lora": loras is not None, "steps": steps,
            "lora_ms": lora_us / 1e3 / steps if cuda else nan,
            "all_ms": all_us / 1e3 / steps if cuda else nan,
            "kernel_names": sorted(names)}


def batch_table(results: list[dict], sizes: Sizes) -> tuple[list[str], list[list]]:
    rates = {}
    for r in results:
        p = r["passes"]
        rates[r["label"]] = p[0]["tokens"] / _median([x["seconds"] for x in p])
    ref, off = rates.get(QKVO), rates.get(OFF)
    columns = ["slot buffers on", "passes", "output tokens per pass", "tok/s (median pass)",
               "vs q/k/v/o", f"within {BATCH_TOLERANCE:.0%}", "vs LoRA off",
               "prefix-hit tokens"]
    rows = []
    for r in results:
        rate = rates[r["label"]]
        ratio = rate / ref if ref else float("nan")
        rows.append([r["label"], len(r["passes"]), f"{r['passes'][0]['tokens']:,}",
                     _fmt(rate), "-" if r["label"] == OFF else _fmt(ratio, ".3f"),
                     "-" if r["label"] in (QKVO, OFF) else _verdict(
                         abs(ratio - 1) <= BATCH_TOLERANCE, f"{ratio - 1:+.1%}"),
                     _fmt(rate / off, ".3f") if off else "n/a",
                     f"{sum(x['prefix_hits'] for x in r['passes']):,}"])
    return columns, rows


def kernels_table(results: list[dict], floor_bytes: int) -> tuple[list[str], list[list]]:
    columns = ["slot buffers on", "batch", "LoRA kernels ms / step",
               "all kernels ms / step (adapters)", "all kernels ms / step (base model)",
               "difference ms", "adapter bytes read (MB)", "floor ms (bytes / copy BW)",
               "LoRA kernels / floor", f"<= {KERNEL_FLOOR_RATIO}x floor", "LoRA kernels"]
    rows = []
    for r in results:
        floor = floor_bytes / r["bandwidth"] if r["bandwidth"] == r["bandwidth"] else \
            float("nan")
        for on in (k for k in r["kernels"] if k["lora"]):
            off = next(k for k in r["kernels"] if not k["lora"] and k["batch"] == on["batch"])
            ratio = on["lora_ms"] / (floor * 1e3) if floor == floor else float("nan")
            rows.append([r["label"], on["batch"], _fmt(on["lora_ms"], ".3f"),
                         _fmt(on["all_ms"], ".3f"), _fmt(off["all_ms"], ".3f"),
                         _fmt(on["all_ms"] - off["all_ms"], ".3f"),
                         f"{floor_bytes / 1e6:,.1f}", _fmt(floor * 1e3, ".3f"),
                         _fmt(ratio, ".2f"),
                         "n/a" if ratio != ratio else _verdict(ratio <= KERNEL_FLOOR_RATIO,
                                                               f"{ratio:.2f}x"),
                         ", ".join(sorted({n.split("(")[0][:40] for n in on["kernel_names"]}))
                         or "-"])
    return columns, rows


# ---------------------------------------------------------------------------------------------
# (d) time to first token of an adapter only on disk, while other streams run


def run_ttft(model_dir: Path, adapters: list[Path], cold: list[Path], sizes: Sizes,
             quick: bool) -> dict:
    """``AsyncLLM``: ``sizes.streams`` streams over ``sizes.stream_adapters`` adapters;
    once each has 32 tokens, for each path in ``cold`` (then once more for an adapter in a
    slot): the second before it, a request (prompt ``sizes.prompt``, 4 new tokens) for it,
    its time to first token, and the streams' inter-token gaps in the second before and
    while it waited (seconds). A stream asks for ``sizes.stream_tokens`` tokens and, should
    it end before the probes do, starts again on a new prompt (a gap never spans two of its
    requests); the restarts inside a probe's window are counted with it."""
    from manylora import EngineArgs, SamplingParams
    from manylora.engine.async_llm import AsyncLLM

    llm = AsyncLLM.from_engine_args(EngineArgs(model=str(model_dir), **_engine(quick)))
    loras = _loras(adapters[:sizes.stream_adapters])
    fresh = _loras(cold, first_id=10_000, prefix="cold")
    vocab = llm.engine.vocab_size
    # per stream, one list of output times per request it made
    arrivals: list[list[list[float]]] = [[] for _ in range(sizes.streams)]
    restarts: list[float] = []

    async def stream(i: int, prompt: dict) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=sizes.stream_tokens,
                                ignore_eos=True)
        for k in range(1_000):
            if k:
                restarts.append(time.monotonic())
                prompt = _prompts(1, sizes.prompt, vocab, 10_000 * (k + 1) + i)[0]
            times: list[float] = []
            arrivals[i].append(times)
            async for _ in llm.generate(prompt, params, lora_request=loras[i % len(loras)]):
                times.append(time.monotonic())

    async def first_token(prompt: dict, lora) -> tuple[float, float, float]:
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        sent = time.monotonic()
        gen = llm.generate(prompt, params, lora_request=lora)
        try:
            async for _ in gen:
                return sent, time.monotonic(), time.monotonic() - sent
        finally:
            await gen.aclose()
        raise RuntimeError("the request ended without a token")

    def gaps(lo: float, hi: float) -> list[float]:
        out = []
        for requests in arrivals:
            for times in requests:
                out += [b - a for a, b in zip(times, times[1:]) if lo <= b < hi]
        return out

    async def main() -> dict:
        prompts = _prompts(sizes.streams + len(cold) + 2, sizes.prompt, vocab, 501)
        tasks = [asyncio.create_task(stream(i, prompts[i])) for i in range(sizes.streams)]
        try:
            while min(len(a[0]) if a else 0 for a in arrivals) < 32:
                if any(t.done() for t in tasks):
                    [t.result() for t in tasks if t.done()]
                    raise RuntimeError("a stream ended before the measurement")
                await asyncio.sleep(0.05)
            # untimed: one whole request beside the streams, so the decode graphs of one
            # row more than the streams are captured before any window
            warm = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
            async for _ in llm.generate(prompts[-1], warm, lora_request=loras[0]):
                pass
            probes = []
            for k, lora in enumerate([*fresh, loras[0]]):
                await asyncio.sleep(1.0)
                sent, got, ttft = await first_token(prompts[sizes.streams + k], lora)
                if any(t.done() for t in tasks):
                    [t.result() for t in tasks if t.done()]
                    raise RuntimeError("a stream task ended during the measurement")
                probes.append({"cold": lora in fresh, "ttft": ttft,
                               "before": gaps(sent - 1.0, sent), "during": gaps(sent, got),
                               "restarts": sum(sent - 1.0 <= t < got for t in restarts)})
                print(f"ttft ({'cold' if lora in fresh else 'in a slot'}): {ttft * 1e3:.1f} "
                      f"ms, ITL before {_median(probes[-1]['before']) * 1e3:.2f} ms, during "
                      f"{_median(probes[-1]['during']) * 1e3:.2f} ms", flush=True)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return {"probes": probes}

    try:
        return asyncio.run(main())
    finally:
        llm.shutdown()


def ttft_table(result: dict, streams: int) -> tuple[list[str], list[list]]:
    columns = ["request's adapter", "requests", "TTFT ms (median)", "TTFT ms (max)",
               "streams' ITL ms before (median)", "streams' ITL ms during (median)",
               "ITL rise", f"<= {ITL_RISE:.0%}", "streams' ITL ms during (max)",
               "stream restarts in the windows"]
    rows = []
    for cold in (True, False):
        probes = [p for p in result["probes"] if p["cold"] == cold]
        before = [g for p in probes for g in p["before"]]
        during = [g for p in probes for g in p["during"]]
        rise = _median(during) / _median(before) - 1 if before and during else float("nan")
        rows.append(["only on disk (never seen)" if cold else "in a slot", len(probes),
                     _fmt(_median([p["ttft"] for p in probes]) * 1e3, ".1f"),
                     _fmt(max(p["ttft"] for p in probes) * 1e3, ".1f"),
                     _fmt(_median(before) * 1e3, ".2f"), _fmt(_median(during) * 1e3, ".2f"),
                     _fmt(rise, "+.1%"),
                     "-" if not cold or rise != rise else _verdict(rise <= ITL_RISE,
                                                                   f"{rise:+.0%}"),
                     _fmt(max(during) * 1e3 if during else float("nan"), ".2f"),
                     sum(p.get("restarts", 0) for p in probes)])
    return columns, rows


# ---------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", nargs="+", choices=(*PARTS, "all"), default=["all"])
    ap.add_argument("--repeats", type=int, default=3, help="timed passes of the batch part")
    ap.add_argument("--steps", type=int, default=20, help="decode steps profiled per case")
    ap.add_argument("--cold", type=int, default=3,
                    help="requests for never-seen adapters in the ttft part")
    ap.add_argument("--arch", choices=tuple(SHAPES), default="llama",
                    help="the model's shape (benchmarks/shapes.py): Llama-3-8B, Qwen3-8B, "
                    "Gemma-2-9B or Granite-3.1-8B; a tiny one of the family with --quick")
    ap.add_argument("--quick", action="store_true", help="tiny model on CPU, no record")
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    parts = PARTS if "all" in args.parts else tuple(p for p in PARTS if p in args.parts)
    quick = args.quick
    if not quick and not torch.cuda.is_available():
        raise SystemExit("bench_lora needs a CUDA GPU (or --quick for a CPU smoke run)")
    sizes = QUICK if quick else FULL
    shape = SHAPES[args.arch]
    config = shape.tiny if quick else shape.full
    setting = SETTING.format(shape=shape.name)
    device = torch.device("cpu" if quick else "cuda")
    gpu = gpu_name(device)
    command = command_line("benchmarks.bench_lora")
    write = not (quick or args.no_record)
    count = sizes.churn_adapters if "churn" in parts else max(sizes.distinct,
                                                              sizes.stream_adapters)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir = write_config(root / "model", config)
        t0 = time.perf_counter()
        paths = write_peft_adapters(root / "adapters", config, count + args.cold, RANK,
                                    LORA_TARGETS, device,
                                    torch.float32 if quick else torch.bfloat16)
        adapters, cold = paths[:count], paths[count:]
        print(f"wrote {len(paths)} adapters in {time.perf_counter() - t0:.1f} s", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if "churn" in parts:
            results = [in_child(run_churn, model_dir, config, adapters, slots, sizes, quick)
                       for slots in (sizes.churn_slots, sizes.churn_adapters)]
            columns, rows = churn_table(results)
            record(f"LoRA churn ({shape.name}, {gpu}): {sizes.churn_requests:,} requests, "
                   f"adapters drawn Zipf(1.0) over {sizes.churn_adapters}, "
                   f"{sizes.churn_slots} slots vs all fit", command, columns, rows,
                   notes=setting + f" Prompt {sizes.prompt} random token ids, {sizes.new} new "
                   "tokens, every request at once in one `LLM.generate` call (core in its own "
                   f"process); {results[0]['distinct']} distinct adapters drawn "
                   "(`benchmarks/churn_workload.py`, seed 0). Untimed first: every adapter "
                   "registered at once with `add_lora_async` (read from disk into the host "
                   "tier by the engine's loader threads; max_cpu_loras = all; wall time in "
                   f"the last column), then a warm-up pass of {sizes.drain} requests on Zipf "
                   "draws (other token ids) where request i stops after 4 + i tokens, so the "
                   "decode batch drains through the CUDA-graph sizes and the decode graphs of "
                   "the adapters' projections are captured before the timed pass. Timed: the "
                   "one `generate` call. Counters: the adapter "
                   "cache's "
                   "(`lora_cache_stats`) over the timed pass: slot loads = host → device "
                   "copies into a slot (on demand or staged ahead), disk reads = host-tier "
                   "misses, waited on = disk reads a step waited for; ms per slot load = "
                   "their mean GPU time on the side stream; floor = one adapter's bytes over "
                   "the pinned host → device bandwidth measured in the same process. vLLM "
                   f"0.26: issue 17's figure ({VLLM_CHURN:,} tok/s at 16 slots, same model, "
                   "settings and GPU type).", write=write, device=device)
        batch_results = []
        if "batch" in parts or "kernels" in parts:
            for label, targets in ((SEVEN, None), (QKVO, LORA_TARGETS)):
                r = in_child(run_batch_and_kernels, model_dir, adapters, targets, parts, sizes,
                             args.repeats, args.steps, quick)
                r["label"] = label
                batch_results.append(r)
        if "batch" in parts:
            off = in_child(run_batch_and_kernels, model_dir, adapters, None, ("batch",),
                           sizes, args.repeats, args.steps, quick, False)
            off["label"] = OFF
            columns, rows = batch_table([*batch_results, off], sizes)
            record(f"LoRA slot buffers on seven projections vs q/k/v/o, and LoRA off "
                   f"({shape.name}, {gpu}): {sizes.distinct} distinct adapters at batch "
                   f"{sizes.distinct}", command, columns, rows,
                   notes=setting + f" {sizes.distinct} slots; request i on adapter i; prompt "
                   f"{sizes.prompt}, {sizes.new} new tokens; one warm-up pass (other token "
                   f"ids, 16 new), then {args.repeats} timed `LLM.generate` passes on token ids "
                   "of their own; tok/s = output tokens / the median pass time. The core runs "
                   "in the measuring process (`MANYLORA_ENABLE_MULTIPROCESSING=0`, shared with "
                   "the kernels part). The adapters target q/k/v/o: with slot buffers on all "
                   "seven projections the engine must skip gate/up/down for them. Target: "
                   f"within {BATCH_TOLERANCE:.0%}. LoRA off: the same passes on the base "
                   "model, on an engine with LoRA disabled (enable_lora=False).", write=write,
                   device=device)
        if "kernels" in parts:
            floor_bytes = sizes.distinct * adapter_bytes(config, RANK, LORA_TARGETS)
            columns, rows = kernels_table(batch_results, floor_bytes)
            record(f"LoRA kernels' GPU time per decode step vs the adapters' bytes "
                   f"({shape.name}, {gpu}): "
                   f"{sizes.distinct} distinct adapters", command, columns, rows,
                   notes=setting + f" {sizes.distinct} slots; request i on adapter i % "
                   f"{sizes.distinct}, prompt {sizes.prompt}; after the prefill and 5 decode "
                   f"steps, {args.steps} `step()` calls of the in-process core under "
                   "torch.profiler (CUDA activity); kernel ms / step = summed kernel durations "
                   f"/ steps. LoRA kernels: names holding {', '.join(LORA_KERNELS)}. Base "
                   "model: the same number of requests without adapters on the same engine. "
                   f"Floor: {sizes.distinct} adapters × their A and B (q/k/v/o, rank {RANK}, "
                   "bf16, every layer) over the device-to-device copy bandwidth (read + "
                   "write, 2 GiB, measured in the same process before the engine). Target: "
                   f"LoRA kernels <= {KERNEL_FLOOR_RATIO}x the floor.", write=write,
                   device=device)
        if "ttft" in parts:
            result = in_child(run_ttft, model_dir, adapters, cold, sizes, quick)
            columns, rows = ttft_table(result, sizes.streams)
            record(f"LoRA: first token of an adapter only on disk while {sizes.streams} "
                   f"streams decode ({shape.name}, {gpu})", command, columns, rows,
                   notes=setting + f" `AsyncLLM` (core in its own process); {sizes.streams} "
                   f"streams (prompt {sizes.prompt}, up to {sizes.stream_tokens} new tokens, "
                   "started again on a new prompt if they end: the last column counts those "
                   "restarts inside a request's windows, whose prefill then shares the steps) "
                   f"on {sizes.stream_adapters} adapters, already decoding; then, one after "
                   f"the other with 1 s between them, {args.cold} requests (prompt "
                   f"{sizes.prompt}, 4 new) on adapters never seen (PEFT files on disk, new "
                   "paths), then one on an adapter in a slot. TTFT: from `generate` to its "
                   "first output; ITL: gaps between a stream's outputs, ending in the second "
                   "before the request (before) or between the request and its first token "
                   f"(during). Target: median ITL during <= {1 + ITL_RISE:.2f}x before.",
                   write=write, device=device)


if __name__ == "__main__":
    main()
