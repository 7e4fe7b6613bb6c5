"""The LLaMA-family decoder (Llama 2/3, Mistral, Qwen2) over a flat batch of tokens.

No padding: the step's tokens of every sequence are concatenated into ``[T]`` rows, and
attention finds each sequence's keys through its block table. Parameter names match
Hugging Face's except the fused ``qkv_proj`` and ``gate_up_proj`` (the weight loader
translates them).

Tensor parallelism (Megatron-LM, Shoeybi et al. 2019, as vLLM lays it out): ``qkv_proj`` and
``gate_up_proj`` are column-parallel (each rank holds its heads' rows of q, k and v, its
columns of gate and up), ``o_proj`` and ``down_proj`` row-parallel (all-reduced), the
embedding and LM head vocabulary-parallel. Attention runs on the rank's heads only, so the
model needs no other communication: two all-reduces per layer, one for the embedding, one
all-gather for the logits. Heads are split by KV-head groups, unevenly where they do not
divide (rank 0 holds the most); with fewer KV heads than ranks each rank holds one KV head
(``ModelConfig.shard``).
"""

from __future__ import annotations

import torch
from torch import nn

from manylora.config import MODEL_LAYER, LoRAConfig, ModelConfig
from manylora.distributed.parallel_state import TPGroup
from manylora.lora.kernels.meta import LoRAKernelMeta
from manylora.lora.linear import LoRALinear
from manylora.lora.slot_table import SlotColumns, SlotTable
from manylora.lora.slots import LoRASlots
from manylora.lora.vocab import EmbeddingLoRA, HeadLoRA
from manylora.model.layers.activation import silu_and_mul
from manylora.model.layers.embedding import Embedding
from manylora.model.layers.norm import RMSNorm
from manylora.model.layers.qk_norm import rms_norm_heads_
from manylora.model.layers.rotary import RotaryEmbedding
from manylora.ops.attention import paged_attention, write_kv
from manylora.ops.attention_metadata import AttentionMetadata
from manylora.ops.paged_kv import KVCache
from manylora.ops.quant import linear_method_for


def qkv_output_ranges(cfg: ModelConfig, rank: int) -> tuple[tuple[int, int], ...]:
    """Rows ``[start, stop)`` of the whole q, k and v projections that ``rank`` holds under
    ``cfg`` (that rank's config, ``shard(tp_size, rank)``): its query heads, and its KV heads
    (one replicated head when there are fewer KV heads than ranks)."""
    q0 = cfg.q_head_start(rank) * cfg.head_dim
    kv0 = cfg.kv_head_start(rank) * cfg.head_dim
    return (q0, q0 + cfg.q_size), (kv0, kv0 + cfg.kv_size), (kv0, kv0 + cfg.kv_size)


def layer_prefix(layer_idx: int) -> str:
    """The Hugging Face module name of decoder layer ``layer_idx`` (``model.layers.3``),
    which quantization configs name modules under."""
    return f"model.layers.{layer_idx}"


def linear_method(cfg: ModelConfig, prefix: str, modules: tuple[str, ...]):
    """The linear method of the projection whose Hugging Face modules are ``prefix``'s
    ``modules`` under the model's quantization (``manylora.ops.quant``)."""
    return linear_method_for(cfg.quantization, [f"{prefix}.{m}" for m in modules])


def o_input_range(cfg: ModelConfig, rank: int) -> tuple[int, int]:
    """Columns ``[start, stop)`` of the whole ``o_proj`` that ``rank`` holds: its query
    heads' (``cfg`` is that rank's config)."""
    q0 = cfg.q_head_start(rank) * cfg.head_dim
    return q0, q0 + cfg.q_size


class LlamaAttention(nn.Module):
    #: The per-head q/k norm applied before RoPE (``q_norm`` / ``k_norm`` of width
    #: ``head_dim``, ``rms_norm_heads_``: Qwen3's ``RMSNorm``, Gemma 3's ``GemmaRMSNorm``),
    #: or None.
    qk_norm_class: type[RMSNorm] | None = None

    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding,
                 device: torch.device, tp: TPGroup) -> None:
        super().__init__()
        self.cfg = cfg
        self.rotary = [rotary]  # shared table; a list keeps it out of this module's buffers
        self.sliding_window = cfg.sliding_windows[layer_idx]
        sharded = tp.size > 1
        prefix = f"{layer_prefix(layer_idx)}.self_attn"
        qkv = ("q_proj", "k_proj", "v_proj")
        self.qkv_proj = LoRALinear(
            cfg.hidden_size, (cfg.total_q_size, cfg.total_kv_size, cfg.total_kv_size),
            qkv, cfg.qkv_bias, cfg.dtype, device, "column", tp,
            qkv_output_ranges(cfg, tp.rank) if sharded else None,
            linear_method=linear_method(cfg, prefix, qkv))
        self.o_proj = LoRALinear(cfg.total_q_size, (cfg.hidden_size,), ("o_proj",),
                                 cfg.o_bias, cfg.dtype, device, "row", tp,
                                 in_range=o_input_range(cfg, tp.rank) if sharded else None,
                                 linear_method=linear_method(cfg, prefix, ("o_proj",)))
        self.scale = cfg.head_dim ** -0.5
        #: The attention logits' soft cap (``paged_attention``'s ``softcap``; None: uncapped).
        self.softcap: float | None = None
        if self.qk_norm_class is not None:
            self.q_norm = self.qk_norm_class(cfg.head_dim, cfg.rms_norm_eps, cfg.dtype, device)
            self.k_norm = self.qk_norm_class(cfg.head_dim, cfg.rms_norm_eps, cfg.dtype, device)

    def rotate(self, positions: torch.Tensor, qkv: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``qkv [T, q + 2 kv]`` (this rank's heads) → views ``q [T, Hq, D]``, ``k [T, Hkv,
        D]``, ``v [T, Hkv, D]`` of it, RoPE applied to q and k in place (``positions`` int64
        ``[T]``), after the per-head q/k norm when the class has one (written back into
        ``qkv``, which the piecewise CUDA graphs hold static)."""
        cfg = self.cfg
        q, k, v = qkv.split((cfg.q_size, cfg.kv_size, cfg.kv_size), dim=-1)
        if self.qk_norm_class is not None:
            rms_norm_heads_(self.q_norm, q, cfg.head_dim)
            rms_norm_heads_(self.k_norm, k, cfg.head_dim)
        q = q.view(-1, cfg.num_heads, cfg.head_dim)
        k = k.view(-1, cfg.num_kv_heads, cfg.head_dim)
        v = v.reshape(-1, cfg.num_kv_heads, cfg.head_dim)
        q, k = self.rotary[0](positions, q, k)
        return q, k, v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache,
               attn: AttentionMetadata, out: torch.Tensor | None = None) -> torch.Tensor:
        """``write_kv`` of k, v into this layer's ``KVCache`` (quantized there when it is),
        then ``paged_attention`` of q (``scale``, ``sliding_window``, ``softcap``) → ``[T,
        q_size]`` in q's dtype (into ``out [T, Hq, D]`` when given). The part of a layer that
        reads the step's attention metadata: it runs eagerly between the pieces of a
        piecewise CUDA graph."""
        write_kv(k, v, kv_cache, attn.cache_loc)
        return paged_attention(q, kv_cache, attn, self.scale, self.sliding_window, out=out,
                               softcap=self.softcap)


class LlamaMLP(nn.Module):
    """``down_proj(silu(gate) * up)``; ``prefix`` is its Hugging Face module name
    (``model.layers.3.mlp``), ``lora_prefix`` what its LoRA module names start with
    (``"shared_expert."`` for Qwen2-MoE's shared expert: ``shared_expert.gate_proj``)."""

    def __init__(self, cfg: ModelConfig, device: torch.device, tp: TPGroup,
                 prefix: str = "mlp", lora_prefix: str = "") -> None:
        super().__init__()
        inter = cfg.total_intermediate_size
        gate_up = ("gate_proj", "up_proj")
        self.gate_up_proj = LoRALinear(cfg.hidden_size, (inter, inter),
                                       tuple(lora_prefix + m for m in gate_up), cfg.mlp_bias,
                                       cfg.dtype, device, "column", tp,
                                       linear_method=linear_method(cfg, prefix, gate_up))
        self.down_proj = LoRALinear(inter, (cfg.hidden_size,), (lora_prefix + "down_proj",),
                                    cfg.mlp_bias, cfg.dtype, device, "row", tp,
                                    linear_method=linear_method(cfg, prefix, ("down_proj",)))

    def forward(self, x: torch.Tensor, lora: LoRAKernelMeta | None) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x, lora)), lora)


class LlamaDecoderLayer(nn.Module):
    #: The attention, MLP and norm classes (a family whose parts differ subclasses them).
    attention_class: type[LlamaAttention] = LlamaAttention
    mlp_class: type[LlamaMLP] = LlamaMLP
    norm_class: type[RMSNorm] = RMSNorm

    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding,
                 device: torch.device, tp: TPGroup) -> None:
        super().__init__()
        self.self_attn = self.attention_class(cfg, layer_idx, rotary, device, tp)
        self.mlp = self.mlp_class(cfg, device, tp, f"{layer_prefix(layer_idx)}.mlp")
        self.input_layernorm = self.norm_class(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype,
                                               device)
        self.post_attention_layernorm = self.norm_class(cfg.hidden_size, cfg.rms_norm_eps,
                                                        cfg.dtype, device)

    def pre_attention(self, x: torch.Tensor, residual: torch.Tensor | None,
                      lora: LoRAKernelMeta | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, residual) → (qkv [T, q + 2 kv], residual)``: the input norm (the residual
        add fused into it; the first layer has no residual yet: ``residual = x``), then
        ``qkv_proj`` (+ LoRA).

        Each residual add is fused into the next RMSNorm (vLLM's ``fused_add_rms_norm``):
        ``h = x + residual; x = norm(h); residual = h``.
        """
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        return self.self_attn.qkv_proj(x, lora), residual

    def post_attention(self, o: torch.Tensor, residual: torch.Tensor,
                       lora: LoRAKernelMeta | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(attention output [T, q_size], residual) → (mlp output, residual stream before
        it)``: ``o_proj`` (+ LoRA; all-reduced), the post-attention norm with the residual
        add fused, the MLP (+ LoRA); the next norm adds the two."""
        x = self.self_attn.o_proj(o, lora)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x, lora), residual


class LlamaModel(nn.Module):
    #: The decoder layer's and the final norm's classes (a family whose layers differ
    #: subclasses them).
    layer_class: type[LlamaDecoderLayer] = LlamaDecoderLayer
    norm_class: type[RMSNorm] = RMSNorm

    def __init__(self, cfg: ModelConfig, device: torch.device, tp: TPGroup) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, cfg.dtype, device, tp)
        self.rotary = RotaryEmbedding(cfg.hf_config, cfg.head_dim, cfg.max_model_len).to(device)
        self.layers = nn.ModuleList(
            self.layer_class(cfg, i, self.rotary, device, tp) for i in range(cfg.num_layers))
        self.norm = self.norm_class(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype, device)


class LlamaForCausalLM(nn.Module):
    """A LLaMA-family causal LM whose projections all run through ``LoRALinear``.

    Args:
        cfg: the model shape and dtype; the whole model's, or sharded for ``tp.size`` ranks.
            ``self.cfg`` is the rank's (``cfg.shard(tp.size, tp.rank)``): its head counts and
            intermediate size are this rank's, which is what KV cache allocation and the
            model runner read.
        device: where parameters are allocated (uninitialised; the weight loader fills them).
        tp: the tensor-parallel group (None: one rank). Every parameter is then the rank's
            slice (``tp_slices``), and forward and ``compute_logits`` are collectives that
            all ranks run together on the same batch.

    Forward: ``input_ids`` and ``positions`` int64 ``[T]``, one ``KVCache`` per layer
    (``data [2, num_blocks, block_size, num_kv_heads, head_dim]`` in the model dtype, or int8 /
    float8_e4m3fn with float32 ``scale [2, num_blocks, block_size, num_kv_heads]``), the
    step's attention metadata and LoRA mapping → hidden states ``[T, hidden_size]`` in the
    model dtype (the whole hidden state on every rank; the KV caches hold the rank's KV
    heads).
    ``compute_logits(hidden [N, hidden], rows) → float32 [N, vocab]`` on every rank
    (``rows``: the LoRA mapping of those ``N`` rows, for ``lm_head`` adapters).

    Attributes:
        slot_table: the ``SlotTable`` over all slot buffers (None until
            ``create_lora_slots``, and without LoRA).
        embed_lora, head_lora: the ``embed_tokens`` / ``lm_head`` adapter slots
            (``manylora.lora.vocab``); None unless ``lora_target_modules`` names them.

    Raises:
        ValueError: ``cfg`` sharded for another number of ranks than ``tp``, or a shape that
            does not split over them (``ModelConfig.shard``).
    """

    #: The decoder stack's class (a family whose layers differ subclasses it).
    model_class: type[LlamaModel] = LlamaModel

    def __init__(self, cfg: ModelConfig, device: torch.device, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.tp = tp or TPGroup.single()
        if cfg.tp_size not in (1, self.tp.size):
            raise ValueError(f"the config is sharded for {cfg.tp_size} ranks, the group "
                             f"has {self.tp.size}")
        cfg = cfg.shard(self.tp.size, self.tp.rank)
        self.cfg = cfg
        self.model = self.model_class(cfg, device, self.tp)
        self.lm_head = None if cfg.tie_word_embeddings else Embedding(
            cfg.vocab_size, cfg.hidden_size, cfg.dtype, device, self.tp)
        self.slot_table: SlotTable | None = None
        self.embed_lora: EmbeddingLoRA | None = None
        self.head_lora: HeadLoRA | None = None

    def _projections(self, layer: int) -> tuple[LoRALinear, ...]:
        layer_mod = self.model.layers[layer]
        return (layer_mod.self_attn.qkv_proj, layer_mod.self_attn.o_proj,
                layer_mod.mlp.gate_up_proj, layer_mod.mlp.down_proj)

    def create_lora_slots(self, lora_config: LoRAConfig) -> dict[tuple[int, str], LoRASlots]:
        """Allocate every layer's slot buffers once, and the ``SlotTable`` over them
        (``slot_table``); ``{(layer, module): slots}``. Under tensor parallelism the slots
        hold the rank's part of each adapter (sharded further with
        ``lora_config.fully_sharded_loras``).

        Raises:
            ValueError: ``fully_sharded_loras`` with ``max_lora_rank`` or ``hidden_size`` not
                divisible by the number of ranks.
        """
        slots: dict[tuple[int, str], LoRASlots] = {}
        for i in range(len(self.model.layers)):
            for proj in self._projections(i):
                lora = proj.create_lora_slots(lora_config.target_modules, lora_config.max_loras,
                                              lora_config.max_lora_rank,
                                              lora_config.fully_sharded_loras,
                                              lora_config.dtype)
                if lora is not None:
                    slots.update({(i, name): lora for name in lora.module_names})
            slots.update(self._create_layer_lora(i, lora_config))
        slots.update(self._create_vocab_lora(lora_config))
        self.slot_table = SlotTable(slots, lora_config.max_loras,
                                    next(self.parameters()).device)
        return slots

    def _create_layer_lora(self, layer: int, lora_config: LoRAConfig
                           ) -> dict[tuple[int, str], SlotColumns]:
        """Slot buffers of layer ``layer`` beyond its ``_projections``' (a MoE block's
        experts); none in a dense decoder."""
        return {}

    def _create_vocab_lora(self, lora_config: LoRAConfig) -> dict[tuple[int, str], LoRASlots]:
        """The ``embed_tokens`` / ``lm_head`` slots ``lora_config.target_modules`` names
        (``embed_lora`` / ``head_lora``), keyed ``(MODEL_LAYER, module)``; the head's B cut
        to this rank's vocabulary rows."""
        cfg, names = self.cfg, lora_config.target_modules
        args = (lora_config.max_loras, lora_config.max_lora_rank,
                lora_config.dtype or cfg.dtype, next(self.parameters()).device)
        if "embed_tokens" in names:
            self.embed_lora = EmbeddingLoRA(cfg.vocab_size, cfg.hidden_size, *args)
        if "lm_head" in names:
            head = self.model.embed_tokens if self.lm_head is None else self.lm_head
            self.head_lora = HeadLoRA(cfg.hidden_size, cfg.vocab_size,
                                      (head.vocab_start, head.vocab_end), *args)
        return {(MODEL_LAYER, m.slots.module_names[0]): m.slots
                for m in (self.embed_lora, self.head_lora) if m is not None}

    def _projection(self, layer: int, module: str) -> LoRALinear:
        for proj in self._projections(layer):
            if module in proj.module_names:
                return proj
        raise ValueError(f"no projection {module!r} in layer {layer}")

    def lora_module_weight(self, layer: int, module: str) -> torch.Tensor:
        """The base weight ``[out, in]`` of one LoRA-targetable projection (a view into the
        packed weight), e.g. ``(3, "k_proj")``; this rank's slice under tensor parallelism.

        Raises:
            ValueError: no such module in the layer.
        """
        return self._projection(layer, module).module_weight(module)

    def lora_dora_norm(self, layer: int, module: str, a: torch.Tensor,
                       b: torch.Tensor) -> torch.Tensor:
        """``||W + b @ a||`` per output row of the whole base weight of ``(layer, module)``,
        float32 ``[out]`` on the model's device and on every rank (``AdapterTarget.dora_norm``;
        ``dora_row_norm_tp``). A collective under tensor parallelism: all ranks must read
        their adapters, module by module, in the same order.

        Args:
            a: the adapter's whole ``[r, in]``; b: its whole ``[out, r]`` (scaling folded).

        Raises:
            ValueError: no such module in the layer.
        """
        return self._projection(layer, module).dora_norm(module, a, b)

    def lora_base_weight_equal(self, module: str, weight: torch.Tensor) -> bool:
        """Whether ``weight [vocab, hidden]`` (cast to the model dtype) equals the base
        ``embed_tokens`` or ``lm_head`` table (``"lm_head"`` of a tied model: the
        embedding), on every rank (``AdapterTarget.base_weight_equal``). A collective
        under tensor parallelism (each rank compares its vocabulary rows; one all-reduce),
        called as ``lora_dora_norm`` is."""
        table = (self.model.embed_tokens if module == "embed_tokens" or self.lm_head is None
                 else self.lm_head)
        base = table.linear_method.dense_weight(table)
        lo, hi = table.vocab_start, table.vocab_end
        same = tuple(weight.shape) == (self.cfg.vocab_size, base.shape[1]) and torch.equal(
            base[: hi - lo], weight[lo:hi].to(base.device, base.dtype))
        if self.tp.size == 1:
            return same
        differ = torch.tensor([0.0 if same else 1.0], device=base.device)
        return float(self.tp.all_reduce(differ)) == 0.0

    def embed(self, input_ids: torch.Tensor, lora: LoRAKernelMeta | None = None
              ) -> torch.Tensor:
        """int64 ``[T]`` token ids → ``[T, hidden]`` in the model dtype (all-reduced under
        tensor parallelism), each row's ``embed_tokens`` adapter delta added (``lora``: the
        step's mapping). A family that scales its embedding overrides this and scales the
        result, as HF scales the adapted ``embed_tokens`` output."""
        x = self.model.embed_tokens(input_ids)
        if self.embed_lora is not None:
            self.embed_lora.add_(input_ids, x, lora)
        return x

    def final_norm(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The last layer's ``(mlp output, residual)`` → hidden states ``[T, hidden]``."""
        return self.model.norm(x, residual)[0]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], attn: AttentionMetadata,
                lora: LoRAKernelMeta | None) -> torch.Tensor:
        """The layers in order: per layer ``pre_attention`` → ``rotate`` → ``attend`` →
        ``post_attention``, then ``final_norm``; the piecewise CUDA graphs
        (``worker/piecewise_graphs.py``) run the same methods, captured between the
        ``attend`` calls."""
        x, residual = self.embed(input_ids, lora), None                 # [T, H]
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            qkv, residual = layer.pre_attention(x, residual, lora)
            q, k, v = layer.self_attn.rotate(positions, qkv)
            o = layer.self_attn.attend(q, k, v, kv_cache, attn)
            x, residual = layer.post_attention(o, residual, lora)
        return self.final_norm(x, residual)

    def compute_logits(self, hidden: torch.Tensor, rows: LoRAKernelMeta | None = None
                       ) -> torch.Tensor:
        """``hidden [N, hidden] → float32 [N, vocab]``: under tensor parallelism each rank's
        vocabulary rows, all-gathered, the padding past ``vocab_size`` dropped. ``rows``:
        the LoRA mapping of these ``N`` rows (``lm_head`` adapters add their delta to the
        head's output, before the cast; None: the base head). A family that rescales or
        soft-caps its logits overrides this, passing ``rows`` on."""
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        logits = head.linear_method.apply(head, hidden)                # [N, vocab / tp]
        if self.head_lora is not None:
            self.head_lora.add_(hidden, logits, rows)
        logits = logits.float()
        if self.tp.size == 1:
            return logits
        logits = self.tp.all_gather(logits, dim=-1)                    # [N, padded vocab]
        vocab = self.cfg.vocab_size
        return logits if logits.shape[-1] == vocab else logits[:, :vocab].contiguous()
