"""Frozen configuration records, one per component, each checked when it is built.

Every component receives the narrowest of these it needs: the scheduler gets a
``SchedulerConfig``, the KV cache manager a ``CacheConfig``, the adapter manager a
``LoRAConfig``, the model a ``ModelConfig``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field
from typing import Any

import torch

logger = logging.getLogger(__name__)

#: The projections an adapter may target, in the order the model applies them.
LORA_TARGET_MODULES: tuple[str, ...] = (
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
)

#: Hugging Face architectures that manylora serves (all LLaMA-shaped decoders).
SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
)

#: Architecture of a config that names only its ``model_type``.
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                "qwen2": "Qwen2ForCausalLM"}

_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
}


def resolve_device(device: str | torch.device) -> torch.device:
    """``"auto"`` → ``cuda`` when a GPU is visible, else ``cpu``; anything else as given.

    Raises:
        ValueError: ``device`` names CUDA but no GPU is visible.
    """
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} was asked for, but no CUDA GPU is visible")
    return dev


#: ``lora_dtype`` values (vLLM's ``--lora-dtype``).
LORA_DTYPE_NAMES = ("auto", "float16", "bfloat16", "float32")


def resolve_lora_dtype(lora_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the adapter slots, the host tier and the LoRA kernels' operands.

    ``"auto"``: the model's. Otherwise the model's or float32: the kernels run the
    activations in the slots' dtype, and float32 holds every float16 / bfloat16 activation
    exactly (a delta computed in float32 is rounded once, to the model's dtype), where a
    narrower slot dtype would round the base output of every row of the batch.

    Raises:
        ValueError: an unknown name, or a dtype other than the model's and float32.
    """
    if lora_dtype not in LORA_DTYPE_NAMES:
        raise ValueError(f"lora_dtype must be one of {', '.join(LORA_DTYPE_NAMES)}, got "
                         f"{lora_dtype!r}")
    if lora_dtype == "auto":
        return model_dtype
    dtype = _DTYPES[lora_dtype]
    if dtype not in (model_dtype, torch.float32):
        raise ValueError(f"lora_dtype {lora_dtype} on a {str(model_dtype).removeprefix('torch.')} "
                         "model: the LoRA slots must be in the model's dtype or float32 "
                         "(use 'auto' or 'float32')")
    return dtype


def resolve_dtype(dtype: str | torch.dtype, device: torch.device, hf_config: Any) -> torch.dtype:
    """The dtype weights and activations run in.

    ``"auto"``: float32 on CPU; on CUDA the checkpoint's own dtype when it is bfloat16
    or float16, otherwise bfloat16 (vLLM's rule, except that CPU stays in float32).

    Raises:
        ValueError: an unknown dtype name.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto":
        if dtype not in _DTYPES:
            raise ValueError(f"dtype={dtype!r} is not one of 'auto', {sorted(_DTYPES)}")
        return _DTYPES[dtype]
    if device.type == "cpu":
        return torch.float32
    ckpt = getattr(hf_config, "torch_dtype", None) or getattr(hf_config, "dtype", None)
    if isinstance(ckpt, str):
        ckpt = _DTYPES.get(ckpt)
    return ckpt if ckpt in (torch.bfloat16, torch.float16) else torch.bfloat16


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a LLaMA-family decoder, read from a Hugging Face config.

    Attributes:
        hidden_size, intermediate_size, vocab_size: widths (elements).
        num_heads, num_kv_heads, head_dim: attention geometry; ``num_kv_heads`` < ``num_heads``
            is GQA, ``num_kv_heads == 1`` MQA.
        rms_norm_eps: RMSNorm epsilon.
        qkv_bias, o_bias, mlp_bias: whether those projections carry a bias (Qwen2: qkv only).
        sliding_windows: per layer, the attention window in tokens or None for full attention.
        max_model_len: the longest sequence (prompt + output) in tokens.
        hf_config: the ``transformers`` config, kept for RoPE parameters.
        tp_size: ranks the model is split over (Megatron-LM tensor parallelism). A config
            from ``from_hf`` has 1; ``shard(tp_size, rank)`` gives the per-rank config, whose
            ``num_heads``, ``num_kv_heads`` and ``intermediate_size`` (and so ``q_size``,
            ``kv_size``) are one rank's, so that code sizing a rank's tensors (attention,
            ``worker.kv_cache``) reads the fields as they are; where the heads do not divide
            evenly they differ between ranks (``shard``).
        tp_rank: the rank this config is for (0 at ``tp_size`` 1).
        total_num_heads, total_num_kv_heads, total_intermediate_size: the whole model's
            (equal to the per-rank fields at ``tp_size`` 1; filled in when not given).
    """

    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    sliding_windows: tuple[int | None, ...]
    max_model_len: int
    dtype: torch.dtype
    hf_config: Any = field(repr=False, compare=False)
    tp_size: int = 1
    tp_rank: int = 0
    total_num_heads: int | None = None
    total_num_kv_heads: int | None = None
    total_intermediate_size: int | None = None

    def __post_init__(self) -> None:
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be ≥ 1, got {self.tp_size}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} is outside tp_size {self.tp_size}")
        for name in ("num_heads", "num_kv_heads", "intermediate_size"):
            if getattr(self, f"total_{name}") is None:
                object.__setattr__(self, f"total_{name}", getattr(self, name))

    @classmethod
    def from_hf(cls, hf_config: Any, dtype: torch.dtype,
                max_model_len: int | None = None) -> ModelConfig:
        """Build from a ``transformers`` ``PretrainedConfig``.

        Raises:
            ValueError: an architecture manylora does not serve, or ``max_model_len``
                beyond the model's ``max_position_embeddings``.
        """
        model_type = getattr(hf_config, "model_type", "?")
        archs = list(getattr(hf_config, "architectures", None) or [])
        if not archs and model_type in _MODEL_TYPES:
            archs = [_MODEL_TYPES[model_type]]
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs or model_type!r}: manylora serves "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        num_heads = hf_config.num_attention_heads
        num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_attention_heads={num_heads} is not a multiple of "
                f"num_key_value_heads={num_kv_heads}")
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        qwen = arch == "Qwen2ForCausalLM"
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        limit = int(hf_config.max_position_embeddings)
        if max_model_len is None:
            max_model_len = limit
        elif max_model_len > limit:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the model's "
                f"max_position_embeddings={limit}")
        return cls(
            architecture=arch,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            vocab_size=hf_config.vocab_size,
            rms_norm_eps=float(hf_config.rms_norm_eps),
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            qkv_bias=qwen or attention_bias,
            o_bias=attention_bias and not qwen,
            mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
            sliding_windows=_sliding_windows(hf_config),
            max_model_len=max_model_len,
            dtype=dtype,
            hf_config=hf_config,
        )

    def shard(self, tp_size: int, rank: int = 0) -> ModelConfig:
        """The config of rank ``rank`` of ``tp_size`` (Megatron-LM's / vLLM's split; KV heads
        that do not divide are partitioned as ``torch.tensor_split`` partitions a length).

        Every rank gets ``intermediate_size / tp_size`` MLP columns. Attention is split by
        KV-head groups, each rank taking whole KV heads with the query heads of their groups:

        * ``num_kv_heads ≥ tp_size``: the first ``num_kv_heads % tp_size`` ranks get
          ``num_kv_heads // tp_size + 1`` KV heads, the others ``num_kv_heads // tp_size``,
          in order (rank 0 holds the most); each rank's query heads are its KV heads' groups
          (``num_heads / num_kv_heads`` per KV head). With SmolLM2's 9 query / 3 KV heads at
          2 ranks, rank 0 holds KV heads 0-1 and query heads 0-5, rank 1 KV head 2 and query
          heads 6-8. When the heads divide, this is the even split.
        * ``num_kv_heads < tp_size``: each rank gets one KV head, rank ``r`` holding KV head
          ``r * num_kv_heads // tp_size`` (replicated over ``tp_size / num_kv_heads`` ranks),
          and ``num_heads / tp_size`` query heads.

        Sharding a sharded config starts again from the whole model's sizes; ``shard(1)`` is
        the whole model. Every rank's ``num_heads / num_kv_heads`` (its query heads per KV
        head) is the same.

        Args:
            tp_size: the number of ranks (≥ 1).
            rank: which rank's config, ``0 ≤ rank < tp_size``; rank 0's is the largest (what
                sizes per-rank memory, e.g. KV cache blocks).

        Raises:
            ValueError: ``tp_size < 1``, a ``rank`` outside it, ``num_heads`` not a multiple
                of ``num_kv_heads``, ``intermediate_size`` not divisible by ``tp_size``, or
                (when ``num_kv_heads < tp_size``) ``num_heads`` not divisible by ``tp_size``
                or ``num_kv_heads`` not dividing it; the message names the numbers.
        """
        heads, kv_heads = self.total_num_heads, self.total_num_kv_heads
        inter = self.total_intermediate_size
        if tp_size < 1:
            raise ValueError(f"tp_size must be ≥ 1, got {tp_size}")
        if not 0 <= rank < tp_size:
            raise ValueError(f"rank {rank} is outside tensor_parallel_size={tp_size}")
        if heads % kv_heads:
            raise ValueError(f"num_attention_heads={heads} is not a multiple of "
                             f"num_key_value_heads={kv_heads}")
        if inter % tp_size:
            raise ValueError(f"intermediate_size={inter} is not divisible by "
                             f"tensor_parallel_size={tp_size}")
        if kv_heads < tp_size and heads % tp_size:
            raise ValueError(f"num_attention_heads={heads} is not divisible by "
                             f"tensor_parallel_size={tp_size} (with num_key_value_heads="
                             f"{kv_heads} below it, KV heads are replicated and query heads "
                             "split evenly)")
        if kv_heads < tp_size and tp_size % kv_heads:
            raise ValueError(f"num_key_value_heads={kv_heads} is below "
                             f"tensor_parallel_size={tp_size} and does not divide it, so "
                             "its KV heads cannot be replicated evenly")
        _, n_kv = _kv_head_range(kv_heads, tp_size, rank)
        n_q = heads // tp_size if kv_heads < tp_size else n_kv * (heads // kv_heads)
        return dataclasses.replace(
            self, tp_size=tp_size, tp_rank=rank, num_heads=n_q, num_kv_heads=n_kv,
            intermediate_size=inter // tp_size, total_num_heads=heads,
            total_num_kv_heads=kv_heads, total_intermediate_size=inter)

    @property
    def q_size(self) -> int:
        """This rank's query width, ``num_heads * head_dim``."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """This rank's key (and value) width, ``num_kv_heads * head_dim``."""
        return self.num_kv_heads * self.head_dim

    @property
    def total_q_size(self) -> int:
        """The whole model's query width."""
        return self.total_num_heads * self.head_dim

    @property
    def total_kv_size(self) -> int:
        """The whole model's key (and value) width."""
        return self.total_num_kv_heads * self.head_dim

    @property
    def kv_heads_replicated(self) -> bool:
        """Whether ranks share KV heads (fewer KV heads than ranks)."""
        return self.total_num_kv_heads < self.tp_size

    def kv_head_start(self, rank: int) -> int:
        """The first of the whole model's KV heads that ``rank`` holds (``shard``'s split;
        it holds ``shard(tp_size, rank).num_kv_heads`` of them)."""
        return _kv_head_range(self.total_num_kv_heads, self.tp_size, rank)[0]

    def q_head_start(self, rank: int) -> int:
        """The first of the whole model's query heads that ``rank`` holds (``shard``'s split;
        it holds ``shard(tp_size, rank).num_heads`` of them)."""
        heads, kv_heads = self.total_num_heads, self.total_num_kv_heads
        if kv_heads < self.tp_size:
            return rank * (heads // self.tp_size)
        return self.kv_head_start(rank) * (heads // kv_heads)

    @property
    def vocab_per_rank(self) -> int:
        """Rows of the embedding and LM head on each rank: ``ceil(vocab_size / tp_size)``
        (the last ranks' tables are padded with zero rows past ``vocab_size``)."""
        return -(-self.vocab_size // self.tp_size)

    def module_shapes(self) -> dict[str, tuple[int, int]]:
        """``{module: (in_features, out_features)}`` for the seven LoRA-targetable projections,
        of the whole model (what adapters are shaped for), whatever ``tp_size`` is."""
        h, i = self.hidden_size, self.total_intermediate_size
        q, kv = self.total_q_size, self.total_kv_size
        return {
            "q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv),
            "o_proj": (q, h), "gate_proj": (h, i), "up_proj": (h, i),
            "down_proj": (i, h),
        }


def _kv_head_range(kv_heads: int, tp_size: int, rank: int) -> tuple[int, int]:
    """``(first KV head, count)`` of ``rank`` under ``ModelConfig.shard``'s split: one
    replicated head when ``kv_heads < tp_size``, else ``kv_heads // tp_size`` each and one more
    for each of the first ``kv_heads % tp_size`` ranks."""
    if kv_heads < tp_size:
        return rank * kv_heads // tp_size, 1
    base, extra = divmod(kv_heads, tp_size)
    return rank * base + min(rank, extra), base + (rank < extra)


def _sliding_windows(hf_config: Any) -> tuple[int | None, ...]:
    """Per-layer attention windows, as transformers applies them (Mistral, Qwen2)."""
    n = hf_config.num_hidden_layers
    window = getattr(hf_config, "sliding_window", None)
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is not None:
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    if getattr(hf_config, "model_type", "") == "qwen2":
        if not getattr(hf_config, "use_sliding_window", False):
            return (None,) * n
        first = getattr(hf_config, "max_window_layers", n)
        return tuple(window if i >= first else None for i in range(n))
    return (window,) * n


#: ``kv_cache_dtype`` values: the model dtype, or quantized per token and KV head.
KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3")


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: ``num_blocks`` blocks of ``block_size`` tokens each.

    Attributes:
        kv_cache_dtype: ``"auto"`` (the model dtype), ``"int8"`` or ``"fp8_e4m3"``.
        enable_prefix_caching: reuse full blocks across requests of the same adapter.
        num_host_blocks: blocks of swap space in host memory (0: none).
    """

    block_size: int
    num_blocks: int
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    num_host_blocks: int = 0

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be ≥ 1, got {self.block_size}")
        if self.num_blocks < 1:
            raise ValueError(f"num_kv_blocks must be ≥ 1, got {self.num_blocks}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.num_host_blocks < 0:
            raise ValueError(f"num_host_blocks must be ≥ 0, got {self.num_host_blocks}")


#: ``SchedulerConfig.scheduling_policy`` values.
SCHEDULING_POLICIES = ("fair", "fcfs")


def check_fairness(scheduling_policy: str, max_group_share: float) -> None:
    """Check the fair-sharing settings (``SchedulerConfig``'s, as ``EngineArgs`` takes them).

    Raises:
        ValueError: a policy not in ``SCHEDULING_POLICIES``, or a share outside (0, 1].
    """
    if scheduling_policy not in SCHEDULING_POLICIES:
        raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}"
                         f", got {scheduling_policy!r}")
    if not 0.0 < max_group_share <= 1.0:
        raise ValueError(f"max_group_share must be in (0, 1], got {max_group_share}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous-batching limits.

    Attributes:
        max_num_seqs: requests in the running batch at once.
        max_num_batched_tokens: tokens (prefill + decode) computed in one step.
        max_loras: distinct adapters in one step (the number of device slots).
        lora_aging_steps: steps a waiting request may be passed over by requests whose
            adapters are resident before it takes the next free slot in arrival order.
        lora_new_adapters_per_step: while more adapters wait than slots are free (and the
            scheduler is given the adapter cache's residency), adapters a step may admit
            that the running batch does not use; None: as many as slots allow.
        lora_staging_slots: under the same condition, slots kept free of running adapters
            so the next adapters' copies run ahead on the side stream instead of stalling a
            step; at most ``max_loras // 4`` of them.
        scheduling_policy: ``"fair"``: waiting requests join least-running client group
            first (first-come first-served within a group), and a group holding more than
            ``max_group_share`` of ``max_num_seqs`` gives up its newest running requests
            to other groups' waiting ones when no sequence slot is free; ``"fcfs"``: strict
            arrival order, nothing preempted for fairness (vLLM's default policy).
        max_group_share: under ``"fair"``, the share (0, 1] of ``max_num_seqs`` a client
            group keeps while other groups wait (rounded up, at least one request); 1: no
            preemption for fairness, only the least-running-first order.
    """

    max_num_seqs: int
    max_num_batched_tokens: int
    max_loras: int
    lora_aging_steps: int = 64
    lora_new_adapters_per_step: int | None = 1
    lora_staging_slots: int = 1
    scheduling_policy: str = "fair"
    max_group_share: float = 0.5

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_loras",
                     "lora_aging_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be ≥ 1, got {getattr(self, name)}")
        if self.lora_new_adapters_per_step is not None and self.lora_new_adapters_per_step < 1:
            raise ValueError(f"lora_new_adapters_per_step must be ≥ 1 or None, got "
                             f"{self.lora_new_adapters_per_step}")
        if self.lora_staging_slots < 0:
            raise ValueError(f"lora_staging_slots must be ≥ 0, got {self.lora_staging_slots}")
        check_fairness(self.scheduling_policy, self.max_group_share)

    @property
    def max_group_seqs(self) -> int:
        """The running requests a client group keeps while others wait (``"fair"``):
        ``ceil(max_group_share * max_num_seqs)``, at least 1."""
        return max(1, math.ceil(self.max_group_share * self.max_num_seqs - 1e-9))


@dataclass(frozen=True)
class LoRAConfig:
    """Adapter slots and the host tier (vLLM's LoRAConfig, TensorRT-LLM's lora_target_modules
    and PEFT cache bounds).

    Attributes:
        max_loras: device slots, i.e. distinct adapters per step.
        max_lora_rank: rank every slot buffer is padded to.
        max_cpu_loras: adapters kept loaded in host memory (LRU), ≥ max_loras.
        target_modules: projections that get slot buffers; an adapter that targets another
            one is refused.
        max_cpu_lora_bytes: bytes of adapter tensors the host tier may hold (None: bounded
            by count only).
        fully_sharded_loras: under tensor parallelism, also shard the half of each adapter
            that is otherwise replicated (vLLM's ``fully_sharded_loras``, after S-LoRA):
            A along the rank for column-parallel projections (``max_lora_rank`` must be
            divisible by the number of ranks), B along its output for row-parallel ones, at
            the cost of one more collective per column-parallel projection (an all-gather)
            and two more per row-parallel one (an all-reduce, an all-gather). No effect on
            one rank.
        load_timeout: seconds one adapter read (disk to host memory: parse, validate,
            digest, pin; from the moment a loader thread starts it) may go without progress
            (a module read); one stuck longer fails alone (``LoRALoadTimeoutError``). None:
            no bound.
        dtype: of the slot buffers and the adapters in the host tier (adapters are cast to
            it when read; ``resolve_lora_dtype``); None: the model's.
    """

    max_loras: int = 8
    max_lora_rank: int = 64
    max_cpu_loras: int = 32
    target_modules: tuple[str, ...] = LORA_TARGET_MODULES
    max_cpu_lora_bytes: int | None = None
    fully_sharded_loras: bool = False
    load_timeout: float | None = 60.0
    dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        if self.load_timeout is not None and not self.load_timeout > 0:
            raise ValueError(f"lora load_timeout must be > 0 seconds, got {self.load_timeout}")
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be ≥ 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be ≥ 1, got {self.max_lora_rank}")
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be ≥ max_loras ({self.max_loras})")
        if self.max_cpu_lora_bytes is not None and self.max_cpu_lora_bytes < 1:
            raise ValueError(f"max_cpu_lora_bytes must be ≥ 1, got {self.max_cpu_lora_bytes}")
        unknown = [m for m in self.target_modules if m not in LORA_TARGET_MODULES]
        if unknown or not self.target_modules:
            raise ValueError(
                f"lora_target_modules {unknown or '[]'} invalid: choose from "
                f"{', '.join(LORA_TARGET_MODULES)}")
