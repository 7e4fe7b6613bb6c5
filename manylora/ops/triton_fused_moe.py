"""Fused mixture-of-experts MLP on CUDA: token-to-expert alignment and a grouped Triton GEMM.

vLLM's ``fused_moe`` design. Each token ``t`` is routed to ``k`` experts ``e[t, j]`` with
weights ``w[t, j]`` (``manylora.ops.fused_moe.select_experts``); the layer computes::

    y[t] = Σ_j w[t, j] · W2[e[t, j]] · act(W13[e[t, j]] x[t])

with ``W13[e] = [gate; up]`` (``[2I, H]``, gate rows first: transformers' stacked
``gate_up_proj``) and ``act([g; u]) = f(g) * u``, ``f`` SiLU (Mixtral, Qwen-MoE) or
tanh-approximated GELU. Three steps, no host synchronisation (CUDA-graph capturable):

1. :func:`moe_align_block_size` sorts the ``T * k`` (token, slot) pairs by expert and pads
   each expert's run to a multiple of ``BLOCK_M``, so every block of ``BLOCK_M`` sorted pairs
   belongs to one expert. The output has the fixed worst-case length, whatever the routing.
2. ``_fused_moe_kernel`` (launched twice): one program computes a ``BLOCK_M × BLOCK_N`` tile of
   ``C[pair] = A[row(pair)] @ W[expert]ᵀ`` for one block of sorted pairs, gathering the rows
   of ``A`` by ``pair // k`` (first GEMM, ``A = x``) or by ``pair`` (second GEMM, ``A`` the
   activations), optionally scaling by the pair's routing weight, and scattering row ``pair``
   of ``C``. Padding slots are neither read nor written; blocks past the padded total return
   at once. float32 accumulation, one rounding to the activation dtype on the store.
3. The ``k`` scaled rows of each token are summed (``torch.sum`` over a ``[T, k, H]`` view,
   no atomics, so the result is deterministic).

The experts' LoRA (``manylora.lora.kernels.fused_moe_lora``) comes in two ways. For decode
the GEMM's pieces are ``@triton.jit`` helpers (``moe_tile_position``, ``moe_block``,
``moe_gemm_tile``), so that ``manylora.lora.kernels.moe_lora_fused`` runs the same tiles and
K loop with the LoRA terms added in its epilogue. For large batches ``fused_experts_triton``
hands its two GEMM outputs to callers before they are used (``add_gate_up`` before the
activation, ``add_down`` before the sum), for launches grouped by (slot, expert), aligned by
:func:`align_block_size` on their own key.

Rounding follows vLLM: ``h = r(x W13ᵀ)``, ``a = r(r(f(g)) * u)``, ``o = r(w · (a W2ᵀ))`` (the
weight applied to the float32 accumulator), ``y = r(Σ_j o_j)``, ``r`` rounding to the
activation dtype. Under ``TRITON_INTERPRET=1`` (CPU tensors, how the tests run) 16-bit
operands are widened to float32 before the dot (the interpreter multiplies bfloat16 bit
patterns as integers) and stores truncate instead of rounding. float32 operands are
multiplied in IEEE float32 on every backend (not TF32).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from manylora.ops.host_math import cdiv
from manylora.ops.triton_fused import silu_and_mul_triton

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: ``act`` of the gate half: SiLU (Mixtral, Qwen2-MoE, Qwen3-MoE) or tanh-approximated GELU.
ACTIVATIONS = ("silu", "gelu_tanh")

#: Launch configs by rows per expert, ``ceil(T * k / E)`` (the mean number of pairs each expert
#: gets; vLLM's default config switches on a similar ``T ≤ E``): ``(bound, (BLOCK_M, BLOCK_N,
#: BLOCK_K, num_warps, num_stages))``, the first row whose bound is ≥ the rows per expert is
#: used. Not tuned per shape. With few rows per expert (decode) a short ``BLOCK_M`` wastes
#: little padding and the op is bound by reading the experts' weights; with many (prefill)
#: longer blocks reuse each weight tile over more rows. ``benchmarks/bench_fused_moe.py`` times
#: them against the byte floor.
MOE_CONFIGS: tuple[tuple[int, tuple[int, int, int, int, int]], ...] = (
    (16, (16, 64, 64, 4, 4)),
    (64, (32, 64, 64, 4, 4)),
    (1 << 62, (64, 128, 64, 8, 3)),
)


def moe_config(num_tokens: int, top_k: int, num_experts: int) -> tuple[int, int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)`` from ``MOE_CONFIGS`` for
    ``num_tokens`` tokens routed to ``top_k`` of ``num_experts`` experts each."""
    rows = cdiv(num_tokens * top_k, num_experts)
    return next(config for bound, config in MOE_CONFIGS if rows <= bound)


def moe_token_cases(max_tokens: int, top_k: int, num_experts: int) -> list[int]:
    """Token counts ``T`` in ``[1, max_tokens]``, one per launch class of the fused MoE op and
    of its LoRA launches (``lora.kernels.fused_moe_lora``): the config :func:`moe_config`
    picks, and whether the pair count ``T k`` is 1 or a multiple of 16 (what Triton
    specializes the kernels' run-time ints on; every other int and stride is fixed by the
    layer's shape). The start-up warm-up launches these (``worker.warmup``); the smallest
    ``T`` of each class is taken.

    Raises:
        ValueError: ``max_tokens``, ``top_k`` or ``num_experts`` below 1.
    """
    if min(max_tokens, top_k, num_experts) < 1:
        raise ValueError(f"max_tokens ({max_tokens}), top_k ({top_k}) and num_experts "
                         f"({num_experts}) must be ≥ 1")
    cases: dict[tuple, int] = {}
    for t in range(1, max_tokens + 1):
        pairs = t * top_k
        cases.setdefault((moe_config(t, top_k, num_experts), pairs == 1, pairs % 16 == 0), t)
    return sorted(cases.values())


def moe_align_block_size(topk_ids: torch.Tensor, block_m: int, num_experts: int
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The (token, slot) pairs sorted by expert, each expert's run padded to ``block_m``.

    vLLM's ``moe_align_block_size``. Pair ``p = t * k + j`` stands for ``topk_ids[t, j]``.
    Expert ``e``'s pairs (in increasing ``p``) occupy ``sorted_token_ids[s_e : s_e + n_e]``,
    followed by padding up to ``s_e + ceil(n_e / block_m) * block_m = s_{e+1}``; experts come
    in increasing order, an expert without pairs takes no room. Torch ops only (a stable sort,
    ``scatter_add_``, ``cumsum``, ``searchsorted``), no host synchronisation and a fixed output
    size, so it can be captured in a CUDA graph.

    Args:
        topk_ids: ``[T, k]`` int32 / int64 expert ids, each in ``[0, num_experts)`` (not
            checked: that would synchronise; an id out of range is a device-side error).
        block_m: rows of one GEMM block, ≥ 1.
        num_experts: ``E``.

    Returns:
        ``(sorted_token_ids, expert_ids, num_tokens_post_padded)``, int32 on the device of
        ``topk_ids``:

        * ``sorted_token_ids`` ``[P]``, ``P = T * k + E * (block_m - 1)`` (the worst case):
          pair indices, ``T * k`` in padding slots and past the padded total.
        * ``expert_ids`` ``[ceil(P / block_m)]``: the expert of each block; -1 for blocks past
          the padded total.
        * ``num_tokens_post_padded`` ``[1]``: the padded total ``Σ_e ceil(n_e / block_m) *
          block_m``.

    Raises:
        ValueError: ``topk_ids`` not a 2-D integer tensor, or ``block_m`` / ``num_experts``
            below 1.
    """
    if topk_ids.dim() != 2 or topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids: expected [T, k] int32/int64, got {tuple(topk_ids.shape)} "
                         f"{topk_ids.dtype}")
    if block_m < 1 or num_experts < 1:
        raise ValueError(f"block_m ({block_m}) and num_experts ({num_experts}) must be ≥ 1")
    num_pairs = topk_ids.numel()
    return align_block_size(topk_ids.reshape(-1).long(), block_m, num_experts,
                            num_pairs + num_experts * (block_m - 1))


def align_block_size(keys: torch.Tensor, block_m: int, num_keys: int, max_padded: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``moe_align_block_size`` over any group key: the pairs ``p`` with ``keys[p] <
    num_keys`` sorted by key (stably), each key's run padded to a multiple of ``block_m``;
    pairs whose key is ``num_keys`` are left out. Torch ops only, no host synchronisation.

    Args:
        keys: int64 ``[P]`` in ``[0, num_keys]`` (not checked).
        block_m: rows of one block, ≥ 1.
        num_keys: the number of groups.
        max_padded: the output length, at least the padded total of any ``keys`` (``P +
            min(num_keys, P) * (block_m - 1)`` always is).

    Returns:
        ``(sorted_token_ids [max_padded], block_keys [ceil(max_padded / block_m)],
        num_tokens_post_padded [1])``, int32, as ``moe_align_block_size``'s (``P`` in padding,
        -1 for blocks past the padded total).
    """
    device = keys.device
    num_pairs = keys.numel()
    counts = torch.zeros(num_keys + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, keys, torch.ones_like(keys))
    counts = counts[:num_keys]
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    start = torch.cumsum(counts, 0) - counts
    keys_sorted, order = torch.sort(keys, stable=True)
    kept = keys_sorted < num_keys
    group = keys_sorted.clamp_max(num_keys - 1)
    rank = torch.arange(num_pairs, device=device) - start[group]
    # left-out pairs go to one spare slot past the end, cut off below
    dest = torch.where(kept, padded_start[group] + rank, max_padded)
    sorted_ids = torch.full((max_padded + 1,), num_pairs, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    block_start = torch.arange(0, max_padded, block_m, device=device)
    block_key = torch.searchsorted(padded_end, block_start, right=True)
    block_keys = torch.where(block_key < num_keys, block_key, -1).to(torch.int32)
    total = padded_end[-1:].to(torch.int32)
    return sorted_ids[:max_padded], block_keys, total


@triton.jit
def moe_tile_position(N, BLOCK_N: tl.constexpr):
    """``(pid_m, pid_n)``: the sorted block and the column tile of this program of a grouped
    GEMM's grid ``(blocks * cdiv(N, BLOCK_N),)``."""
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    return pid // num_pid_n, pid % num_pid_n


@triton.jit
def moe_block(sorted_ids_ptr, expert_ids_ptr, pid_m, pid_n, num_pairs, N,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``(pairs [BLOCK_M], row_mask, expert, offs_n [BLOCK_N], col_mask)`` of sorted block
    ``pid_m`` and column tile ``pid_n``: its pair indices (``num_pairs`` in padding), which
    of them are pairs, its expert (int64), the tile's columns and which are below ``N``."""
    pairs = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return pairs, pairs < num_pairs, expert, offs_n, offs_n < N


@triton.jit
def moe_gemm_tile(a_ptr, w_ptr, rows, row_mask, expert, offs_n, col_mask, K, stride_am,
                  stride_we, stride_wn, DOT_FP32: tl.constexpr, IEEE: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """float32 ``A[rows] @ W[expert, offs_n]ᵀ`` (``[BLOCK_M, BLOCK_N]``; rows and columns
    outside the masks read as zero): the grouped GEMM's K loop."""
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn \
        + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        a = tl.load(a_ptrs + k0, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs + k0, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        if DOT_FP32:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        if IEEE:
            acc = tl.dot(a, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
    return acc


@triton.jit
def _fused_moe_kernel(a_ptr, w_ptr, c_ptr, topk_w_ptr, sorted_ids_ptr, expert_ids_ptr,
                      total_ptr, N, K, num_pairs, stride_am, stride_we, stride_wn,
                      stride_cm, A_ROW_DIV: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr,
                      DOT_FP32: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``C[p] = (w[p] ·) A[p // A_ROW_DIV] @ W[e]ᵀ`` for one ``BLOCK_M × BLOCK_N`` tile."""
    pid_m, pid_n = moe_tile_position(N, BLOCK_N)
    if pid_m * BLOCK_M >= tl.load(total_ptr):
        return
    pairs, row_mask, expert, offs_n, col_mask = moe_block(
        sorted_ids_ptr, expert_ids_ptr, pid_m, pid_n, num_pairs, N, BLOCK_M, BLOCK_N)
    acc = moe_gemm_tile(a_ptr, w_ptr, (pairs // A_ROW_DIV).to(tl.int64), row_mask, expert,
                        offs_n, col_mask, K, stride_am, stride_we, stride_wn, DOT_FP32, IEEE,
                        BLOCK_M, BLOCK_N, BLOCK_K)
    if MUL_ROUTED_WEIGHT:
        weight = tl.load(topk_w_ptr + pairs, mask=row_mask, other=0.0)
        acc = acc * weight.to(tl.float32)[:, None]
    c_ptrs = c_ptr + pairs.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty),
             mask=row_mask[:, None] & col_mask[None, :])


def dot_modes(a: torch.Tensor) -> tuple[bool, bool]:
    """``(DOT_FP32, IEEE)`` of the grouped GEMM over operands of ``a``'s dtype and device:
    16-bit operands widened to float32 under the interpreter, float32 products in IEEE
    float32 (no TF32)."""
    dot_fp32 = a.device.type != "cuda" and a.dtype != torch.float32
    return dot_fp32, dot_fp32 or a.dtype == torch.float32


def _grouped_gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor,
                  topk_weights: torch.Tensor | None, sorted_ids: torch.Tensor,
                  expert_ids: torch.Tensor, total: torch.Tensor, row_div: int,
                  config: tuple[int, int, int, int, int]) -> None:
    """One launch of ``_fused_moe_kernel``: ``out [T*k, N]`` from ``a`` rows and ``w [E, N, K]``."""
    block_m, block_n, block_k, warps, stages = config
    num_pairs, n = out.shape
    k = w.shape[2]
    grid = (cdiv(sorted_ids.numel(), block_m) * cdiv(n, block_n),)
    dot_fp32, ieee = dot_modes(a)
    _fused_moe_kernel[grid](
        a, w, out, out if topk_weights is None else topk_weights, sorted_ids, expert_ids,
        total, n, k, num_pairs, a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        A_ROW_DIV=row_div, MUL_ROUTED_WEIGHT=topk_weights is not None,
        DOT_FP32=dot_fp32, IEEE=ieee, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=warps, num_stages=stages)


def check_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation: str) -> None:
    """Raise ValueError unless the arguments fit ``fused_experts_triton``: a known activation,
    one dtype of ``_DTYPES`` for x, w13 and w2, shapes that chain (x ``[T, H]``, w13
    ``[E, 2I, H]``, w2 ``[E, H, I]``), float32 ``topk_weights`` and int ``topk_ids`` both
    ``[T, k]``, one device, unit stride along ``H`` and contiguous weights."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation {activation!r} is not one of {ACTIVATIONS}")
    if x.dtype not in _DTYPES or w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise ValueError(f"x, w13, w2 must share one dtype of {_DTYPES}, got {x.dtype}, "
                         f"{w13.dtype}, {w2.dtype}")
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"expected x [T, H], w13 [E, 2I, H], w2 [E, H, I], got "
                         f"{tuple(x.shape)}, {tuple(w13.shape)}, {tuple(w2.shape)}")
    t, h = x.shape
    e, two_i, h13 = w13.shape
    if h13 != h or two_i % 2 or w2.shape != (e, h, two_i // 2):
        raise ValueError(f"shapes do not chain: x {tuple(x.shape)}, w13 {tuple(w13.shape)} "
                         f"(want [E, 2I, {h}]), w2 {tuple(w2.shape)} (want [E, {h}, I])")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != t or topk_weights.shape != topk_ids.shape \
            or topk_weights.dtype != torch.float32 \
            or topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"expected topk_weights [{t}, k] float32 and topk_ids [{t}, k] int, "
                         f"got {tuple(topk_weights.shape)} {topk_weights.dtype}, "
                         f"{tuple(topk_ids.shape)} {topk_ids.dtype}")
    tensors = (x, w13, w2, topk_weights, topk_ids)
    if any(a.device != x.device for a in tensors):
        raise ValueError(f"tensors on different devices: {[str(a.device) for a in tensors]}")
    if x.stride(1) != 1 or not w13.is_contiguous() or not w2.is_contiguous():
        raise ValueError("x needs unit stride along H, w13 and w2 must be contiguous")


def fused_experts_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                         topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                         activation: str = "silu",
                         config: tuple[int, int, int, int, int] | None = None, *,
                         add_gate_up: Callable[[torch.Tensor], None] | None = None,
                         add_down: Callable[[torch.Tensor, torch.Tensor], None] | None = None
                         ) -> torch.Tensor:
    """The routed experts' MLP of a token batch (vLLM's ``fused_experts``, unquantized)::

        y[t] = Σ_j w[t, j] · W2[e_tj] · act(W13[e_tj] x[t]),   e_tj = topk_ids[t, j]

    with ``act([g; u]) = silu(g) * u`` or ``gelu_tanh(g) * u`` (gate rows first, as
    transformers' ``gate_up_proj``). Routing weights are used as given (normalise them in
    ``select_experts``). No host synchronisation, fixed-size intermediates: CUDA-graph
    capturable (the first call of a shape class compiles the kernels; warm up before capture).
    Runs on CUDA tensors, and on CPU tensors under ``TRITON_INTERPRET=1``.

    Args:
        x: ``[T, H]`` float32 / bfloat16 / float16 activations, unit stride along ``H``.
        w13: ``[E, 2I, H]`` contiguous, x's dtype: each expert's gate rows then up rows.
        w2: ``[E, H, I]`` contiguous, x's dtype: each expert's down projection.
        topk_weights: ``[T, k]`` float32 routing weights.
        topk_ids: ``[T, k]`` int32 / int64 expert ids in ``[0, E)`` (not checked on the
            device; an id out of range is a device-side error). A token may name an expert
            twice; each slot then counts.
        activation: ``"silu"`` or ``"gelu_tanh"``.
        config: ``(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)``; None:
            :func:`moe_config` of ``T``, ``k`` and ``E``.
        add_gate_up: None, or called with the first GEMM's output ``h`` (``[T * k, 2I]``,
            row ``t * k + j``, x's dtype) before the activation, to add into it in place (the
            grouped LoRA launches of ``manylora.lora.kernels.fused_moe_lora``).
        add_down: None, or called with the activations ``a`` (``[T * k, I]``) and the second
            GEMM's weighted output ``o`` (``[T * k, H]``) before the sum over ``k``, to add
            into ``o`` in place.

    Returns:
        ``[T, H]`` in x's dtype (a new tensor).

    Raises:
        ValueError: an unknown activation, or dtypes, shapes, layouts or devices that do not
            fit together.
    """
    check_experts(x, w13, w2, topk_weights, topk_ids, activation)
    t, h = x.shape
    num_experts, two_i, _ = w13.shape
    top_k = topk_ids.shape[1]
    if t == 0 or top_k == 0:
        return torch.zeros_like(x)
    config = config or moe_config(t, top_k, num_experts)
    sorted_ids, expert_ids, total = moe_align_block_size(topk_ids, config[0], num_experts)
    num_pairs = t * top_k
    gate_up = torch.empty(num_pairs, two_i, dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, gate_up, None, sorted_ids, expert_ids, total, top_k, config)
    if add_gate_up is not None:
        add_gate_up(gate_up)
    if activation == "silu":
        act = silu_and_mul_triton(gate_up)
    else:
        gate, up = gate_up.chunk(2, dim=-1)
        act = F.gelu(gate, approximate="tanh") * up
    out = torch.empty(num_pairs, h, dtype=x.dtype, device=x.device)
    _grouped_gemm(act, w2, out, topk_weights.reshape(-1), sorted_ids, expert_ids, total, 1,
                  config)
    if add_down is not None:
        add_down(act, out)
    return out.view(t, top_k, h).sum(dim=1)
