"""Start-up compilation of every Triton kernel specialization the engine can launch.

Triton compiles a kernel the first time it sees a new *specialization*: a new value of a
``tl.constexpr`` argument, a new dtype, or a run-time int or pointer argument that turns 1,
a multiple of 16 or 16-byte aligned where it was not. Compiling takes seconds, so a
specialization first met inside a request stalls every request of that step. vLLM and
SGLang compile (or capture) at start-up for the same reason; this module does it for
manylora's kernels.

What selects a specialization, kernel by kernel (``manylora/ops``):

* LoRA (``triton_lora``): per projection, the slot buffers' rank and slice count (``R``,
  ``NUM_SLICES``) and dtype, whether the projection has a bias to shift DoRA rows by
  (``HAS_SHIFT``; ``HAS_DORA`` is always on in the engine; ranks and DoRA flags are the
  slot table's data, and the table views' offsets and strides are not specialized); per step,
  the variant (SGMV/BGMV kernels) and the block sizes ``shrink_plan`` / ``expand_plan``
  pick from the row count and the longest SGMV segment (``BLOCK_M``, ``BLOCK_N``,
  ``BLOCK_K``, split-K's ``ATOMIC``).
* Tiled LoRA (``lora_tiled_kernels``): per projection as above, plus the bias (``HAS_BIAS``);
  per step, the tile height ``BLOCK_M`` and what ``tiled_shrink_plan`` /
  ``tiled_expand_plan`` pick from the tile count (``tiled_row_cases``).
* Attention (``triton_attention``): the model's G, head_dim, block_size, KV-cache dtype
  (``QUANT``), each layer's window (``USE_WINDOW``) and soft cap (``SOFTCAP``); per step,
  decode tiles vs prefill tiles (``BLOCK_Q``, ``BLOCK_M`` and the tile config) and the
  decode launch's ``NUM_SPLITS`` (with the combine kernel), which ``decode_split_choices``
  enumerates.
* Fused elementwise (``triton_fused``): RMSNorm with and without the residual, Llama's and
  Gemma's (``UNIT_OFFSET``); SiLU-and-mul
  and RoPE have one specialization per model.
* Fused MoE (``triton_fused_moe``) and its LoRA launches (``lora.kernels.fused_moe_lora``):
  per MoE block shape and dtype, and the expert slots' rank; per step, the config the rows
  per expert pick and whether the pair count is 1 or a multiple of 16 (``moe_token_cases``),
  launched through ``FusedMoE.warm_up``.
* Skinny projections (``triton_skinny``): per row bucket (``BLOCK_M``) and weight shape,
  the measured launch constants, and whether the projection has a bias; the row count is
  not specialized.

Everything else that used to vary per step (the metadata tensors' alignment, the table
width, ``N_TILES``, ``num_tiles``, the rotary positions) is ``do_not_specialize``. The
warm-up launches each remaining combination once, through the same entry points the model
calls, on the engine's own slot buffers and KV caches: LoRA mappings whose slots all have
rank 0 (the kernels read nothing and return), KV writes to slot -1 (nothing written),
attention whose output is discarded. No collective is involved, so it runs on any
tensor-parallel rank on its own.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import NamedTuple

import torch
import triton

from manylora.lora.kernels import plans as lora_plans
from manylora.lora.kernels import tiled_plans as lora_tiled_plans
from manylora.lora.kernels import triton_lora
from manylora.lora.kernels.meta import LoRAKernelMeta, build_lora_kernel_meta
from manylora.lora.linear import LoRALinear
from manylora.lora.slots import LoRASlots
from manylora.model.layers.moe import FusedMoE
from manylora.model.layers.norm import RMSNorm
from manylora.model.llama import LlamaForCausalLM
from manylora.ops import triton_attention, triton_fused, triton_skinny
from manylora.ops.attention_metadata import build_attention_metadata
from manylora.ops.linear_method import UnquantizedLinearMethod
from manylora.ops.paged_kv import KVCache
from manylora.ops.triton_fused_moe import moe_token_cases

logger = logging.getLogger(__name__)

# Rows of the synthetic tensors of the shape-independent launches (fused ops, attention).
_ROWS = 2


class TritonCompileLog:
    """Context manager recording every kernel specialization Triton compiles (or loads from
    its on-disk cache) into the process's in-memory kernel cache while it is active.

    Installs Triton's JIT cache hook (``triton.knobs.runtime.jit_cache_hook`` from Triton
    3.4, ``JITFunction.cache_hook`` before), chained to any hook already set; the hook runs
    before each compilation and lets it proceed. Under ``TRITON_INTERPRET=1`` nothing is
    compiled and the log stays empty.

    Attributes:
        compiled: one description per specialization (the kernel's name with its argument
            types, constants and launch options, as Triton's hook gives it), in order.
    """

    def __init__(self) -> None:
        self.compiled: list[str] = []
        knobs = getattr(triton, "knobs", None)
        if knobs is not None and hasattr(knobs.runtime, "jit_cache_hook"):
            self._owner, self._attr = knobs.runtime, "jit_cache_hook"
        else:
            self._owner, self._attr = triton.runtime.jit.JITFunction, "cache_hook"
        self._previous = None

    def __enter__(self) -> TritonCompileLog:
        self._previous = previous = getattr(self._owner, self._attr)

        def hook(*args, **kwargs):
            self.compiled.append(str(kwargs.get("repr") or kwargs.get("key")))
            return previous(*args, **kwargs) if previous is not None else False

        setattr(self._owner, self._attr, hook)
        return self

    def __exit__(self, *exc) -> None:
        setattr(self._owner, self._attr, self._previous)


class WarmupReport(NamedTuple):
    """What ``warm_up_triton`` did.

    Attributes:
        launches: kernel entry-point calls made.
        compiled: specializations compiled or loaded into memory (``TritonCompileLog``).
        seconds: wall time, compilation included.
    """

    launches: int
    compiled: int
    seconds: float


def warm_up_triton(model: LlamaForCausalLM, kv_caches: Sequence[KVCache], block_size: int,
                   max_num_batched_tokens: int, max_num_seqs: int,
                   max_model_len: int) -> WarmupReport | None:
    """Compile every Triton specialization the engine can launch, before serving (see the
    module docstring); logs how long it took. Call it once the model's LoRA slots and KV
    caches exist, before CUDA graphs are captured.

    Args:
        model: the loaded model, with its LoRA slots when LoRA is on.
        kv_caches: the engine's per-layer caches (read, never written).
        block_size: tokens per cache block.
        max_num_batched_tokens, max_num_seqs: the scheduler's limits (rows of a step, decode
            sequences of a step).
        max_model_len: the longest sequence, tokens (bounds a block table's width).

    Returns:
        A ``WarmupReport``; None off CUDA, where the engine runs no Triton kernel.
    """
    if kv_caches[0].data.device.type != "cuda":
        return None
    start = time.perf_counter()
    with torch.inference_mode(), TritonCompileLog() as log:
        launches = launch_every_specialization(
            model, kv_caches, block_size, max(max_num_batched_tokens, max_num_seqs),
            max_num_seqs, -(-max_model_len // block_size))
        torch.cuda.synchronize()
    report = WarmupReport(launches, len(log.compiled), time.perf_counter() - start)
    logger.info("Triton warm-up: %d launches, %d kernel specializations compiled or loaded, "
                "%.1f s", report.launches, report.compiled, report.seconds)
    return report


def launch_every_specialization(model: LlamaForCausalLM, kv_caches: Sequence[KVCache],
                                block_size: int, max_rows: int, max_num_seqs: int,
                                max_blocks_per_seq: int) -> int:
    """Call the Triton entry points once per specialization the engine can reach (the body
    of ``warm_up_triton``, on any device Triton runs on).

    Args:
        model, kv_caches, block_size: as ``warm_up_triton``.
        max_rows: the most token rows a step can have.
        max_num_seqs: the most sequences a step can have.
        max_blocks_per_seq: the widest block table.

    Returns:
        The number of entry-point calls made.
    """
    return (_warm_lora(model, max_rows)
            + _warm_layers(model, kv_caches, block_size, max_num_seqs, max_blocks_per_seq)
            + _warm_moe(model, max_rows)
            + _warm_skinny(model) + _warm_quantized(model)
            + _warm_token_bitmask(model, kv_caches[0].data.device))


def _warm_moe(model: LlamaForCausalLM, max_rows: int) -> int:
    """Each distinct MoE block's experts product, base and LoRA (``FusedMoE.warm_up``), at
    one token count per launch class (``moe_token_cases``)."""
    launches, seen = 0, set()
    for m in model.modules():
        if not isinstance(m, FusedMoE):
            continue
        slots = None if m.expert_lora is None else tuple(m.expert_lora.weights().a_gate.shape)
        key = (tuple(m.experts.w13.shape), m.experts.w13.dtype, m.top_k, slots)
        if key not in seen:
            seen.add(key)
            launches += m.warm_up(moe_token_cases(max_rows, m.top_k, m.num_experts))
    return launches


def _warm_token_bitmask(model: LlamaForCausalLM, device: torch.device) -> int:
    """The structured-output bitmask kernel (``triton_token_bitmask``): one specialization
    per vocabulary (float32 logits, int32 bitmask rows), launched on one row allowing every
    token."""
    from manylora.ops.token_bitmask import apply_token_bitmask_

    vocab = model.cfg.vocab_size
    logits = torch.zeros((1, vocab), dtype=torch.float32, device=device)
    bitmask = torch.full((1, 1 + -(-vocab // 32)), -1, dtype=torch.int32, device=device)
    bitmask[0, 0] = 0
    apply_token_bitmask_(logits, bitmask)
    return 1


def _warm_quantized(model: LlamaForCausalLM) -> int:
    """Each quantized projection's kernels (``LinearMethodBase.warm_up``), once per
    distinct (method, weight shapes)."""
    launches, seen = 0, set()
    for m in model.modules():
        if not isinstance(m, LoRALinear) or isinstance(m.linear_method,
                                                       UnquantizedLinearMethod):
            continue
        key = (type(m.linear_method), tuple((n, tuple(p.shape), p.dtype)
                                            for n, p in m.named_parameters()))
        if key not in seen:
            seen.add(key)
            launches += m.linear_method.warm_up(m)
    return launches


def _warm_skinny(model: LlamaForCausalLM) -> int:
    """The skinny projection kernel (``triton_skinny``) once per row bucket and distinct
    weight (shape, dtype, bias) it is measured faster for (``skinny_eligible``; the decode
    graphs capture it): the projections and the LM head."""
    heads = [model.model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight]
    weights = {(tuple(m.weight.shape), m.weight.dtype, m.bias is not None): (m.weight, m.bias)
               for m in model.modules() if isinstance(m, LoRALinear)
               and isinstance(m.linear_method, UnquantizedLinearMethod)}
    weights.update({(tuple(w.shape), w.dtype, False): (w, None) for w in heads})
    launches = 0
    for weight, bias in weights.values():
        for rows in triton_skinny.ROW_BUCKETS:
            x = torch.zeros(rows, weight.shape[1], dtype=weight.dtype, device=weight.device)
            if triton_skinny.skinny_eligible(x, weight):
                triton_skinny.skinny_linear(x, weight, bias)
                launches += 1
    return launches


# ---------------------------------------------------------------------------------------------
# LoRA


class _VocabTarget(NamedTuple):
    """The ``embed_tokens`` / ``lm_head`` slots as ``_launch_pair`` reads a layer: their
    input width and the width of the output their expand writes (the embedding, or this
    rank's logits)."""

    lora: LoRASlots
    in_features: int
    width: int
    parallel: None = None


def _lora_targets(model: LlamaForCausalLM) -> dict[tuple, LoRALinear | _VocabTarget]:
    """One ``LoRALinear`` per distinct kernel-facing shape (layers repeat them), and the
    ``embed_tokens`` / ``lm_head`` slots (``manylora.lora.vocab``) when sized."""
    vocab = []
    if model.embed_lora is not None:
        vocab.append(_VocabTarget(model.embed_lora.slots, model.cfg.vocab_size,
                                  model.cfg.hidden_size))
    if model.head_lora is not None:
        head = model.model.embed_tokens if model.lm_head is None else model.lm_head
        vocab.append(_VocabTarget(model.head_lora.slots, model.cfg.hidden_size,
                                  head.weight.shape[0]))
    targets: dict[tuple, LoRALinear | _VocabTarget] = {}
    for m in [*model.modules(), *vocab]:
        if not isinstance(m, LoRALinear | _VocabTarget) or m.lora is None:
            continue
        slots = m.lora
        key = (m.in_features, _expand_width(m), slots.output_slices,
               tuple(slots.lora_a_stacked[0].shape), tuple(slots.lora_b_stacked[0].shape),
               slots.lora_a_stacked[0].dtype, slots.bias is not None)
        targets.setdefault(key, m)
    return targets


def _expand_width(m: LoRALinear) -> int:
    """Columns of the ``y`` the expand writes: the layer's output, or under fully sharded
    row parallelism this rank's LoRA columns of it."""
    if isinstance(m, _VocabTarget):
        return m.width
    if m.parallel == "row" and m.fully_sharded:
        lo, hi = m._lora_cols
        return hi - lo
    return sum(m.output_sizes)


def _launch_pair(m: LoRALinear | _VocabTarget, lora_meta: LoRAKernelMeta, rows: int,
                 zeros: torch.Tensor) -> int:
    """One shrink and one expand of ``m``'s slots over ``rows`` zero rows through the entry
    points the model calls, with ``zeros`` (int32 ``[max_loras, S]``) as the rank and DoRA
    tables; the number of launches (2)."""
    slots = m.lora
    a, b = slots.lora_a_stacked, slots.lora_b_stacked
    dtype, device = a[0].dtype, a[0].device
    x = torch.zeros(rows, m.in_features, dtype=dtype, device=device)
    triton_lora.lora_shrink_triton(x, a, zeros, lora_meta, rank_start=slots.rank_start)
    buffer = torch.zeros(rows, len(b), b[0].shape[1], dtype=torch.float32, device=device)
    y = torch.zeros(rows, _expand_width(m), dtype=dtype, device=device)
    triton_lora.lora_expand_triton(y, buffer, b, zeros, lora_meta, slots.output_slices,
                                   zeros, slots.dora_scale_stacked, slots.bias)
    return 2


def _warm_lora(model: LlamaForCausalLM, max_rows: int) -> int:
    launches = 0
    for m in _lora_targets(model).values():
        slots = m.lora
        a, b = slots.lora_a_stacked, slots.lora_b_stacked
        max_loras, rank_a, k = a[0].shape
        rank_b = b[0].shape[1]
        max_n = max(size for _, size in slots.output_slices)
        device = a[0].device
        dot_fp32 = lora_plans.interpreted_bf16(a[0])
        shift = slots.bias is not None
        zeros = torch.zeros(max_loras, len(a), dtype=torch.int32, device=device)
        cases: dict[tuple, tuple[str, int, int]] = {}
        for variant, n, s in lora_plans.lora_row_cases(max_rows):
            sp = lora_plans.shrink_plan(variant, n, s, max_loras, k, rank_a, len(a),
                                        a[0].element_size(), dot_fp32)
            ep = lora_plans.expand_plan(variant, n, s, max_loras, max_n, rank_b, len(b),
                                        True, shift, dot_fp32)
            key = (sp.kernel, tuple(sp.constexprs.items()), ep.kernel,
                   tuple(ep.constexprs.items()))
            cases.setdefault(key, (variant, n, s))
        for variant, n, s in cases.values():
            # A table of rank 0 everywhere: the launches compile, the programs read nothing
            # and return (the model's table may already hold adapters).
            lora_meta = build_lora_kernel_meta([0] * s + [-1] * (n - s), max_loras, device,
                                             variant=variant)
            launches += _launch_pair(m, lora_meta, n, zeros)
        launches += _warm_tiled(m, max_rows, max_loras)
    return launches


def _warm_tiled(m: LoRALinear | _VocabTarget, max_rows: int, max_loras: int) -> int:
    """Launch the tiled kernels once per distinct plan of ``tiled_row_cases``, through the
    entry points the model calls, with a rank table of zeros (the programs return at once);
    the tiles all name row 0 of a one-row step."""
    slots = m.lora
    a, b = slots.lora_a_stacked, slots.lora_b_stacked
    _, rank_a, k = a[0].shape
    rank_b = b[0].shape[1]
    max_n = max(size for _, size in slots.output_slices)
    device = a[0].device
    dot_fp32 = lora_plans.interpreted_bf16(a[0])
    shift = slots.bias is not None
    zeros = torch.zeros(max_loras, len(a), dtype=torch.int32, device=device)
    cases: dict[tuple, tuple[int, int]] = {}
    for num_tiles, block_m in lora_tiled_plans.tiled_row_cases(max_rows, max_loras):
        sp = lora_tiled_plans.tiled_shrink_plan(num_tiles, block_m, k, rank_a, len(a),
                                                a[0].element_size(), dot_fp32)
        ep = lora_tiled_plans.tiled_expand_plan(num_tiles, block_m, max_n, rank_b, len(b),
                                                True, shift, dot_fp32)
        cases.setdefault((tuple(sp.constexprs.items()), tuple(ep.constexprs.items())),
                         (num_tiles, block_m))
    launches = 0
    for num_tiles, block_m in cases.values():
        lora_meta = build_lora_kernel_meta([-1], max_loras, device, variant="tiled",
                                         block_m=block_m)
        ones = torch.ones(num_tiles, dtype=torch.int32, device=device)
        lora_meta = lora_meta._replace(tile_slot=ones - 1, tile_start=ones - 1, tile_len=ones,
                                   has_lora=True)
        launches += _launch_pair(m, lora_meta, 1, zeros)
    return launches


# ---------------------------------------------------------------------------------------------
# norms, activation, RoPE, KV write, attention


def _warm_layers(model: LlamaForCausalLM, kv_caches: Sequence[KVCache], block_size: int,
                 max_num_seqs: int, max_blocks_per_seq: int) -> int:
    cfg = model.cfg
    device = kv_caches[0].data.device
    dtype = cfg.dtype
    launches = 0
    norms = {(type(n), n.weight.shape, n.weight.dtype): n for n in model.modules()
             if isinstance(n, RMSNorm)}
    for norm in norms.values():
        # rows of the norm's own width: the hidden size, or a head (Qwen3's q/k norms)
        rows = torch.zeros(_ROWS, norm.weight.shape[0], dtype=dtype, device=device)
        offset = norm.unit_offset                       # Gemma's (1 + w)
        triton_fused.rms_norm_triton(rows, norm.weight, norm.eps, unit_offset=offset)
        triton_fused.fused_add_rms_norm_triton(rows, rows.clone(), norm.weight, norm.eps,
                                               unit_offset=offset)
        launches += 2
    triton_fused.silu_and_mul_triton(
        torch.zeros(_ROWS, 2 * cfg.intermediate_size, dtype=dtype, device=device))
    launches += 1

    group = cfg.num_heads // cfg.num_kv_heads
    positions = torch.zeros(_ROWS, dtype=torch.int64, device=device)
    seen = set()
    for layer, kv_cache in zip(model.model.layers, kv_caches):
        attn = layer.self_attn
        softcap = getattr(attn, "softcap", None)          # Gemma 2's attention soft cap
        key = (attn.sliding_window, softcap, kv_cache.data.dtype,
               tuple(kv_cache.data.shape[2:]), kv_cache.quantized)
        if key in seen:
            continue
        seen.add(key)
        # q, k, v as LlamaAttention takes them: views of the packed qkv projection's output.
        qkv = torch.zeros(_ROWS, cfg.q_size + 2 * cfg.kv_size, dtype=dtype, device=device)
        q, k, v = qkv.split((cfg.q_size, cfg.kv_size, cfg.kv_size), dim=-1)
        q = q.view(-1, cfg.num_heads, cfg.head_dim)
        k = k.view(-1, cfg.num_kv_heads, cfg.head_dim)
        v = v.reshape(-1, cfg.num_kv_heads, cfg.head_dim)
        rotary = model.model.rotary
        rd = rotary.rotary_dim          # partial_rotary_factor: the heads' first rd only
        triton_fused.rotary_embedding_triton(positions, q[..., :rd], k[..., :rd], rotary.cos,
                                             rotary.sin)
        triton_attention.write_kv_triton(
            k, v, kv_cache, torch.full((_ROWS,), -1, dtype=torch.int64, device=device))
        # one prefill sequence of _ROWS tokens: the prefill launch
        meta = build_attention_metadata([_ROWS], [_ROWS], [[0]], block_size, group, device)
        triton_attention.paged_attention_triton(q, kv_cache, meta, attn.scale,
                                                attn.sliding_window, softcap=softcap)
        launches += 3
        # one decode sequence, once per split count the heuristic can pick
        meta = build_attention_metadata([1], [1], [[0]], block_size, group, device)
        for splits in triton_attention.decode_split_choices(
                group, cfg.num_kv_heads, cfg.head_dim, q.dtype, block_size, max_blocks_per_seq,
                max_num_seqs, attn.sliding_window, device):
            triton_attention.paged_attention_triton(q[:1], kv_cache, meta, attn.scale,
                                                    attn.sliding_window, num_splits=splits,
                                                    softcap=softcap)
            launches += 1
    return launches
