"""Mixture-of-experts routing and the experts' MLPs over a flat batch of tokens (vLLM's
``fused_moe``: ``select_experts`` then ``fused_experts``).

The torch implementation here is the reference and the CPU path: it loops over the experts
some token chose and adds each expert's weighted output with ``index_add_``. On CUDA
``fused_experts`` hands the work to the Triton grouped-GEMM kernel
(``manylora.ops.triton_fused_moe.fused_experts_triton``: no host sync, CUDA-graph
capturable).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from manylora.ops.triton_fused_moe import fused_experts_triton

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
    return _fused_experts_torch(x, w13, w2, topk_weights, topk_ids, activation)


def _fused_experts_torch(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                         topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                         activation: str) -> torch.Tensor:
    act = _ACTIVATIONS[activation]
    out = torch.zeros_like(x)
    ids = topk_ids.long()
    for expert in torch.unique(ids).tolist():
        token, slot = torch.nonzero(ids == expert, as_tuple=True)
        gate, up = F.linear(x[token], w13[expert]).chunk(2, dim=-1)
        y = F.linear(act(gate) * up, w2[expert])
        out.index_add_(0, token, (y * topk_weights[token, slot, None]).to(x.dtype))
    return out
