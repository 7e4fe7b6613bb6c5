"""Where the host time of an ``EngineCore.step`` goes: cProfile over 30 decode steps at
batch 256 (a Llama-3-8B-shaped model, random bf16 weights, prompts of 512 tokens), with the
core in this process. ``tolist`` is the wait for the GPU (the sampled tokens' read-back);
the rest is host work that is serial with the GPU until scheduling is asynchronous.

    python -m benchmarks.profile_core_step            # LoRA disabled
    python -m benchmarks.profile_core_step --lora     # 64 rank-16 q/k/v/o adapters, i % 64

Prints the plain (unprofiled) mean step time, then the profile by cumulative and by
internal time. Needs CUDA.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import random
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.llama3_8b import LLAMA3_8B, write_config, write_peft_adapters

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
BATCH = 256
PROMPT = 512
STEPS = 30


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lora", action="store_true", help="64 adapters, request i on i % 64")
    args = ap.parse_args()
    os.environ["MANYLORA_ENABLE_MULTIPROCESSING"] = "0"     # the core in this process
    from manylora import LLM, LoRARequest, SamplingParams

    tmp = Path(tempfile.mkdtemp())
    model = write_config(tmp / "model", LLAMA3_8B)
    kwargs = dict(load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
                  device="cuda", max_num_seqs=BATCH, max_num_batched_tokens=8192,
                  max_model_len=2048)
    loras = None
    if args.lora:
        dirs = write_peft_adapters(tmp / "adapters", LLAMA3_8B, 64, 16, TARGETS,
                                   torch.device("cuda"), torch.bfloat16)
        loras = [LoRARequest(f"a{k}", k + 1, str(d)) for k, d in enumerate(dirs)]
        kwargs.update(max_loras=64, max_cpu_loras=64, max_lora_rank=16,
                      lora_target_modules=TARGETS)
    else:
        kwargs.update(enable_lora=False)
    llm = LLM(str(model), **kwargs)
    engine = llm.llm_engine
    core = engine.engine_core
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)
    for i in range(BATCH):
        engine.add_request(None, {"prompt_token_ids": [rng.randrange(32000)
                                                       for _ in range(PROMPT)]},
                           params, loras[i % 64] if loras else None)
    with torch.inference_mode():
        sched = core.scheduler
        while sched.num_waiting or any(r.num_computed_tokens < r.num_tokens - 1
                                       for r in sched.running):
            core.step()                                   # prefill until all decode
        for _ in range(5):
            core.step()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(STEPS):
            core.step()
        print(f"plain step ms (mean of {STEPS}): "
              f"{(time.perf_counter() - start) / STEPS * 1e3:.2f}")
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(STEPS):
            core.step()
        profile.disable()
    for key, count in (("cumtime", 45), ("tottime", 30)):
        out = io.StringIO()
        pstats.Stats(profile, stream=out).sort_stats(key).print_stats(count)
        print(out.getvalue())
    engine.shutdown()


if __name__ == "__main__":
    main()
