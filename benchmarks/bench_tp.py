"""Tensor parallelism: decode step time and throughput at TP 1 and 2, LoRA off and on,
``fully_sharded_loras`` off and on.

A Llama-3-8B-shaped model with random bf16 weights (``load_format="dummy"``; every rank
holds the slices of the same random model), 16 distinct rank-16 q/k/v/o adapters in PEFT's
format. Each variant gets its own ``LLMEngine`` (max_num_seqs 64, 16 slots, CUDA graphs for
decode, captured on every rank) in its own process, one after the other (each starts on
empty GPUs).

* **Decode step**: ``B`` requests (random 512-token prompts, request i on adapter i % 16 when
  LoRA is on) are prefilled, then 32 decode steps are timed one by one (``LLMEngine.step``,
  which ends with the sampled tokens on the host, so each time is a whole step: rank 0's
  sending of the step's inputs included); the median is reported. B = 1 and 64.
* **Throughput**: 256 requests at once, 128-token prompts, 64 new tokens (greedy,
  ignore_eos); output tokens over the wall time of stepping them all to the end.

Floor of a batch-1 step: the bytes one GPU must read (its share of the weights, plus the
adapters' rows) over the measured copy bandwidth; at TP 2 each GPU reads half the weights,
so the ideal step is 0.5x TP 1's.

    python -m benchmarks.bench_tp
    python -m benchmarks.bench_tp --quick     # tiny model on CPU (gloo), a smoke run
"""

from __future__ import annotations

import argparse
import multiprocessing
import queue
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import command_line, gpu_name, measure_copy_bandwidth, record
from benchmarks.llama3_8b import LLAMA3_8B, TINY, write_config, write_peft_adapters
from manylora import EngineArgs, LoRARequest, SamplingParams
from manylora.engine.llm_engine import LLMEngine

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
NUM_ADAPTERS = 16
RANK = 16
#: Kinds of kernel time in ``kernel_breakdown``.
KINDS = ("gemm", "collective", "lora", "other")
# (tensor_parallel_size, LoRA on, fully_sharded_loras)
VARIANTS = [(1, False, False), (1, True, False), (2, False, False), (2, True, False),
            (2, True, True)]


def build(model_dir: Path, tp: int, lora: bool, fully_sharded: bool, quick: bool
          ) -> LLMEngine:
    return LLMEngine(EngineArgs(
        model=str(model_dir), load_format="dummy", skip_tokenizer_init=True,
        device="cpu" if quick else "cuda", dtype="auto", tensor_parallel_size=tp,
        enable_lora=lora, fully_sharded_loras=fully_sharded,
        max_loras=NUM_ADAPTERS,
        max_lora_rank=RANK, max_num_seqs=64, max_model_len=1024,
        num_kv_blocks=4096 if not quick else 512))


def _lora(adapters: list[Path], i: int, on: bool) -> LoRARequest | None:
    if not on:
        return None
    k = i % NUM_ADAPTERS
    return LoRARequest(f"a{k}", k + 1, str(adapters[k]))


def kernel_breakdown(engine: LLMEngine, steps: int) -> dict[str, float]:
    """Rank 0's GPU kernels over ``steps`` engine steps (``torch.profiler``), per step: the
    summed kernel time by kind, ms (``gemm``: cuBLAS, split-K reductions included;
    ``collective``: NCCL; ``lora``: the shrink/expand kernels; ``other``: attention, norms,
    rotary, copies, sampling), and ``count``, the kernels launched. Prints the eight
    costliest kernels.

    Raises:
        RuntimeError: a step had no request to run (the figures would be diluted).
    """
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            if not engine.step():
                raise RuntimeError("a profiled step ran no request")
    out = {"gemm": 0.0, "collective": 0.0, "lora": 0.0, "other": 0.0, "count": 0.0}
    kernels = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA]
    for evt in sorted(kernels, key=lambda e: -e.self_device_time_total)[:8]:
        print(f"    {evt.self_device_time_total / 1e3 / steps:7.3f} ms/step "
              f"{evt.count / steps:5.0f}x  {evt.key[:90]}", flush=True)
    for evt in kernels:
        name = evt.key.lower()
        kind = ("collective" if "nccl" in name else
                "lora" if "shrink" in name or "expand" in name else
                "gemm" if any(k in name for k in ("nvjet", "gemm", "cublas", "cutlass"))
                else "other")
        out[kind] += evt.self_device_time_total / 1e3 / steps
        out["count"] += evt.count / steps
    return out


def decode_step_ms(engine: LLMEngine, batch: int, prompt_len: int, vocab: int,
                   adapters: list[Path], lora: bool, rng: random.Random,
                   profile_steps: int = 0) -> tuple[float, float, float, dict | None]:
    """Medians over 32 decode steps of ``batch`` requests, ms: the step's wall time, the part
    of it rank 0 spends sending the step's inputs to the other ranks (0 at TP 1), and rank
    0's GPU time of the step's decode graph (CUDA events around its replay; nan without
    CUDA graphs); then, with ``profile_steps``, the ``kernel_breakdown`` of that many more
    steps (else None)."""
    params = SamplingParams(temperature=0.0, max_tokens=40 + profile_steps, ignore_eos=True)
    ids = [engine.add_request(None, {"prompt_token_ids": [rng.randrange(vocab)
                                                          for _ in range(prompt_len)]},
                              params, _lora(adapters, i, lora)) for i in range(batch)]
    seen: set[str] = set()
    while len(seen) < batch:                                   # prefill (and warm-up)
        seen.update(o.request_id for o in engine.step())
    for _ in range(3):
        engine.step()
    runner = engine.engine_core.executor.runner
    sends: list[float] = []
    send = runner.on_step
    if send is not None:
        def timed_send(inputs) -> None:
            t = time.perf_counter()
            send(inputs)
            sends.append(time.perf_counter() - t)
        runner.on_step = timed_send
    events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
    if runner.graphs is not None:
        def timed_replay(key, replay=runner.graphs.replay):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = replay(key)
            end.record()
            events.append((start, end))
            return out
        runner.graphs.replay = timed_replay
    times = []
    for _ in range(32):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    runner.on_step = send
    if runner.graphs is not None:
        del runner.graphs.replay                               # the class's method again
    kernels = kernel_breakdown(engine, profile_steps) if profile_steps else None
    engine.abort_request(ids)
    graph_ms = statistics.median(s.elapsed_time(e) for s, e in events) if events else float("nan")
    return (statistics.median(times) * 1e3, statistics.median(sends or [0.0]) * 1e3, graph_ms,
            kernels)


def throughput(engine: LLMEngine, vocab: int, adapters: list[Path], lora: bool,
               rng: random.Random, requests: int, prompt_len: int, max_tokens: int) -> float:
    """Output tokens per second of ``requests`` requests at once."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(requests):
        engine.add_request(None, {"prompt_token_ids": [rng.randrange(vocab)
                                                       for _ in range(prompt_len)]},
                           params, _lora(adapters, i, lora))
    tokens = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens += len(out.outputs[0].token_ids)
    return tokens / (time.perf_counter() - start)


def weight_bytes(config: dict) -> int:
    """Bytes of one rank-1 copy of the bf16 weights (embedding read excluded: one row)."""
    h, i, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    kv = config["num_key_value_heads"] * h // config["num_attention_heads"]
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * i
    return 2 * (layers * per_layer + config["vocab_size"] * h)


def run_variant(variant: tuple[int, bool, bool, bool], model_dir: Path,
                adapters: list[Path], quick: bool, results_q) -> None:
    """One variant in its own process; puts ``(batch-1 ms, its send ms, its graph GPU ms,
    batch-64 ms, tok/s, the batch-1 kernel breakdown or None)`` on ``results_q``."""
    tp, lora, fully = variant
    config = TINY if quick else LLAMA3_8B
    vocab = config["vocab_size"]
    rng = random.Random(0)
    start = time.perf_counter()
    engine = build(model_dir, tp, lora, fully, quick)
    print(f"TP {tp}, LoRA {lora}, fully sharded {fully}: engine "
          f"built in {time.perf_counter() - start:.1f} s", flush=True)
    try:
        b1, send1, graph1, kernels = decode_step_ms(
            engine, 1, 32 if quick else 512, vocab, adapters, lora, rng,
            profile_steps=0 if quick else 10)
        b64, _, _, _ = decode_step_ms(engine, 8 if quick else 64, 32 if quick else 512, vocab,
                                adapters, lora, rng)
        rate = throughput(
            engine, vocab, adapters, lora, rng, *((16, 8, 4) if quick else (256, 128, 64)))
    finally:
        engine.shutdown()
    print(f"  batch-1 step {b1:.2f} ms (send {send1:.3f} ms, graph {graph1:.2f} ms), batch-64 "
          f"step {b64:.2f} ms, {rate:,.0f} tok/s", flush=True)
    results_q.put((b1, send1, graph1, b64, rate, kernels))


def _result(q, proc, variant: tuple) -> tuple:
    """What ``run_variant`` put on ``q``, waiting while ``proc`` lives.

    Raises:
        RuntimeError: the variant's process ended without a result.
    """
    while True:
        try:
            return q.get(timeout=5)
        except queue.Empty:
            if not proc.is_alive():
                raise RuntimeError(f"variant {variant} ended with exit code {proc.exitcode} "
                                   "and no result") from None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    config = TINY if args.quick else LLAMA3_8B
    device = torch.device("cpu" if args.quick else "cuda")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_config(Path(tmp) / "model", config)
        adapters = write_peft_adapters(Path(tmp) / "adapters", config, NUM_ADAPTERS, RANK,
                                       TARGETS, device,
                                       torch.float32 if args.quick else torch.bfloat16)
        results = {}
        ctx = multiprocessing.get_context("spawn")
        for variant in VARIANTS:
            results_q = ctx.Queue()
            proc = ctx.Process(target=run_variant, args=(variant, model_dir, adapters,
                                                         args.quick, results_q))
            proc.start()
            results[variant] = _result(results_q, proc, variant)
            proc.join()
        bandwidth = measure_copy_bandwidth(device) if device.type == "cuda" else float("nan")
    floor1 = weight_bytes(config) / bandwidth * 1e3
    for (tp, lora, fully), (b1, send1, graph1, b64, rate, _) in results.items():
        base = results[(1, lora, False)]
        rows.append([tp, "rank-16 q/k/v/o" if lora else "off", "on" if fully else "off",
                     f"{b1:.2f}", f"{b1 / base[0]:.2f}", f"{send1:.3f}", f"{graph1:.2f}",
                     f"{graph1 / base[2]:.2f}", f"{floor1 / tp:.2f}",
                     f"{b64:.2f}", f"{b64 / base[3]:.2f}", f"{rate:,.0f}",
                     f"{rate / base[4]:.2f}"])
    gpu = gpu_name(device)
    record(f"Tensor parallelism ({gpu}): Llama-3-8B shape, decode step and throughput at TP 1 "
           "and 2", command_line("benchmarks.bench_tp"),
           ["TP", "LoRA", "fully sharded", "batch-1 step ms", "vs TP 1",
            "of it send ms", "of it graph GPU ms", "graph vs TP 1",
            "floor ms (weights / BW / TP)", "batch-64 step ms", "vs TP 1",
            "tok/s (256 requests)", "vs TP 1"],
           rows,
           notes="Random bf16 weights; step = `LLMEngine.step` wall time (rank 0's sending of "
                 "the step's inputs and the sampled tokens' read-back included), median of 32 "
                 "decode steps at context 512; 'of it send': the median time rank 0 spends "
                 "sending a batch-1 step's inputs (`TPDriver.step`); 'of it graph GPU': rank "
                 "0's GPU time of the batch-1 step's decode graph (CUDA events around its "
                 "replay: every layer and its all-reduces; not the LM head, sampling or the "
                 "host's work, which the step adds); batch-1 LoRA rows "
                 "use one adapter, batch-64 rows 16. Throughput: 256 requests at once, "
                 "128-token prompts, 64 new tokens, "
                 "request i on adapter i % 16. All-reduces: NCCL's. 'vs TP 1' compares "
                 "with TP 1 at the same LoRA setting. Floor: the bf16 weights one GPU reads per "
                 "step over the measured copy bandwidth (KV and adapters excluded).",
           write=not args.quick, device=device)
    breakdown = [[tp, "rank-16 q/k/v/o" if lora else "off", "on" if fully else "off",
                  f"{b1:.2f}", f"{graph1:.2f}", f"{sum(k[c] for c in KINDS):.2f}",
                  *(f"{k[c]:.2f}" for c in KINDS), f"{k['count']:.0f}",
                  f"{b1 - sum(k[c] for c in KINDS):.2f}", f"{floor1 / tp:.2f}"]
                 for (tp, lora, fully), (b1, _, graph1, _, _, k) in results.items()
                 if k is not None]
    if breakdown:
        record(f"Tensor parallelism ({gpu}): where a batch-1 decode step's time goes on rank 0",
               command_line("benchmarks.bench_tp"),
               ["TP", "LoRA", "fully sharded", "step ms", "graph GPU ms", "kernels ms",
                "of them GEMM", "NCCL", "LoRA", "other", "kernels per step",
                "step − kernels ms", "floor ms"],
               breakdown,
               notes="Same run as the table above. Kernels: `torch.profiler` over 10 more "
                     "batch-1 steps, rank 0's CUDA kernel time per step by kind (GEMM: "
                     "cuBLAS, split-K reductions included; NCCL: the all-reduces and the "
                     "logits' all-gather; LoRA: shrink/expand; other: attention, norms, "
                     "rotary, activation, KV writes, copies, sampling). 'step − kernels': "
                     "the part of the step when rank 0's GPU runs no kernel: host work "
                     "(scheduling, inputs, sending, sampling, outputs) and the gaps between "
                     "a graph's kernels. Floor: the weights one GPU reads over the copy "
                     "bandwidth.",
               write=True, device=device)


if __name__ == "__main__":
    main()
