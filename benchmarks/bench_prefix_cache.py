"""Adapter-aware prefix caching and multi-turn sessions: time to first token and throughput.

A Llama-3-8B-shaped model with random bf16 weights (``load_format="dummy"``), 16 distinct
rank-16 q/k/v/o adapters in PEFT's format, random token ids (seeded), greedy, ignore_eos.

1. **Shared system prompt.** 256 requests, each one 1024-token system prompt shared by all
   plus its own 64-token user suffix, 64 new tokens; request i uses adapter i % 16. KV
   computed under one adapter's q/k/v weights is not valid under another's, so the cache
   forks per adapter: at best the system prompt is prefilled 16 times, not 256. Arrivals:
   all at once (a batch: throughput), then Poisson arrivals at 80% of the request rate the
   caching-off engine reached in the batch (an open loop: time to first token under load).
   Variants: prefix caching off, on.
2. **5-turn chat.** 64 conversations of 5 turns, conversation c on adapter c % 16. Turn 1
   is the conversation's own 256-token first message plus 128 user tokens; turns 2-5 are
   128 user tokens; every turn generates 64 tokens. Closed loop: the 64 conversations start
   at once and each sends its next turn as soon as its previous one ends. Variants: full
   resend (each turn's prompt is the whole history plus the new turn, as in OpenAI-style
   chat APIs) with prefix caching off, the same with it on, and sessions (``session_id``
   per conversation: the prompt is only the new turn, the engine prepends the history and
   keeps its KV between turns; prefix caching on).

Time to first token (TTFT) = from ``add_request`` (in the open loop: from the request's
arrival time) to the end of the ``LLMEngine.step`` that returns its first token, so it
includes the time spent queued. Each variant gets its own engine (max_num_seqs 128,
max_num_batched_tokens 8192, max_model_len 4096, 16 adapter slots, 16384 KV blocks), warmed
up by a smaller run of the same workload with other token ids (Triton compilation, adapter
loads) before the timed runs, and freed before the next one is built.

    python -m benchmarks.bench_prefix_cache
    python -m benchmarks.bench_prefix_cache --no-open-loop   # batch arrivals only
    python -m benchmarks.bench_prefix_cache --quick          # tiny model on CPU, a smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import random
import tempfile
import time
from collections import deque
from pathlib import Path

import torch

from benchmarks.common import command_line, gpu_name, measure_matmul_flops, record
from benchmarks.llama3_8b import LLAMA3_8B, TINY, module_dims, write_config, write_peft_adapters
from manylora import LLM, LoRARequest, SamplingParams
from manylora.engine.llm_engine import LLMEngine

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
RANK = 16
BLOCK_SIZE = 16  # the engine's default block_size (prefix hits are whole blocks)
COUNTERS = ("prefix_queries", "prefix_hits", "preemptions", "recomputed_tokens",
            "swapped_out_blocks", "swapped_in_blocks", "evicted_blocks", "evicted_sessions")


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Workload and engine sizes (token counts are tokens)."""

    adapters: int = 16
    requests: int = 256
    system: int = 1024
    suffix: int = 64
    new: int = 64
    conversations: int = 64
    turns: int = 5
    first: int = 256
    user: int = 128
    reply: int = 64
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 8192
    max_model_len: int = 4096
    num_kv_blocks: int = 16384

    def warmup(self) -> Sizes:
        """The smaller run that warms an engine up: same prompt shapes, fewer requests."""
        return dataclasses.replace(self, requests=2 * self.adapters, new=4,
                                   conversations=min(8, self.conversations), turns=2)


FULL = Sizes()
QUICK = Sizes(adapters=4, requests=16, system=64, suffix=8, new=8, conversations=4, turns=3,
              first=32, user=16, reply=8, max_num_seqs=8, max_num_batched_tokens=128,
              max_model_len=512, num_kv_blocks=256)


@dataclasses.dataclass
class RunResult:
    """One timed run.

    Attributes:
        seconds: wall time from the first submission to the last token.
        prompt_tokens: prompt tokens of every request (a chat turn's history included).
        output_tokens: generated tokens.
        ttft: seconds to first token, per request (per turn in the chat).
        turn_ttft: the chat's TTFTs by turn (0-based); empty for the shared-prompt runs.
        counters: the change of the KV cache counters (``COUNTERS``) over the run.
    """

    seconds: float
    prompt_tokens: int
    output_tokens: int
    ttft: list[float]
    turn_ttft: dict[int, list[float]]
    counters: dict[str, int]

    @property
    def hit_rate(self) -> float:
        """Prompt tokens found in the cache (prefix cache or session) / tokens looked up."""
        return self.counters["prefix_hits"] / max(self.counters["prefix_queries"], 1)

    @property
    def prefilled(self) -> int:
        """Prompt tokens computed: looked up minus found (re-joins after preemption count)."""
        return self.counters["prefix_queries"] - self.counters["prefix_hits"]


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``values``, linear between closest ranks."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def counters(engine: LLMEngine) -> dict[str, int]:
    """The KV cache's cumulative counters now."""
    stats = engine.kv_cache_stats()
    return {name: getattr(stats, name) for name in COUNTERS}


def counter_delta(engine: LLMEngine, before: dict[str, int]) -> dict[str, int]:
    """The change of the KV cache counters since ``before``."""
    now = counters(engine)
    return {name: now[name] - before[name] for name in COUNTERS}


def shared_prompt_workload(vocab: int, s: Sizes, seed: int) -> list[tuple[list[int], int]]:
    """``(prompt ids, adapter index)``: one shared system prompt + a distinct user suffix."""
    rng = random.Random(seed)
    system = [rng.randrange(vocab) for _ in range(s.system)]
    return [(system + [rng.randrange(vocab) for _ in range(s.suffix)], i % s.adapters)
            for i in range(s.requests)]


def chat_workload(vocab: int, s: Sizes, seed: int) -> list[tuple[int, list[list[int]]]]:
    """``(adapter index, new tokens of each turn)`` per conversation; turn 1 starts with the
    conversation's own first message."""
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    return [(c % s.adapters, [ids(s.first) + ids(s.user)] + [ids(s.user)
                                                            for _ in range(s.turns - 1)])
            for c in range(s.conversations)]


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """``n`` arrival times (seconds from the start) of a Poisson process of ``rate`` per s."""
    rng = random.Random(seed)
    t, times = 0.0, []
    for _ in range(n):
        times.append(t)
        t += rng.expovariate(rate)
    return times


def check_output(out, new: int) -> list[int]:
    """The generated ids of a finished request; raises unless it ran to ``new`` tokens."""
    ids = list(out.outputs[0].token_ids)
    reason = out.outputs[0].finish_reason
    if reason != "length" or len(ids) != new:
        raise RuntimeError(f"request {out.request_id} ended with {reason!r} after {len(ids)} "
                           f"tokens, expected 'length' after {new}")
    return ids


def run_shared(engine: LLMEngine, work: list[tuple[list[int], int]],
               loras: list[LoRARequest], new: int,
               arrivals: list[float] | None = None) -> RunResult:
    """Serve ``work`` (workload 1): all at once, or at ``arrivals`` (seconds from the start).

    TTFT runs from just before ``add_request`` (all at once) or from the scheduled arrival
    (open loop), to the end of the step that returns the first token.
    """
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    times = arrivals or [0.0] * len(work)
    pending = deque(range(len(work)))
    start: dict[str, float] = {}
    ttft: dict[str, float] = {}
    output_tokens = 0
    finished = 0
    before = counters(engine)
    t0 = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        while pending and times[pending[0]] <= time.perf_counter() - t0:
            i = pending.popleft()
            ids, adapter = work[i]
            ref = time.perf_counter() if arrivals is None else t0 + times[i]
            rid = engine.add_request(f"r{i}", {"prompt_token_ids": ids}, params, loras[adapter])
            start[rid] = ref
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, times[pending[0]] - (time.perf_counter() - t0)))
            continue
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            if out.request_id not in ttft and out.outputs[0].token_ids:
                ttft[out.request_id] = now - start[out.request_id]
            if out.finished:
                output_tokens += len(check_output(out, new))
                finished += 1
    seconds = time.perf_counter() - t0
    if finished != len(work):
        raise RuntimeError(f"{finished} of {len(work)} requests finished")
    return RunResult(seconds, sum(len(ids) for ids, _ in work), output_tokens,
                     list(ttft.values()), {}, counter_delta(engine, before))


def run_chat(engine: LLMEngine, convs: list[tuple[int, list[list[int]]]],
             loras: list[LoRARequest], reply: int, sessions: bool,
             tag: str = "conv") -> RunResult:
    """Serve the conversations (workload 2) in a closed loop: each sends its next turn as
    soon as its previous one ends.

    ``sessions``: each turn's prompt is only its new tokens, with ``session_id`` =
    ``tag`` + the conversation's index; else the prompt is the whole history (earlier
    prompts and outputs) plus the new tokens. Either way every turn's full prompt, as the
    engine reports it, must equal the history plus the new tokens. Sessions are ended after
    the timed part.
    """
    params = SamplingParams(temperature=0.0, max_tokens=reply, ignore_eos=True)
    history: list[list[int]] = [[] for _ in convs]
    info: dict[str, tuple[int, int, float]] = {}
    ttft: dict[str, float] = {}
    turn_ttft: dict[int, list[float]] = {}
    totals = {"prompt": 0, "output": 0, "turns": 0}

    def submit(c: int, k: int) -> None:
        adapter, turns = convs[c]
        prompt = turns[k] if sessions else history[c] + turns[k]
        rid = f"{tag}{c}-turn{k}"
        t = time.perf_counter()
        engine.add_request(rid, {"prompt_token_ids": prompt}, params, loras[adapter],
                           session_id=f"{tag}{c}" if sessions else None)
        info[rid] = (c, k, t)

    before = counters(engine)
    t0 = time.perf_counter()
    for c in range(len(convs)):
        submit(c, 0)
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            c, k, t = info[out.request_id]
            if out.request_id not in ttft and out.outputs[0].token_ids:
                ttft[out.request_id] = now - t
                turn_ttft.setdefault(k, []).append(now - t)
            if not out.finished:
                continue
            generated = check_output(out, reply)
            expected = history[c] + convs[c][1][k]
            if list(out.prompt_token_ids) != expected:
                raise RuntimeError(f"{out.request_id}: the engine's prompt has "
                                   f"{len(out.prompt_token_ids)} tokens, expected the history "
                                   f"+ the new turn ({len(expected)} tokens)")
            history[c] = expected + generated
            totals["prompt"] += len(expected)
            totals["output"] += len(generated)
            totals["turns"] += 1
            if k + 1 < len(convs[c][1]):
                submit(c, k + 1)
    seconds = time.perf_counter() - t0
    delta = counter_delta(engine, before)
    expected_turns = sum(len(turns) for _, turns in convs)
    if totals["turns"] != expected_turns:
        raise RuntimeError(f"{totals['turns']} of {expected_turns} turns finished")
    if sessions:
        for c in range(len(convs)):
            engine.end_session(f"{tag}{c}")
    return RunResult(seconds, totals["prompt"], totals["output"], list(ttft.values()),
                     turn_ttft, delta)


def build_engine(model_dir: Path, device: str, s: Sizes, caching: bool, quick: bool) -> LLM:
    """One engine of the benchmark's configuration, prefix caching ``caching``."""
    t0 = time.perf_counter()
    llm = LLM(str(model_dir), load_format="dummy", skip_tokenizer_init=True,
              dtype="float32" if quick else "bfloat16", device=device, max_loras=s.adapters,
              max_lora_rank=RANK, lora_target_modules=TARGETS, max_num_seqs=s.max_num_seqs,
              max_num_batched_tokens=s.max_num_batched_tokens, max_model_len=s.max_model_len,
              enable_prefix_caching=caching, num_kv_blocks=s.num_kv_blocks)
    stats = llm.llm_engine.kv_cache_stats()
    print(f"engine built (prefix caching {'on' if caching else 'off'}) in "
          f"{time.perf_counter() - t0:.1f} s: {stats.num_blocks} KV blocks of {BLOCK_SIZE} "
          "tokens", flush=True)
    return llm


def release_memory() -> None:
    """Collect garbage and return cached CUDA memory (after an engine is dropped)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f}"


def describe(name: str, r: RunResult) -> str:
    """A progress line for one timed run."""
    return (f"{name}: {r.seconds:.2f} s, {r.output_tokens / r.seconds:,.0f} output tok/s, "
            f"TTFT median {ms(percentile(r.ttft, 50))} ms p90 {ms(percentile(r.ttft, 90))} ms, "
            f"hit rate {r.hit_rate:.1%}, prefilled {r.prefilled:,}, counters {r.counters}")


def flops_per_token(config: dict) -> float:
    """2 x the parameters of the decoder layers' projections: FLOPs of one prefilled token in
    the linear layers (attention scores and the LM head left out)."""
    per_layer = sum(i * o for i, o in module_dims(config).values())
    return 2.0 * per_layer * config["num_hidden_layers"]


def saving_note(config: dict, tokens: int, quick: bool) -> str:
    """What ``tokens`` fewer prefilled tokens are in FLOPs and matmul time."""
    flops = tokens * flops_per_token(config)
    line = (f"{tokens:,} tokens not prefilled × {flops_per_token(config) / 1e9:.3g} GFLOP "
            f"(linear layers) = {flops / 1e12:,.4g} TFLOP")
    if not quick:
        rate = measure_matmul_flops()
        line += (f", {flops / rate:.2f} s at the measured bf16 matmul rate "
                 f"({rate / 1e12:.0f} TFLOP/s)")
    return line


def shared_prompt_benchmark(model_dir: Path, device: str, s: Sizes, config: dict,
                            loras: list[LoRARequest], quick: bool, open_loop: bool,
                            load: float) -> tuple[list[list[str]], str]:
    """Workload 1, caching off then on; the table's rows and the notes."""
    vocab = config["vocab_size"]
    work = shared_prompt_workload(vocab, s, seed=0)
    warm = s.warmup()
    warm_work = shared_prompt_workload(vocab, warm, seed=1)
    open_work = shared_prompt_workload(vocab, s, seed=2)
    runs: dict[tuple[bool, str], RunResult] = {}
    rate = 0.0
    for caching in (False, True):
        llm = build_engine(model_dir, device, s, caching, quick)
        engine = llm.llm_engine
        run_shared(engine, warm_work, loras, warm.new)
        print("warmed up", flush=True)
        runs[caching, "batch"] = run_shared(engine, work, loras, s.new)
        print(describe(f"shared prompt, caching {caching}, all at once",
                       runs[caching, "batch"]), flush=True)
        if open_loop:
            if not caching:
                rate = load * s.requests / runs[False, "batch"].seconds
            arrivals = poisson_arrivals(s.requests, rate, seed=5)
            runs[caching, "poisson"] = run_shared(engine, open_work, loras, s.new, arrivals)
            print(describe(f"shared prompt, caching {caching}, Poisson {rate:.2f} req/s",
                           runs[caching, "poisson"]), flush=True)
        del llm, engine
        release_memory()
    rows = []
    for mode in ("batch", "poisson") if open_loop else ("batch",):
        off = runs[False, mode]
        for caching in (False, True):
            r = runs[caching, mode]
            rows.append([
                f"caching {'on' if caching else 'off'}",
                "all at once" if mode == "batch" else f"Poisson {rate:.2f} req/s",
                ms(percentile(r.ttft, 50)), ms(percentile(r.ttft, 90)),
                f"{r.output_tokens / r.seconds:,.0f}",
                f"{(r.prompt_tokens + r.output_tokens) / r.seconds:,.0f}",
                f"{(r.output_tokens / r.seconds) / (off.output_tokens / off.seconds):.2f}x",
                f"{percentile(off.ttft, 50) / percentile(r.ttft, 50):.2f}x",
                f"{r.hit_rate:.1%}", f"{r.prefilled:,}", r.counters["preemptions"],
                f"{r.seconds:.2f}"])
    prompt = s.system + s.suffix
    ideal_hits = (s.requests - s.adapters) * (s.system // BLOCK_SIZE * BLOCK_SIZE)
    ideal_prefill = s.requests * prompt - ideal_hits
    on, off = runs[True, "batch"], runs[False, "batch"]
    notes = (
        f"Llama-3-8B shape, random bf16 weights; {s.requests} requests = one shared "
        f"{s.system}-token system prompt + a distinct {s.suffix}-token suffix, {s.new} new "
        f"tokens, greedy, ignore_eos; request i on adapter i % {s.adapters} (rank {RANK}, "
        "q/k/v/o). Engine: max_num_seqs "
        f"{s.max_num_seqs}, max_num_batched_tokens {s.max_num_batched_tokens}, block "
        f"{BLOCK_SIZE}, {s.num_kv_blocks} KV blocks, {s.adapters} adapter slots, CUDA graphs "
        "for decode. 'all at once': every request submitted before the first step, so TTFT "
        f"includes queueing (only {s.max_num_seqs} run at a time). "
        + (f"'Poisson': an open loop at {load:.0%} of the request rate the caching-off engine "
           "reached all at once (other token ids, same shape), TTFT from each scheduled "
           "arrival; there tok/s follows the arrival rate. " if open_loop else "")
        + "output tok/s = generated tokens / wall time; total tok/s adds the prompt tokens. "
        "Ratios: tok/s on / off, TTFT median off / on. Hit rate = prompt tokens found in the "
        "prefix cache / prompt tokens looked up; prefilled = looked up − found.\n\n"
        f"Physical ceiling: caching off prefills {s.requests * prompt:,} prompt tokens; KV is "
        "valid only under the adapter it was computed with, so the best a cache keyed by "
        f"adapter can do is prefill the system prompt once per adapter ({s.adapters}×) and "
        f"every suffix: {ideal_prefill:,} tokens, a hit rate of "
        f"{ideal_hits / (s.requests * prompt):.1%}. Measured all at once: {on.prefilled:,} "
        f"prefilled ({on.hit_rate:.1%}); requests of an adapter that are scheduled before "
        "that adapter's first system-prompt prefill has completed a block find less. Saving "
        f"against caching off: {saving_note(config, off.prefilled - on.prefilled, quick)}.")
    return rows, notes


def chat_benchmark(model_dir: Path, device: str, s: Sizes, config: dict,
                   loras: list[LoRARequest], quick: bool) -> tuple[list[list[str]], str]:
    """Workload 2: full resend without and with prefix caching, then sessions."""
    vocab = config["vocab_size"]
    convs = chat_workload(vocab, s, seed=3)
    warm = s.warmup()
    warm_convs = chat_workload(vocab, warm, seed=4)
    variants = (("full resend, caching off", False, False),
                ("full resend, caching on", True, False),
                ("sessions, caching on", True, True))
    runs: dict[str, RunResult] = {}
    for name, caching, sessions in variants:
        llm = build_engine(model_dir, device, s, caching, quick)
        engine = llm.llm_engine
        run_chat(engine, warm_convs, loras, warm.reply, sessions, tag="warm")
        print("warmed up", flush=True)
        runs[name] = run_chat(engine, convs, loras, s.reply, sessions)
        print(describe(f"chat, {name}", runs[name]), flush=True)
        del llm, engine
        release_memory()
    base = runs[variants[0][0]]
    last = s.turns - 1
    rows = []
    for name, _, _ in variants:
        r = runs[name]
        rows.append([
            name, ms(percentile(r.ttft, 50)), ms(percentile(r.ttft, 90)),
            ms(percentile(r.turn_ttft[last], 50)), ms(percentile(r.turn_ttft[last], 90)),
            f"{r.output_tokens / r.seconds:,.0f}",
            f"{(r.output_tokens / r.seconds) / (base.output_tokens / base.seconds):.2f}x",
            f"{percentile(base.ttft, 50) / percentile(r.ttft, 50):.2f}x",
            f"{r.hit_rate:.1%}", f"{r.prefilled:,}", r.counters["preemptions"],
            r.counters["evicted_sessions"], f"{r.seconds:.2f}"])
    resend = base.prompt_tokens
    ideal = s.conversations * (s.first + s.user + (s.turns - 1) * (s.user + 1))
    best = min(r.prefilled for r in runs.values())
    notes = (
        f"Llama-3-8B shape, random bf16 weights; {s.conversations} conversations × "
        f"{s.turns} turns, conversation c on adapter c % {s.adapters} (rank {RANK}, q/k/v/o). "
        f"Turn 1 = the conversation's own {s.first}-token first message + {s.user} user "
        f"tokens, turns 2-{s.turns} = {s.user} user tokens; {s.reply} new tokens per turn, "
        "greedy, ignore_eos. Closed loop: all conversations start at once, each sends its "
        "next turn when the previous one ends. Full resend: each turn's prompt is the whole "
        "history (earlier prompts and outputs) + the new turn; sessions: `session_id` per "
        "conversation, the prompt is the new turn only and the engine keeps the history's KV "
        f"between turns. Engine as in the shared-prompt table. TTFT: from `add_request` to "
        f"the step that returns the first token; 'turn {s.turns}' = the last turn only. "
        "Ratios against full resend with caching off: tok/s, and TTFT median off / variant. "
        "Hit rate counts session history found as a hit.\n\n"
        f"Physical floor: a full resend without caching prefills every turn's whole prompt, "
        f"{resend:,} tokens. The least any variant can prefill is what the model has not "
        f"seen: each turn's new tokens plus, from turn 2, the previous turn's last generated "
        f"token (sampled, never fed back): {ideal:,} tokens. Best measured: {best:,}; "
        f"full resend with caching also recomputes the partial last block of the history "
        f"(prefix hits are whole {BLOCK_SIZE}-token blocks). Saving of sessions against "
        "full resend without caching: "
        f"{saving_note(config, base.prefilled - runs[variants[2][0]].prefilled, quick)}.")
    return rows, notes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny model (CPU allowed), no record")
    ap.add_argument("--no-record", action="store_true")
    ap.add_argument("--no-open-loop", action="store_true",
                    help="shared-prompt workload: all-at-once arrivals only")
    ap.add_argument("--load", type=float, default=0.8,
                    help="open-loop request rate as a share of the caching-off engine's")
    args = ap.parse_args()
    quick = args.quick or not torch.cuda.is_available()
    config = TINY if quick else LLAMA3_8B
    s = QUICK if quick else FULL
    device = "cpu" if quick else "cuda"
    write = not (args.no_record or quick)
    command = command_line("benchmarks.bench_prefix_cache")
    gpu = gpu_name(torch.device(device))
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_config(Path(tmp) / "model", config)
        paths = write_peft_adapters(Path(tmp) / "adapters", config, s.adapters, RANK, TARGETS,
                                    torch.device(device))
        loras = [LoRARequest(f"adapter{i}", i + 1, str(p)) for i, p in enumerate(paths)]
        shared_rows, shared_notes = shared_prompt_benchmark(
            model_dir, device, s, config, loras, quick, not args.no_open_loop, args.load)
        chat_rows, chat_notes = chat_benchmark(model_dir, device, s, config, loras, quick)
    record(f"Prefix caching, shared system prompt ({gpu}): {s.requests} requests, "
           f"{s.system}-token system prompt + {s.suffix}-token suffix, {s.adapters} adapters",
           command,
           ["variant", "arrivals", "TTFT median ms", "TTFT p90 ms", "output tok/s",
            "total tok/s", "tok/s vs off", "TTFT median off / this", "prefix hit rate",
            "prefilled tokens", "preemptions", "seconds"],
           shared_rows, notes=shared_notes, write=write, device=device)
    record(f"Prefix caching and sessions, {s.turns}-turn chat ({gpu}): {s.conversations} "
           f"conversations, {s.user} user + {s.reply} generated tokens per turn, "
           f"{s.adapters} adapters",
           command,
           ["variant", "TTFT median ms", "TTFT p90 ms", f"turn {s.turns} TTFT median ms",
            f"turn {s.turns} TTFT p90 ms", "output tok/s", "tok/s vs resend off",
            "TTFT median resend off / this", "prefix hit rate", "prefilled tokens",
            "preemptions", "evicted sessions", "seconds"],
           chat_rows, notes=chat_notes, write=write, device=device)


if __name__ == "__main__":
    main()
