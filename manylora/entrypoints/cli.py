"""The ``manylora`` command: ``generate``, ``demo`` and ``convert-lora``."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

from manylora.lora.request import LoRARequest
from manylora.sampling_params import SamplingParams

_BASE = ("base", "none", "-")
DEMO_PROMPTS = [
    ("SELECT the names of users who", "sql"),
    ("Write a short greeting for a new customer:", "chat"),
    ("def fibonacci(n):", "code"),
    ("What is seven times six?", "math"),
    ("The quick brown fox", None),
    ("Low-rank adaptation adds a small update", "chat"),
    ("SELECT count(*) FROM orders WHERE", "sql"),
    ("A large language model reads a prompt", None),
]


def _engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--max-loras", type=int, default=8)
    p.add_argument("--max-lora-rank", type=int, default=64)
    p.add_argument("--max-cpu-loras", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--lora-target-modules", nargs="+", default=None)


def _engine_kwargs(a: argparse.Namespace) -> dict:
    return dict(dtype=a.dtype, device=a.device, max_loras=a.max_loras,
                max_lora_rank=a.max_lora_rank, max_cpu_loras=a.max_cpu_loras,
                max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
                block_size=a.block_size, num_kv_blocks=a.num_kv_blocks,
                max_model_len=a.max_model_len,
                lora_target_modules=tuple(a.lora_target_modules or ()) or None)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="manylora", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate for prompts, each with its own adapter")
    gen.add_argument("--model", required=True, help="checkpoint directory or hub id")
    gen.add_argument("--lora", action="append", default=[], metavar="NAME=DIR",
                     help="register an adapter (repeatable)")
    gen.add_argument("--prompt", action="append", required=True, help="repeatable")
    gen.add_argument("--adapter", action="append", default=[],
                     help="adapter NAME for the prompt at the same position, or 'base'; "
                          "given once, it applies to every prompt")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    _engine_flags(gen)
    demo = sub.add_parser("demo", help="a mixed batch over several adapters, checked against peft")
    demo.add_argument("--cache-dir", default=os.environ.get(
        "MANYLORA_CACHE", str(Path.home() / ".cache" / "manylora" / "demo")))
    demo.add_argument("--max-tokens", type=int, default=24)
    demo.add_argument("--device", default="auto")
    conv = sub.add_parser("convert-lora", help="convert a PEFT adapter to TensorRT-LLM's LoRA "
                          "tensors (model.lora_weights.npy, model.lora_config.npy)")
    conv.add_argument("-i", "--input", required=True, metavar="PEFT_DIR",
                      help="the PEFT adapter directory")
    conv.add_argument("-o", "--output", required=True, metavar="OUT_DIR",
                      help="directory to write the .npy files to (created if missing)")
    conv.add_argument("--storage-type", default="float16",
                      choices=("float16", "bfloat16", "float32"),
                      help="dtype of the stored weights")
    conv.add_argument("--base-model", default=None, metavar="DIR",
                      help="base checkpoint directory; needed to normalize DoRA magnitudes")
    return parser


def _generate(a: argparse.Namespace) -> int:
    from manylora.entrypoints.llm import LLM

    registry: dict[str, LoRARequest] = {}
    for i, spec in enumerate(a.lora):
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"--lora {spec!r}: expected NAME=DIR")
        registry[name] = LoRARequest(name, i + 1, path)
    names = a.adapter or ["base"]
    if len(names) == 1:
        names = names * len(a.prompt)
    if len(names) != len(a.prompt):
        raise SystemExit(f"{len(names)} --adapter for {len(a.prompt)} --prompt")
    unknown = [n for n in names if n not in registry and n not in _BASE]
    if unknown:
        raise SystemExit(f"--adapter {unknown[0]!r} was not registered with --lora")
    llm = LLM(a.model, **_engine_kwargs(a))
    params = SamplingParams(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                            seed=a.seed, max_tokens=a.max_tokens)
    outs = llm.generate(a.prompt, params, [registry.get(n) for n in names], use_tqdm=False)
    for name, out in zip(names, outs):
        print(f"[{name}] {out.prompt!r} -> {out.outputs[0].text!r}")
    return 0


def _demo(a: argparse.Namespace) -> int:
    from manylora.entrypoints.llm import LLM
    from manylora.testing import compare_greedy, hf_greedy_reference, make_demo_set

    demo = make_demo_set(Path(a.cache_dir))
    print(f"base model: {demo.base_dir}")
    ids = {name: i + 1 for i, name in enumerate(demo.adapters)}
    llm = LLM(str(demo.base_dir), dtype="float32", device=a.device, max_loras=4,
              max_lora_rank=64)
    tok = llm.get_tokenizer()
    prompts = [{"prompt_token_ids": tok(t).input_ids} for t, _ in DEMO_PROMPTS]
    names = [n for _, n in DEMO_PROMPTS]
    loras = [None if n is None else LoRARequest(n, ids[n], str(demo.adapters[n])) for n in names]
    params = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True)
    llm.generate(prompts[:1], params, loras[:1], use_tqdm=False)   # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params, loras, use_tqdm=False)
    seconds = time.perf_counter() - start
    refs = hf_greedy_reference(demo.base_dir, demo.adapters,
                               [p["prompt_token_ids"] for p in prompts], names, a.max_tokens)
    agree = []
    for (text, name), out, ref in zip(DEMO_PROMPTS, outs, refs):
        ok, _ = compare_greedy(out.outputs[0].token_ids, ref)
        agree.append(ok)
        print(f"{name or 'base':>5} | {'agrees' if ok else 'DIFFERS'} | {text!r} -> "
              f"{out.outputs[0].text!r}")
    n_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"{len(outs)} requests, {len(set(n for n in names if n))} adapters + base in one "
          f"batch on {llm.llm_engine.device}: {n_tokens} tokens in {seconds:.2f} s "
          f"({n_tokens / seconds:.0f} tokens/s)")
    print("every row agrees with transformers + peft" if all(agree) else
          f"{agree.count(False)} rows differ from transformers + peft")
    return 0 if all(agree) else 1


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = _parser().parse_args(argv)
    if args.command == "convert-lora":
        from manylora.entrypoints.convert_lora import run

        return run(args)
    return _generate(args) if args.command == "generate" else _demo(args)


if __name__ == "__main__":
    sys.exit(main())
