"""Steps that are not decode-only, replayed as piecewise CUDA graphs (vLLM's piecewise
``CUDAGraphMode``): the model between attention calls is captured per token bucket, and
attention, whose metadata changes with every step's sequences, runs eagerly between the
pieces.

For a model of ``L`` layers there are ``L + 1`` pieces, each a sequence of the model's own
methods (``model/llama.py``; the eager forward runs the same methods in the same order):

* piece 0: embedding, layer 0's input norm, ``qkv_proj`` (+ LoRA), RoPE;
* piece ``i`` (1..L-1): layer ``i-1``'s ``o_proj`` (+ LoRA), post-attention norm and MLP
  (+ LoRA), layer ``i``'s input norm (residual add fused), ``qkv_proj``, RoPE;
* piece ``L``: layer ``L-1``'s ``o_proj``, post-attention norm, MLP, the final norm.

Between piece ``i`` and ``i + 1``, layer ``i``'s ``write_kv`` and ``paged_attention`` run
eagerly, reading q, k, v from the static ``qkv`` buffer and writing their output into the
static ``o`` buffer. The pieces read the step's ids, positions and LoRA mapping from the
runner's persistent device buffer, at offsets fixed by the token bucket
(``worker/step_inputs.py``), and pass the residual stream and q/k/v through static buffers
sized for the largest bucket and used as ``[:Tb]`` views, so memory does not grow with the
number of buckets. All graphs share one memory pool.

Without CUDA (or before capture) ``run`` executes the same pieces eagerly over the same
padded buffers, which is how the CPU tests check the composition.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from manylora.lora.kernels.meta import LoRAKernelMeta
from manylora.model.llama import LlamaForCausalLM
from manylora.ops.attention_metadata import AttentionMetadata
from manylora.ops.paged_kv import KVCache

logger = logging.getLogger(__name__)

#: Token buckets of piecewise steps by default (capped by ``max_num_batched_tokens``): close
#: enough that padding a step to its bucket adds little work. Steps of more tokens run
#: eagerly: their GPU time exceeds their launch time, and padding a compute-bound step to a
#: coarse bucket costs more than the launches it saves (BENCHMARKS.md).
DEFAULT_PIECE_SIZES = (16, 32, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512)

#: ``(token bucket, LoRA variant or None)``.
PieceKey = tuple[int, str | None]


class PiecewiseGraphs:
    """The ``L + 1`` pieces of the model per ``(token bucket, LoRA variant)``, captured as
    CUDA graphs or run eagerly.

    Args:
        model: the model whose pieces run (``pre_attention``, ``rotate``, ``attend``,
            ``post_attention`` of each layer; ``embed``, ``final_norm``).
        sizes: the token buckets; a step of ``n`` tokens is padded to the smallest ``>= n``.
        device: the model's device (the static buffers live there).

    Raises:
        ValueError: an empty or non-positive size.

    Static buffers (model dtype, ``Tmax`` = the largest bucket): ``qkv [Tmax, q + 2 kv]``
    (this rank's heads), ``residual [Tmax, hidden]``, ``o [Tmax, Hq, D]``, ``hidden [Tmax,
    hidden]``. A replay returns ``hidden[:Tb]``, valid until the next step.
    """

    def __init__(self, model: LlamaForCausalLM, sizes: Sequence[int],
                 device: torch.device) -> None:
        self.sizes = tuple(sorted(set(int(s) for s in sizes)))
        if not self.sizes or self.sizes[0] < 1:
            raise ValueError(f"piecewise token buckets must be positive, got {tuple(sizes)}")
        self.model = model
        cfg = model.cfg
        self.num_layers = cfg.num_layers
        t, dtype = self.sizes[-1], cfg.dtype
        self.qkv = torch.zeros(t, cfg.q_size + 2 * cfg.kv_size, dtype=dtype, device=device)
        self.residual = torch.zeros(t, cfg.hidden_size, dtype=dtype, device=device)
        self.o = torch.zeros(t, cfg.num_heads, cfg.head_dim, dtype=dtype, device=device)
        self.hidden = torch.zeros(t, cfg.hidden_size, dtype=dtype, device=device)
        self._graphs: dict[PieceKey, list[torch.cuda.CUDAGraph]] = {}
        self._views: dict[int, tuple[torch.Tensor, ...]] = {}    # q, k, v, o per bucket
        self._pool = None

    def bucket(self, num_tokens: int) -> int | None:
        """The token bucket of a step of ``num_tokens`` tokens, or None (run eagerly)."""
        for size in self.sizes:
            if size >= num_tokens:
                return size
        return None

    @property
    def num_graphs(self) -> int:
        """Piece graphs captured (``L + 1`` per key)."""
        return sum(len(g) for g in self._graphs.values())

    def has(self, key: PieceKey) -> bool:
        """Whether ``key`` has its pieces captured."""
        return key in self._graphs

    def _piece(self, i: int, tb: int, ids: torch.Tensor, positions: torch.Tensor,
               lora: LoRAKernelMeta | None) -> None:
        """Piece ``i`` over the first ``tb`` rows: reads ``ids`` / ``positions`` (int32
        ``[tb]``, device views of the step buffer) and the static ``o`` and ``residual``,
        writes the static ``qkv`` (RoPE applied) and ``residual``, or ``hidden`` (last
        piece)."""
        layers = self.model.model.layers
        if i == 0:
            x, residual = self.model.embed(ids.long(), lora), None
        else:
            x, residual = layers[i - 1].post_attention(
                self.o[:tb].view(tb, -1), self.residual[:tb], lora)
        if i == self.num_layers:
            self.hidden[:tb].copy_(self.model.final_norm(x, residual))
            return
        qkv, residual = layers[i].pre_attention(x, residual, lora)
        self.qkv[:tb].copy_(qkv)
        self.residual[:tb].copy_(residual)
        layers[i].self_attn.rotate(positions.long(), self.qkv[:tb])

    def _attend(self, i: int, tb: int, kv_cache: KVCache, attn: AttentionMetadata) -> None:
        """Layer ``i``'s eager part: ``write_kv`` and ``paged_attention`` from the static
        ``qkv`` (already rotated) into the static ``o``."""
        views = self._views.get(tb)
        if views is None:
            cfg = self.model.cfg
            q, k, v = self.qkv[:tb].split((cfg.q_size, cfg.kv_size, cfg.kv_size), dim=-1)
            views = (q.view(tb, cfg.num_heads, cfg.head_dim),
                     k.view(tb, cfg.num_kv_heads, cfg.head_dim),
                     v.view(tb, cfg.num_kv_heads, cfg.head_dim), self.o[:tb])
            self._views[tb] = views
        q, k, v, o = views
        self.model.model.layers[i].self_attn.attend(q, k, v, kv_cache, attn, out=o)

    def run(self, key: PieceKey, ids: torch.Tensor, positions: torch.Tensor,
            lora: LoRAKernelMeta | None, attn: AttentionMetadata,
            kv_caches: Sequence[KVCache]) -> torch.Tensor:
        """One step: piece 0, then per layer its eager attention and the next piece; each
        piece a graph replay when ``key`` was captured, else run eagerly.

        Args:
            key: ``(Tb, variant)``; the step's token segments are padded to ``Tb``.
            ids, positions: int32 ``[Tb]`` device views of the step buffer (a captured graph
                reads them where they were at capture: the runner's persistent buffer).
            lora: the step's mapping over ``Tb`` rows (None: no LoRA row); ignored by a
                captured graph, which reads the mapping's buffer in place.
            attn: the step's attention metadata (``cache_loc`` over ``Tb`` rows, -1 on
                padding; sequence tensors unpadded).
            kv_caches: one ``KVCache`` per layer.

        Returns:
            hidden states ``[Tb, hidden]``: a view of the static ``hidden`` buffer.
        """
        tb = key[0]
        graphs = self._graphs.get(key)
        for i in range(self.num_layers + 1):
            if graphs is None:
                self._piece(i, tb, ids, positions, lora)
            else:
                graphs[i].replay()
            if i < self.num_layers:
                self._attend(i, tb, kv_caches[i], attn)
        return self.hidden[:tb]

    def capture(self, key: PieceKey, ids: torch.Tensor, positions: torch.Tensor,
                lora: LoRAKernelMeta | None) -> None:
        """Capture the ``L + 1`` pieces of ``key`` on these inputs (views of the persistent
        step buffer, at the offsets the bucket fixes; ``lora`` a padded mapping over them),
        each after one eager warm-up run on a side stream (JIT, allocator), into the shared
        pool. Attention is not run: the pieces read the static buffers as they are."""
        tb = key[0]
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graphs = []
        stream = torch.cuda.Stream()
        for i in range(self.num_layers + 1):
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._piece(i, tb, ids, positions, lora)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                self._piece(i, tb, ids, positions, lora)
            graphs.append(graph)
        self._graphs[key] = graphs
        logger.debug("captured %d piece graphs for %d tokens, LoRA variant %s",
                     len(graphs), *key)

    def release(self) -> None:
        """Destroy every captured piece graph and their pool (before the process group under
        tensor parallelism, as ``DecodeGraphs.release``); later steps run the pieces
        eagerly."""
        if self._graphs:
            torch.cuda.synchronize()
        for graphs in self._graphs.values():
            for graph in graphs:
                graph.reset()
        self._graphs.clear()
        self._pool = None
