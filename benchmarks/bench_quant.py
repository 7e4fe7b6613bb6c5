"""Quantized base weights on the GPU: FP8 and INT4 against bf16 and their byte floors.

A Llama-3-8B-shaped model with dummy weights in each format's own layout
(``load_format="dummy"``, the format's ``quantization_config`` in config.json, or
``quantization="fp8"`` for online FP8 of the bf16 weights):

* ``bf16``: dense bf16 weights.
* ``fp8``: online FP8 (``--quantization fp8``): per-output-channel weight scales, dynamic
  per-token activation scales (W8A8).
* ``fp8-block``: transformers' fine-grained FP8 (128x128 weight blocks, 1x128 activation
  groups), as Qwen3-FP8 and DeepSeek-V3 publish.
* ``int4``: GPTQ, 4 bits, group 128, symmetric, no activation order (W4A16).

Parts (``--parts``):

* ``gemm``: one projection's ``linear_method.apply`` per Llama-3-8B shape (q/k/v fused
  4096→6144, o 4096→4096, gate/up fused 4096→28672, down 14336→4096) at 1, 16 and 64
  rows, each call captured in a CUDA graph and its replays timed (``common.time_cuda_graph``:
  L2 cleared before each). Bytes = the layer's stored tensors (weights, scales, zero points);
  floor = bytes over the device-to-device copy bandwidth measured in the same process.
  Target at decode (1 to 64 rows): FP8 and W4A16 at 70% or more of the copy bandwidth.
* ``decode``: ``bench_decode.measure_decode`` at batch 1 and 64, context 512, LoRA off:
  the engine's decode step (CUDA-graph replay, logits, sampling) against the bytes it must
  read. Target: the batch-1 step at least 1.7x faster than bf16 for FP8 and 2.8x for INT4.
* ``lora``: ``bench_lora``'s batch part (64 requests on 64 distinct rank-16 q/k/v/o
  adapters, prompt 128, 64 new, 64 slots) over each base: output tok/s, median of
  ``--repeats`` passes. Target: the FP8 base at least 1.5x the bf16 base.

    python -m benchmarks.bench_quant --parts gemm decode    # ~4 min on one H100
    python -m benchmarks.bench_quant --parts lora --formats fp8    # > 5 min: bf16 and FP8
    python -m benchmarks.bench_quant --quick                # tiny model on CPU, no record

Each part prints and records (``common.record``) its table to BENCHMARKS.md unless
``--no-record``.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import tempfile
from pathlib import Path

import torch

from benchmarks.bench_decode import measure_decode
from benchmarks.bench_engine import in_child
from benchmarks.bench_lora import FULL, QUICK, run_batch_and_kernels
from benchmarks.common import (
    command_line,
    gpu_name,
    measure_copy_bandwidth,
    record,
    time_cuda_graph,
)
from benchmarks.llama3_8b import LLAMA3_8B, TINY, write_config, write_peft_adapters

PARTS = ("gemm", "decode", "lora")
#: format → (config.json's quantization_config, the engine's quantization).
FORMATS: dict[str, tuple[dict | None, str | None]] = {
    "bf16": (None, None),
    "fp8": (None, "fp8"),
    "fp8-block": ({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                   "weight_block_size": [128, 128]}, None),
    "int4": ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False,
              "sym": True, "checkpoint_format": "gptq"}, None),
}
#: The targets: decode speed-up at batch 1 over bf16, GEMM share of the copy bandwidth,
#: workload throughput over bf16 with 64 adapters.
DECODE_SPEEDUP = {"fp8": 1.7, "fp8-block": 1.7, "int4": 2.8}
GEMM_SHARE = 0.70
LORA_SPEEDUP = {"fp8": 1.5, "fp8-block": 1.5}
#: Llama-3-8B's projections as manylora fuses them: name, in, out.
PROJECTIONS = (("q_proj/k_proj/v_proj", 4096, 6144), ("o_proj", 4096, 4096),
               ("gate_proj/up_proj", 4096, 28672), ("down_proj", 14336, 4096))
ROWS = (1, 16, 64)
RANK = 16
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def gemm_case(fmt: str, in_features: int, out_features: int, rows: int,
              device: torch.device) -> dict:
    """One projection of ``fmt`` with dummy weights: ``ms`` (median CUDA-graph replay of
    ``apply`` on ``rows`` bf16 rows; NaN off CUDA) and ``bytes`` (its stored tensors)."""
    from manylora.config import parse_quantization
    from manylora.lora.linear import LoRALinear
    from manylora.model.loader import fill_dummy_weights
    from manylora.ops.quant import linear_method_for

    qcfg, quant = FORMATS[fmt]
    method = linear_method_for(parse_quantization(qcfg, quant),
                               ["model.layers.0.self_attn.q_proj"])
    layer = LoRALinear(in_features, (out_features,), ("q_proj",), False, torch.bfloat16,
                       device, linear_method=method)
    fill_dummy_weights(layer, device)
    method.process_weights_after_loading(layer)
    method.warm_up(layer)
    nbytes = sum(t.numel() * t.element_size()
                 for t in (*layer.parameters(), *layer.buffers()))
    x = torch.randn(rows, in_features, dtype=torch.bfloat16, device=device)
    ms = time_cuda_graph(lambda: method.apply(layer, x)) if device.type == "cuda" \
        else float("nan")
    return {"ms": ms, "bytes": nbytes}


def run_gemm(quick: bool, formats: tuple[str, ...] = tuple(FORMATS)) -> dict:
    device = torch.device("cpu" if quick else "cuda")
    bandwidth = measure_copy_bandwidth(device) if device.type == "cuda" else float("nan")
    shapes = ((n, 64, 96) for n, _, _ in PROJECTIONS[:1]) if quick else PROJECTIONS
    cases = []
    for name, k, n in shapes:
        for fmt in formats:
            for rows in (1, 4) if quick else ROWS:
                case = gemm_case(fmt, k, n, rows, device)
                cases.append({"projection": name, "in": k, "out": n, "format": fmt,
                              "rows": rows, **case})
                print(cases[-1], flush=True)
    return {"bandwidth": bandwidth, "cases": cases}


def gemm_table(result: dict) -> tuple[list[str], list[list]]:
    bw = result["bandwidth"]
    cases = result["cases"]
    bf16 = {(c["projection"], c["rows"]): c["ms"] for c in cases if c["format"] == "bf16"}
    columns = ["projection (in→out)", "rows", "format", "MB read", "ms (median)", "floor ms",
               "% of copy BW", "vs bf16", f">= {GEMM_SHARE:.0%} of copy BW"]
    rows = []
    for c in cases:
        floor = c["bytes"] / bw * 1e3
        share = floor / c["ms"]
        rows.append([f"{c['projection']} ({c['in']}→{c['out']})", c["rows"], c["format"],
                     f"{c['bytes'] / 1e6:,.1f}", f"{c['ms']:.4f}", f"{floor:.4f}",
                     f"{share:.0%}", f"{bf16[(c['projection'], c['rows'])] / c['ms']:.2f}x",
                     "-" if c["format"] == "bf16" else ("yes" if share >= GEMM_SHARE
                                                        else "no")])
    return columns, rows


def run_decode(quick: bool, iters: int, formats: tuple[str, ...] = tuple(FORMATS)
               ) -> list[dict]:
    out = []
    for fmt in formats:
        qcfg, quant = FORMATS[fmt]
        for r in in_child(measure_decode, (1, 4) if quick else (1, 64), 512, RANK, iters,
                          "auto", quick, (False,), qcfg, quant):
            out.append({"format": fmt, **r})
    return out


def decode_table(results: list[dict]) -> tuple[list[str], list[list]]:
    bf16 = {r["batch"]: r["step_s"] for r in results if r["format"] == "bf16"}
    columns = ["format", "batch", "step ms (median)", "GB read", "floor ms", "% of copy BW",
               "speed-up vs bf16", "target"]
    rows = []
    for r in results:
        speedup = bf16[r["batch"]] / r["step_s"]
        target = DECODE_SPEEDUP.get(r["format"]) if r["batch"] == 1 else None
        rows.append([r["format"], r["batch"], f"{r['step_s'] * 1e3:.3f}",
                     f"{r['bytes'] / 1e9:.2f}", f"{r['floor_s'] * 1e3:.3f}",
                     f"{r['floor_s'] / r['step_s']:.0%}", f"{speedup:.2f}x",
                     "-" if target is None else
                     f">= {target}x: {'yes' if speedup >= target else 'no'}"])
    return columns, rows


def run_lora(quick: bool, repeats: int, formats: tuple[str, ...] = tuple(FORMATS)
             ) -> list[dict]:
    sizes = QUICK if quick else FULL
    config = TINY if quick else LLAMA3_8B
    device = torch.device("cpu" if quick else "cuda")
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        adapters = write_peft_adapters(root / "adapters", config, sizes.distinct, RANK,
                                       LORA_TARGETS, device,
                                       torch.float32 if quick else torch.bfloat16)
        for fmt in formats:
            qcfg, quant = FORMATS[fmt]
            model_dir = write_config(root / fmt, config if qcfg is None
                                     else dict(config, quantization_config=qcfg))
            r = in_child(functools.partial(run_batch_and_kernels, quantization=quant),
                         model_dir, adapters, None, ("batch",), sizes, repeats, 1, quick)
            passes = r["passes"]
            out.append({"format": fmt, "tokens": passes[0]["tokens"],
                        "rate": passes[0]["tokens"] / statistics.median(
                            p["seconds"] for p in passes),
                        "prefix_hits": sum(p["prefix_hits"] for p in passes)})
            print(out[-1], flush=True)
    return out


def lora_table(results: list[dict]) -> tuple[list[str], list[list]]:
    bf16 = next(r["rate"] for r in results if r["format"] == "bf16")
    columns = ["base", "output tokens per pass", "tok/s (median pass)", "vs bf16 base",
               "target", "prefix-hit tokens"]
    rows = []
    for r in results:
        ratio = r["rate"] / bf16
        target = LORA_SPEEDUP.get(r["format"])
        rows.append([r["format"], f"{r['tokens']:,}", f"{r['rate']:,.0f}", f"{ratio:.2f}x",
                     "-" if target is None else
                     f">= {target}x: {'yes' if ratio >= target else 'no'}",
                     f"{r['prefix_hits']:,}"])
    return columns, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", nargs="+", choices=(*PARTS, "all"), default=["all"])
    ap.add_argument("--repeats", type=int, default=3, help="timed passes of the lora part")
    ap.add_argument("--iters", type=int, default=30, help="timed steps of the decode part")
    ap.add_argument("--formats", nargs="+", choices=tuple(FORMATS), default=list(FORMATS),
                    help="the bases to measure (bf16, the reference, is always added)")
    ap.add_argument("--quick", action="store_true", help="tiny model on CPU, no record")
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    parts = PARTS if "all" in args.parts else tuple(p for p in PARTS if p in args.parts)
    if not args.quick and not torch.cuda.is_available():
        raise SystemExit("bench_quant needs a CUDA GPU (or --quick for a CPU smoke run)")
    device = torch.device("cpu" if args.quick else "cuda")
    gpu = gpu_name(device)
    command = command_line("benchmarks.bench_quant")
    write = not (args.quick or args.no_record)
    chosen = tuple(f for f in FORMATS if f == "bf16" or f in args.formats)
    formats = ", ".join(chosen)
    if "gemm" in parts:
        columns, rows = gemm_table(in_child(run_gemm, args.quick, chosen))
        record(f"Quantized projections vs bf16 and the copy bandwidth (Llama-3-8B shapes, "
               f"{gpu})", command, columns, rows, write=write, device=device,
               notes=f"Formats: {formats} (`benchmarks/bench_quant.py`). One projection's "
               "`linear_method.apply` on bf16 rows, captured in a CUDA graph, median replay "
               "with L2 cleared; MB read = the layer's stored tensors (weights, scales, zero "
               "points); floor = MB read / the device-to-device copy bandwidth measured in "
               f"the same process. Target at decode: >= {GEMM_SHARE:.0%} of the copy "
               "bandwidth for FP8 and W4A16.")
    if "decode" in parts:
        columns, rows = decode_table(run_decode(args.quick, args.iters, chosen))
        record(f"Decode step on quantized bases vs bf16 (Llama-3-8B shape, {gpu}), LoRA off",
               command, columns, rows, write=write, device=device,
               notes=f"Formats: {formats}. `bench_decode.measure_decode`: context 512, the "
               "engine's decode step (`ModelRunner.execute`: CUDA-graph replay of the 32 "
               "layers, logits, greedy sampling), median of the timed steps; GB read = "
               "stored weights (embedding rows only) + KV of batch × 512 tokens; floor = GB "
               "read / copy bandwidth. Targets at batch 1: FP8 >= 1.7x, INT4 >= 2.8x the "
               "bf16 step's speed.")
    if "lora" in parts:
        columns, rows = lora_table(run_lora(args.quick, args.repeats, chosen))
        record(f"64 distinct adapters over quantized bases (Llama-3-8B shape, {gpu})",
               command, columns, rows, write=write, device=device,
               notes=f"Formats: {formats}. `bench_lora`'s batch part on each base: 64 "
               "requests on 64 distinct rank-16 q/k/v/o PEFT adapters (bf16), 64 slots, "
               "prompt 128, 64 new tokens, greedy, ignore_eos; one warm-up pass, then "
               f"{args.repeats} timed `LLM.generate` passes on token ids of their own; tok/s "
               "= output tokens / the median pass. Target: the FP8 base >= 1.5x the bf16 "
               "base.")


if __name__ == "__main__":
    main()
