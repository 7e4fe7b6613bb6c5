"""The model's shape (``ModelConfig``): read from a Hugging Face config, split per rank."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from manylora.config.architectures import resolve_architecture
from manylora.config.lora import LORA_EXPERT_MODULES, LORA_MOE_MODULES, LORA_VOCAB_MODULES
from manylora.config.moe import MoEShape, moe_shape
from manylora.config.quantization import QuantizationConfig, parse_quantization


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
        quantization: the base weights' quantization format (``manylora.config.quantization``;
            None: 16/32-bit weights in ``dtype``).
        moe: the experts of a mixture-of-experts model, whole on every rank
            (``manylora.config.moe``); None for a dense one.
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
    quantization: QuantizationConfig | None = None
    moe: MoEShape | None = None

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
                max_model_len: int | None = None,
                quantization: str | None = None) -> ModelConfig:
        """Build from a ``transformers`` ``PretrainedConfig``; ``quantization`` is the
        engine's setting (``parse_quantization``: None reads the config's
        ``quantization_config``).

        Raises:
            ValueError: an architecture the model registry does not hold
                (``resolve_architecture``), or ``max_model_len`` beyond the model's
                ``max_position_embeddings``.
            QuantizationError: (a ``ValueError``) a quantization format or option manylora
                does not serve, named.
        """
        arch = resolve_architecture(hf_config)
        num_heads = hf_config.num_attention_heads
        num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_attention_heads={num_heads} is not a multiple of "
                f"num_key_value_heads={num_kv_heads}")
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        qwen = arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")
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
            quantization=parse_quantization(_quantization_config(hf_config), quantization),
            moe=moe_shape(hf_config),
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
        """``{module: (in_features, out_features)}`` for the LoRA-targetable modules, of the
        whole model (what adapters are shaped for), whatever ``tp_size`` is: the seven
        projections, ``embed_tokens`` as peft's embedding LoRA reads it (``(vocab, hidden)``:
        ``lora_embedding_A [r, vocab]``, ``lora_embedding_B [hidden, r]``) and ``lm_head``
        (``(hidden, vocab)``); on a MoE model also the ``LORA_MOE_MODULES`` it has, the
        experts' per expert (``experts.gate_proj``: ``(hidden, I)``), the router
        ``(hidden, E)`` and the shared expert's gate ``(hidden, 1)``."""
        h, i = self.hidden_size, self.total_intermediate_size
        q, kv = self.total_q_size, self.total_kv_size
        shapes = {
            "q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv),
            "o_proj": (q, h), "gate_proj": (h, i), "up_proj": (h, i),
            "down_proj": (i, h),
            "embed_tokens": (self.vocab_size, h), "lm_head": (h, self.vocab_size),
        }
        moe = self.moe
        if moe is not None:
            e = moe.intermediate_size
            shapes.update({"experts.gate_proj": (h, e), "experts.up_proj": (h, e),
                           "experts.down_proj": (e, h), "router": (h, moe.num_experts)})
            if moe.shared_expert_size:
                s = moe.shared_expert_size
                shapes.update({"shared_expert.gate_proj": (h, s),
                               "shared_expert.up_proj": (h, s),
                               "shared_expert.down_proj": (s, h), "shared_expert_gate": (h, 1)})
        return shapes

    def layer_modules(self) -> tuple[frozenset[str], ...]:
        """Per decoder layer, the names of the LoRA-targetable projections it has: the
        attention's, and a dense MLP's or the MoE block's (``module_shapes``' names)."""
        shapes = self.module_shapes()
        attn = frozenset(("q_proj", "k_proj", "v_proj", "o_proj"))
        dense = attn | {"gate_proj", "up_proj", "down_proj"}
        sparse = attn | {m for m in shapes if m in LORA_MOE_MODULES}
        moe_layers = () if self.moe is None else self.moe.sparse_layers
        return tuple(sparse if i in moe_layers else dense for i in range(self.num_layers))

    def module_copies(self) -> dict[str, tuple[int, int]]:
        """``{module: (columns, pairs)}`` for the ``module_shapes`` modules the model has:
        how many rank-table columns one adapter slot gives the module (one per layer that
        has it; one for ``embed_tokens`` / ``lm_head``) and how many ``(in, out)`` A/B pairs
        (as many, times ``E`` for the experts' modules)."""
        copies = dict.fromkeys(LORA_VOCAB_MODULES, (1, 1))
        experts = 1 if self.moe is None else self.moe.num_experts
        for modules in self.layer_modules():
            for m in modules:
                columns, pairs = copies.get(m, (0, 0))
                copies[m] = (columns + 1,
                             pairs + (experts if m in LORA_EXPERT_MODULES else 1))
        return copies


def _quantization_config(hf_config: Any) -> Any:
    """The config's ``quantization_config`` as a plain mapping (transformers may hold it as
    a ``QuantizationConfigMixin``), or None."""
    qcfg = getattr(hf_config, "quantization_config", None)
    if qcfg is not None and hasattr(qcfg, "to_dict"):
        qcfg = qcfg.to_dict()
    return qcfg


def _kv_head_range(kv_heads: int, tp_size: int, rank: int) -> tuple[int, int]:
    """``(first KV head, count)`` of ``rank`` under ``ModelConfig.shard``'s split: one
    replicated head when ``kv_heads < tp_size``, else ``kv_heads // tp_size`` each and one more
    for each of the first ``kv_heads % tp_size`` ranks."""
    if kv_heads < tp_size:
        return rank * kv_heads // tp_size, 1
    base, extra = divmod(kv_heads, tp_size)
    return rank * base + min(rank, extra), base + (rank < extra)


def _sliding_windows(hf_config: Any) -> tuple[int | None, ...]:
    """Per-layer attention windows, as transformers applies them: ``layer_types`` (Gemma 2
    and 3 alternate ``sliding_attention`` and ``full_attention`` layers), Qwen2's
    ``max_window_layers``, or one window for every layer (Mistral). A window ``W`` lets a
    query see itself and the ``W - 1`` keys before it (transformers'
    ``sliding_window_overlay``: ``kv_idx > q_idx - W``)."""
    n = hf_config.num_hidden_layers
    window = getattr(hf_config, "sliding_window", None)
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is not None:
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    if getattr(hf_config, "model_type", "") in ("qwen2", "qwen2_moe"):
        if not getattr(hf_config, "use_sliding_window", False):
            return (None,) * n
        first = getattr(hf_config, "max_window_layers", n)
        return tuple(window if i >= first else None for i in range(n))
    return (window,) * n
