"""LoRA on the experts of a mixture-of-experts model: the fused op against the base op and
its byte floor, and decode throughput with 16 expert + attention adapters against LoRA off,
at Qwen3-30B-A3B's shape (hidden 2048, 48 layers, 128 experts of 768, top-8), bfloat16.

* ``kernel``: ``fused_experts_lora`` (``manylora.lora.kernels.fused_moe_lora``) and the base
  ``fused_experts_triton`` at T = 1, 64, 256 and 1,024 tokens, each token on one of 16
  rank-16 adapters (slot ``t % 16``) with gate, up and down on every expert, routing
  uniform; the LoRA op with both gate/up shrinks (by (token, expert) pair as routed, and the
  pairs grouped by (slot, expert)), and which one ``moe_lora_path`` takes. Time:
  one CUDA-graph replay of the whole op, L2 cleared (``common.time_cuda_graph``). Floor:
  the bytes actually read (the distinct experts hit × their ``w13`` + ``w2`` bytes, plus the
  distinct (slot, expert) pairs hit × their A and B bytes) over the copy bandwidth measured
  in the same process.
* ``engine``: ``load_format="dummy"``, token ids in and out, ``max_num_seqs`` 256, 16 slots
  of rank 16 with slot buffers on q/k/v/o, the experts and the router; 16 PEFT adapters
  written in peft's key format (q/k/v/o, and ``target_parameters`` on the stacked experts:
  peft's ``ParamWrapper`` keys). Batch 64 and 256 (prompt 128, 64 new tokens, greedy,
  ``ignore_eos``): request ``i`` on adapter ``i % 16``, against the same requests on the base
  model on the same engine. One warm-up pass, then 3 timed ``LLM.generate`` passes; tok/s =
  output tokens / the median pass. Goal: at least 0.85x of LoRA off.

    python -m benchmarks.bench_moe_lora                    # both parts; ~10 min on one H200
    python -m benchmarks.bench_moe_lora --parts kernel     # ~1 min
    python -m benchmarks.bench_moe_lora --quick            # tiny shapes on CPU, no record

The engine part needs about 61 GB for the weights and 27 GB for the 16 slots (each holds
A and B for all 128 experts of 48 layers): an H200, not an H100.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import (
    command_line,
    gpu_name,
    measure_copy_bandwidth,
    record,
    time_cpu,
    time_cuda_graph,
)
from benchmarks.llama3_8b import module_dims, write_config

#: Qwen3-30B-A3B's config.json fields (transformers' names).
QWEN3_30B_A3B = dict(
    architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048,
    intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
    num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
    num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
    vocab_size=151936, rope_theta=1000000.0, max_position_embeddings=40960,
    rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False,
    torch_dtype="bfloat16", bos_token_id=151643, eos_token_id=151645)
QUICK_MODEL = {**QWEN3_30B_A3B, "hidden_size": 64, "intermediate_size": 96,
               "moe_intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8,
               "num_experts_per_tok": 2, "vocab_size": 512, "max_position_embeddings": 1024,
               "bos_token_id": 1, "eos_token_id": 2}
ADAPTERS, RANK = 16, 16
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
SLOT_MODULES = ATTN + ("experts.gate_proj", "experts.up_proj", "experts.down_proj", "router")
TOKENS, QUICK_TOKENS = (1, 64, 256, 1024), (1, 17)
BATCHES, QUICK_BATCHES = (64, 256), (4,)


# ------------------------------------------------------------------------------ kernel

def _kernel_operands(t: int, cfg: dict, device: torch.device, dtype: torch.dtype):
    from manylora.lora.kernels.fused_moe_lora import MoELoRAWeights

    h, i, e, k = (cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["num_experts"],
                  cfg["num_experts_per_tok"])
    gen = torch.Generator(device).manual_seed(0)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, device=device, generator=gen) * scale).to(dtype)

    x = randn(t, h)
    w13, w2 = randn(e, 2 * i, h, scale=h ** -0.5), randn(e, h, i, scale=i ** -0.5)
    ids = torch.rand(t, e, device=device, generator=gen).topk(k, dim=-1).indices.to(
        torch.int32)
    weights = torch.randn(t, k, device=device, generator=gen).softmax(-1)
    lora = MoELoRAWeights(
        randn(ADAPTERS, e, RANK, h, scale=h ** -0.5), randn(ADAPTERS, e, RANK, i, scale=0.01),
        randn(ADAPTERS, e, RANK, h, scale=h ** -0.5), randn(ADAPTERS, e, RANK, i, scale=0.01),
        randn(ADAPTERS, e, RANK, i, scale=i ** -0.5), randn(ADAPTERS, e, RANK, h, scale=0.01),
        torch.full((ADAPTERS, 3), RANK, dtype=torch.int32, device=device))
    slots = (torch.arange(t, device=device) % ADAPTERS).to(torch.int32)
    return x, w13, w2, weights, ids, slots, lora


def run_kernel(quick: bool, device: torch.device, dtype: torch.dtype,
               bandwidth: float | None) -> tuple[list[str], list[list]]:
    from manylora.lora.kernels.fused_moe_lora import (
        fused_experts_lora,
        fused_experts_lora_triton,
        moe_lora_path,
    )
    from manylora.ops.fused_moe import fused_experts

    cfg = QUICK_MODEL if quick else QWEN3_30B_A3B
    h, i = cfg["hidden_size"], cfg["moe_intermediate_size"]
    elem = torch.finfo(dtype).bits // 8
    rows = []
    for t in QUICK_TOKENS if quick else TOKENS:
        x, w13, w2, weights, ids, slots, lora = _kernel_operands(t, cfg, device, dtype)
        experts_hit = int(ids.unique().numel())
        pairs_hit = int((slots[:, None].long() * cfg["num_experts"] + ids.long()).unique()
                        .numel())
        nbytes = (experts_hit * 3 * h * i + pairs_hit * 3 * RANK * (h + i)) * elem
        chosen = moe_lora_path(ids.numel(), cfg["num_experts"], ADAPTERS)

        def base(x=x, w13=w13, w2=w2, weights=weights, ids=ids):
            return fused_experts(x, w13, w2, weights, ids)

        if quick:
            def with_lora(x=x, w13=w13, w2=w2, weights=weights, ids=ids, slots=slots,
                          lora=lora):
                return fused_experts_lora(x, w13, w2, weights, ids, slots, lora)

            rows.append([t, experts_hit, pairs_hit, f"{nbytes / 2**20:.2f}",
                         f"{time_cpu(base, reps=1) * 1e3:.0f} ms", "-", "-", chosen,
                         f"{time_cpu(with_lora, reps=1) * 1e3:.0f} ms", "-", "-", "-"])
            continue
        lora_ms = {}
        for path in ("pairs", "grouped"):
            def with_lora(x=x, w13=w13, w2=w2, weights=weights, ids=ids, slots=slots,
                          lora=lora, path=path):
                return fused_experts_lora_triton(x, w13, w2, weights, ids, slots, lora,
                                                 path=path)

            lora_ms[path] = time_cuda_graph(with_lora)
        base_ms = time_cuda_graph(base)
        floor_ms = nbytes / bandwidth * 1e3
        best = lora_ms[chosen]
        rows.append([t, experts_hit, pairs_hit, f"{nbytes / 2**20:.1f}", f"{base_ms * 1e3:.1f}",
                     f"{lora_ms['pairs'] * 1e3:.1f}", f"{lora_ms['grouped'] * 1e3:.1f}", chosen,
                     f"{best * 1e3:.1f}", f"{best / base_ms:.2f}", f"{floor_ms * 1e3:.1f}",
                     f"{floor_ms / best:.0%}"])
    columns = ["tokens", "experts hit", "(slot, expert) pairs hit", "MiB read (with LoRA)",
               "base µs", "with LoRA, shrink by pair µs", "with LoRA, shrink grouped µs",
               "path taken",
               "with LoRA µs (path taken)", "LoRA / base", "floor µs (with LoRA)",
               "floor / time"]
    return columns, rows


# ------------------------------------------------------------------------------ engine

def write_moe_peft_adapters(directory: Path, cfg: dict, count: int, rank: int,
                            device: torch.device, dtype: torch.dtype = torch.bfloat16
                            ) -> list[Path]:
    """``count`` random adapters in PEFT's on-disk format for a Qwen3-MoE config: rank
    ``rank`` on q/k/v/o and, through ``target_parameters``, on every layer's stacked
    ``mlp.experts.gate_up_proj`` and ``mlp.experts.down_proj`` (peft's nested
    ``ParamWrapper`` keys: ``experts.base_layer.lora_A`` for gate_up, ``experts.lora_A`` for
    down; A ``[r·E, in]``, B ``[out, r·E]``); lora_alpha = 2 * rank."""
    from safetensors.torch import save_file

    dims = module_dims(cfg)
    h, i, e = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["num_experts"]
    gen = torch.Generator(device).manual_seed(1234)

    def pair(fan_in: int, fan_out: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        a = torch.randn(rows, fan_in, generator=gen, device=device) * fan_in ** -0.5
        b = torch.randn(fan_out, rows, generator=gen, device=device) * 0.01
        return a.to(dtype).cpu(), b.to(dtype).cpu()

    paths = []
    for n in range(count):
        tensors = {}
        for layer in range(cfg["num_hidden_layers"]):
            prefix = f"base_model.model.model.layers.{layer}"
            named = [(f"{prefix}.self_attn.{m}", *dims[m], rank) for m in ATTN]
            named += [(f"{prefix}.mlp.experts.base_layer", h, 2 * i, rank * e),
                      (f"{prefix}.mlp.experts", i, h, rank * e)]
            for key, fan_in, fan_out, rows in named:
                a, b = pair(fan_in, fan_out, rows)
                tensors[f"{key}.lora_A.weight"], tensors[f"{key}.lora_B.weight"] = a, b
        path = directory / f"adapter{n}"
        path.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path / "adapter_model.safetensors"))
        (path / "adapter_config.json").write_text(json.dumps(dict(
            peft_type="LORA", r=rank, lora_alpha=2 * rank, target_modules=list(ATTN),
            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
            bias="none", base_model_name_or_path=None, task_type="CAUSAL_LM")))
        paths.append(path)
    return paths


def run_engine(quick: bool, device: torch.device) -> tuple[list[str], list[list]]:
    from manylora import LLM, LoRARequest, SamplingParams

    cfg = QUICK_MODEL if quick else QWEN3_30B_A3B
    prompt, new = (16, 4) if quick else (128, 64)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_config(Path(tmp) / "model", cfg)
        adapters = write_moe_peft_adapters(Path(tmp), cfg, ADAPTERS, RANK, device)
        print(f"adapters written ({time.perf_counter() - started:.0f} s)", flush=True)
        llm = LLM(str(model_dir), load_format="dummy", skip_tokenizer_init=True,
                  device=device.type, dtype="float32" if quick else "bfloat16",
                  max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=1024,
                  max_loras=ADAPTERS, max_cpu_loras=ADAPTERS, max_lora_rank=RANK,
                  lora_target_modules=list(SLOT_MODULES))
        print(f"engine started ({time.perf_counter() - started:.0f} s)", flush=True)
        loras = [LoRARequest(f"a{n}", n + 1, str(p)) for n, p in enumerate(adapters)]
        params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
        gen = torch.Generator().manual_seed(0)
        rows = []
        for batch in QUICK_BATCHES if quick else BATCHES:
            results = {}
            for label, reqs in (("LoRA off", [None] * batch),
                                ("16 adapters", [loras[n % ADAPTERS] for n in range(batch)])):
                times = []
                for rep in range(1 if quick else 4):       # the first pass warms up
                    prompts = [{"prompt_token_ids": torch.randint(
                        10, cfg["vocab_size"], (prompt,), generator=gen).tolist()}
                        for _ in range(batch)]
                    start = time.perf_counter()
                    outs = llm.generate(prompts, params, lora_request=reqs, use_tqdm=False)
                    elapsed = time.perf_counter() - start
                    if rep or quick:
                        times.append(elapsed)
                tokens = sum(len(o.outputs[0].token_ids) for o in outs)
                results[label] = tokens / statistics.median(times)
            off, on = results["LoRA off"], results["16 adapters"]
            rows.append([batch, f"{off:,.0f}", f"{on:,.0f}", f"{on / off:.2f}",
                         "-" if quick else ("yes" if on / off >= 0.85 else "no")])
            print(f"batch {batch}: {rows[-1]} ({time.perf_counter() - started:.0f} s)",
                  flush=True)
        llm.llm_engine.shutdown()
    columns = ["batch", "LoRA off tok/s", "16 expert + attention adapters tok/s", "ratio",
               "≥ 0.85x"]
    return columns, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", nargs="+", choices=("kernel", "engine"),
                    default=["kernel", "engine"])
    ap.add_argument("--quick", action="store_true",
                    help="tiny shapes on CPU (the kernel through TRITON_INTERPRET=1), no record")
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    if args.quick:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        device, dtype, bandwidth = torch.device("cpu"), torch.float32, None
    elif torch.cuda.is_available():
        device, dtype = torch.device("cuda"), torch.bfloat16
        bandwidth = measure_copy_bandwidth(device)
    else:
        raise SystemExit("needs a CUDA GPU (or --quick)")
    write = not (args.quick or args.no_record)
    shape = "H 2048, I 768, E 128, top-8, rank 16, 16 adapters"
    if "kernel" in args.parts:
        columns, rows = run_kernel(args.quick, device, dtype, bandwidth)
        record(f"Fused MoE with LoRA on the experts vs the base op and its floor, {shape} "
               f"({gpu_name(device)})", command_line("benchmarks.bench_moe_lora"), columns,
               rows, notes="Floor: distinct experts hit × (w13 + w2 bytes) + distinct (slot, "
               "expert) pairs hit × their A and B bytes, over the measured copy bandwidth. "
               "Time: CUDA-graph replay of the whole op, L2 cleared.", write=write,
               device=device)
    if "engine" in args.parts:
        columns, rows = run_engine(args.quick, device)
        record(f"Qwen3-30B-A3B-shaped decode with 16 expert + attention adapters vs LoRA off "
               f"({gpu_name(device)})", command_line("benchmarks.bench_moe_lora"), columns,
               rows, notes="Dummy bf16 weights, prompt 128, 64 new tokens, greedy, "
               "ignore_eos; request i on adapter i % 16; median of 3 passes after a warm-up.",
               write=write, device=device)


if __name__ == "__main__":
    main()
