"""End to end: output tokens per second of whole ``LLM.generate`` calls, prefill included.

(i)  batch 64, prompt 128, 64 new tokens, greedy, 1 and 64 distinct rank-16 q/k/v/o
     adapters: manylora with LoRA, manylora with LoRA off (the same requests on the base
     model) and transformers + peft (one adapter per row through ``adapter_names``), run
     first, its model freed before manylora's is built.
(ii) 1000 requests, prompts of 128 to 1024 tokens and 64 to 256 new tokens (seed 0), over 1,
     8, 64 and 256 distinct adapters (round robin), and once with LoRA off.

A Llama-3-8B-shaped model with random bf16 weights (``load_format="dummy"``); adapters are
written in PEFT's format and loaded by the engine. Timed calls follow two untimed passes of
the workload's shapes (with every adapter, and without), so adapters are in the host tier and
the Triton kernels are compiled (both happen once per server lifetime). Every pass, warm-up
included, has the same prompt and output lengths but token ids of its own (``fresh_ids``,
one seed per pass): no timed pass finds its prompts in the prefix cache (prefix caching stays
on, as users run it), which the table's "prefix-hit tokens" column shows. Tokens per second
= generated tokens / wall time of the call (the peers' measure).

    python -m benchmarks.bench_e2e --part i            # adds --skip-peft to leave peft out
    python -m benchmarks.bench_e2e --part ii
    python -m benchmarks.bench_e2e --part i --quick    # tiny model on CPU, a smoke run
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import gpu_name, prefix_hit_tokens, record
from benchmarks.llama3_8b import LLAMA3_8B, TINY, write_config, write_peft_adapters
from benchmarks.peft_baseline import run_peft_baseline
from manylora import LLM, LoRARequest, SamplingParams

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
RANK = 16


def workload_i(vocab: int, batch: int = 64, prompt: int = 128, new: int = 64):
    rng = random.Random(0)
    return [([rng.randrange(vocab) for _ in range(prompt)], new) for _ in range(batch)]


def workload_ii(vocab: int, n: int = 1000, quick: bool = False):
    rng = random.Random(0)
    lo, hi, out_lo, out_hi = (8, 32, 4, 8) if quick else (128, 1024, 64, 256)
    return [([rng.randrange(vocab) for _ in range(rng.randint(lo, hi))],
             rng.randint(out_lo, out_hi)) for _ in range(n)]


def fresh_ids(work, vocab: int, seed: int):
    """``work`` with the same prompt and output lengths but new random token ids (``seed``):
    a pass the prefix cache has not seen."""
    rng = random.Random(seed)
    return [([rng.randrange(vocab) for _ in ids], new) for ids, new in work]


def run(llm: LLM, work, adapters: list[LoRARequest] | None) -> tuple[float, int, int]:
    """Generate ``work`` (prompt ids, new tokens) round-robin over ``adapters``; (tok/s,
    output tokens, prompt tokens found in the prefix cache during the call)."""
    prompts = [{"prompt_token_ids": ids} for ids, _ in work]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in work]
    loras = [adapters[i % len(adapters)] if adapters else None for i in range(len(work))]
    hits = prefix_hit_tokens(llm)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, loras, use_tqdm=False)
    seconds = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    expected = sum(n for _, n in work)
    if tokens != expected:
        raise RuntimeError(f"generated {tokens} tokens, expected {expected}")
    return tokens / seconds, tokens, prefix_hit_tokens(llm) - hits


def peft_baseline(adapters: int, quick: bool) -> float:
    """transformers + peft on the same workload (i); its tokens per second."""
    if not quick:
        return run_peft_baseline(adapters)["tokens_per_s"]
    tiny = {k: TINY[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                 "num_attention_heads", "num_key_value_heads", "vocab_size")}
    return run_peft_baseline(adapters, batch=4, prompt_len=8, new_tokens=4, device="cpu",
                             dtype=torch.float32, config=tiny)["tokens_per_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("i", "ii"), required=True)
    ap.add_argument("--skip-peft", action="store_true")
    ap.add_argument("--quick", action="store_true", help="tiny model (CPU allowed), no record")
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    quick = args.quick or not torch.cuda.is_available()
    config = TINY if quick else LLAMA3_8B
    counts = (1, 64) if args.part == "i" else (1, 8, 64, 256)
    if quick:
        counts = tuple(min(c, 8) for c in counts)
    peft = {}
    if args.part == "i" and not args.skip_peft:
        peft = {n: peft_baseline(n, quick) for n in counts}
    device = torch.device("cuda" if torch.cuda.is_available() and not quick else "cpu")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_config(Path(tmp) / "model", config)
        paths = write_peft_adapters(Path(tmp) / "adapters", config, max(counts), RANK, TARGETS,
                                    device)
        llm = LLM(str(model_dir), load_format="dummy", skip_tokenizer_init=True,
                  dtype="float32" if quick else "bfloat16", device=device.type,
                  max_loras=max(counts), max_cpu_loras=max(counts), max_lora_rank=RANK,
                  lora_target_modules=TARGETS, max_num_seqs=256, max_num_batched_tokens=8192,
                  max_model_len=2048)
        requests = [LoRARequest(f"adapter{i}", i + 1, str(p)) for i, p in enumerate(paths)]
        vocab = config["vocab_size"]
        work = workload_i(vocab) if args.part == "i" else workload_ii(
            vocab, 40 if quick else 1000, quick)
        seeds = iter(range(1, 100))
        # Warm-up: the workload's shapes once with every adapter and once without, so each
        # Triton specialization it needs is compiled and every adapter is in the host tier.
        run(llm, fresh_ids(work, vocab, next(seeds)), requests[: max(counts)])
        run(llm, fresh_ids(work, vocab, next(seeds)), None)
        rows = []
        off, _, off_hits = run(llm, fresh_ids(work, vocab, next(seeds)), None)
        for n in counts:
            on, tokens, hits = run(llm, fresh_ids(work, vocab, next(seeds)), requests[:n])
            row = [n, len(work), tokens, f"{on:,.0f}", f"{off:,.0f}", f"{on / off:.1%}",
                   f"{hits:,} / {off_hits:,}"]
            if args.part == "i":
                row += [f"{peft[n]:,.1f}" if n in peft else "-",
                        f"{on / peft[n]:,.0f}x" if n in peft else "-"]
            rows.append(row)
            print(row, flush=True)
    columns = ["adapters", "requests", "output tokens", "manylora LoRA tok/s",
               "manylora LoRA off tok/s", "LoRA / off", "prefix-hit tokens (LoRA / off)"]
    if args.part == "i":
        columns += ["transformers + peft tok/s", "manylora / peft"]
        title = (f"End to end (i) ({gpu_name(device)}): batch 64, prompt 128, 64 new tokens, "
                 "rank-16 q/k/v/o adapters")
    else:
        title = (f"End to end (ii) ({gpu_name(device)}): 1000 requests, prompt 128-1024, "
                 "output 64-256, seed 0")
    notes = ("Llama-3-8B shape, random bf16 weights, greedy, ignore_eos; tok/s = output tokens "
             "/ wall time of one `LLM.generate` call (prefill included). LoRA off = the same "
             "requests without adapters on the same engine. Every pass (warm-up included) "
             "has token ids of its own: prefix-hit tokens = prompt tokens the timed call found "
             "in the prefix cache (0 unless preempted requests found their own blocks). "
             "Engine: max_num_seqs 256, max_num_batched_tokens 8192, block 16, "
             "max_lora_rank 16, prefix caching on, CUDA graphs for decode.")
    record(title, "python -m benchmarks.bench_e2e " + " ".join(sys.argv[1:]), columns, rows,
           notes=notes, write=not (args.no_record or quick))


if __name__ == "__main__":
    main()
