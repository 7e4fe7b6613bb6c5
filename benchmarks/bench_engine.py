"""Issue 16's engine targets, side by side: offline and served throughput, GPU idle per decode
step, batch-1 decode against the copy bandwidth, start-up time.

A Llama-3-8B-shaped model with random bf16 weights (``load_format="dummy"``,
``skip_tokenizer_init``: token ids in and out), 64 distinct rank-16 q/k/v/o adapters written in
PEFT's format, one engine setting for everything: ``max_num_seqs`` 256,
``max_num_batched_tokens`` 8192, 64 adapter slots, prefix caching on. Every timed pass has
token ids of its own (no prompt the prefix cache has seen): its prefix-hit tokens are
reported and should be 0.

Workloads (issue 16's table; greedy, ignore_eos):

* **W1**: batch 64, prompt 128, 64 new tokens, LoRA off;
* **W2**: 512 requests, prompts of 128-1024 tokens, 64-256 new tokens (uniform, seed 0),
  LoRA off;
* **W3**: W2's lengths, 64 adapters round robin, every 8th request on the base model.

Parts (``--part``, several at once allowed, in this order):

* ``offline``: ``LLM.generate`` (the core in its own process) on each workload: a warm-up
  pass (the workload's prompt lengths, other token ids, at most 16 new tokens each: every
  prefill shape and adapter is met), then the timed passes (``--repeats``, W1 at least 3,
  each on token ids of its own); output tokens / the median time of the whole call.
* ``serve``: ``manylora serve`` with the same engine settings and the same prompts, driven by
  the official ``openai`` client in ``--client-procs`` processes, every request streamed
  (``common.drive_openai``); warm-up pass, then the timed passes. With ``offline`` in the same
  run, the table has server / offline per workload (target >= 0.95 on W2) next to vLLM 0.26's
  figures from the issue (6,037 / 5,857 / 2,406 tok/s) and the targets (6,900 / 6,700 /
  1.5 x 2,406).
* ``idle``: the core in the measuring process (``MANYLORA_ENABLE_MULTIPROCESSING=0``), 256
  requests (512-token prompts, ignore_eos) brought to steady decode, then ``--steps``
  ``EngineCore.step()`` calls timed, and as many again under ``torch.profiler``: per step the
  wall time, the GPU busy time (the union of the kernels' intervals inside the step's
  window), idle = wall - busy, the host time until the step's last kernel launch and after
  its last kernel ended; LoRA off (async scheduling on and off) and 64 adapters (4 rows
  each). Target: idle < 0.5 ms.
* ``decode``: ``bench_decode.measure_decode`` at batch 1, context 512, LoRA off: bytes read
  / step time against the measured copy bandwidth (target >= 80%), the step synchronous
  and pipelined as under async scheduling (judged on the latter, the engine's default).
* ``startup``: ``LLM(...)`` built in a fresh process with an empty Triton cache
  (``TRITON_CACHE_DIR`` a new directory) and again with that cache warm; the core's
  "Triton warm-up" log line (its stderr) gives the launches, the specializations compiled or
  loaded and the warm-up's seconds. Target: < 60 s with every specialization compiled.

Each measurement that holds the GPU runs in a process of its own, one after the other, so
each starts on an empty GPU. Each part prints and records (``common.record``) its table.
Expected durations on one H100 (start-ups included; the first call of a machine compiles
Triton's cache, add a minute):

    python -m benchmarks.bench_engine --part offline serve    # ~5-6 min
    python -m benchmarks.bench_engine --part idle decode      # ~3 min
    python -m benchmarks.bench_engine --part startup          # ~2-3 min
    python -m benchmarks.bench_engine --quick                 # every part, tiny model, CPU

(``--quick`` takes about 1.5 min on 2 busy CPU cores.) Should ``offline serve`` come near a
10-minute limit, split it by workload (``--workloads W1 W2``, then ``--workloads W3``); the
server / offline ratio needs both paths in one invocation.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from bisect import bisect_left
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.common import (
    ServedRequest,
    command_line,
    drive_openai,
    gpu_name,
    prefix_hit_tokens,
    record,
    start_server,
    stop_server,
)
from benchmarks.llama3_8b import LLAMA3_8B, TINY, write_config, write_peft_adapters

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
RANK = 16
PARTS = ("offline", "serve", "idle", "decode", "startup")
#: vLLM 0.26's output tok/s on an H100 (issue 16's table) and the issue's targets.
VLLM = {"W1": 6037, "W2": 5857, "W3": 2406}
TARGET = {"W1": 6900, "W2": 6700, "W3": 1.5 * 2406}
SERVE_RATIO_TARGET = 0.95
IDLE_TARGET_MS = 0.5
DECODE_BW_TARGET = 0.80
STARTUP_TARGET_S = 60.0
#: New tokens per request of a warm-up pass, at most.
WARMUP_NEW = 16
#: Seeds of each workload's warm-up and timed token ids (lengths: seed 0).
SEEDS = {"W1": (11, 12), "W2": (21, 22), "W3": (31, 32)}
#: Host API calls that launch GPU work (kernels, CUDA graphs), by name prefix.
LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaGraphLaunch", "cuGraphLaunch",
                "cudaLaunchCooperativeKernel")
#: GPU activity that is not a kernel, by name prefix.
NOT_KERNELS = ("Memcpy", "Memset", "gpu_user_annotation")
WARMUP_LINE = re.compile(r"Triton warm-up: (\d+) launches, (\d+) kernel specializations "
                         r"compiled or loaded, ([\d.]+) s")


@dataclass(frozen=True)
class Workload:
    """A list of requests: ``lengths[i]`` = (prompt tokens, new tokens) of request i, on
    the base model or (``lora``) on adapter ``adapter_of(i)``."""

    name: str
    title: str
    lengths: list[tuple[int, int]]
    lora: bool

    def prompts(self, vocab: int, seed: int) -> list[list[int]]:
        """Random token ids of the workload's prompt lengths (``seed``)."""
        rng = random.Random(seed)
        return [[rng.randrange(vocab) for _ in range(p)] for p, _ in self.lengths]


def workloads(quick: bool) -> dict[str, Workload]:
    """W1, W2 and W3 (tiny sizes with ``quick``)."""
    rng = random.Random(0)
    n, lo, hi, out_lo, out_hi = (16, 8, 32, 4, 8) if quick else (512, 128, 1024, 64, 256)
    mixed = [(rng.randint(lo, hi), rng.randint(out_lo, out_hi)) for _ in range(n)]
    batch, prompt, new = (4, 8, 4) if quick else (64, 128, 64)
    return {"W1": Workload("W1", f"batch {batch}, prompt {prompt}, {new} new, LoRA off",
                           [(prompt, new)] * batch, False),
            "W2": Workload("W2", f"{n} requests, prompts {lo}-{hi}, {out_lo}-{out_hi} new, "
                           "LoRA off", mixed, False),
            "W3": Workload("W3", f"the same {n}, {num_adapters(quick)} adapters round robin, "
                           "every 8th on the base", mixed, True)}


def num_adapters(quick: bool) -> int:
    return 4 if quick else 64


def adapter_of(i: int, count: int) -> int | None:
    """Request i's adapter in a LoRA workload: None (the base model) for every 8th request,
    else the others round robin over ``count`` adapters (each one used)."""
    return None if i % 8 == 7 else (i - i // 8) % count


def engine_kwargs(quick: bool, lora: bool = True) -> dict:
    """The engine setting of every part (``EngineArgs`` fields); ``lora`` False: LoRA
    disabled (``enable_lora=False``, no slots), as a LoRA-off baseline runs."""
    common = dict(load_format="dummy", skip_tokenizer_init=True,
                  dtype="float32" if quick else "bfloat16", device="cpu" if quick else "cuda",
                  max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=2048,
                  enable_prefix_caching=True, **({"num_kv_blocks": 1024} if quick else {}))
    if not lora:
        return dict(common, enable_lora=False)
    return dict(common, max_loras=num_adapters(quick), max_cpu_loras=num_adapters(quick),
                max_lora_rank=RANK, lora_target_modules=LORA_TARGETS)


def in_child(fn: Callable, *args):
    """``fn(*args)`` in a fresh (``spawn``) process, which ends with it (and frees the GPU);
    its result, or its exception raised here."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def _ms(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x:.2f}"


def _rate(r: dict | None) -> float:
    return r["tokens"] / r["seconds"] if r else float("nan")


# ---------------------------------------------------------------------------------------------
# (a) offline and (b) served throughput


def timed_seeds(name: str, repeats: int) -> list[int]:
    """The token-id seeds of a workload's timed passes: ``repeats`` of them (at least 3 for
    W1, whose pass lasts about a second), each pass on prompts of its own."""
    passes = max(repeats, 3) if name == "W1" else repeats
    return [SEEDS[name][1] + 1000 * r for r in range(passes)]


def summarize(passes: list[dict]) -> dict:
    """One workload's timed passes (same lengths, so same ``tokens``) → ``tokens``, the
    median ``seconds`` (and ``ttft``, ``itl``: the median of the passes' medians, when
    present), ``prefix_hits`` and ``preemptions`` summed over the passes, ``passes``."""
    out = {"tokens": passes[0]["tokens"], "passes": len(passes),
           "seconds": statistics.median(p["seconds"] for p in passes)}
    for key in ("ttft", "itl"):
        if key in passes[0]:
            out[key] = statistics.median(p[key] for p in passes)
    for key in ("prefix_hits", "preemptions"):
        if key in passes[0]:
            out[key] = sum(p[key] for p in passes)
    return out


def write_setting(root: Path, quick: bool) -> tuple[Path, list[Path]]:
    """The benchmark model's config (``LLAMA3_8B``, ``TINY`` with ``quick``) and its
    ``num_adapters`` rank-``RANK`` PEFT adapters on ``LORA_TARGETS``, written under
    ``root``: ``(model_dir, adapter_dirs)``."""
    config = TINY if quick else LLAMA3_8B
    device = torch.device("cpu" if quick else "cuda")
    model_dir = write_config(root / "model", config)
    adapters = write_peft_adapters(root / "adapters", config, num_adapters(quick), RANK,
                                   LORA_TARGETS, device,
                                   torch.float32 if quick else torch.bfloat16)
    return model_dir, adapters


def offline_pass(llm, work: Workload, loras: list, seed: int,
                 cap: int | None) -> tuple[int, int]:
    """One ``LLM.generate`` of the workload's requests (token ids of ``seed``; new tokens
    capped at ``cap``; adapter ``adapter_of(i)`` from ``loras`` when the workload uses
    them), greedy, ignore_eos: ``(tokens generated, tokens asked)``."""
    from manylora import SamplingParams

    news = [min(n, cap) if cap else n for _, n in work.lengths]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in news]
    reqs = [loras[k] if work.lora and (k := adapter_of(i, len(loras))) is not None
            else None for i in range(len(news))]
    outs = llm.generate([{"prompt_token_ids": p}
                         for p in work.prompts(llm.llm_engine.vocab_size, seed)],
                        params, reqs, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs), sum(news)


def run_offline(model_dir: Path, adapters: list[Path], names: Sequence[str], repeats: int,
                quick: bool, lora: bool = True) -> dict[str, dict]:
    """Each workload through ``LLM.generate``, warm-up pass first, then its timed passes
    (``timed_seeds``); per workload the ``summarize``-d ``tokens``, ``seconds``,
    ``prefix_hits`` (prompt tokens found in the prefix cache) and ``preemptions``.

    Raises:
        RuntimeError: a pass generated another number of tokens than it asked for.
    """
    from manylora import LLM, LoRARequest

    llm = LLM(str(model_dir), **engine_kwargs(quick, lora))
    loras = [LoRARequest(f"a{k}", k + 1, str(p)) for k, p in enumerate(adapters)]
    results = {}

    def generate(work: Workload, seed: int, cap: int | None) -> tuple[int, float]:
        start = time.perf_counter()
        tokens, asked = offline_pass(llm, work, loras, seed, cap)
        seconds = time.perf_counter() - start
        if tokens != asked:
            raise RuntimeError(f"{work.name}: generated {tokens} tokens, asked {asked}")
        return tokens, seconds

    try:
        for name in names:
            work = workloads(quick)[name]
            generate(work, SEEDS[name][0], WARMUP_NEW)
            passes = []
            for seed in timed_seeds(name, repeats):
                hits = prefix_hit_tokens(llm)
                preempted = llm.llm_engine.kv_cache_stats().preemptions
                tokens, seconds = generate(work, seed, None)
                passes.append({
                    "tokens": tokens, "seconds": seconds,
                    "prefix_hits": prefix_hit_tokens(llm) - hits,
                    "preemptions": llm.llm_engine.kv_cache_stats().preemptions - preempted})
                print(f"offline {name}: {tokens:,} tokens in {seconds:.2f} s = "
                      f"{tokens / seconds:,.0f} tok/s, {passes[-1]}", flush=True)
            results[name] = summarize(passes)
    finally:
        llm.llm_engine.shutdown()
    return results


def served_requests(work: Workload, prompts: list[list[int]], cap: int | None,
                    adapters: int) -> list[ServedRequest]:
    """The workload's requests for the openai client (adapter k is served as ``a{k}``)."""
    out = []
    for i, (prompt, (_, new)) in enumerate(zip(prompts, work.lengths, strict=True)):
        k = adapter_of(i, adapters) if work.lora else None
        out.append(("base" if k is None else f"a{k}", prompt, min(new, cap) if cap else new))
    return out


def run_serve(model_dir: Path, adapters: list[Path], names: Sequence[str], repeats: int,
              port: int, procs: int, quick: bool, lora: bool = True) -> dict[str, dict]:
    """Each workload through ``manylora serve`` (``common.drive_openai``), warm-up pass
    first, then its timed passes (``timed_seeds``); per workload the ``summarize``-d
    ``drive_openai`` figures.

    Raises:
        RuntimeError: a timed pass got another number of tokens than it asked for.
    """
    vocab = (TINY if quick else LLAMA3_8B)["vocab_size"]
    batches, labels = [], []
    for name in names:
        work = workloads(quick)[name]
        batches.append(served_requests(work, work.prompts(vocab, SEEDS[name][0]), WARMUP_NEW,
                                       len(adapters)))
        labels.append(None)
        for seed in timed_seeds(name, repeats):
            batches.append(served_requests(work, work.prompts(vocab, seed), None,
                                           len(adapters)))
            labels.append(name)
    proc = start_server(model_dir, port, engine_kwargs(quick, lora),
                        [(f"a{k}", p) for k, p in enumerate(adapters)] if lora else [],
                        extra_args=["--uvicorn-log-level", "warning"])   # no line per request
    try:
        runs = drive_openai(port, batches, procs)
    finally:
        stop_server(proc)
    results = {}
    for name in names:
        passes = [r for r, label in zip(runs, labels, strict=True) if label == name]
        expected = sum(n for _, n in workloads(quick)[name].lengths)
        for r in passes:
            if r["tokens"] != expected:
                raise RuntimeError(f"serve {name}: {r['tokens']} tokens, asked {expected}")
            print(f"serve {name}: {r['tokens']:,} tokens in {r['seconds']:.2f} s = "
                  f"{_rate(r):,.0f} tok/s, {r}", flush=True)
        results[name] = summarize(passes)
    return results


def throughput_table(names: Sequence[str], offline: dict, served: dict, quick: bool
                     ) -> tuple[list[str], list[list]]:
    columns = ["workload", "output tokens per pass", "timed passes", "offline tok/s",
               "serve tok/s", "serve / offline",
               "vLLM 0.26 tok/s", "target tok/s", "offline / target", "serve / target",
               "TTFT median ms (serve)", "ITL median ms (serve)",
               "prefix-hit tokens (offline / serve)", "preemptions (offline)"]
    rows = []
    for name in names:
        work = workloads(quick)[name]
        off, srv = offline.get(name), served.get(name)
        rate_off, rate_srv = _rate(off), _rate(srv)
        tokens = (off or srv)["tokens"]
        rows.append([
            f"{name}: {work.title}", f"{tokens:,}", (off or srv)["passes"], _num(rate_off),
            _num(rate_srv),
            _ratio(rate_srv / rate_off), f"{VLLM[name]:,}", f"{TARGET[name]:,.0f}",
            _ratio(rate_off / TARGET[name]), _ratio(rate_srv / TARGET[name]),
            _num(srv["ttft"] * 1e3) if srv else "-", _ms(srv["itl"] * 1e3) if srv else "-",
            f"{off['prefix_hits'] if off else '-'} / {srv['prefix_hits'] if srv else '-'}",
            off["preemptions"] if off else "-"])
    return columns, rows


def _num(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:,.0f}"


def _ratio(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.2f}"


# ---------------------------------------------------------------------------------------------
# (c) GPU idle per decode step


def step_timeline(prof, label: str) -> list[dict]:
    """Per profiled step (``record_function(label + index)`` windows): ``wall`` (ms),
    ``busy`` (ms of the window during which at least one CUDA kernel ran: the union of the
    kernels' intervals, memory copies and sets excluded), ``kernels`` (count), ``launched``
    (ms from the window's start to the end of its last kernel or graph launch call on the
    host), ``after`` (ms from the end of its last kernel to the window's end: host work the
    GPU waits through). GPU figures are nan when the profile holds no kernel (no CUDA).

    Kernel times come from the CUDA activity trace, on the host clock (Kineto aligns them),
    so a kernel is counted in the window it ran in, whichever step launched it.
    """
    from torch.autograd import DeviceType

    windows, kernels, launches = [], [], []
    for e in prof.events():
        span = (e.time_range.start, e.time_range.end)
        if e.name.startswith(label):                  # the step's window (CPU) or its GPU twin
            if e.device_type == DeviceType.CPU:
                windows.append(span)
        elif e.name.startswith(LAUNCH_CALLS):         # CUDA runtime / driver API, on the host
            launches.append(span[1])
        elif e.device_type == DeviceType.CUDA and not getattr(
                e, "is_user_annotation", False) and not e.name.startswith(NOT_KERNELS):
            kernels.append(span)
    windows.sort()
    kernels.sort()
    launches.sort()
    starts = [s for s, _ in kernels]
    steps = []
    for lo, hi in windows:
        inside = [(max(s, lo), min(e, hi)) for s, e in
                  kernels[max(0, bisect_left(starts, lo) - 64):bisect_left(starts, hi)]
                  if min(e, hi) > max(s, lo)]
        busy, end, last = 0.0, -math.inf, -math.inf
        for s, e in inside:
            if s > end:
                busy += e - s
                end = e
            elif e > end:
                busy += e - end
                end = e
            last = max(last, e)
        calls = launches[bisect_left(launches, lo):bisect_left(launches, hi)]
        nan = float("nan")
        steps.append({"wall": (hi - lo) / 1e3,
                      "busy": busy / 1e3 if inside else nan,
                      "kernels": len(inside),
                      "launched": (calls[-1] - lo) / 1e3 if calls else nan,
                      "after": (hi - last) / 1e3 if inside else nan})
    return steps


def run_idle(model_dir: Path, adapters: list[Path], steps: int, quick: bool) -> list[dict]:
    """Decode steps at batch 256 (8 with ``quick``) with the core in this process, LoRA off
    (async scheduling on, then off) then on (request i on adapter i % 64, async scheduling
    on); per case the medians of ``steps`` unprofiled step
    times (``wall_plain``, ms) and of ``step_timeline`` over ``steps`` profiled steps, the
    batch and the context at the profiled steps (tokens).

    Raises:
        RuntimeError: a measured step did not decode every request once.
    """
    os.environ["MANYLORA_ENABLE_MULTIPROCESSING"] = "0"
    from torch.profiler import ProfilerActivity, profile, record_function

    from manylora import EngineArgs, LoRARequest, SamplingParams
    from manylora.engine.llm_engine import LLMEngine

    batch, prompt_len = (8, 16) if quick else (256, 512)
    engine = LLMEngine(EngineArgs(model=str(model_dir), **engine_kwargs(quick)))
    core = engine.engine_core
    rng = random.Random(7)
    activities = [ProfilerActivity.CPU] + (
        [ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    params = SamplingParams(temperature=0.0, max_tokens=2 * steps + 160, ignore_eos=True)
    results = []

    def decode_step() -> None:
        rows = len(core.step().outputs)
        if rows != batch:
            raise RuntimeError(f"a decode step gave {rows} tokens, expected {batch}")

    try:
        # LoRA off with async scheduling on (the default) and off, then 64 adapters (on);
        # the core reads its flag each step, and holds no step in flight between cases
        for lora, async_on in ((False, True), (False, False), (True, True)):
            core.async_scheduling = async_on
            ids = [engine.add_request(
                None, {"prompt_token_ids": [rng.randrange(engine.vocab_size)
                                            for _ in range(prompt_len)]}, params,
                LoRARequest(f"a{i % len(adapters)}", i % len(adapters) + 1,
                            str(adapters[i % len(adapters)])) if lora else None)
                   for i in range(batch)]
            seen: set[str] = set()
            while len(seen) < batch:                       # prefill: every request decodes
                seen.update(o.request_id for o in engine.step())
            for _ in range(5):
                decode_step()
            plain = []
            for _ in range(steps):
                t0 = time.perf_counter()
                decode_step()
                plain.append((time.perf_counter() - t0) * 1e3)
            context = max(core.scheduler.requests[rid].num_tokens for rid in ids)
            with profile(activities=activities) as prof:
                for k in range(steps):
                    with record_function(f"bench_step_{k}"):
                        decode_step()
            timeline = step_timeline(prof, "bench_step_")
            engine.abort_request(ids)
            med = {key: statistics.median(s[key] for s in timeline) for key in timeline[0]}
            results.append({"lora": lora, "async": async_on, "batch": batch,
                            "context": context, "wall_plain": statistics.median(plain), **med})
            print(f"idle (LoRA {lora}, async {async_on}): {results[-1]}", flush=True)
    finally:
        engine.shutdown()
    return results


def idle_table(results: list[dict], adapters: int) -> tuple[list[str], list[list]]:
    columns = ["LoRA", "async scheduling", "batch", "context (tokens)", "step ms (no profiler)",
               "step ms (profiled)", "GPU busy ms", "busy %", "idle ms (no profiler)",
               "idle ms (profiled)", "host to last launch ms", "host after last kernel ms",
               "kernels per step", f"idle < {IDLE_TARGET_MS} ms"]
    rows = []
    for r in results:
        idle = r["wall_plain"] - r["busy"]
        rows.append([f"{adapters} adapters" if r["lora"] else "off",
                     "on" if r["async"] else "off", r["batch"],
                     f"~{r['context']}", _ms(r["wall_plain"]), _ms(r["wall"]), _ms(r["busy"]),
                     "n/a" if math.isnan(r["busy"]) else f"{r['busy'] / r['wall']:.0%}",
                     _ms(idle), _ms(r["wall"] - r["busy"]), _ms(r["launched"]),
                     _ms(r["after"]), f"{r['kernels']:.0f}",
                     "n/a" if math.isnan(idle) else ("yes" if idle < IDLE_TARGET_MS else
                                                     f"no (+{idle - IDLE_TARGET_MS:.2f} ms)")])
    return columns, rows


# ---------------------------------------------------------------------------------------------
# (d) batch-1 decode against the copy bandwidth


def run_decode(quick: bool) -> dict:
    """``bench_decode.measure_decode`` at batch 1, context 512, LoRA off."""
    from benchmarks.bench_decode import measure_decode

    return measure_decode([1], context=512, rank=RANK, quick=quick, loras=(False,))[0]


def decode_table(r: dict) -> tuple[list[str], list[list]]:
    """Judged on the pipelined step (async scheduling, the engine's default)."""
    share = r["floor_s"] / r["step_async_s"]
    columns = ["batch", "GB read per step", "step ms (synchronous)", "step ms (async, median)",
               "copy BW GB/s (measured)", "achieved GB/s (async)", "% of copy BW (async)",
               "% of copy BW (synchronous)", f"target {DECODE_BW_TARGET:.0%}"]
    rows = [[r["batch"], f"{r['bytes'] / 1e9:.2f}", f"{r['step_s'] * 1e3:.3f}",
             f"{r['step_async_s'] * 1e3:.3f}", _num(r["bandwidth"] / 1e9),
             f"{r['bytes'] / r['step_async_s'] / 1e9:,.0f}",
             "n/a" if math.isnan(share) else f"{share:.0%}",
             "n/a" if math.isnan(share) else f"{r['floor_s'] / r['step_s']:.0%}",
             "n/a" if math.isnan(share) else ("yes" if share >= DECODE_BW_TARGET else
                                              f"no (-{DECODE_BW_TARGET - share:.0%})")]]
    return columns, rows


# ---------------------------------------------------------------------------------------------
# (e) start-up

_STARTUP_CHILD = """
import json, sys, time
from manylora import LLM
t0 = time.perf_counter()
llm = LLM(sys.argv[1], **json.loads(sys.argv[2]))
print("STARTUP_SECONDS", time.perf_counter() - t0, flush=True)
llm.llm_engine.shutdown()
"""


def run_startup(model_dir: Path, cache_dir: Path, quick: bool) -> dict:
    """``LLM(...)`` built in a fresh process whose Triton (and TorchInductor) caches are in
    ``cache_dir`` (empty: every kernel compiled; already filled: loaded): its
    ``seconds`` and the core's "Triton warm-up" figures (``launches``, ``compiled``,
    ``warmup_s``; None when the line is absent, as on CPU).

    Raises:
        RuntimeError: the process failed (its standard error is printed).
    """
    for sub in ("triton", "inductor"):
        (cache_dir / sub).mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, TRITON_CACHE_DIR=str(cache_dir / "triton"),
               TORCHINDUCTOR_CACHE_DIR=str(cache_dir / "inductor"))
    done = subprocess.run([sys.executable, "-c", _STARTUP_CHILD, str(model_dir),
                           json.dumps(engine_kwargs(quick))], env=env, capture_output=True,
                          text=True, timeout=600)
    seconds = re.search(r"STARTUP_SECONDS ([\d.]+)", done.stdout)
    if done.returncode != 0 or seconds is None:
        print(done.stderr, file=sys.stderr, flush=True)
        raise RuntimeError(f"the start-up process failed with exit code {done.returncode}")
    line = WARMUP_LINE.search(done.stderr)
    result = {"seconds": float(seconds.group(1)),
              "launches": int(line.group(1)) if line else None,
              "compiled": int(line.group(2)) if line else None,
              "warmup_s": float(line.group(3)) if line else None}
    print(f"start-up ({cache_dir}): {result}", flush=True)
    return result


def startup_table(cold: dict, warm: dict) -> tuple[list[str], list[list]]:
    columns = ["Triton cache", "`LLM(...)` s", "warm-up launches",
               "specializations compiled or loaded", "Triton warm-up s",
               f"< {STARTUP_TARGET_S:.0f} s"]
    rows = []
    for name, r in (("empty (cold)", cold), ("warm", warm)):
        rows.append([name, f"{r['seconds']:.1f}",
                     "-" if r["launches"] is None else r["launches"],
                     "-" if r["compiled"] is None else r["compiled"],
                     "-" if r["warmup_s"] is None else f"{r['warmup_s']:.1f}",
                     "yes" if r["seconds"] < STARTUP_TARGET_S else
                     f"no (+{r['seconds'] - STARTUP_TARGET_S:.0f} s)"])
    return columns, rows


# ---------------------------------------------------------------------------------------------


SETTING = ("Llama-3-8B shape, random bf16 weights, token ids in and out, rank-16 q/k/v/o PEFT "
           "adapters, max_num_seqs 256, max_num_batched_tokens 8192, 64 adapter slots, prefix "
           "caching on, CUDA graphs for decode.")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", nargs="+", choices=(*PARTS, "all"), default=["all"])
    ap.add_argument("--workloads", nargs="+", choices=tuple(SEEDS), default=list(SEEDS),
                    help="the workloads of the offline and serve parts")
    ap.add_argument("--repeats", type=int, default=1,
                    help="timed passes per workload (W1: at least 3), each on prompts of its "
                         "own; the median is reported")
    ap.add_argument("--steps", type=int, default=30, help="decode steps timed by the idle part")
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--client-procs", type=int, default=8,
                    help="openai client processes sharing the requests (serve)")
    ap.add_argument("--quick", action="store_true", help="tiny model on CPU, no record")
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    parts = PARTS if "all" in args.part else tuple(p for p in PARTS if p in args.part)
    quick = args.quick
    if quick:
        args.steps, args.client_procs = min(args.steps, 5), min(args.client_procs, 2)
    elif not torch.cuda.is_available():
        raise SystemExit("bench_engine needs a CUDA GPU (or --quick for a CPU smoke run)")
    device = torch.device("cpu" if quick else "cuda")
    gpu = gpu_name(device)
    command = command_line("benchmarks.bench_engine")
    write = not (quick or args.no_record)
    names = list(args.workloads)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir, adapters = write_setting(root, quick)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        # LoRA-off workloads on an engine with LoRA disabled (the baseline's meaning), the
        # adapter workload on the LoRA engine; each engine in a process of its own
        groups = [(lora, [n for n in names if workloads(quick)[n].lora == lora])
                  for lora in (False, True)]
        offline, served = {}, {}
        for lora, group in groups:
            if group and "offline" in parts:
                offline |= in_child(run_offline, model_dir, adapters, group, args.repeats,
                                    quick, lora)
            if group and "serve" in parts:
                served |= run_serve(model_dir, adapters, group, args.repeats, args.port,
                                    args.client_procs, quick, lora)
        if offline or served:
            columns, rows = throughput_table(names, offline, served, quick)
            record(f"Engine v2 throughput ({gpu}): offline `LLM.generate` and `manylora serve` "
                   "(openai client, streamed), issue 16's workloads", command, columns, rows,
                   notes=SETTING + " Output tok/s = output tokens of a timed pass / its median "
                   "time (offline: the whole `generate` call; served: from the common send "
                   "time to the last stream's end); each workload's warm-up pass "
                   f"(its prompt lengths, other token ids, at most {WARMUP_NEW} new tokens) runs "
                   "first. W1 and W2 run on an engine with LoRA disabled (enable_lora=False), "
                   "W3 on one with 64 adapter slots. "
                   f"Served: {args.client_procs} client processes, every request at once, "
                   "greedy, ignore_eos; TTFT and ITL at the client. vLLM 0.26: issue 16's "
                   "figures (same model, settings and GPU type, V1 engine defaults). Targets: "
                   "1.15x vLLM with LoRA off, 1.5x with 64 adapters, serve / offline >= "
                   f"{SERVE_RATIO_TARGET} on W2. Prefix-hit tokens: prompt tokens the timed "
                   "pass found in the prefix cache (0 expected).",
                   write=write, device=device)
        if "idle" in parts:
            idle = in_child(run_idle, model_dir, adapters, args.steps, quick)
            columns, rows = idle_table(idle, num_adapters(quick))
            record(f"Engine v2 GPU idle per decode step ({gpu}): batch {idle[0]['batch']}, "
                   "core in process",
                   command, columns, rows,
                   notes=SETTING + f" {args.steps} `EngineCore.step()` calls timed, then "
                   f"{args.steps} more under torch.profiler (CPU + CUDA activity), medians. "
                   "Busy: the union of the CUDA kernels' intervals inside a step's window "
                   "(copies excluded); idle (no profiler) = the unprofiled step's wall time - "
                   "busy (the profiler's own host overhead left out); idle (profiled) = the "
                   "profiled step's wall - busy. Host to last launch: from the step's start to "
                   "the end of its last kernel or graph launch call; after last kernel: from "
                   "the GPU's last kernel's end to the step's end (host work the GPU waits "
                   "through: sampled tokens' read-back, scheduler update, outputs). With async "
                   "scheduling a step call plans and launches step n+1, then reads step n: its "
                   "wall time is the pipeline's period, and a kernel counts in the window it "
                   "ran in, whichever call launched it. LoRA on: "
                   f"request i on adapter i % {num_adapters(quick)}.",
                   write=write, device=device)
        if "decode" in parts:
            columns, rows = decode_table(in_child(run_decode, quick))
            record(f"Engine v2 batch-1 base decode vs the copy bandwidth ({gpu})", command,
                   columns, rows,
                   notes="`bench_decode.measure_decode`: synchronous: `ModelRunner.execute` "
                   "wall time (host preparation, CUDA-graph replay, logits, greedy sampling, "
                   "the token's read-back); async: the step period with step n+1 launched "
                   "before step n's token is read (its id gathered on the device), as the "
                   "engine runs by default; batch 1, context 512, LoRA off; GB read = weights "
                   "(one "
                   "embedding row) + KV; copy BW: a 2 GiB device-to-device copy, read + write. "
                   f"Target: >= {DECODE_BW_TARGET:.0%} of the copy bandwidth.",
                   write=write, device=device)
        if "startup" in parts:
            cache = root / "jit-cache"
            cold = run_startup(model_dir, cache, quick)
            warm = run_startup(model_dir, cache, quick)
            columns, rows = startup_table(cold, warm)
            record(f"Engine v2 start-up ({gpu}): `LLM(...)` until ready", command, columns,
                   rows,
                   notes=SETTING + " Each in a fresh process (the core in its own): model "
                   "(dummy weights), KV cache, adapter slots, Triton warm-up (every "
                   "specialization the engine can launch), CUDA graph capture. Cold: "
                   "TRITON_CACHE_DIR a new empty directory; warm: the same directory again. "
                   "Warm-up figures: the core's 'Triton warm-up' log line.",
                   write=write, device=device)


if __name__ == "__main__":
    main()
