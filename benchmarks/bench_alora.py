"""Activated LoRA on multi-adapter pipelines: prefill tokens computed, time to first token and
throughput, against the same adapters as plain LoRA.

A Llama-3-8B-shaped model with random bf16 weights (``load_format="dummy"``, token ids in and
out), 4 distinct rank-16 q/k/v/o adapters in PEFT's format, greedy, ignore_eos. The pattern
aLoRA exists for (Greenewald et al., 2025): a conversation is answered by the base model, then
several adapters (a checker, a rewriter, a classifier) each read the whole conversation and
answer their own question about it.

* 64 conversations of 2,000 random token ids each. All 64 are submitted at once to the base
  model, which writes a 32-token reply.
* As soon as conversation c's reply ends, 4 adapter requests are submitted for it, one per
  adapter: prompt = the conversation + the reply + the adapter's invocation sequence (6
  tokens of its own) + a 16-token question; 32 new tokens.

Two engines, each in a fresh process, with prefix caching on in both:

* ``aLoRA``: the adapters carry ``alora_invocation_tokens`` (peft's ``LoraConfig`` field), so
  each adapter request runs as the base model before its invocation sequence: the blocks the
  base model's request left in the prefix cache are found, and only the tail is prefilled.
* ``plain LoRA``: the same weights without the field: each adapter's KV differs from the
  first token on, so every adapter request prefills its whole prompt.

Prefill tokens computed = prompt tokens looked up in the prefix cache minus those found
(``KVCacheStats``: ``prefix_queries - prefix_hits``), over all requests; prefix-hit tokens
that crossed adapters are ``prefix_hits_alora``. TTFT = from ``add_request`` to the end of the
``LLMEngine.step`` that returns the request's first token, for the adapter requests.
Throughput = all output tokens / the run's wall time. Goals: at least 4x fewer prefill tokens
and 3x lower median TTFT with aLoRA. Each engine is warmed up by a smaller run (8
conversations, other token ids) first.

    python -m benchmarks.bench_alora              # ~4 min on one H200
    python -m benchmarks.bench_alora --quick      # tiny model on CPU, a smoke run, no record

Prints and records (``common.record``) its table to BENCHMARKS.md unless ``--no-record``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.bench_engine import in_child
from benchmarks.common import command_line, record
from benchmarks.llama3_8b import LLAMA3_8B, TINY, write_config, write_peft_adapters

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
RANK = 16
COUNTERS = ("prefix_queries", "prefix_hits", "prefix_hits_alora", "preemptions")


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Workload and engine sizes (lengths in tokens)."""

    conversations: int = 64
    context: int = 2000
    reply: int = 32
    adapters: int = 4
    invocation: int = 6
    question: int = 16
    answer: int = 32
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 4096

    def warmup(self) -> Sizes:
        """The smaller run that warms an engine up: same prompt shapes, fewer conversations."""
        return dataclasses.replace(self, conversations=8, reply=4, answer=4)


FULL = Sizes()
QUICK = Sizes(conversations=4, context=96, reply=4, invocation=3, question=4, answer=4,
              max_num_seqs=32, max_num_batched_tokens=256, max_model_len=512)


@dataclasses.dataclass(frozen=True)
class Workload:
    """The token ids of one run: each conversation's context and each adapter's question
    about it (``questions[c][a]``)."""

    contexts: list[list[int]]
    questions: list[list[list[int]]]


def invocations(vocab: int, s: Sizes) -> list[list[int]]:
    """Each adapter's invocation sequence: ``s.invocation`` ids of its own (seeded)."""
    rng = random.Random(99)
    return [[rng.randrange(vocab) for _ in range(s.invocation)] for _ in range(s.adapters)]


def workload(vocab: int, s: Sizes, seed: int) -> Workload:
    """Random conversations and questions (seeded)."""
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    return Workload([ids(s.context) for _ in range(s.conversations)],
                    [[ids(s.question) for _ in range(s.adapters)]
                     for _ in range(s.conversations)])


def write_adapters(root: Path, config: dict, s: Sizes, device: torch.device,
                   dtype: torch.dtype) -> tuple[list[Path], list[Path]]:
    """The plain adapters and copies of them that carry ``alora_invocation_tokens``."""
    plain = write_peft_adapters(root / "plain", config, s.adapters, RANK, TARGETS, device,
                                dtype)
    activated = []
    for path, inv in zip(plain, invocations(config["vocab_size"], s)):
        dst = root / "alora" / path.name
        dst.mkdir(parents=True)
        (dst / "adapter_model.safetensors").write_bytes(
            (path / "adapter_model.safetensors").read_bytes())
        cfg = json.loads((path / "adapter_config.json").read_text())
        (dst / "adapter_config.json").write_text(json.dumps({**cfg,
                                                             "alora_invocation_tokens": inv}))
        activated.append(dst)
    return plain, activated


def _counters(engine) -> dict[str, int]:
    stats = engine.kv_cache_stats()
    return {name: getattr(stats, name) for name in COUNTERS}


def _generated(out, new: int) -> list[int]:
    ids = list(out.outputs[0].token_ids)
    if out.outputs[0].finish_reason != "length" or len(ids) != new:
        raise RuntimeError(f"request {out.request_id} ended with "
                           f"{out.outputs[0].finish_reason!r} after {len(ids)} tokens, "
                           f"expected 'length' after {new}")
    return ids


def run(engine, work: Workload, loras: list, invs: list[list[int]], s: Sizes) -> dict:
    """One pass of the pipeline on ``engine`` (an ``LLMEngine``): the base replies, then each
    conversation's adapter requests as soon as its reply ends.

    Returns the wall ``seconds``, ``output_tokens``, the adapter requests' ``ttft`` (s) and
    the KV cache counters' change (``COUNTERS``).
    """
    from manylora import SamplingParams

    reply = SamplingParams(temperature=0.0, max_tokens=s.reply, ignore_eos=True)
    answer = SamplingParams(temperature=0.0, max_tokens=s.answer, ignore_eos=True)
    submitted: dict[str, float] = {}
    ttft: list[float] = []
    output_tokens = finished = 0
    before = _counters(engine)
    t0 = time.perf_counter()
    for c, context in enumerate(work.contexts):
        engine.add_request(f"base{c}", {"prompt_token_ids": context}, reply, None)
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            rid = out.request_id
            if rid in submitted and out.outputs[0].token_ids:
                ttft.append(now - submitted.pop(rid))
            if not out.finished:
                continue
            finished += 1
            if rid.startswith("base"):
                c = int(rid[4:])
                history = work.contexts[c] + _generated(out, s.reply)
                output_tokens += s.reply
                for a, lora in enumerate(loras):
                    name = f"c{c}-a{a}"
                    submitted[name] = time.perf_counter()
                    engine.add_request(name, {"prompt_token_ids": history + invs[a]
                                              + work.questions[c][a]}, answer, lora)
            else:
                output_tokens += len(_generated(out, s.answer))
    seconds = time.perf_counter() - t0
    expected = s.conversations * (1 + s.adapters)
    if finished != expected:
        raise RuntimeError(f"{finished} of {expected} requests finished")
    after = _counters(engine)
    return {"seconds": seconds, "output_tokens": output_tokens, "ttft": ttft,
            "counters": {k: after[k] - before[k] for k in COUNTERS}}


def measure(model_dir: Path, adapters: list[Path], s: Sizes, quick: bool) -> dict:
    """One engine (in its own process): a warm-up pass, then the timed pass."""
    from manylora import LLM, LoRARequest

    llm = LLM(str(model_dir), load_format="dummy", skip_tokenizer_init=True,
              dtype="float32" if quick else "bfloat16", device="cpu" if quick else "cuda",
              max_loras=s.adapters, max_cpu_loras=s.adapters, max_lora_rank=RANK,
              lora_target_modules=TARGETS, max_num_seqs=s.max_num_seqs,
              max_num_batched_tokens=s.max_num_batched_tokens, max_model_len=s.max_model_len,
              enable_prefix_caching=True, **({"num_kv_blocks": 1024} if quick else {}))
    engine = llm.llm_engine
    vocab = engine.vocab_size
    loras = [LoRARequest(f"adapter{a}", a + 1, str(p)) for a, p in enumerate(adapters)]
    invs = invocations(vocab, s)
    warm = s.warmup()
    run(engine, workload(vocab, warm, seed=1), loras, invs, warm)
    result = run(engine, workload(vocab, s, seed=0), loras, invs, s)
    engine.shutdown()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model on the CPU, no record")
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()
    config, s = (TINY, QUICK) if args.quick else (LLAMA3_8B, FULL)
    device = torch.device("cpu" if args.quick else "cuda")
    dtype = torch.float32 if args.quick else torch.bfloat16
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir = write_config(root / "model", config)
        plain, activated = write_adapters(root, config, s, device, dtype)
        for label, paths in (("plain LoRA", plain), ("aLoRA", activated)):
            results[label] = r = in_child(measure, model_dir, paths, s, args.quick)
            print(f"{label}: {r['seconds']:.2f} s, counters {r['counters']}, TTFT median "
                  f"{statistics.median(r['ttft']) * 1e3:.1f} ms", flush=True)
    base = results["plain LoRA"]
    rows = []
    for label, r in results.items():
        c = r["counters"]
        prefilled = c["prefix_queries"] - c["prefix_hits"]
        base_prefilled = (base["counters"]["prefix_queries"]
                          - base["counters"]["prefix_hits"])
        ttft = statistics.median(r["ttft"])
        rows.append([label, f"{prefilled:,}", f"{base_prefilled / prefilled:.2f}x",
                     f"{c['prefix_hits']:,}", f"{c['prefix_hits_alora']:,}",
                     f"{ttft * 1e3:,.1f}", f"{statistics.median(base['ttft']) / ttft:.2f}x",
                     f"{max(r['ttft']) * 1e3:,.1f}",
                     f"{r['output_tokens'] / r['seconds']:,.0f}",
                     f"{(base['seconds'] / r['seconds']):.2f}x", f"{r['seconds']:.2f}",
                     c["preemptions"]])
    prompt = s.context + s.reply + s.invocation + s.question
    record(f"Activated LoRA vs plain LoRA on a multi-adapter pipeline "
           f"({'tiny, CPU' if args.quick else 'Llama-3-8B shape'})",
           command_line("benchmarks.bench_alora"),
           ["adapters", "prefill tokens computed", "fewer than plain", "prefix-hit tokens",
            "of them across adapters", "adapter requests' TTFT median (ms)",
            "lower than plain", "TTFT max (ms)", "output tok/s", "vs plain", "seconds",
            "preemptions"], rows,
           notes=(f"{s.conversations} conversations of {s.context} random token ids, each "
                  f"answered by the base model ({s.reply} new tokens), then {s.adapters} "
                  f"adapter requests per conversation (rank {RANK}, q/k/v/o; prompt = the "
                  f"conversation + the reply + the adapter's {s.invocation}-token invocation "
                  f"sequence + a {s.question}-token question = {prompt} tokens; {s.answer} new "
                  "tokens), submitted as soon as the conversation's reply ends. Greedy, "
                  f"ignore_eos, prefix caching on, {s.adapters} slots, max_num_seqs "
                  f"{s.max_num_seqs}, max_num_batched_tokens {s.max_num_batched_tokens}, CUDA "
                  "graphs for decode; one warm-up pass (8 conversations, other ids) per "
                  "engine. Prefill tokens computed = prefix_queries - prefix_hits over all "
                  "requests (the base replies' prefill is in both rows). TTFT from "
                  "add_request to the end of the step that returns the first token. Goals: "
                  "at least 4x fewer prefill tokens and 3x lower median TTFT."),
           write=not (args.no_record or args.quick), device=device)


if __name__ == "__main__":
    main()
