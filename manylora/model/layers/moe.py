"""The mixture-of-experts MLP block (Mixtral's ``block_sparse_moe``, Qwen2-MoE's and
Qwen3-MoE's ``mlp``): a replicated router, ``E`` gated experts stacked into two tensors,
and Qwen2-MoE's shared expert with its sigmoid gate.

Tensor parallelism splits every expert as the dense MLP is split (vLLM's ``FusedMoE``
without expert parallelism): each rank holds, for every expert, its ``I / tp`` columns of
gate and up (rows of ``w13``) and the same columns of down (``w2``); the block's output is
all-reduced once. The router and the shared expert's gate are replicated; the shared expert
is a ``LlamaMLP``-shaped pair of ``LoRALinear`` (column / row parallel, all-reduced there).

Checkpoints: the stacked tensors are gathered at load (``checkpoint_loader`` on the
parameters, called by ``ModelWeightsLoader.load_model``) from either layout transformers
writes: per expert, ``experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj`` (Qwen2-MoE,
Qwen3-MoE; transformers 5's ``save_pretrained`` still writes these) or ``experts.{e}.w1`` /
``w3`` / ``w2`` (Mixtral: gate, up, down), or stacked, ``experts.gate_up_proj [E, 2I, H]``
(gate rows, then up rows) and ``experts.down_proj [E, H, I]``; under the block's own name
or the other family name (``mlp`` / ``block_sparse_moe``). Only the rank's columns are read.
"""

from __future__ import annotations

import torch
from torch import nn

from manylora.checkpoint.weights import CheckpointError, MissingWeightError, TPSlice
from manylora.distributed.parallel_state import TPGroup
from manylora.ops.fused_moe import fused_experts, select_experts

#: Names a checkpoint gives the MoE block (transformers 5's, then Mixtral's older one).
_BLOCK_NAMES = ("mlp", "block_sparse_moe")
#: Per-expert ``(gate, up, down)`` module names, in the order they are looked for.
_PER_EXPERT = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))


class FusedMoE(nn.Module):
    """Router + experts (+ shared expert) of one decoder layer.

    Args:
        hidden_size: ``H``.
        num_experts: ``E``.
        intermediate_size: each expert's whole ``I`` (``moe_intermediate_size``; Mixtral's
            ``intermediate_size``).
        top_k: experts per token.
        renormalize: whether the top-k weights are scaled to sum to 1 (``select_experts``).
        dtype, device: of the parameters.
        tp: the tensor-parallel group.
        shared_expert: Qwen2-MoE's shared expert (``forward(x, lora) → [T, H]``,
            all-reduced), gated by ``sigmoid(shared_expert_gate(x))``; None without.

    Parameters: ``gate.weight [E, H]``, ``experts.w13 [E, 2 I/tp, H]`` (this rank's gate
    columns, then its up columns), ``experts.w2 [E, H, I/tp]``, ``shared_expert_gate.weight
    [1, H]`` with a shared expert. The experts' ``tp_slices`` name the rank's part of the
    whole stacked tensors (``load_format="dummy"`` draws the whole and cuts it).

    Forward: ``x [T, H]`` → ``[T, H]`` in the model dtype, the same on every rank.

    Raises:
        ValueError: ``intermediate_size`` not divisible by ``tp.size``.
    """

    def __init__(self, hidden_size: int, num_experts: int, intermediate_size: int,
                 top_k: int, renormalize: bool, dtype: torch.dtype, device: torch.device,
                 tp: TPGroup, shared_expert: nn.Module | None = None) -> None:
        super().__init__()
        if intermediate_size % tp.size:
            raise ValueError(f"moe intermediate_size={intermediate_size} is not divisible by "
                             f"tensor_parallel_size={tp.size}")
        self.tp, self.top_k, self.renormalize = tp, top_k, renormalize
        self.num_experts, self.intermediate_size = num_experts, intermediate_size
        local = intermediate_size // tp.size
        self.gate = nn.Linear(hidden_size, num_experts, bias=False, dtype=dtype, device=device)
        self.gate.weight.checkpoint_loader = self._load_router
        self.experts = nn.Module()
        self.experts.w13 = nn.Parameter(
            torch.empty(num_experts, 2 * local, hidden_size, dtype=dtype, device=device),
            requires_grad=False)
        self.experts.w2 = nn.Parameter(
            torch.empty(num_experts, hidden_size, local, dtype=dtype, device=device),
            requires_grad=False)
        self.experts.w13.checkpoint_loader = self._load_w13
        self.experts.w2.checkpoint_loader = self._load_w2
        # the rank's columns of the whole [E, 2I, H] / [E, H, I] (the dummy loader's cut)
        cols = self._cols(intermediate_size, 1)
        self.experts.w13.tp_slices = (cols, cols)
        self.experts.w2.tp_slices = (self._cols(intermediate_size, 2),)
        self.shared_expert = shared_expert
        self.shared_expert_gate = None
        if shared_expert is not None:
            self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False, dtype=dtype,
                                                device=device)

    def forward(self, x: torch.Tensor, lora=None) -> torch.Tensor:
        weights, ids = select_experts(self.gate(x), self.top_k, self.renormalize)
        y = self.tp.all_reduce(fused_experts(x, self.experts.w13, self.experts.w2,
                                             weights, ids))
        if self.shared_expert is not None:
            gate = torch.sigmoid(self.shared_expert_gate(x))
            y = y + gate * self.shared_expert(x, None)
        return y

    # -- checkpoint loading (ModelWeightsLoader.load_model's ``checkpoint_loader`` hook) --

    def _prefixes(self, name: str, suffix: str) -> list[str]:
        """The checkpoint names of the block that parameter ``name`` (ending in ``suffix``)
        may lie under: its own, then the other family name."""
        block = name[: -len(suffix)]
        parent, _, own = block.rpartition(".")
        names = [own] + [n for n in _BLOCK_NAMES if n != own]
        return [f"{parent}.{n}" for n in names]

    def _cols(self, full: int, dim: int, offset: int = 0) -> TPSlice:
        local = self.intermediate_size // self.tp.size
        start = offset + self.tp.rank * local
        return TPSlice(dim, start, start + local, full, local)

    def _load_router(self, loader, param: nn.Parameter, name: str) -> None:
        for prefix in self._prefixes(name, ".gate.weight"):
            tensor = loader.load_tensor(f"{prefix}.gate.weight")
            if tensor is not None:
                return _copy(param, tensor, f"{prefix}.gate.weight")
        raise MissingWeightError(f"Checkpoint {loader.model_dir} has no router weight for "
                                 f"{name!r}")

    def _load_w13(self, loader, param: nn.Parameter, name: str) -> None:
        inter = self.intermediate_size
        for prefix in self._prefixes(name, ".experts.w13"):
            key = f"{prefix}.experts.gate_up_proj"
            gate = loader.load_part(key, self._cols(2 * inter, 1))
            if gate is not None:
                up = loader.load_part(key, self._cols(2 * inter, 1, inter))
                return _copy(param, torch.cat([gate, up], dim=1), key)
            for g, u, _ in _PER_EXPERT:
                keys = [(f"{prefix}.experts.{e}.{g}.weight", f"{prefix}.experts.{e}.{u}.weight")
                        for e in range(self.num_experts)]
                if loader.load_part(keys[0][0], self._cols(inter, 0)) is None:
                    continue
                rows = [torch.cat([_part(loader, k, self._cols(inter, 0)) for k in pair])
                        for pair in keys]
                return _copy(param, torch.stack(rows), keys[0][0])
        raise MissingWeightError(f"Checkpoint {loader.model_dir} has no experts' gate/up "
                                 f"weights for {name!r}")

    def _load_w2(self, loader, param: nn.Parameter, name: str) -> None:
        inter = self.intermediate_size
        for prefix in self._prefixes(name, ".experts.w2"):
            key = f"{prefix}.experts.down_proj"
            stacked = loader.load_part(key, self._cols(inter, 2))
            if stacked is not None:
                return _copy(param, stacked, key)
            for _, _, d in _PER_EXPERT:
                keys = [f"{prefix}.experts.{e}.{d}.weight" for e in range(self.num_experts)]
                if loader.load_part(keys[0], self._cols(inter, 1)) is None:
                    continue
                return _copy(param, torch.stack([_part(loader, k, self._cols(inter, 1))
                                                 for k in keys]), keys[0])
        raise MissingWeightError(f"Checkpoint {loader.model_dir} has no experts' down "
                                 f"weights for {name!r}")


def _part(loader, key: str, part: TPSlice) -> torch.Tensor:
    tensor = loader.load_part(key, part)
    if tensor is None:
        raise MissingWeightError(f"Checkpoint {loader.model_dir} has no {key!r}")
    return tensor


def _copy(param: nn.Parameter, tensor: torch.Tensor, key: str) -> None:
    if tensor.shape != param.shape:
        raise CheckpointError(f"Shape mismatch for {key!r}: checkpoint {tuple(tensor.shape)} "
                              f"vs parameter {tuple(param.shape)}")
    param.data.copy_(tensor)
