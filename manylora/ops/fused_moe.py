"""Mixture-of-experts routing and the experts' MLPs over a flat batch of tokens (vLLM's
``fused_moe``: ``select_experts`` then ``fused_experts``).

The torch implementation here is the reference and the CPU path: it loops over the experts
some token chose and adds each expert's weighted output with ``index_add_``
(``fused_experts_torch``, which also takes additions to each expert's two GEMMs: how
``manylora.lora.kernels.fused_moe_lora`` applies LoRA to the experts). On CUDA
``fused_experts`` hands the work to the Triton grouped-GEMM kernel
(``manylora.ops.triton_fused_moe.fused_experts_triton``: no host sync, CUDA-graph
capturable).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from manylora.ops.triton_fused_moe import fused_experts_triton

#: An addition to one expert's GEMM in ``fused_experts_torch``: called with the expert, the
#: token of each of the expert's rows (int64 ``[n]``) and the GEMM's input rows (``[n, K]``),
#: it returns None (nothing to add) or ``(rows, delta)``: int64 indices into those ``n`` rows
#: and the float32 ``[len(rows), N]`` to add to them.
ExpertDelta = Callable[[int, torch.Tensor, torch.Tensor],
                       "tuple[torch.Tensor, torch.Tensor] | None"]

#: Activations of the experts' gate half (``act(gate) * up``), named as the Triton kernel
#: names them.
_ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda g: F.gelu(g, approximate="tanh")}


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                   scoring: str = "softmax") -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's ``top_k`` experts and their weights, as transformers routes Mixtral,
    Qwen2-MoE and Qwen3-MoE: a float32 softmax over all ``E`` experts, the ``top_k``
    largest probabilities, divided by their sum when ``renormalize`` (Mixtral always;
    Qwen2-MoE / Qwen3-MoE: ``norm_topk_prob``).

    Args:
        router_logits: ``[T, E]`` in any float dtype.
        top_k: experts per token, ``1 ≤ top_k ≤ E``.
        renormalize: whether the ``top_k`` weights are scaled to sum to 1.
        scoring: ``"softmax"`` (the only scoring these families use).

    Returns:
        ``topk_weights`` float32 ``[T, top_k]`` and ``topk_ids`` int32 ``[T, top_k]``, each
        row's experts in decreasing weight.

    Raises:
        ValueError: an unknown ``scoring`` or ``top_k`` outside ``[1, E]``.
    """
    if scoring != "softmax":
        raise ValueError(f"unknown MoE scoring {scoring!r}: use 'softmax'")
    num_experts = router_logits.shape[-1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k} is outside [1, {num_experts}] experts")
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  activation: str = "silu") -> torch.Tensor:
    """The weighted sum of each token's chosen experts' gated MLPs::

        y[t] = Σ_j w[t,j] · W2[e_tj] · (act(G[e_tj] x[t]) * U[e_tj] x[t])

    where ``W13[e] = [G[e]; U[e]]`` (gate rows, then up rows; ``act(W13[e] x)`` above means
    this gated product), as transformers' ``MixtralExperts`` / ``Qwen2MoeExperts`` compute
    it.

    Args:
        x: ``[T, H]`` tokens, in the weights' dtype.
        w13: ``[E, 2I, H]`` the experts' gate and up projections.
        w2: ``[E, H, I]`` the experts' down projections.
        topk_weights: float32 ``[T, k]`` (``select_experts``).
        topk_ids: int ``[T, k]`` expert ids in ``[0, E)``.
        activation: ``"silu"`` or ``"gelu_tanh"``.

    Returns:
        ``[T, H]`` in ``x``'s dtype (products accumulated in float32 per expert, as
        ``torch.matmul`` accumulates).

    Raises:
        ValueError: an unknown activation or mismatched shapes.
    """
    if activation not in _ACTIVATIONS:
        raise ValueError(f"unknown MoE activation {activation!r}: use one of "
                         f"{', '.join(_ACTIVATIONS)}")
    num_experts, two_inter, hidden = w13.shape
    if (w2.shape != (num_experts, hidden, two_inter // 2) or x.shape[-1] != hidden
            or topk_weights.shape != topk_ids.shape or topk_ids.shape[0] != x.shape[0]):
        raise ValueError(f"fused_experts shapes do not agree: x {tuple(x.shape)}, w13 "
                         f"{tuple(w13.shape)}, w2 {tuple(w2.shape)}, topk "
                         f"{tuple(topk_ids.shape)} / {tuple(topk_weights.shape)}")
    if x.is_cuda:
        return fused_experts_triton(x, w13, w2, topk_weights, topk_ids, activation)
    return fused_experts_torch(x, w13, w2, topk_weights, topk_ids, activation)


def fused_experts_torch(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                        topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                        activation: str = "silu", *, gate_up_delta: ExpertDelta | None = None,
                        down_delta: ExpertDelta | None = None) -> torch.Tensor:
    """``fused_experts`` in torch ops (no argument checks): a loop over the experts some token
    chose, each expert's rows gathered, ``F.linear`` per GEMM, the weighted rows added into
    the output with ``index_add_``. The CPU path and the reference of the Triton kernel.

    Rounding (``r`` to x's dtype): ``h = r(x W13ᵀ)``, ``a = r(r(f(g)) * u)``,
    ``o = r(w · r(a W2ᵀ))`` (the weight applied in float32), ``y = Σ_j o_j`` accumulated in
    x's dtype in increasing expert order.

    ``gate_up_delta`` / ``down_delta`` (LoRA on the experts: ``manylora.lora.kernels.
    fused_moe_lora``) add to an expert's GEMM output: with ``(rows, delta)`` returned, rows
    ``rows`` of ``h`` become ``r(h + delta)`` (before the activation) and those of the down
    GEMM ``o = r(w · r(a W2ᵀ) + w · delta)`` (the delta weighted like the base term, one
    rounding of the sum). Rows they leave out, and every row when they return None, get
    exactly the roundings above.

    Args:
        x, w13, w2, topk_weights, topk_ids, activation: as ``fused_experts``' (checked there).
        gate_up_delta: None, or an :data:`ExpertDelta` of the first GEMM (``delta``
            ``[n, 2I]``, input rows ``x[token]``).
        down_delta: None, or an :data:`ExpertDelta` of the second GEMM (``delta`` ``[n, H]``,
            input rows ``a``).

    Returns:
        ``[T, H]`` in x's dtype.
    """
    act = _ACTIVATIONS[activation]
    out = torch.zeros_like(x)
    ids = topk_ids.long()
    for expert in torch.unique(ids).tolist():
        token, slot = torch.nonzero(ids == expert, as_tuple=True)
        xe = x[token]
        h = F.linear(xe, w13[expert])
        if gate_up_delta is not None and (add := gate_up_delta(expert, token, xe)) is not None:
            rows, delta = add
            h[rows] = (h[rows].float() + delta).to(h.dtype)
        gate, up = h.chunk(2, dim=-1)
        a = act(gate) * up
        weight = topk_weights[token, slot, None]
        y = F.linear(a, w2[expert]) * weight
        if down_delta is not None and (add := down_delta(expert, token, a)) is not None:
            rows, delta = add
            y[rows] += weight[rows] * delta
        out.index_add_(0, token, y.to(x.dtype))
    return out
