"""The mixture-of-experts MLP block (Mixtral's ``block_sparse_moe``, Qwen2-MoE's and
Qwen3-MoE's ``mlp``): a replicated router, ``E`` gated experts stacked into two tensors,
and Qwen2-MoE's shared expert with its sigmoid gate.

Tensor parallelism splits every expert as the dense MLP is split (vLLM's ``FusedMoE``
without expert parallelism): each rank holds, for every expert, its ``I / tp`` columns of
gate and up (rows of ``w13``) and the same columns of down (``w2``); the block's output is
all-reduced once. The router and the shared expert's gate are replicated; the shared expert
is a ``LlamaMLP``-shaped pair of ``LoRALinear`` (column / row parallel, all-reduced there).

Adapters (``LORA_MOE_MODULES``, slots only where ``lora_target_modules`` names them): the
experts' gate, up and down per (slot, expert) in ``ExpertLoRASlots``, applied inside the
fused experts' product (``fused_experts_lora``; gate/up cut as column-parallel, down as
row-parallel, before the one all-reduce); the router and the shared expert's gate are
replicated ``LoRALinear``s, the shared expert's projections ``LoRALinear``s split as the
dense MLP's.

Checkpoints: the stacked tensors are gathered at load (``checkpoint_loader`` on the
parameters, called by ``ModelWeightsLoader.load_model``) from either layout transformers
writes: per expert, ``experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj`` (Qwen2-MoE,
Qwen3-MoE; transformers 5's ``save_pretrained`` still writes these) or ``experts.{e}.w1`` /
``w3`` / ``w2`` (Mixtral: gate, up, down), or stacked, ``experts.gate_up_proj [E, 2I, H]``
(gate rows, then up rows) and ``experts.down_proj [E, H, I]``; under the block's own name
or the other family name (``mlp`` / ``block_sparse_moe``). Only the rank's columns are read.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from manylora.checkpoint.weights import CheckpointError, MissingWeightError, TPSlice
from manylora.config import LORA_EXPERT_MODULES, MoEShape
from manylora.distributed.parallel_state import TPGroup
from manylora.lora.expert_slots import ExpertLoRASlots
from manylora.lora.kernels.fused_moe_lora import fused_experts_lora
from manylora.lora.kernels.meta import LoRAKernelMeta
from manylora.lora.linear import LoRALinear
from manylora.ops.fused_moe import fused_experts, select_experts

#: Names a checkpoint gives the MoE block (transformers 5's, then Mixtral's older one).
_BLOCK_NAMES = ("mlp", "block_sparse_moe")
#: Per-expert ``(gate, up, down)`` module names, in the order they are looked for.
_PER_EXPERT = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))


class FusedMoE(nn.Module):
    """Router + experts (+ shared expert) of one decoder layer, each adapter-targetable.

    Args:
        hidden_size: ``H``.
        moe: the model's experts (``ModelConfig.moe``: ``E``, each expert's whole ``I``,
            top-k, whether the top-k weights are renormalized).
        dtype, device: of the parameters.
        tp: the tensor-parallel group.
        shared_expert: Qwen2-MoE's shared expert (``forward(x, lora) → [T, H]``,
            all-reduced; its projections' LoRA modules ``shared_expert.*``), gated by
            ``sigmoid(shared_expert_gate(x))``; None without.

    Parameters: ``gate.weight [E, H]`` (the router, a replicated ``LoRALinear``: LoRA module
    ``router``), ``experts.w13 [E, 2 I/tp, H]`` (this rank's gate columns, then its up
    columns), ``experts.w2 [E, H, I/tp]``, ``shared_expert_gate.weight [1, H]`` (LoRA module
    ``shared_expert_gate``) with a shared expert. The experts' ``tp_slices`` name the rank's
    part of the whole stacked tensors (``load_format="dummy"`` draws the whole and cuts it).
    ``create_lora_slots`` gives the experts adapter slots (``ExpertLoRASlots``).

    Forward: ``x [T, H]`` and the step's ``LoRAKernelMeta`` (None: no adapters) → ``[T, H]``
    in the model dtype, the same on every rank. A row's adapter reaches the router's logits,
    its experts' projections (``fused_experts_lora``) and the shared expert and its gate.

    Raises:
        ValueError: ``intermediate_size`` not divisible by ``tp.size``.
    """

    def __init__(self, hidden_size: int, moe: MoEShape, dtype: torch.dtype,
                 device: torch.device, tp: TPGroup,
                 shared_expert: nn.Module | None = None) -> None:
        super().__init__()
        intermediate_size, num_experts = moe.intermediate_size, moe.num_experts
        if intermediate_size % tp.size:
            raise ValueError(f"moe intermediate_size={intermediate_size} is not divisible by "
                             f"tensor_parallel_size={tp.size}")
        self.tp, self.top_k, self.renormalize = tp, moe.top_k, moe.renormalize
        self.hidden_size = hidden_size
        self.num_experts, self.intermediate_size = num_experts, intermediate_size
        local = intermediate_size // tp.size
        self.gate = LoRALinear(hidden_size, (num_experts,), ("router",), False, dtype, device,
                               tp=tp)
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
        self.expert_lora: ExpertLoRASlots | None = None
        self.shared_expert = shared_expert
        self.shared_expert_gate = None
        if shared_expert is not None:
            self.shared_expert_gate = LoRALinear(hidden_size, (1,), ("shared_expert_gate",),
                                                 False, dtype, device, tp=tp)

    def projections(self) -> tuple[LoRALinear, ...]:
        """The block's adapter-targetable ``LoRALinear``s: the router, and the shared
        expert's gate/up, down and gate."""
        shared = () if self.shared_expert is None else (
            self.shared_expert.gate_up_proj, self.shared_expert.down_proj,
            self.shared_expert_gate)
        return (self.gate, *shared)

    def create_lora_slots(self, enabled: Sequence[str], max_loras: int, max_lora_rank: int,
                          dtype: torch.dtype | None = None) -> ExpertLoRASlots | None:
        """Slot buffers for the experts' modules when ``enabled`` names them (None
        otherwise): this rank's ``I / tp`` columns of gate/up's B and down's A."""
        if not any(m in LORA_EXPERT_MODULES for m in enabled):
            return None
        w2, cols = self.experts.w2, self._cols(self.intermediate_size, 0)
        self.expert_lora = ExpertLoRASlots(
            self.hidden_size, self.intermediate_size, self.num_experts, max_loras,
            max_lora_rank, dtype or w2.dtype, w2.device, (cols.start, cols.stop))
        return self.expert_lora

    def forward(self, x: torch.Tensor, lora: LoRAKernelMeta | None = None) -> torch.Tensor:
        weights, ids = select_experts(self.gate(x, lora), self.top_k, self.renormalize)
        slots = self.expert_lora
        if slots is not None and (lora is None or not lora.has_lora or not slots.used(lora)):
            slots = None
        w13, w2 = self.experts.w13, self.experts.w2
        y = (fused_experts(x, w13, w2, weights, ids) if slots is None else fused_experts_lora(
            x, w13, w2, weights, ids, lora.token_lora_indices, slots.weights()))
        y = self.tp.all_reduce(y)
        if self.shared_expert is not None:
            gate = torch.sigmoid(self.shared_expert_gate(x, lora))
            y = y + gate * self.shared_expert(x, lora)
        return y

    def warm_up(self, token_counts: Sequence[int]) -> int:
        """Run the experts' product once per token count in ``token_counts`` on zero
        activations, through the entry points ``forward`` calls: the base op, and with
        expert slots its LoRA launches on slot 0 (whatever its ranks) by both launch plans
        (``lora.kernels.fused_moe_lora.moe_lora_path`` switches plans at a pair count of its
        own, so each case compiles both); the outputs are dropped. Compiles their Triton
        specializations before serving (``worker.warmup``, with
        ``ops.triton_fused_moe.moe_token_cases``).

        Returns:
            The entry-point calls made.
        """
        w13, w2 = self.experts.w13, self.experts.w2
        launches = 0
        for t in token_counts:
            x = torch.zeros(t, self.hidden_size, dtype=w13.dtype, device=w13.device)
            logits = torch.zeros(t, self.num_experts, dtype=w13.dtype, device=w13.device)
            weights, ids = select_experts(logits, self.top_k, self.renormalize)
            fused_experts(x, w13, w2, weights, ids)
            launches += 1
            if self.expert_lora is not None:
                slots = torch.zeros(t, dtype=torch.int32, device=w13.device)
                for path in ("pairs", "grouped"):
                    fused_experts_lora(x, w13, w2, weights, ids, slots,
                                       self.expert_lora.weights(), path=path)
                    launches += 1
        return launches

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
