"""``manylora serve`` under load: what the HTTP server costs against the offline engine.

A Llama-3-8B-shaped model with random bf16 weights (``load_format="dummy"``, token ids in
and out: ``skip_tokenizer_init``), 16 distinct rank-16 q/k/v/o adapters in PEFT's format.
Workload: ``--requests`` requests at once, each a random ``--prompt-len``-token prompt
(seeded) and ``--max-tokens`` new tokens (greedy, ignore_eos), request i on adapter i % 16
(every 8th on the base model).

1. **offline**: ``LLM.generate`` on the whole batch (the engine with no server: the upper
   bound a server can reach).
2. **server**: ``manylora serve`` with the same engine arguments in its own process; the
   official ``openai`` client (``AsyncOpenAI`` in ``--client-procs`` processes, all requests
   concurrent, streamed) sends token-id prompts to ``/v1/completions``. Time to first token and
   inter-token latency are taken at the client (first and later chunks); throughput is
   output tokens over the wall time from the first request sent to the last stream ended.

Each path is warmed up first by the same number of requests with other token ids and 4 new
tokens each (Triton compiles every prefill shape), then runs the workload twice with two
other prompt sets (no prefix hits between runs); the second run is reported (the first can
still compile Triton specializations the warm-up missed, which the server's process,
started later, would find in Triton's disk cache).

    python -m benchmarks.bench_serving
    python -m benchmarks.bench_serving --quick       # tiny model on CPU, a smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import random
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import (
    ServedRequest,
    command_line,
    drive_openai,
    gpu_name,
    prefix_hit_tokens,
    record,
    server_metric,
    start_server,
    stop_server,
)
from benchmarks.llama3_8b import LLAMA3_8B, TINY, write_config, write_peft_adapters
from manylora import LLM, LoRARequest, SamplingParams

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
NUM_ADAPTERS = 16
# Warm-up: the same number of requests with other token ids (no prefix hits later) and a few
# new tokens each, so every prefill shape is compiled before the timed run.
WARMUP_TOKENS = 4
# Timed runs per path, each with its own prompts; the last one is reported (the first can
# still JIT-compile Triton specializations the warm-up did not reach, which a later process
# finds in Triton's disk cache).
RUNS = 2


def _adapter_of(i: int) -> int | None:
    """Request i's adapter index (None: the base model)."""
    return None if i % 8 == 7 else i % NUM_ADAPTERS


def engine_kwargs(quick: bool) -> dict:
    return dict(load_format="dummy", skip_tokenizer_init=True, dtype="auto",
                device="cpu" if quick else "cuda", max_loras=NUM_ADAPTERS, max_lora_rank=16,
                max_num_seqs=256, max_model_len=2048,
                **({"num_kv_blocks": 2048} if quick else {}))


def offline(model_dir: Path, adapters: list[Path], prompts, warm, max_tokens: int,
            quick: bool) -> dict:
    llm = LLM(str(model_dir), **engine_kwargs(quick))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    loras = [None if _adapter_of(i) is None else LoRARequest(
        f"a{_adapter_of(i)}", _adapter_of(i) + 1, str(adapters[_adapter_of(i)]))
        for i in range(len(warm))]
    llm.generate([{"prompt_token_ids": p} for p in warm],
                 dataclasses.replace(params, max_tokens=WARMUP_TOKENS), loras, use_tqdm=False)
    for run in prompts:
        hits = prefix_hit_tokens(llm)
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in run], params, loras,
                            use_tqdm=False)
        seconds = time.perf_counter() - start
        hits = prefix_hit_tokens(llm) - hits
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    kv = llm.llm_engine.kv_cache_stats()
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"seconds": seconds, "tokens": tokens, "preemptions": kv.preemptions,
            "blocks": kv.num_blocks, "prefix_hits": hits}


def served_batch(prompts: list[list[int]], max_tokens: int) -> list[ServedRequest]:
    """The workload's requests for the openai client: request i on adapter ``a{i % 16}``
    (every 8th on the base model)."""
    return [("base" if _adapter_of(i) is None else f"a{_adapter_of(i)}", p, max_tokens)
            for i, p in enumerate(prompts)]


def serve(model_dir: Path, adapters: list[Path], prompts, warm, max_tokens: int, port: int,
          procs: int, quick: bool) -> dict:
    """The workload through ``manylora serve`` and ``procs`` client processes, warm-up
    first; the last run's figures, with the server's preemptions and KV blocks."""
    proc = start_server(model_dir, port, engine_kwargs(quick),
                        [(f"a{i}", p) for i, p in enumerate(adapters)])
    try:
        runs = drive_openai(port, [served_batch(warm, WARMUP_TOKENS),
                                   *(served_batch(p, max_tokens) for p in prompts)], procs)
        result = dict(runs[-1])
        result["preemptions"] = int(server_metric(port, "manylora:num_preemptions_total"))
        result["blocks"] = int(server_metric(port, "manylora:kv_cache_blocks"))
    finally:
        stop_server(proc)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--client-procs", type=int, default=8,
                    help="client processes sharing the requests")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.requests, args.prompt_len, args.max_tokens = 32, 16, 8
    config = TINY if args.quick else LLAMA3_8B
    rng = random.Random(0)
    warm, *prompts = ([[rng.randrange(4, config["vocab_size"]) for _ in range(args.prompt_len)]
                       for _ in range(args.requests)] for _ in range(1 + RUNS))
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir = write_config(root / "model", config)
        device = torch.device("cpu" if args.quick else "cuda")
        adapters = write_peft_adapters(root / "adapters", config, NUM_ADAPTERS, 16, TARGETS,
                                       device, torch.float32 if args.quick else torch.bfloat16)
        base = offline(model_dir, adapters, prompts, warm, args.max_tokens, args.quick)
        served = serve(model_dir, adapters, prompts, warm, args.max_tokens, args.port,
                       args.client_procs, args.quick)
    off_rate = base["tokens"] / base["seconds"]
    srv_rate = served["tokens"] / served["seconds"]
    rows = [["offline `LLM.generate`", f"{base['tokens']:,}", f"{base['seconds']:.2f}",
             f"{off_rate:,.0f}", "1.00", "-", "-", base["preemptions"], f"{base['blocks']:,}",
             f"{base['prefix_hits']:,}"],
            ["`manylora serve` + `openai` client, streamed", f"{served['tokens']:,}",
             f"{served['seconds']:.2f}", f"{srv_rate:,.0f}", f"{srv_rate / off_rate:.2f}",
             f"{served['ttft'] * 1e3:.0f}", f"{served['itl'] * 1e3:.1f}",
             served["preemptions"], f"{served['blocks']:,}", f"{served['prefix_hits']:,}"]]
    gpu = gpu_name(device)
    record(f"Serving over HTTP vs the offline engine ({gpu}): {args.requests} requests, "
           f"{args.prompt_len}-token prompts, {args.max_tokens} new tokens, 16 adapters + base",
           command_line("benchmarks.bench_serving"),
           ["path", "output tokens", "seconds", "output tok/s", "vs offline",
            "TTFT median (ms)", "ITL median (ms)", "preemptions", "KV blocks",
            "prefix-hit tokens"], rows,
           notes="Llama-3-8B shape, random bf16 weights, 16 rank-16 q/k/v/o adapters, "
                 "max_num_seqs 256, all requests at once, greedy. The server runs in its own "
                 "process (engine loop thread + uvicorn); the clients in "
                 f"{args.client_procs} others. "
                 "TTFT and ITL are medians over requests and chunks, at the client. "
                 "Prefix-hit tokens: prompt tokens the reported run found in the prefix cache "
                 "(every run and the warm-up have prompts of their own: 0 expected).",
           write=not args.quick, device=device)


if __name__ == "__main__":
    main()
