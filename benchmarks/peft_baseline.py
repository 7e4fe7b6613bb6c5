"""The transformers + peft baseline of the end-to-end benchmark: mixed-adapter greedy generate.

A Llama-3-8B-shaped ``LlamaForCausalLM`` with random bf16 weights (built directly on the GPU,
normal(0, 0.02) as transformers initialises it; no checkpoint) is wrapped in peft with
``num_adapters`` distinct LoRA adapters (``r = rank``, ``lora_alpha = 2 * rank``, random
non-zero A and B, kept in the model dtype), and ``generate`` runs greedily over ``batch``
random prompts of ``prompt_len`` tokens, row ``i`` using adapter ``a{i % num_adapters}``
(peft's mixed-batch inference, ``adapter_names=...``), for exactly ``new_tokens`` new tokens
(``min_new_tokens = max_new_tokens``). The timed span is one whole ``generate`` call: the
prefill of every prompt and ``new_tokens`` decode steps, dynamic KV cache (transformers'
default), after a warmup ``generate`` of 2 tokens.

    python -m benchmarks.peft_baseline --adapters 64         # prints a JSON dict
    python -m benchmarks.peft_baseline --base-only           # plain transformers, no peft
    python -m benchmarks.peft_baseline --adapters 2 --device cpu --dtype float32 \\
        --batch 4 --prompt-len 8 --new-tokens 4 --config '{"hidden_size": 64, ...}'
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from collections.abc import Sequence
from typing import Any

import torch

#: Llama-3-8B's shape (transformers' LlamaConfig keyword names).
LLAMA3_8B_CONFIG: dict[str, Any] = dict(
    hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
    max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=False,
    bos_token_id=128000, eos_token_id=128001)

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def llama_config(overrides: dict[str, Any] | None = None) -> Any:
    """A ``LlamaConfig`` of Llama-3-8B's shape, with ``overrides`` (LlamaConfig kwargs) applied.

    ``rope_theta`` goes where this transformers wants it: inside ``rope_parameters`` on 5.x,
    a top-level field on 4.x. A smaller ``vocab_size`` without its own BOS/EOS ids gets the
    last two ids of the vocabulary as BOS and EOS.
    """
    import transformers
    from transformers import LlamaConfig

    overrides = dict(overrides or {})
    kwargs = dict(LLAMA3_8B_CONFIG, **overrides)
    vocab = int(kwargs["vocab_size"])
    if kwargs["eos_token_id"] >= vocab and "eos_token_id" not in overrides:
        kwargs["eos_token_id"] = vocab - 1
    if kwargs["bos_token_id"] >= vocab and "bos_token_id" not in overrides:
        kwargs["bos_token_id"] = vocab - 2
    theta = float(kwargs.pop("rope_theta"))
    if int(transformers.__version__.split(".")[0]) >= 5:
        kwargs.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": theta})
    else:
        kwargs["rope_theta"] = theta
    return LlamaConfig(**kwargs)


def _rope_theta(config: Any) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(config, "rope_theta", float("nan"))))


def build_base_model(config: Any, device: torch.device, dtype: torch.dtype,
                     seed: int) -> Any:
    """``LlamaForCausalLM(config)`` allocated and initialised directly on ``device`` in ``dtype``.

    The default device and dtype are set while the model is constructed, so the weights are
    never materialised on the CPU (for an 8B model on CUDA this takes seconds, not minutes).
    Then every weight is drawn again from a generator seeded with ``seed``, on ``device``:
    normal(0, 0.02), RMSNorm weights 1 (as transformers initialises Llama), so the weights
    do not depend on the transformers version's init code.
    """
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    model.eval()
    model.requires_grad_(False)
    gen = torch.Generator(device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.device.type == "meta":
                raise RuntimeError(f"{name} was not materialised on {device}")
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=gen)
    return model


def add_lora_adapters(model: Any, num_adapters: int, rank: int, targets: Sequence[str],
                      device: torch.device, dtype: torch.dtype, seed: int) -> Any:
    """Wrap ``model`` in peft with ``num_adapters`` distinct random LoRA adapters ``a0, a1, ...``.

    ``get_peft_model(adapter_name="a0")`` then ``add_adapter(f"a{i}")``, ``LoraConfig(r=rank,
    lora_alpha=2 * rank, target_modules=targets)``. peft initialises B to zero; every B is
    overwritten with normal(0, 0.01) so each adapter changes the output. A keeps peft's
    Kaiming-uniform init. Adapter weights stay in ``dtype`` (``autocast_adapter_dtype=False``;
    peft's default would upcast bf16 adapters to float32).
    """
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import LoraLayer

    lora_config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(targets),
                             lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
    with torch.device(device):
        peft_model = get_peft_model(model, lora_config, adapter_name="a0",
                                    autocast_adapter_dtype=False)
        for i in range(1, num_adapters):
            peft_model.add_adapter(f"a{i}", lora_config, autocast_adapter_dtype=False)
    gen = torch.Generator(device).manual_seed(seed + 1)
    with torch.no_grad():
        for module in peft_model.modules():
            if not isinstance(module, LoraLayer):
                continue
            for linear in module.lora_A.values():
                linear.weight.data = linear.weight.data.to(device=device, dtype=dtype)
            for linear in module.lora_B.values():
                shape = linear.weight.shape
                linear.weight.data = (torch.randn(shape, generator=gen, device=device)
                                      * 0.01).to(dtype)
    peft_model.eval()
    if len(peft_model.peft_config) != num_adapters:
        raise RuntimeError(f"peft holds {len(peft_model.peft_config)} adapters, "
                           f"expected {num_adapters}")
    return peft_model


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed_generate(model: Any, device: torch.device, kwargs: dict[str, Any],
                    new_tokens: int) -> tuple[torch.Tensor, float]:
    """One ``generate`` call; returns the output ids and its wall time in s (synchronised)."""
    kwargs = dict(kwargs, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    _sync(device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(**kwargs)
    _sync(device)
    return out, time.perf_counter() - t0


def _generate_benchmark(model: Any, config: Any, device: torch.device, batch: int,
                        prompt_len: int, new_tokens: int, seed: int,
                        extra: dict[str, Any]) -> dict[str, Any]:
    """Warm up, then time one greedy ``generate`` of ``new_tokens`` for ``batch`` prompts."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.vocab_size, (batch, prompt_len), generator=gen).to(device)
    kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                  num_beams=1, pad_token_id=config.eos_token_id, **extra)
    _timed_generate(model, device, kwargs, min(2, new_tokens))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    out, seconds = _timed_generate(model, device, kwargs, new_tokens)
    if tuple(out.shape) != (batch, prompt_len + new_tokens):
        raise RuntimeError(f"generate returned {tuple(out.shape)}, expected "
                           f"{(batch, prompt_len + new_tokens)}")
    return dict(tokens_per_s=batch * new_tokens / seconds, seconds=seconds, batch=batch,
                prompt_len=prompt_len, new_tokens=new_tokens,
                peak_memory_gib=(torch.cuda.max_memory_allocated(device) / 2 ** 30
                                 if device.type == "cuda" else None))


def _environment(config: Any, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    import peft
    import transformers

    return dict(
        device=(torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"),
        dtype=str(dtype).removeprefix("torch."),
        model=dict(hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
                   num_hidden_layers=config.num_hidden_layers,
                   num_attention_heads=config.num_attention_heads,
                   num_key_value_heads=config.num_key_value_heads,
                   vocab_size=config.vocab_size, rope_theta=_rope_theta(config)),
        attn_implementation=getattr(config, "_attn_implementation", None),
        torch=torch.__version__, transformers=transformers.__version__,
        peft=peft.__version__)


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_peft_baseline(num_adapters: int, batch: int = 64, prompt_len: int = 128,
                      new_tokens: int = 64, rank: int = 16,
                      targets: Sequence[str] = DEFAULT_TARGETS, seed: int = 0,
                      device: str | torch.device = "cuda", dtype: torch.dtype = torch.bfloat16,
                      config: dict[str, Any] | None = None) -> dict[str, Any]:
    """Time transformers + peft mixed-adapter greedy generation (see the module docstring).

    Args:
        num_adapters: distinct LoRA adapters loaded; row ``i`` uses ``a{i % num_adapters}``.
        batch: prompts in the one ``generate`` call.
        prompt_len: tokens per prompt (random ids, all the same length, no padding).
        new_tokens: tokens generated per prompt, exactly.
        rank: LoRA rank (``lora_alpha = 2 * rank``).
        targets: peft ``target_modules``.
        seed: seeds the weights, the adapters and the prompts.
        device, dtype: where and in what the model and adapters live.
        config: ``LlamaConfig`` keyword overrides of the Llama-3-8B shape (tests shrink it).

    Returns:
        ``tokens_per_s`` (batch * new_tokens / seconds, generated tokens per second, prefill
        included in the time), ``seconds`` (wall time of the generate call), ``batch``,
        ``prompt_len``, ``new_tokens``, ``num_adapters``, ``rank``, ``targets``,
        ``peak_memory_gib`` (CUDA), the device, dtype, model shape and the torch,
        transformers and peft versions.
    """
    if num_adapters < 1:
        raise ValueError("num_adapters must be >= 1 (use run_base_baseline for no adapters)")
    dev = torch.device(device)
    cfg = llama_config(config)
    model = add_lora_adapters(build_base_model(cfg, dev, dtype, seed), num_adapters, rank,
                              targets, dev, dtype, seed)
    names = [f"a{i % num_adapters}" for i in range(batch)]
    result = _generate_benchmark(model, cfg, dev, batch, prompt_len, new_tokens, seed,
                                 dict(adapter_names=names))
    del model
    _release(dev)
    return dict(mode="peft", **result, num_adapters=num_adapters,
                distinct_adapters_in_batch=len(set(names)), rank=rank, targets=list(targets),
                adapter_dtype=str(dtype).removeprefix("torch."),
                **_environment(cfg, dev, dtype))


def run_base_baseline(batch: int = 64, prompt_len: int = 128, new_tokens: int = 64,
                      seed: int = 0, device: str | torch.device = "cuda",
                      dtype: torch.dtype = torch.bfloat16,
                      config: dict[str, Any] | None = None) -> dict[str, Any]:
    """The same generate on the same model without peft or adapters (plain transformers).

    Arguments and result as :func:`run_peft_baseline`, with ``num_adapters = 0``.
    """
    dev = torch.device(device)
    cfg = llama_config(config)
    model = build_base_model(cfg, dev, dtype, seed)
    result = _generate_benchmark(model, cfg, dev, batch, prompt_len, new_tokens, seed, {})
    del model
    _release(dev)
    return dict(mode="base", **result, num_adapters=0, **_environment(cfg, dev, dtype))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--adapters", type=int, help="distinct LoRA adapters (required with peft)")
    ap.add_argument("--base-only", action="store_true",
                    help="plain transformers generate on the same model, no peft, no adapters")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--targets", default=",".join(DEFAULT_TARGETS),
                    help="comma-separated peft target_modules")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    ap.add_argument("--config", type=json.loads, default=None,
                    help="JSON dict of LlamaConfig overrides, e.g. a tiny model for a smoke run")
    args = ap.parse_args(argv)
    if not args.base_only and args.adapters is None:
        ap.error("--adapters N is required unless --base-only")
    if args.base_only and args.adapters:
        ap.error("--base-only runs without adapters; drop --adapters")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    common = dict(batch=args.batch, prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                  seed=args.seed, device=args.device, dtype=DTYPES[args.dtype],
                  config=args.config)
    if args.base_only:
        result = run_base_baseline(**common)
    else:
        targets = tuple(t.strip() for t in args.targets.split(",") if t.strip())
        result = run_peft_baseline(args.adapters, rank=args.rank, targets=targets, **common)
    print(json.dumps(result, indent=2), flush=True)


if __name__ == "__main__":
    main()
