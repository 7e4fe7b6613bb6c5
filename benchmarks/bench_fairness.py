"""Fair sharing between client groups (issue 18, finding 8): what it buys and what it costs.

A Llama-3-8B-shaped model with random bf16 weights (``load_format="dummy"``, token ids in
and out), LoRA off, ``max_num_seqs`` 128 (``--max-num-seqs``), ``max_num_batched_tokens``
8192, prefix caching on, async scheduling on; the core in the measuring process (its
scheduler's counters are read), each policy in a fresh process. Policies:

* ``fcfs``: strict arrival order (vLLM's), the behaviour before this change;
* ``fair 1.0``: least-running client group first, no preemption for fairness
  (``max_group_share=1``);
* ``fair 0.5``: the default: also preempts a group over half the batch for other groups'
  waiting requests when the batch is full.

Parts:

* ``wait``: the finding. One request with ``n`` = max_num_seqs children, then 2 x
  max_num_seqs (one 128-token prompt, 100 new tokens, ``logprobs=20``), fills the batch; 3
  steps later another client's 2-token request arrives. Its wait (submission to last token,
  ms, and engine steps), and the big request's time from its submission to its last
  child's end. With n = max_num_seqs no child waits, so the newcomer is first in line under
  every policy and only preemption shortens its wait; with 2 x, fcfs queues it behind the
  waiting children.
* ``mixed``: the cost. Clients arrive every 4 steps (seed 0): n in (1, 1, 4, 1, 32, 1, 4,
  128) in turn, prompts 64-512 tokens, 32-256 new tokens (uniform), greedy, ignore_eos.
  Output tok/s over the whole run (ratio to fcfs), the completion time of the single
  requests (median, p90) and of the n >= 32 requests (median), fairness preemptions and the
  tokens recomputed after preemptions.

    python -m benchmarks.bench_fairness              # both parts, one H100: ~3-4 min
    python -m benchmarks.bench_fairness --quick      # tiny model on CPU, no record (~1 min)

Each part prints and records (``common.record``) its table.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.bench_engine import in_child
from benchmarks.common import command_line, gpu_name, record
from benchmarks.llama3_8b import LLAMA3_8B, TINY, write_config

#: name → the policy's EngineArgs fields.
POLICIES = {
    "fcfs": dict(scheduling_policy="fcfs"),
    "fair 1.0": dict(scheduling_policy="fair", max_group_share=1.0),
    "fair 0.5": dict(scheduling_policy="fair", max_group_share=0.5),
}
PARTS = ("wait", "mixed")
#: The fan-out of each arriving client of the mixed load, in turn.
MIXED_FAN_OUT = (1, 1, 4, 1, 32, 1, 4, 128)
ARRIVAL_EVERY_STEPS = 4


def engine_kwargs(quick: bool, max_num_seqs: int, policy: str) -> dict:
    return dict(load_format="dummy", skip_tokenizer_init=True, enable_lora=False,
                dtype="float32" if quick else "bfloat16", device="cpu" if quick else "cuda",
                max_num_seqs=max_num_seqs, max_num_batched_tokens=8192, max_model_len=2048,
                enable_prefix_caching=True, **({"num_kv_blocks": 2048} if quick else {}),
                **POLICIES[policy])


def _engine(model_dir: Path, quick: bool, max_num_seqs: int, policy: str):
    os.environ["MANYLORA_ENABLE_MULTIPROCESSING"] = "0"     # read the scheduler's counters
    from manylora.engine.arg_utils import EngineArgs
    from manylora.engine.llm_engine import LLMEngine

    return LLMEngine(EngineArgs(model=str(model_dir),
                                **engine_kwargs(quick, max_num_seqs, policy)))


def _params(max_tokens: int, logprobs: int | None = None):
    from manylora.sampling_params import RequestOutputKind, SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                          logprobs=logprobs, output_kind=RequestOutputKind.FINAL_ONLY)


def _warm_up(engine, vocab: int, seqs: int) -> None:
    """Every batch size up to ``seqs`` and a prefill, once (graphs, Triton caches)."""
    rng = random.Random(99)
    for i in range(seqs):
        engine.add_request(f"warm-{i}", {"prompt_token_ids": [rng.randrange(vocab)
                                                              for _ in range(64)]},
                           _params(8, 20), client_group="warm")
    while engine.has_unfinished_requests():
        engine.step()


def run_wait(model_dir: Path, quick: bool, seqs: int, policy: str, n: int) -> dict:
    """The ``wait`` part under one policy (see the module doc)."""
    vocab = (TINY if quick else LLAMA3_8B)["vocab_size"]
    new = 10 if quick else 100
    engine = _engine(model_dir, quick, seqs, policy)
    _warm_up(engine, vocab, seqs)
    sched = engine.engine_core.scheduler
    rng = random.Random(1)
    prompt = [rng.randrange(vocab) for _ in range(128)]
    preempt0, recomputed0 = sched.fairness_preemptions, sched.kv.stats.recomputed_tokens
    big_start = time.perf_counter()
    for i in range(n):
        engine.add_request(f"big-{i}", {"prompt_token_ids": prompt}, _params(new, 20),
                           client_group="big")
    for _ in range(3):
        engine.step()
    small_start, step0 = time.perf_counter(), sched._step
    engine.add_request("small", {"prompt_token_ids": prompt[:16]}, _params(2),
                       client_group="small")
    small_s = small_steps = big_s = None
    left = n
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == "small":
                small_s, small_steps = time.perf_counter() - small_start, sched._step - step0
            else:
                left -= 1
        if left == 0 and big_s is None:
            big_s = time.perf_counter() - big_start
    result = dict(policy=policy, small_ms=1e3 * small_s, small_steps=small_steps, big_s=big_s,
                  preemptions=sched.fairness_preemptions - preempt0,
                  recomputed=sched.kv.stats.recomputed_tokens - recomputed0)
    engine.shutdown()
    return result


def mixed_clients(quick: bool, count: int) -> list[dict]:
    """The mixed load's clients, in arrival order: ``n``, prompt length, new tokens."""
    rng = random.Random(0)
    lo, hi, new_lo, new_hi = (8, 32, 4, 16) if quick else (64, 512, 32, 256)
    return [dict(n=MIXED_FAN_OUT[k % len(MIXED_FAN_OUT)], prompt=rng.randint(lo, hi),
                 new=rng.randint(new_lo, new_hi)) for k in range(count)]


def run_mixed(model_dir: Path, quick: bool, seqs: int, policy: str, count: int) -> dict:
    """The ``mixed`` part under one policy (see the module doc)."""
    vocab = (TINY if quick else LLAMA3_8B)["vocab_size"]
    engine = _engine(model_dir, quick, seqs, policy)
    _warm_up(engine, vocab, seqs)
    sched = engine.engine_core.scheduler
    clients = mixed_clients(quick, count)
    rng = random.Random(2)
    prompts = [[rng.randrange(vocab) for _ in range(c["prompt"])] for c in clients]
    preempt0, recomputed0 = sched.fairness_preemptions, sched.kv.stats.recomputed_tokens
    arrived: dict[int, float] = {}
    left = {k: min(c["n"], seqs) for k, c in enumerate(clients)}
    done: dict[int, float] = {}
    tokens = 0
    start = time.perf_counter()
    step = 0
    while len(done) < len(clients):
        while len(arrived) < len(clients) and len(arrived) * ARRIVAL_EVERY_STEPS <= step:
            k = len(arrived)
            arrived[k] = time.perf_counter()
            for i in range(left[k]):
                engine.add_request(f"c{k}-{i}", {"prompt_token_ids": prompts[k]},
                                   _params(clients[k]["new"]), client_group=f"c{k}")
        for out in engine.step():
            k = int(out.request_id[1:].split("-")[0])
            tokens += len(out.outputs[0].token_ids)
            left[k] -= 1
            if left[k] == 0:
                done[k] = time.perf_counter() - arrived[k]
        step += 1
    seconds = time.perf_counter() - start
    singles = sorted(done[k] for k, c in enumerate(clients) if c["n"] == 1)
    big = [done[k] for k, c in enumerate(clients) if c["n"] >= 32]
    result = dict(policy=policy, tokens=tokens, seconds=seconds,
                  single_median_ms=1e3 * statistics.median(singles),
                  single_p90_ms=1e3 * singles[int(0.9 * (len(singles) - 1))],
                  big_median_s=statistics.median(big),
                  preemptions=sched.fairness_preemptions - preempt0,
                  recomputed=sched.kv.stats.recomputed_tokens - recomputed0)
    engine.shutdown()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", nargs="+", choices=(*PARTS, "all"), default=["all"])
    ap.add_argument("--policies", nargs="+", choices=tuple(POLICIES), default=list(POLICIES))
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--clients", type=int, default=64, help="clients of the mixed load")
    ap.add_argument("--quick", action="store_true", help="tiny model on CPU, no record")
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    parts = PARTS if "all" in args.part else tuple(p for p in PARTS if p in args.part)
    quick = args.quick
    if quick:
        args.max_num_seqs, args.clients = min(args.max_num_seqs, 16), min(args.clients, 16)
    elif not torch.cuda.is_available():
        raise SystemExit("bench_fairness needs a CUDA GPU (or --quick for a CPU smoke run)")
    device = torch.device("cpu" if quick else "cuda")
    gpu = gpu_name(device)
    command = command_line("benchmarks.bench_fairness")
    write = not (quick or args.no_record)
    seqs = args.max_num_seqs
    setting = (f"Llama-3-8B shape, dummy {'fp32 (tiny)' if quick else 'bf16'} weights, LoRA "
               f"off, max_num_seqs {seqs}, max_num_batched_tokens 8192, prefix caching and "
               "async scheduling on, the core in process; each policy in a fresh process "
               "after a warm-up pass.")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_config(Path(tmp) / "model", TINY if quick else LLAMA3_8B)
        if "wait" in parts:
            rows = []
            for n in (seqs, 2 * seqs):
                for policy in args.policies:
                    r = in_child(run_wait, model_dir, quick, seqs, policy, n)
                    rows.append([n, policy, f"{r['small_ms']:.1f}", r["small_steps"],
                                 f"{r['big_s']:.2f}", r["preemptions"], r["recomputed"]])
            record(f"Fairness: a 2-token request behind an n-request ({gpu})", command,
                   ["n", "policy", "small request: submit to end (ms)", "steps",
                    "n-request: submit to last child (s)", "fairness preemptions",
                    "recomputed tokens"],
                   rows, notes=setting + " The n-request: one 128-token prompt, "
                   f"{10 if quick else 100} new tokens, logprobs=20, greedy; the 2-token "
                   "request (16-token prompt) arrives 3 steps after it.",
                   write=write, device=device)
        if "mixed" in parts:
            results = [in_child(run_mixed, model_dir, quick, seqs, p, args.clients)
                       for p in args.policies]
            base = next((r for r in results if r["policy"] == "fcfs"), results[0])
            base_rate = base["tokens"] / base["seconds"]
            rows = [[r["policy"], f"{r['tokens'] / r['seconds']:,.0f}",
                     f"{r['tokens'] / r['seconds'] / base_rate:.3f}",
                     f"{r['single_median_ms']:.0f}", f"{r['single_p90_ms']:.0f}",
                     f"{r['big_median_s']:.2f}", r["preemptions"], r["recomputed"]]
                    for r in results]
            record(f"Fairness: the cost on a mixed load of {args.clients} clients ({gpu})",
                   command, ["policy", "output tok/s", f"vs {base['policy']}",
                             "n=1 clients: median (ms)", "p90 (ms)",
                             "n>=32 clients: median (s)", "fairness preemptions",
                             "recomputed tokens"],
                   rows, notes=setting + f" A client arrives every {ARRIVAL_EVERY_STEPS} "
                   f"engine steps with n in {MIXED_FAN_OUT} in turn (capped at max_num_seqs),"
                   " one prompt per client (its children share it), greedy, ignore_eos; "
                   "completion = the client's arrival to its last child's end.",
                   write=write, device=device)


if __name__ == "__main__":
    main()
