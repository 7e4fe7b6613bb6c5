"""Shared helpers for the benchmarks: environment, measured floors, timing, BENCHMARKS.md.

Every recorded figure carries the GPU, the date, the commit and the exact command, and is a
median. The floors a benchmark compares against are measured on the same GPU in the same run:

* copy bandwidth: a device-to-device copy of a 2 GiB buffer, (bytes read + bytes written) /
  median time, in bytes/s;
* matmul rate: one bf16 ``8192 x 8192 x 8192`` matmul, ``2*M*N*K`` / median time, in FLOP/s.

Triton is imported lazily (inside the functions that time on CUDA), so a caller can still set
``TRITON_INTERPRET=1`` after importing this module.

The second half drives ``manylora serve`` the way users do: the server in its own process,
the official ``openai`` client in several client processes (one Python client cannot parse
hundreds of streams at the engine's pace), every request streamed.
"""

from __future__ import annotations

import asyncio
import datetime
import functools
import multiprocessing
import os
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS_MD = REPO_ROOT / "BENCHMARKS.md"
HEADER = (
    "# Benchmarks\n\n"
    "Every figure: GPU, date, commit, exact command; medians; ratios against the measured "
    "floor and against the alternative a user would pick.\n"
)

#: Environment variable that overrides :func:`git_commit` (for copies of the tree without .git).
COMMIT_ENV = "MANYLORA_COMMIT"


def gpu_name(device: torch.device | str | None = None) -> str:
    """The CUDA device's name, or ``"cpu (<processor>)"`` when there is no CUDA device."""
    dev = torch.device(device) if device is not None else None
    if torch.cuda.is_available() and (dev is None or dev.type == "cuda"):
        return torch.cuda.get_device_name(dev)
    import platform

    return f"cpu ({platform.machine() or 'unknown'})"


def _git(*args: str) -> str | None:
    """stdout of ``git args`` run in the repository root, or None if git fails or is absent."""
    try:
        done = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True,
                              timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout


def git_commit() -> str:
    """Short hash of HEAD, plus ``+dirty`` when the tree differs from it; else ``"unknown"``.

    ``$MANYLORA_COMMIT``, when set, is returned as is. Without a ``.git`` in the repository
    root, or without a working ``git``, the answer is ``"unknown"``. Changes to
    ``BENCHMARKS.md`` (which the benchmarks themselves append to) do not count as dirty;
    untracked files that git does not ignore do.
    """
    override = os.environ.get(COMMIT_ENV)
    if override:
        return override
    if not (REPO_ROOT / ".git").exists():
        return "unknown"
    head = _git("rev-parse", "--short", "HEAD")
    if not head or not head.strip():
        return "unknown"
    status = _git("--no-optional-locks", "status", "--porcelain", "--", ".",
                  ":(exclude)BENCHMARKS.md")
    if status is None:
        return f"{head.strip()}+status-unknown"
    return head.strip() + ("+dirty" if status.strip() else "")


def today() -> str:
    """Today's date, ISO format (``YYYY-MM-DD``)."""
    return datetime.date.today().isoformat()


def command_line(module: str | None = None) -> str:
    """The exact command of this run: ``python -m <module> <args>`` or ``python <argv>``."""
    if module:
        return shlex.join(["python", "-m", module, *sys.argv[1:]])
    return shlex.join(["python", *sys.argv])


def do_bench_median(fn: Callable[[], object], warmup: int = 25, rep: int = 100) -> float:
    """Median time of ``fn`` on the current CUDA device, in ms (``triton.testing.do_bench``).

    ``do_bench`` runs ``fn`` once, warms up for ``warmup`` ms, then times runs for about
    ``rep`` ms with CUDA events, clearing the L2 cache before each run (so each run reads
    its operands from device memory).
    """
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def time_cuda_graph(fn: Callable[[], object], warmup: int = 25, rep: int = 100) -> float:
    """Median time of one replay of a CUDA graph of ``fn``, in ms.

    ``fn`` is run three times on a side stream (as ``torch.cuda.graphs`` requires before a
    capture; this also compiles and autotunes Triton kernels), captured once into a
    ``torch.cuda.CUDAGraph``, and the replays are timed with :func:`do_bench_median` (L2
    cleared before each replay). Launch gaps between the kernels of ``fn`` disappear, so
    tiny kernels are timed by what the GPU does.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return do_bench_median(graph.replay, warmup=warmup, rep=rep)


def time_graph_calls(fn: Callable[[int], object], calls: int, replays: int) -> float:
    """Median GPU time of one call, in s: ``fn(0) .. fn(calls - 1)`` run once eagerly (to
    compile), then captured in one ``torch.cuda.CUDAGraph`` and replayed ``replays`` times,
    each replay timed with CUDA events and divided by ``calls``. The call index lets ``fn``
    read another copy of its operands on each call (no L2 reuse from the call before)."""
    for i in range(calls):
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    return statistics.median(times)


def time_cpu(fn: Callable[[], object], reps: int = 5) -> float:
    """Median wall time of ``fn`` over ``reps`` runs after one warmup run, in ms."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _cuda_device(device: torch.device | str | None) -> torch.device:
    """``device`` as a CUDA device with an explicit index (the current one if absent)."""
    dev = torch.device("cuda" if device is None else device)
    if dev.type != "cuda":
        raise ValueError(f"{dev} is not a CUDA device")
    return torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)


def pinned_h2d_bandwidth(nbytes: int = 256 << 20) -> float:
    """Median bytes/s of pinned host → device copies of ``nbytes`` (CUDA events, 10 copies
    after one warm-up copy)."""
    src = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst.copy_(src, non_blocking=True)
    times = []
    for _ in range(10):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) / 1e3)
    return nbytes / statistics.median(times)


def measure_copy_bandwidth(device: torch.device | str = "cuda", nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth, bytes/s: ``2 * nbytes`` / median time of ``dst.copy_(src)``.

    ``src`` and ``dst`` are bf16 buffers of ``nbytes`` each (2 GiB by default, far beyond
    any L2); each copy reads ``nbytes`` and writes ``nbytes``. Measured once per device and
    size, then cached.
    """
    return _copy_bandwidth(_cuda_device(device), nbytes)


@functools.cache
def _copy_bandwidth(dev: torch.device, nbytes: int) -> float:
    with torch.cuda.device(dev):
        ms = _time_copy(dev, nbytes)
        torch.cuda.empty_cache()
    return 2 * nbytes / (ms * 1e-3)


def _time_copy(dev: torch.device, nbytes: int) -> float:
    src = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=dev)
    dst = torch.empty_like(src)
    return do_bench_median(lambda: dst.copy_(src), warmup=50, rep=300)


def measure_matmul_flops(device: torch.device | str = "cuda", n: int = 8192) -> float:
    """bf16 matmul rate, FLOP/s: ``2 * n**3`` / median time of one ``n x n x n`` matmul.

    Inputs are standard normal (power draw depends on the data; all-zero inputs would
    flatter the rate). Measured once per device and size, then cached.
    """
    return _matmul_flops(_cuda_device(device), n)


@functools.cache
def _matmul_flops(dev: torch.device, n: int) -> float:
    with torch.cuda.device(dev):
        ms = _time_matmul(dev, n)
        torch.cuda.empty_cache()
    return 2 * n ** 3 / (ms * 1e-3)


def _time_matmul(dev: torch.device, n: int) -> float:
    gen = torch.Generator(dev).manual_seed(0)
    a = torch.randn(n, n, generator=gen, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, generator=gen, device=dev, dtype=torch.bfloat16)
    c = torch.empty(n, n, device=dev, dtype=torch.bfloat16)
    return do_bench_median(lambda: torch.mm(a, b, out=c), warmup=100, rep=500)


def prefix_hit_tokens(llm) -> int:
    """Prompt tokens an ``LLM``'s engine has found in its prefix cache so far (a counter:
    take the difference around a timed call to see whether it reused earlier passes)."""
    return llm.llm_engine.kv_cache_stats().prefix_hits


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub markdown table; every cell is ``str()``-ed, so format numbers beforehand."""
    lines = ["| " + " | ".join(str(c) for c in columns) + " |",
             "| " + " | ".join("---" for _ in columns) + " |"]
    for row in rows:
        if len(row) != len(columns):
            raise ValueError(f"row {row!r} has {len(row)} cells for {len(columns)} columns")
        lines.append("| " + " | ".join(str(c) for c in row) + " |")
    return "\n".join(lines)


def environment_line(device: torch.device | str | None = None) -> str:
    """GPU, date, commit, and on CUDA the measured copy bandwidth and bf16 matmul rate."""
    dev = torch.device(device) if device is not None else torch.device(
        "cuda" if torch.cuda.is_available() else "cpu")
    parts = [f"GPU: {gpu_name(dev)}", f"date: {today()}", f"commit: `{git_commit()}`"]
    if dev.type == "cuda":
        bw = measure_copy_bandwidth(dev)
        flops = measure_matmul_flops(dev)
        parts.append(f"copy bandwidth: {bw / 1e9:.0f} GB/s (2 GiB bf16 D2D copy, read + write)")
        parts.append(f"bf16 matmul: {flops / 1e12:.0f} TFLOP/s (8192³)")
    parts.append(f"torch {torch.__version__}")
    return " · ".join(parts)


def record(title: str, command: str, columns: Sequence[str],
           rows: Sequence[Sequence[object]], notes: str | None = None, *, write: bool = True,
           device: torch.device | str | None = None, path: Path | None = None) -> str:
    """Print a benchmark section and, if ``write``, append it to ``BENCHMARKS.md``.

    The section is ``## <title>``, one line with GPU, date, commit, measured copy bandwidth
    and matmul rate (CUDA only), the exact ``command``, the table, then ``notes``. The file
    (``path``, by default ``BENCHMARKS.md`` at the repository root) is created with a short
    header if absent.

    Returns:
        the section's markdown.
    """
    section = [f"## {title}", "", environment_line(device), "", f"Command: `{command}`", "",
               markdown_table(columns, rows)]
    if notes:
        section += ["", notes.strip()]
    text = "\n".join(section) + "\n"
    print(text, flush=True)
    if write:
        target = path or BENCHMARKS_MD
        if not target.exists():
            target.write_text(HEADER)
        with target.open("a") as f:
            f.write("\n" + text)
        print(f"appended to {target}", flush=True)
    return text


# ---------------------------------------------------------------------------------------------
# ``manylora serve`` through the official openai client

#: One request of a served workload: (served model name, prompt token ids, new tokens).
ServedRequest = tuple[str, list[int], int]


def engine_cli_flags(engine_kwargs: dict) -> list[str]:
    """``EngineArgs`` keyword arguments as ``manylora serve`` flags (``max_num_seqs=256`` →
    ``--max-num-seqs 256``; True → ``--flag``, False → ``--no-flag``; a tuple → its items)."""
    argv: list[str] = []
    for key, value in engine_kwargs.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is False:
            argv.append("--no-" + key.replace("_", "-"))
        elif isinstance(value, (tuple, list)):
            argv += [flag, *map(str, value)]
        else:
            argv += [flag, str(value)]
    return argv


def start_server(model_dir: Path, port: int, engine_kwargs: dict,
                 lora_modules: Sequence[tuple[str, Path]] = (), served_model_name: str = "base",
                 extra_args: Sequence[str] = (), timeout_s: float = 600.0) -> subprocess.Popen:
    """``manylora serve`` in a process (and session) of its own, once ``/health`` answers 200.

    Args:
        model_dir: the checkpoint directory.
        port: the port on 127.0.0.1.
        engine_kwargs: ``EngineArgs`` fields (``engine_cli_flags``).
        lora_modules: (name, adapter directory) pairs served from the start.
        served_model_name: the base model's name in requests.
        extra_args: more ``manylora serve`` flags (e.g. ``--uvicorn-log-level warning``).
        timeout_s: how long to wait for ``/health``, seconds.

    Raises:
        RuntimeError: the server exited or did not become healthy in ``timeout_s``.
    """
    import httpx

    argv = [sys.executable, "-m", "manylora.entrypoints.cli", "serve", "--model",
            str(model_dir), "--served-model-name", served_model_name, "--port", str(port)]
    if lora_modules:
        argv += ["--lora-modules", *(f"{name}={path}" for name, path in lora_modules)]
    argv += [*engine_cli_flags(engine_kwargs), *extra_args]
    proc = subprocess.Popen(argv, env=dict(os.environ), start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"manylora serve exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop_server(proc)
    raise RuntimeError(f"manylora serve did not start in {timeout_s:.0f} s")


def stop_server(proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    """End a ``start_server`` process: SIGINT to its session, SIGKILL after ``timeout_s``."""
    import signal

    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def server_metric(port: int, name: str) -> float:
    """The sum of a Prometheus metric's samples (every label set) in one ``/metrics`` scrape
    (e.g. ``manylora:prefix_cache_hits_total``, in its own unit)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name)


async def _client_slice(port: int, requests: Sequence[ServedRequest], start_at: float
                        ) -> tuple[list[int], list[float], list[float], float]:
    """One client process's share: its requests, all concurrent, sent at ``start_at``
    (``time.time()``) to ``/v1/completions`` (greedy, ignore_eos, streamed); the completion
    tokens (usage), TTFTs, ITLs (seconds) and the end time (``time.time()``)."""
    import httpx
    import openai

    client = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=3600,
        http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=len(requests) + 8)))
    ttft: list[float] = []
    itl: list[float] = []

    async def one(model: str, prompt: list[int], max_tokens: int) -> int:
        sent = time.perf_counter()
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        last = None
        tokens = 0
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
            if not chunk.choices:
                continue
            if last is None:
                ttft.append(now - sent)
            else:
                itl.append(now - last)
            last = now
        return tokens

    await asyncio.sleep(max(0.0, start_at - time.time()))
    counts = await asyncio.gather(*(one(*r) for r in requests))
    end = time.time()
    await client.close()
    return counts, ttft, itl, end


def _run_slice(args) -> tuple[list[int], list[float], list[float], float]:
    return asyncio.run(_client_slice(*args))


def drive_openai(port: int, batches: Sequence[Sequence[ServedRequest]], procs: int
                 ) -> list[dict]:
    """Send each batch of requests to a ``manylora serve`` on ``port``, one batch after the
    other, all requests of a batch at once, spread round robin over ``procs`` client
    processes (``spawn``) started once for every batch.

    Returns:
        per batch: ``seconds`` (from the common send time to the last stream's end),
        ``tokens`` (completion tokens, from usage), ``ttft`` and ``itl`` (medians over
        requests and over chunks, seconds, at the client), ``prefix_hits`` (prompt tokens
        the server found in its prefix cache during the batch, from ``/metrics``).
    """
    hits_metric = "manylora:prefix_cache_hits_total"
    results = []
    with ProcessPoolExecutor(procs, mp_context=multiprocessing.get_context("spawn")) as pool:
        for batch in batches:
            hits = server_metric(port, hits_metric)
            start_at = time.time() + 2.0          # every client process is up by then
            slices = [(port, list(batch[k::procs]), start_at) for k in range(procs)]
            parts = list(pool.map(_run_slice, slices))
            seconds = max(p[3] for p in parts) - start_at
            ttft = [t for p in parts for t in p[1]]
            itl = [t for p in parts for t in p[2]]
            results.append({
                "seconds": seconds, "tokens": sum(sum(p[0]) for p in parts),
                "ttft": statistics.median(ttft) if ttft else float("nan"),
                "itl": statistics.median(itl) if itl else float("nan"),
                "prefix_hits": int(server_metric(port, hits_metric) - hits)})
    return results
