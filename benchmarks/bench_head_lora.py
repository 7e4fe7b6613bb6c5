"""What a head adapter costs: decode step time at batch 64 with ``lm_head`` LoRA on every
row, against the same adapters without it and against LoRA off.

Llama-3-8B shape (``llama3_8b.LLAMA3_8B``: hidden 4096, vocabulary 128,256), random bf16
weights (``load_format="dummy"``, token ids in and out), CUDA graphs for decode, 64 requests
on 64 distinct rank-16 adapters in 64 slots (prompt 128, greedy, ignore_eos). Engines, each
in a fresh process:

* ``off``: LoRA disabled;
* ``qkvo``: adapters on q/k/v/o, slots on q/k/v/o;
* ``qkvo, head slots``: the same adapters, slots on q/k/v/o and ``lm_head`` (what sizing
  the head's slots costs when no adapter uses them);
* ``qkvo + lm_head``: adapters on q/k/v/o and ``lm_head`` (B ``[128256, 16]``), slots on
  both: every decode row runs its adapter's head shrink and expand over the sampled rows.

Decode step time: two passes of the same 64 requests with ``SHORT`` and ``LONG`` new tokens
(other token ids each pass, so no prefix is cached), ``(t_long - t_short) / (LONG - SHORT)``:
the prefill and start of both passes cancel. Median over ``--repeats``. Target (issue 32): the
head adapter adds about the cost of its own shrink and expand over 64 rows (64 x 16 x
128,256 multiply-adds and each adapter's B once), not a vocabulary-wide pass per token.

    python -m benchmarks.bench_head_lora                 # ~5 min on one H100
    python -m benchmarks.bench_head_lora --quick         # tiny model on CPU, a smoke run

Prints and records (``common.record``) its table to BENCHMARKS.md unless ``--no-record``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.bench_engine import in_child
from benchmarks.common import command_line, record
from benchmarks.llama3_8b import LLAMA3_8B, TINY, write_config, write_peft_adapters

BATCH, RANK, PROMPT, SHORT, LONG = 64, 16, 128, 16, 80
QKVO = ("q_proj", "k_proj", "v_proj", "o_proj")
#: (row label, slots' target modules or None for LoRA off, whether the adapters carry lm_head)
ENGINES = (("off", None, False),
           ("qkvo", QKVO, False),
           ("qkvo, head slots", (*QKVO, "lm_head"), False),
           ("qkvo + lm_head", (*QKVO, "lm_head"), True))


def add_head(paths: list[Path], config: dict, device: torch.device, dtype: torch.dtype
             ) -> list[Path]:
    """Copies of the adapters in ``paths`` with a random rank-``RANK`` ``lm_head`` LoRA
    added (PEFT's keys, no saved base table), next to them."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    hidden, vocab = config["hidden_size"], config["vocab_size"]
    gen = torch.Generator(device).manual_seed(4321)
    out = []
    for path in paths:
        dst = path.with_name(path.name + "-head")
        shutil.copytree(path, dst, dirs_exist_ok=True)
        tensors = load_file(str(dst / "adapter_model.safetensors"))
        a = torch.randn(RANK, hidden, generator=gen, device=device) * hidden ** -0.5
        b = torch.randn(vocab, RANK, generator=gen, device=device) * 0.01
        tensors["base_model.model.lm_head.lora_A.weight"] = a.to(dtype).cpu()
        tensors["base_model.model.lm_head.lora_B.weight"] = b.to(dtype).cpu()
        save_file(tensors, str(dst / "adapter_model.safetensors"))
        cfg = json.loads((dst / "adapter_config.json").read_text())
        cfg["target_modules"] = [*cfg["target_modules"], "lm_head"]
        (dst / "adapter_config.json").write_text(json.dumps(cfg))
        out.append(dst)
    return out


def measure(model_dir: Path, adapters: list[Path] | None, targets: tuple | None,
            quick: bool, repeats: int) -> dict:
    """One engine: the median decode step time (ms) at batch ``BATCH`` and its passes."""
    from manylora import LLM, LoRARequest, SamplingParams

    kwargs = dict(load_format="dummy", skip_tokenizer_init=True,
                  dtype="float32" if quick else "bfloat16", device="cpu" if quick else "cuda",
                  max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=2048,
                  enable_prefix_caching=True, **({"num_kv_blocks": 512} if quick else {}))
    if targets is None:
        kwargs["enable_lora"] = False
    else:
        kwargs.update(max_loras=BATCH, max_cpu_loras=BATCH, max_lora_rank=RANK,
                      lora_target_modules=targets)
    llm = LLM(str(model_dir), **kwargs)
    vocab = llm.llm_engine.vocab_size
    loras = ([LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(adapters)]
             if adapters else [None] * BATCH)
    gen = torch.Generator().manual_seed(0)

    def one_pass(new: int) -> float:
        prompts = [{"prompt_token_ids": torch.randint(0, vocab, (PROMPT,),
                                                      generator=gen).tolist()}
                   for _ in range(BATCH)]
        params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
        return time.perf_counter() - start

    one_pass(SHORT)                                    # loads every adapter, captures graphs
    one_pass(LONG)
    steps = [(one_pass(LONG) - one_pass(SHORT)) / (LONG - SHORT) * 1e3 for _ in range(repeats)]
    llm.llm_engine.shutdown()
    return {"step_ms": statistics.median(steps), "steps_ms": steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model on the CPU, no record")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()
    config = TINY if args.quick else LLAMA3_8B
    device = torch.device("cpu" if args.quick else "cuda")
    dtype = torch.float32 if args.quick else torch.bfloat16
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir = write_config(root / "model", config)
        plain = write_peft_adapters(root / "adapters", config, BATCH, RANK, QKVO, device, dtype)
        head = add_head(plain, config, device, dtype)
        rows, base = [], None
        for label, targets, with_head in ENGINES:
            adapters = None if targets is None else head if with_head else plain
            result = in_child(measure, model_dir, adapters, targets, args.quick, args.repeats)
            base = result["step_ms"] if base is None else base
            rows.append([label, f"{result['step_ms']:.2f}",
                         f"{result['step_ms'] / base:.3f}",
                         " ".join(f"{s:.2f}" for s in result["steps_ms"])])
    record(f"Head adapters: decode step at batch {BATCH} "
           f"({'tiny, CPU' if args.quick else 'Llama-3-8B shape'})",
           command_line("benchmarks.bench_head_lora"),
           ["engine", "step ms (median)", "vs LoRA off", "passes (ms)"], rows,
           notes=(f"{BATCH} requests on {BATCH} distinct rank-{RANK} adapters, prompt {PROMPT};"
                  f" step time = (t({LONG} new) - t({SHORT} new)) / {LONG - SHORT}."),
           write=not (args.no_record or args.quick), device=device)


if __name__ == "__main__":
    main()
