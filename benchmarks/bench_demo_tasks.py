"""The demo adapters' held-out accuracy against the base model's, as one mixed batch.

Workload: SmolLM2-135M-Instruct from its GGUF file (``manylora.demo.model``), the four
shipped adapters (``manylora/demo/adapters``). Every task's ``--per-task`` held-out prompts
(``manylora.demo.tasks.held_out``), each rendered with the GGUF's chat template, go once to
the task's adapter and once to the base model: all of them in one ``LLM.generate`` call,
greedy, ``--max-tokens`` new tokens at most, stopping at the end-of-turn token. An answer
counts when it equals the task's expected answer (``exact_match``).

Reported per task: the adapter's and the base model's exact-match accuracy; for the batch:
requests, completion tokens, wall time of the call and output tokens per second.

    python -m benchmarks.bench_demo_tasks                       # 200 per task, cuda if present
    python -m benchmarks.bench_demo_tasks --device cpu --per-task 200
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from benchmarks.common import command_line, gpu_name, record


def run(model: str | None, device: str, dtype: str, per_task: int, max_tokens: int,
        write: bool) -> str:
    """Run the benchmark; return the recorded markdown section."""
    from manylora import LLM, LoRARequest, SamplingParams
    from manylora.config import resolve_device, resolve_dtype
    from manylora.demo.model import fetch_smollm2
    from manylora.demo.tasks import (
        TASKS,
        adapter_dir,
        chat_messages,
        describe_adapter,
        exact_match,
        held_out,
    )
    from manylora.model.loader import load_hf_config

    gguf = Path(model) if model else fetch_smollm2()
    names = list(TASKS)
    llm = LLM(model=str(gguf), device=device, dtype=dtype, max_model_len=1024,
              max_loras=len(names), max_lora_rank=16, max_num_seqs=256)
    tok = llm.get_tokenizer()
    loras = {n: LoRARequest(n, i + 1, str(adapter_dir(n))) for i, n in enumerate(names)}
    jobs = []                             # (task, expected answer, adapter or None, prompt)
    for name in names:
        for prompt, answer in held_out(name, per_task):
            ids = tok.apply_chat_template(chat_messages(prompt), add_generation_prompt=True,
                                          tokenize=True, return_dict=False)
            jobs += [(name, answer, loras[name], ids), (name, answer, None, ids)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    # a short warm-up: compiles and graph captures are not part of the timed call
    llm.generate([{"prompt_token_ids": j[3]} for j in jobs[:8]], params,
                 lora_request=[j[2] for j in jobs[:8]], use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": j[3]} for j in jobs], params,
                        lora_request=[j[2] for j in jobs])
    seconds = time.perf_counter() - start
    hits: dict[tuple[str, bool], int] = {}
    for (name, answer, lora, _), out in zip(jobs, outs, strict=True):
        key = (name, lora is not None)
        hits[key] = hits.get(key, 0) + exact_match(answer, out.outputs[0].text)
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    rows = [[name, describe_adapter(adapter_dir(name)), f"{hits[(name, True)] / per_task:.3f}",
             f"{hits[(name, False)] / per_task:.3f}", per_task] for name in names]
    where = gpu_name(device if device != "auto" else None)
    dtype_used = str(resolve_dtype(dtype, resolve_device(device), load_hf_config(gguf)))
    notes = (f"{len(jobs)} requests in one `LLM.generate` call (each held-out prompt to its "
             f"adapter and to the base model), greedy, at most {max_tokens} new tokens, "
             f"{dtype_used.removeprefix('torch.')}: {tokens} completion tokens in "
             f"{seconds:.1f} s, "
             f"{tokens / seconds:.0f} output tokens/s.")
    return record(f"Demo adapters' held-out accuracy, SmolLM2-135M-Instruct GGUF ({where})",
                  command_line("benchmarks.bench_demo_tasks"),
                  ["task", "adapter", "adapter exact match", "base exact match", "prompts"],
                  rows, notes, write=write, device=device if device != "auto" else None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="the GGUF file (default: fetch it)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--per-task", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    run(args.model, args.device, args.dtype, args.per_task, args.max_tokens, not args.no_write)


if __name__ == "__main__":
    main()
