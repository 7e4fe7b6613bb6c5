"""First reads of never-seen adapters named at once, right after a cold start.

Workload: in a fresh process, an engine starts (Llama-3-8B shape, random bf16 weights, CUDA
graphs) and at once runs one ``LLM.generate`` call over a mixed batch: one request for each
of N adapters it never saw (rank-16 PEFT adapters on disk, evicted from the page cache with
``posix_fadvise(DONTNEED)`` before the process starts) and N / 4 requests on the base model,
shuffled; prompt 32 random tokens, 32 new tokens, greedy, ignore_eos. N = 64, then 256 in
a second fresh process. Each process gets an empty Triton cache (``TRITON_CACHE_DIR``), as
on a machine's first start, so the kernels compile while the reads run.

Reported per adapter: its first read's end measured from the call (what its requests wait
for: time queued behind other reads plus the read), and the read's own time on its loader
thread (from a worker taking it to its end, whether it succeeded or not); median, p90, max;
failed reads and requests that ended with an error; re-reads (a first read that found the
host tier full of adapters waiting requests need is read again when its turn comes); the
batch's completion. The core runs in the benchmark's process
(``MANYLORA_ENABLE_MULTIPROCESSING=0``) so that the reads can be timed in its adapter
manager; its step loop and loader threads share that process as they share the core's.

    python -m benchmarks.bench_cold_adapters                    # CUDA: 64 and 256
    python -m benchmarks.bench_cold_adapters --counts 64        # one size
    python -m benchmarks.bench_cold_adapters --quick            # tiny model on CPU, a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import gpu_name, record
from benchmarks.llama3_8b import LLAMA3_8B, TINY, write_config, write_peft_adapters

RANK = 16
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
REPO = Path(__file__).resolve().parent.parent
#: (prompt tokens, new tokens) of every request, by ``--quick``.
PROMPT_NEW = {False: (32, 32), True: (8, 8)}


def drop_page_cache(paths: list[Path]) -> None:
    """Evict the adapters' files from the page cache (written back first), so that their
    reads go to the disk as on a machine's first start (no root needed)."""
    for directory in paths:
        for file in directory.iterdir():
            fd = os.open(file, os.O_RDONLY)
            try:
                os.fsync(fd)
                if hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``, nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


# ---------------------------------------------------------------------------------------------
# one fresh process: start the engine, name N new adapters at once


def run_child(args: argparse.Namespace) -> None:
    """Start the engine, time the first reads of ``args.child`` adapters named in one mixed
    ``generate`` call; write the measurements to ``args.out`` as JSON."""
    from manylora import LLM, LoRARequest, SamplingParams

    quick = args.quick
    config = TINY if quick else LLAMA3_8B
    count = args.child
    workdir = Path(args.workdir)
    paths = sorted((workdir / "adapters").iterdir(), key=lambda p: int(p.name[7:]))[:count]
    prompt, new = PROMPT_NEW[quick]
    t0 = time.perf_counter()
    llm = LLM(str(workdir / "model"), load_format="dummy", skip_tokenizer_init=True,
              dtype="float32" if quick else "bfloat16", device="cpu" if quick else "cuda",
              max_loras=args.max_loras, max_cpu_loras=args.max_cpu_loras,
              max_lora_rank=RANK, lora_target_modules=tuple(args.targets.split(",")),
              max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=512)
    startup = time.perf_counter() - t0
    manager = llm.llm_engine.engine_core.lora_manager
    reads: dict[int, list[tuple[float, float, str | None]]] = {}
    original = manager.reader.read

    def timed_read(request):
        start, error = time.perf_counter(), None
        try:
            return original(request)
        except BaseException as e:
            error = f"{type(e).__name__}: {e}"
            raise
        finally:
            reads.setdefault(request.lora_int_id, []).append(
                (start, time.perf_counter(), error))

    manager.reader.read = timed_read
    packs: list[float] = []
    original_pin = manager.reader.pin

    def timed_pin(adapter):
        start = time.perf_counter()
        try:
            return original_pin(adapter)
        finally:
            packs.append(time.perf_counter() - start)

    manager.reader.pin = timed_pin

    rng = random.Random(0)
    vocab = config["vocab_size"]
    loras = [LoRARequest(p.name, i + 1, str(p)) for i, p in enumerate(paths)]
    batch = [*loras, *([None] * (count // 4))]
    rng.shuffle(batch)
    prompts = [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(prompt)]}
               for _ in batch]
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    submitted = time.perf_counter()
    outs = llm.generate(prompts, params, batch, use_tqdm=False)
    completion = time.perf_counter() - submitted
    errors = [str(o.error) for o in outs if o.error is not None]
    first_done, read_s, failed_reads = [], [], []
    for lora in loras:
        timings = reads.get(lora.lora_int_id, [])
        if not timings:
            failed_reads.append(f"{lora.lora_name}: never read")
            continue
        start, end, error = timings[0]
        first_done.append(end - submitted)
        read_s.append(end - start)
        if error is not None:
            failed_reads.append(f"{lora.lora_name}: {error}")
    stats = llm.llm_engine.lora_cache_stats()
    result = dict(
        count=count, startup_s=startup, completion_s=completion, first_done_s=first_done,
        read_s=read_s, pack_s=packs, failed_reads=failed_reads, request_errors=errors,
        rereads=sum(max(0, len(t) - 1) for t in reads.values()),
        host_load_failures=stats.host_load_failures, host_evictions=stats.host_evictions,
        stuck_loader_threads=stats.stuck_loader_threads,
        adapter_bytes=stats.host_load_bytes / max(stats.host_misses, 1))
    Path(args.out).write_text(json.dumps(result))
    llm.llm_engine.shutdown()


# ---------------------------------------------------------------------------------------------
# the parent: write the adapters, one fresh process per size, the table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny model on CPU, no record")
    ap.add_argument("--no-record", action="store_true")
    ap.add_argument("--counts", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--targets", default=",".join(TARGETS),
                    help=f"comma-separated projections (all: {','.join(ALL_TARGETS)})")
    ap.add_argument("--max-loras", type=int, default=32)
    ap.add_argument("--max-cpu-loras", type=int, default=None,
                    help="host tier (default: the engine's, max(32, max_loras))")
    ap.add_argument("--warm-triton-cache", action="store_true",
                    help="keep the Triton cache between runs (default: an empty one each)")
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--workdir", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        run_child(args)
        return
    quick = args.quick or not torch.cuda.is_available()
    args.quick = quick
    if args.targets == "all":
        args.targets = ",".join(ALL_TARGETS)
    config = TINY if quick else LLAMA3_8B
    device = torch.device("cpu" if quick else "cuda")
    prompt, new = PROMPT_NEW[quick]
    rows, details = [], []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        write_config(workdir / "model", config)
        paths = write_peft_adapters(workdir / "adapters", config, max(args.counts), RANK,
                                    tuple(args.targets.split(",")), device)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        for count in args.counts:
            drop_page_cache(paths)
            env = dict(os.environ, MANYLORA_ENABLE_MULTIPROCESSING="0")
            if not args.warm_triton_cache:
                env["TRITON_CACHE_DIR"] = tempfile.mkdtemp(dir=tmp, prefix="triton-")
            out = workdir / f"result-{count}.json"
            cmd = [sys.executable, "-m", "benchmarks.bench_cold_adapters", "--child",
                   str(count), "--workdir", str(workdir), "--out", str(out), "--targets",
                   args.targets, "--max-loras", str(args.max_loras)]
            if args.max_cpu_loras is not None:
                cmd += ["--max-cpu-loras", str(args.max_cpu_loras)]
            if quick:
                cmd.append("--quick")
            subprocess.run(cmd, cwd=REPO, env=env, check=True)
            r = json.loads(out.read_text())
            done, read = r["first_done_s"], r["read_s"]
            rows.append([count, f"{r['startup_s']:.1f}",
                         f"{statistics.median(done):.2f}", f"{percentile(done, 0.9):.2f}",
                         f"{max(done):.2f}", f"{statistics.median(read):.3f}",
                         f"{percentile(read, 0.9):.3f}", f"{max(read):.3f}",
                         f"{statistics.median(r['pack_s']):.3f}", f"{max(r['pack_s']):.3f}",
                         len(r["failed_reads"]), len(r["request_errors"]), r["rereads"],
                         f"{r['completion_s']:.1f}"])
            print(rows[-1], flush=True)
            for line in (r["failed_reads"] + r["request_errors"])[:5]:
                details.append(f"N={count}: {line}")
            adapter_mib = r["adapter_bytes"] / 2**20
    columns = ["adapters", "engine start s", "first read done s: median", "p90", "max",
               "read s: median", "p90", "max", "pin + pack s: median", "max", "failed reads",
               "request errors", "re-reads", "batch s"]
    title = (f"Cold burst of never-seen adapters ({gpu_name(device)}): N rank-{RANK} adapters "
             "named at once right after start-up")
    notes = [(
        f"{'Tiny model on CPU' if quick else 'Llama-3-8B shape, random bf16 weights'}; "
        f"adapters on {args.targets} ({adapter_mib:.1f} MiB packed each), page cache "
        f"dropped, {'warm' if args.warm_triton_cache else 'empty'} Triton cache, a fresh "
        f"process per N; max_loras {args.max_loras}, max_cpu_loras "
        f"{args.max_cpu_loras or 'default'}; one `LLM.generate` call: N adapter requests and "
        f"N/4 base requests shuffled, prompt {prompt}, {new} new tokens, greedy, ignore_eos. "
        "'first "
        "read done' = from the call to the end of the adapter's first read (queueing "
        "included); 'read' = that read on its loader thread; 'pin + pack' = the part of a read "
        "that allocates the adapter's page-locked buffer and lays it out (every read, re-reads "
        "too); 'batch' = the call's wall time.")]
    if details:
        notes.append("Failures: " + "; ".join(details))
    record(title, "python -m benchmarks.bench_cold_adapters " + " ".join(sys.argv[1:]),
           columns, rows, notes="\n\n".join(notes), write=not (args.no_record or quick),
           device=device)


if __name__ == "__main__":
    main()
