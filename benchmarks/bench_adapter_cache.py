"""The adapter cache under churn: more adapters than slots, against every adapter in a slot.

Workload: 10,000 requests (prompt 32 random tokens, 32 new tokens, greedy, ignore_eos)
whose adapters are drawn Zipf(1.0) over 1000 distinct rank-16 q/k/v/o adapters (seed 0),
all submitted at once to one ``LLM.generate`` call. Variants of the same engine:

* ``fit``: max_loras = 1000, every adapter has its own slot (the ceiling);
* ``slots``: max_loras = 32, host tier holds all 1000 (slot churn only);
* ``slots-host``: max_loras = 32, max_cpu_loras = 128 (slot churn and disk re-reads,
  staged ahead by the loader threads).

Every adapter is registered (``LLMEngine.add_lora``, read from disk once) and the kernels are
warmed up on a smaller draw of the same workload before the timed call. Also measured on the
``slots`` engine: the time from a request for a cold adapter (on disk, never seen) to its
first token, against the same for an adapter in the host tier and one in a slot; and the
host → device copy time per adapter against the measured pinned-memory copy bandwidth.

    python -m benchmarks.bench_adapter_cache
    python -m benchmarks.bench_adapter_cache --quick      # tiny model on CPU, a smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import itertools
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import gpu_name, pinned_h2d_bandwidth, record
from benchmarks.llama3_8b import LLAMA3_8B, TINY, write_config, write_peft_adapters
from manylora import LLM, LoRARequest, SamplingParams

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
RANK = 16


def zipf_workload(vocab: int, requests: int, adapters: int, prompt: int, new: int,
                  seed: int = 0) -> list[tuple[list[int], int]]:
    """``(prompt ids, adapter index)`` pairs, adapters drawn with weight 1/k (Zipf 1.0)."""
    rng = random.Random(seed)
    ids = rng.choices(range(adapters), weights=[1 / (k + 1) for k in range(adapters)],
                      k=requests)
    return [([rng.randrange(vocab) for _ in range(prompt)], a) for a in ids]


def generate(llm: LLM, work, loras: list[LoRARequest], new: int) -> tuple[float, int]:
    """One ``LLM.generate`` over ``work``; (seconds, output tokens)."""
    prompts = [{"prompt_token_ids": ids} for ids, _ in work]
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, [loras[a] for _, a in work], use_tqdm=False)
    seconds = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    if tokens != new * len(work):
        raise RuntimeError(f"generated {tokens} tokens, expected {new * len(work)}")
    return seconds, tokens


_ttft_seeds = itertools.count(1000)


def time_to_first_token(llm: LLM, lora: LoRARequest, vocab: int) -> float:
    """Seconds from ``add_request`` to the step that returns the request's first token; each
    call's 32-token prompt is new (a seed of its own), so no call finds its prompt in the
    prefix cache and every time includes the whole prefill."""
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    rng = random.Random(next(_ttft_seeds))
    prompt = {"prompt_token_ids": [rng.randrange(vocab) for _ in range(32)]}
    t0 = time.perf_counter()
    rid = engine.add_request(None, prompt, params, lora)
    while True:
        if any(o.request_id == rid and o.outputs[0].token_ids for o in engine.step()):
            return time.perf_counter() - t0


def run_variant(model_dir: Path, device: str, quick: bool, max_loras: int, max_cpu_loras: int,
                loras: list[LoRARequest], warm, work, new: int):
    llm = LLM(str(model_dir), load_format="dummy", skip_tokenizer_init=True,
              dtype="float32" if quick else "bfloat16", device=device, max_loras=max_loras,
              max_cpu_loras=max_cpu_loras, max_lora_rank=RANK, lora_target_modules=TARGETS,
              max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=512)
    engine = llm.llm_engine
    t0 = time.perf_counter()
    for lora in loras:
        engine.add_lora(lora)
    register_s = (time.perf_counter() - t0) / len(loras)
    generate(llm, warm, loras, new)
    before = engine.lora_cache_stats()
    seconds, tokens = generate(llm, work, loras, new)
    after = engine.lora_cache_stats()
    delta = {f.name: getattr(after, f.name) - getattr(before, f.name)
             for f in dataclasses.fields(after)}
    return llm, tokens / seconds, seconds, register_s, delta


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny model (CPU allowed), no record")
    ap.add_argument("--no-record", action="store_true")
    ap.add_argument("--requests", type=int, default=10_000)
    args = ap.parse_args()
    quick = args.quick or not torch.cuda.is_available()
    config = TINY if quick else LLAMA3_8B
    num_adapters, slots, host = (40, 4, 8) if quick else (1000, 32, 128)
    requests = 400 if quick else args.requests
    prompt, new = (8, 8) if quick else (32, 32)
    device = "cuda" if not quick else "cpu"
    vocab = config["vocab_size"]
    work = zipf_workload(vocab, requests, num_adapters, prompt, new)
    warm = zipf_workload(vocab, requests // 10, num_adapters, prompt, new, seed=1)
    rows, notes = [], []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_config(Path(tmp) / "model", config)
        paths = write_peft_adapters(Path(tmp) / "adapters", config, num_adapters + 5, RANK,
                                    TARGETS, torch.device(device))
        loras = [LoRARequest(f"adapter{i}", i + 1, str(p))
                 for i, p in enumerate(paths[:num_adapters])]
        results = {}
        for name, max_loras, max_cpu in (("fit", num_adapters, num_adapters),
                                         ("slots", slots, num_adapters),
                                         ("slots-host", slots, host)):
            llm, tps, seconds, register_s, d = run_variant(
                model_dir, device, quick, max_loras, max_cpu, loras, warm, work, new)
            results[name] = tps
            copies = d["device_misses"]
            per_copy = d["device_load_seconds"] / copies if copies else 0.0
            rows.append([name, max_loras, max_cpu, f"{tps:,.0f}",
                         f"{tps / results['fit']:.1%}", f"{seconds:.1f}", copies,
                         d["device_evictions"], f"{per_copy * 1e3:.2f}", d["host_misses"],
                         d["sync_disk_loads"], f"{register_s * 1e3:.0f}"])
            print(rows[-1], flush=True)
            if name == "slots":
                notes.append(cold_start_note(llm, paths[num_adapters:], vocab, loras, d, quick))
            del llm
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    columns = ["variant", "max_loras", "max_cpu_loras", "tok/s", "vs fit", "seconds",
               "slot loads", "slot evictions", "H2D ms / adapter", "disk reads",
               "disk reads waited on", "register ms / adapter"]
    title = (f"Adapter cache under churn ({gpu_name(torch.device(device))}): {requests} "
             f"requests, {num_adapters} rank-{RANK} q/k/v/o adapters drawn Zipf(1.0)")
    notes.insert(0, (
        "Llama-3-8B shape, random bf16 weights; prompt 32, 32 new tokens, greedy, ignore_eos; "
        "one `LLM.generate` call with every request; tok/s = output tokens / wall time. "
        "max_num_seqs 256, max_num_batched_tokens 8192, CUDA graphs for decode. 'slot loads' "
        "= host → device adapter copies during the timed call, 'H2D ms / adapter' their "
        "mean GPU time (side stream), 'disk reads' = adapters re-read from disk "
        "during the call, 'waited on' = reads a step had to wait for."))
    record(title, "python -m benchmarks.bench_adapter_cache " + " ".join(sys.argv[1:]),
           columns, rows, notes="\n\n".join(notes), write=not (args.no_record or quick))


def cold_start_note(llm: LLM, fresh: list[Path], vocab: int, loras: list[LoRARequest],
                    stats: dict, quick: bool) -> str:
    """Time to first token for cold (disk), host-tier and resident adapters; H2D vs PCIe."""
    engine = llm.llm_engine
    resident_id = next(i for i in engine.engine_core.lora_manager.slot_to_id
                       if i is not None)
    resident = [time_to_first_token(llm, loras[resident_id - 1], vocab) for _ in range(5)]
    manager = engine.engine_core.lora_manager
    host_only = [lid for lid in range(1, len(loras) + 1)
                 if manager.is_ready(lid) and not manager.is_resident(lid)]
    warm = [time_to_first_token(llm, loras[lid - 1], vocab) for lid in host_only[:5]]
    cold = [time_to_first_token(llm, LoRARequest(f"cold{i}", 10_000 + i, str(p)), vocab)
            for i, p in enumerate(fresh)]
    adapter_bytes = stats["device_load_bytes"] / max(stats["device_misses"], 1)
    line = (f"Time to first token of one request (prompt 32) on the idle `slots` engine, median "
            f"of {len(cold)}: cold adapter (PEFT files on disk, never seen) "
            f"{statistics.median(cold) * 1e3:.1f} ms; adapter in the host tier "
            f"{statistics.median(warm) * 1e3:.1f} ms; adapter in a slot "
            f"{statistics.median(resident) * 1e3:.1f} ms.")
    if not quick and stats["device_misses"]:
        bw = pinned_h2d_bandwidth()
        per = stats["device_load_seconds"] / stats["device_misses"]
        line += (f" Host → device copy per adapter ({adapter_bytes / 2**20:.1f} MiB, pinned, "
                 f"side stream): {per * 1e3:.2f} ms mean = "
                 f"{adapter_bytes / per / 1e9:.1f} GB/s, against {bw / 1e9:.1f} GB/s measured "
                 f"for one 256 MiB pinned copy ({adapter_bytes / bw * 1e3:.2f} ms floor).")
    return line


if __name__ == "__main__":
    main()
