"""The start-up Triton warm-up (``manylora.worker.warmup``) against the launches of real steps.

CPU: every kernel of ``manylora/ops`` is replaced by a recorder that computes the key Triton
would compile it under (constexprs, launch options, argument dtypes, and for the arguments
Triton specializes, whether an int is 1 / a multiple of 16 and whether a pointer is 16-byte
aligned), and launches nothing. The model's forward pass, forced onto the Triton entry
points, then runs random steps (decode, prefill over cached prefixes, mixed, CUDA-graph
padded batches; LoRA off, BGMV, SGMV; DoRA flags) on a model with LoRA slots and its KV
caches (llama, an int8 KV cache, mistral's window, qwen2's biases, gemma 2's soft cap over
sliding and global layers, gemma 3's per-head q/k norms, qwen2-moe's experts with adapter
slots, its router and shared expert): every key those steps produce must be among the keys
the warm-up produces.

GPU: an engine with LoRA (DoRA and plain adapters) and prefix caching serves a mixed
workload after start-up, and Triton compiles nothing during it.
"""

from __future__ import annotations

import inspect
import random

import pytest
import torch

from manylora import LLM, LoRARequest, SamplingParams
from manylora.config import LORA_ALL_MODULES, LORA_TARGET_MODULES, LoRAConfig, ModelConfig
from manylora.lora import slots as lora_slots
from manylora.lora.kernels import (
    fused_moe_lora,
    fused_moe_lora_kernels,
    moe_lora_fused,
    moe_lora_pairs,
    triton_lora,
)
from manylora.lora.kernels import plans as lora_plans
from manylora.lora.kernels import sgmv_kernels as lora_kernels
from manylora.lora.kernels import tiled_kernels as lora_tiled_kernels
from manylora.lora.kernels import tiled_plans as lora_tiled_plans
from manylora.lora.kernels.meta import build_lora_kernel_meta
from manylora.lora.kernels.row_tiles import max_row_tiles
from manylora.model import llama
from manylora.model.layers import moe
from manylora.model.layers.norm import GemmaRMSNorm, RMSNorm
from manylora.model.layers.rotary import RotaryEmbedding
from manylora.model.loader import load_hf_config, load_model
from manylora.ops import triton_attention, triton_fused, triton_fused_moe
from manylora.ops.attention_metadata import build_attention_metadata
from manylora.testing import MOE_FAMILIES, MOE_TINY, make_checkpoint, make_peft_adapter
from manylora.worker.kv_cache import allocate_kv_caches
from manylora.worker.warmup import TritonCompileLog, launch_every_specialization

KERNEL_MODULES = (lora_kernels, lora_tiled_kernels, triton_attention, triton_fused,
                  triton_fused_moe, fused_moe_lora_kernels, moe_lora_fused, moe_lora_pairs)
BLOCK_SIZE = 4
MAX_TOKENS = 40          # max_num_batched_tokens
MAX_SEQS = 8
MAX_LORAS = 3
NUM_BLOCKS = 64


def _is_constexpr(param: inspect.Parameter) -> bool:
    return "constexpr" in str(param.annotation)


def _do_not_specialize(kernel) -> set[str]:
    names = getattr(kernel, "do_not_specialize", None)      # JITFunction
    if names is None:                                       # the interpreter's function
        names = getattr(kernel, "kwargs", {}).get("do_not_specialize")
    return set(names or ())


def specialization_key(kernel, args: tuple, kwargs: dict) -> tuple:
    """What Triton compiles a launch of ``kernel`` under: its constexprs and launch options,
    the dtype of each tensor and the type of each scalar, and for the arguments not in
    ``do_not_specialize``, ints equal to 1 or divisible by 16 and 16-byte aligned pointers."""
    params = list(inspect.signature(kernel.fn).parameters.values())
    bound = dict(zip((p.name for p in params), args))
    names = {p.name for p in params}
    bound.update({k: v for k, v in kwargs.items() if k in names})
    dns = _do_not_specialize(kernel)
    parts = []
    for p in params:
        value = bound.get(p.name, p.default)
        if _is_constexpr(p):
            parts.append((p.name, value))
        elif isinstance(value, torch.Tensor):
            aligned = None if p.name in dns else value.data_ptr() % 16 == 0
            parts.append((p.name, str(value.dtype), aligned))
        elif isinstance(value, bool) or value is None:
            parts.append((p.name, value))
        elif isinstance(value, int):
            kind = "i64" if not -2**31 <= value < 2**31 else "i32"
            spec = None if p.name in dns else (value == 1, value % 16 == 0)
            parts.append((p.name, kind, spec))
        else:
            parts.append((p.name, type(value).__name__))
    options = tuple(sorted((k, v) for k, v in kwargs.items() if k not in names))
    return kernel.fn.__name__, tuple(parts), options


class _Recorder:
    """Stands in for a kernel: ``kernel[grid](...)`` records the launch's key, runs nothing."""

    def __init__(self, kernel, keys: set) -> None:
        self.kernel, self.keys = kernel, keys

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.keys.add(specialization_key(self.kernel, args, kwargs))
        return launch


def _record_kernels(monkeypatch) -> set:
    keys: set = set()
    for module in KERNEL_MODULES:
        for name, obj in list(vars(module).items()):
            if name.endswith("_kernel") and hasattr(obj, "fn"):
                monkeypatch.setattr(module, name, _Recorder(obj, keys))
    return keys


def _force_triton(monkeypatch) -> None:
    """Route the model's forward pass through the Triton entry points (on CPU it takes the
    PyTorch references)."""
    monkeypatch.setattr(lora_slots, "lora_shrink", triton_lora.lora_shrink_triton)
    monkeypatch.setattr(lora_slots, "lora_expand", triton_lora.lora_expand_triton)
    monkeypatch.setattr(llama, "write_kv", triton_attention.write_kv_triton)
    monkeypatch.setattr(llama, "paged_attention", triton_attention.paged_attention_triton)
    monkeypatch.setattr(llama, "silu_and_mul", triton_fused.silu_and_mul_triton)
    monkeypatch.setattr(moe, "fused_experts", triton_fused_moe.fused_experts_triton)
    monkeypatch.setattr(moe, "fused_experts_lora", fused_moe_lora.fused_experts_lora_triton)

    def norm(self, x, residual=None):
        if residual is None:
            return triton_fused.rms_norm_triton(x, self.weight, self.eps)
        return triton_fused.fused_add_rms_norm_triton(x, residual, self.weight, self.eps)

    monkeypatch.setattr(RMSNorm, "forward", norm)

    def gemma_norm(self, x, residual=None):
        if residual is None:
            return triton_fused.rms_norm_triton(x, self.weight, self.eps, unit_offset=True)
        return triton_fused.fused_add_rms_norm_triton(x, residual, self.weight, self.eps,
                                                      unit_offset=True)

    monkeypatch.setattr(GemmaRMSNorm, "forward", gemma_norm)
    monkeypatch.setattr(RotaryEmbedding, "forward", lambda self, positions, q, k:
                        triton_fused.rotary_embedding_triton(positions, q, k, self.cos,
                                                             self.sin))


def _random_step(rng: random.Random, model, max_blocks: int):
    """One step's model inputs: eager (decode, prefill, chunks over cached prefixes, mixed)
    or a CUDA-graph padded decode batch; LoRA off, or rows over random slots with the
    default, SGMV, BGMV or tiled variant (graphs: BGMV or tiled, as the engine captures)."""
    dev = DEVICE
    graph = rng.random() < 0.3
    budget = MAX_TOKENS
    q_lens, c_lens = [], []
    for _ in range(rng.randint(1, MAX_SEQS)):
        q = 1 if graph or rng.random() < 0.5 else rng.randint(2, max(2, min(24, budget)))
        if q > budget:
            break
        budget -= q
        q_lens.append(q)
        c_lens.append(q + rng.choice([0, 0, rng.randint(1, max_blocks * BLOCK_SIZE - q)]))
    tables = [[rng.randrange(NUM_BLOCKS) for _ in range(-(-c // BLOCK_SIZE))] for c in c_lens]
    pad = min(s for s in (1, 2, 4, 8) if s >= len(q_lens)) if graph else None
    group = model.cfg.num_heads // model.cfg.num_kv_heads
    attn = build_attention_metadata(q_lens, c_lens, tables, BLOCK_SIZE, group, dev, pad_to=pad,
                                    max_blocks_per_seq=max_blocks if graph else None)
    rows = sum(q_lens) if pad is None else pad
    seq_slots = [rng.randrange(-1, MAX_LORAS) for _ in q_lens]
    token_slots = [s for s, q in zip(seq_slots, q_lens) for _ in range(q)]
    lora = None
    if rng.random() < 0.8 and (graph or any(s >= 0 for s in token_slots)):
        variant = rng.choice(["tiled", "bgmv"] if graph else [None, "sgmv", "bgmv", "tiled"])
        lora = build_lora_kernel_meta(token_slots, MAX_LORAS, dev, pad_to=pad, variant=variant)
    ids = torch.tensor([rng.randrange(100) for _ in range(rows)], dtype=torch.int64,
                       device=dev)
    positions = torch.tensor([c - q + j for q, c in zip(q_lens, c_lens) for j in range(q)]
                             + [0] * (rows - sum(q_lens)), dtype=torch.int64, device=dev)
    return ids, positions, attn, lora


#: The Triton kernels run on the GPU where there is one, else through Triton's interpreter
#: on CPU tensors (conftest sets TRITON_INTERPRET only without CUDA).
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

MODELS = {
    "llama": ({}, "auto"),
    "llama-int8-kv": ({}, "int8"),
    "mistral-window": (dict(arch="mistral", sliding_window=6), "auto"),
    "qwen2-bias": (dict(arch="qwen2"), "auto"),
    "qwen3-qk-norm": (dict(arch="qwen3", head_dim=24), "auto"),
    "gemma2-softcap-windows": (dict(arch="gemma2", head_dim=16, sliding_window=6,
                                    attn_logit_softcapping=5.0), "auto"),
    "gemma3-qk-norm": (dict(arch="gemma3", head_dim=16, sliding_window=6,
                            layer_types=["sliding_attention", "full_attention"]), "auto"),
    # 4 experts, top-2: up to 20 rows per expert in a step, two of the fused MoE configs
    "qwen2-moe-experts": (dict(arch="qwen2_moe", **MOE_TINY, **MOE_FAMILIES["qwen2_moe"]),
                          "auto"),
}


@pytest.fixture(scope="module", params=list(MODELS))
def model_and_caches(request, tmp_path_factory):
    """A model with LoRA slots (every projection targeted; the plain Llama also its
    ``embed_tokens`` and ``lm_head``, and Gemma 2, whose embedding and logits wrap them)
    and its KV caches, on ``DEVICE``."""
    checkpoint_kwargs, kv_cache_dtype = MODELS[request.param]
    base = make_checkpoint(tmp_path_factory.mktemp(request.param), **checkpoint_kwargs)
    cfg = ModelConfig.from_hf(load_hf_config(base), torch.float32)
    model = load_model(base, cfg, DEVICE)
    vocab = request.param in ("llama", "gemma2-softcap-windows")
    every = vocab or request.param == "qwen2-moe-experts"     # the MoE block's modules too
    targets = LORA_ALL_MODULES if every else LORA_TARGET_MODULES
    model.create_lora_slots(LoRAConfig(MAX_LORAS, 16, target_modules=targets))
    kv_caches = allocate_kv_caches(model.cfg, NUM_BLOCKS, BLOCK_SIZE, DEVICE,
                                   kv_cache_dtype)
    return model, kv_caches


def test_warm_up_covers_every_launch_of_real_steps(model_and_caches, monkeypatch):
    model, kv_caches = model_and_caches
    keys = _record_kernels(monkeypatch)
    _force_triton(monkeypatch)
    max_blocks = -(-model.cfg.max_model_len // BLOCK_SIZE)
    with torch.inference_mode():
        launches = launch_every_specialization(model, kv_caches, BLOCK_SIZE, MAX_TOKENS,
                                               MAX_SEQS, max_blocks)
        warmed = set(keys)
        keys.clear()
        rng = random.Random(0)
        for _ in range(100):
            ids, positions, attn, lora = _random_step(rng, model, max_blocks)
            hidden = model(ids, positions, kv_caches, attn, lora)
            if lora is not None and model.head_lora is not None:     # the sampled rows
                rows = rng.sample(range(len(ids)), rng.randrange(1, min(len(ids), MAX_SEQS) + 1))
                model.compute_logits(hidden[rows], build_lora_kernel_meta(
                    [rng.randrange(-1, MAX_LORAS) for _ in rows], MAX_LORAS, hidden.device))
    stepped = set(keys)
    assert launches >= len(warmed) > 0
    kernels = {k[0] for k in stepped}
    assert {"_paged_attention_kernel", "bgmv_expand_kernel", "sgmv_shrink_kernel",
            "tiled_shrink_kernel", "tiled_expand_kernel",
            "_rms_norm_kernel", "_rotary_kernel", "_write_kv_kernel"} <= kernels
    if any(isinstance(m, moe.FusedMoE) for m in model.modules()):
        assert {"_fused_moe_kernel", "moe_lora_shrink_kernel", "moe_lora_pair_shrink_kernel",
                "moe_lora_gemm_kernel", "moe_lora_act_kernel"} <= kernels
    missing = stepped - warmed
    assert not missing, "launched by steps, not by the warm-up:\n" + "\n".join(
        map(str, sorted(missing, key=str)))


def test_lora_row_cases_cover_every_plan():
    """The reduced row counts of ``lora_row_cases`` give the same launches as every
    (rows, longest segment) pair, for projections of several shapes."""
    def plans(cases, k, slices, max_n, rank):
        out = set()
        for variant, n, s in cases:
            sp = lora_plans.shrink_plan(variant, n, s, 4, k, rank, slices, 2)
            ep = lora_plans.expand_plan(variant, n, s, 4, max_n, rank, slices, True, False)
            out.add((sp.kernel, tuple(sp.constexprs.items()), ep.kernel,
                     tuple(ep.constexprs.items())))
        return out

    max_rows = 160
    every = [("bgmv", n, n) for n in range(1, max_rows + 1)] + [
        ("sgmv", n, s) for n in range(1, max_rows + 1) for s in range(1, n + 1)]
    for k, slices, max_n, rank in ((4096, 3, 4096, 16), (64, 1, 64, 8), (200, 2, 500, 64),
                                   (14336, 1, 4096, 128)):
        want = plans(every, k, slices, max_n, rank)
        assert plans(lora_plans.lora_row_cases(max_rows), k, slices, max_n, rank) == want


def test_tiled_row_cases_cover_every_plan():
    """``tiled_row_cases`` gives the same tiled launches as every tile count a step of up to
    ``max_rows`` rows can have, for projections of several shapes."""
    def plans(cases, k, slices, max_n, rank):
        return {(repr(lora_tiled_plans.tiled_shrink_plan(n, bm, k, rank, slices, 2)),
                 repr(lora_tiled_plans.tiled_expand_plan(n, bm, max_n, rank, slices, True,
                                                         False)))
                for n, bm in cases}

    max_rows, max_loras = 1100, 64
    every = [(n, bm) for bm in lora_tiled_plans.TILE_BLOCK_MS
             for n in range(1, max_row_tiles(max_rows, max_loras, bm) + 1)]
    for k, slices, max_n, rank in ((4096, 3, 4096, 16), (64, 1, 64, 8), (14336, 1, 4096, 128)):
        want = plans(every, k, slices, max_n, rank)
        got = plans(lora_tiled_plans.tiled_row_cases(max_rows, max_loras), k, slices, max_n,
                    rank)
        assert got == want


@pytest.mark.parametrize("num_kv_heads, max_blocks, window", [
    (8, 300, None), (1, 200, None), (2, 300, 700), (4, 40, 30)])
def test_decode_split_choices_are_every_split_the_heuristic_picks(monkeypatch, num_kv_heads,
                                                                  max_blocks, window):
    """Against ``paged_attention_triton``'s heuristic at every (decode sequences, table
    width) a step can have, on a 132-SM GPU."""
    monkeypatch.setattr(triton_attention, "_sm_count", lambda device: 132)
    group, head_dim, dtype, max_seqs = 4, 128, torch.bfloat16, 64
    block_n = triton_attention.tile_config(triton_attention.decode_block_m(group), head_dim,
                                           dtype)["BLOCK_N"]
    every = {triton_attention.decode_splits(
                 n, num_kv_heads,
                 triton_attention.decode_max_keys(w, BLOCK_SIZE, window, block_n), block_n,
                 torch.device("cpu"))
             for n in range(1, max_seqs + 1) for w in range(1, max_blocks + 1)}
    assert triton_attention.decode_split_choices(
        group, num_kv_heads, head_dim, dtype, BLOCK_SIZE, max_blocks, max_seqs, window,
        torch.device("cpu")) == sorted(every)


def test_compile_log_chains_and_restores_the_jit_hook(monkeypatch):
    """Inside the log, Triton's JIT cache hook records each specialization and still calls
    the hook that was installed before (letting compilation proceed); on exit the previous
    hook is back."""
    log = TritonCompileLog()
    owner, attr = log._owner, log._attr
    seen = []
    monkeypatch.setattr(owner, attr, lambda **kw: seen.append(kw["repr"]))
    previous = getattr(owner, attr)
    with log:
        assert not getattr(owner, attr)(key="k", repr="_kernel[num_warps=4](x: *fp32)",
                                        fn=None, compile={}, is_manual_warmup=False,
                                        already_compiled=False)
    assert log.compiled == ["_kernel[num_warps=4](x: *fp32)"] and seen == log.compiled
    assert getattr(owner, attr) is previous


# ---------------------------------------------------------------------------------------------
# GPU: nothing compiles after start-up


def _cached_specializations() -> int | None:
    """Kernels in the in-memory caches of our JIT functions (None where Triton keeps them
    elsewhere)."""
    total = 0
    for module in KERNEL_MODULES:
        for name, obj in vars(module).items():
            caches = getattr(obj, "device_caches", None)
            if not name.endswith("_kernel") or caches is None:
                continue
            total += sum(len(c[0]) for c in caches.values())
    return total


@pytest.mark.gpu
def test_no_triton_compilation_after_start_up(tmp_path):
    """A mixed workload after start-up compiles no Triton kernel: prefill with and without
    prefix-cache hits, chunked prefill, decode in graphs and in eager mixed steps, 0-3
    adapters per batch (DoRA and plain), logprobs, seeded sampling."""
    base = make_checkpoint(tmp_path / "base", max_position_embeddings=1024)
    all_modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                   "down_proj"]
    specs = {"dora": dict(r=8, target_modules=all_modules, use_dora=True, seed=1),
             "plain": dict(r=16, target_modules=["q_proj", "v_proj"], seed=2),
             "plain_all": dict(r=4, target_modules=all_modules, seed=3)}
    loras = [LoRARequest(name, i + 1, str(make_peft_adapter(base, tmp_path / name, **spec)))
             for i, (name, spec) in enumerate(specs.items())]
    llm = LLM(str(base), device="cuda", dtype="bfloat16", max_loras=4, max_lora_rank=16,
              enable_prefix_caching=True, max_num_batched_tokens=64, max_num_seqs=16,
              block_size=16, num_kv_blocks=512)
    rng = random.Random(0)
    shared = [rng.randrange(100) for _ in range(96)]
    cached_before = _cached_specializations()
    with TritonCompileLog() as log:
        for round_ in range(4):
            n = 3 + 4 * round_
            prompts = [{"prompt_token_ids": shared[:rng.choice([0, 16, 48, 96])]
                        + [rng.randrange(100) for _ in range(rng.randint(1, 150))]}
                       for _ in range(n)]
            adapters = [None, *loras[:round_]]
            params = [SamplingParams(temperature=rng.choice([0.0, 0.8]), seed=i,
                                     logprobs=rng.choice([None, 2]), ignore_eos=True,
                                     max_tokens=rng.randint(1, 40)) for i in range(n)]
            outs = llm.generate(prompts, params, [adapters[i % len(adapters)] for i in range(n)],
                                use_tqdm=False)
            assert all(len(o.outputs[0].token_ids) == p.max_tokens
                       for o, p in zip(outs, params))
    assert log.compiled == [], "compiled after start-up:\n" + "\n".join(log.compiled)
    if cached_before is not None:
        assert _cached_specializations() == cached_before
