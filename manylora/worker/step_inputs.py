"""A step's model inputs as one int32 buffer: its layout, and the persistent host/device
buffers every rank copies it through (vLLM v1's ``CpuGpuBuffer``s, in one buffer).

Rank 0's ``InputBatch`` writes a step into the pinned host buffer; one host → device copy
moves it; every tensor the forward pass reads (ids, positions, query starts, sequence
lengths, the attention tiles, the LoRA mapping, the rows sampled and the sampling columns)
is a view of the persistent device buffer. The segments a CUDA graph reads come first and
their offsets depend only on the padded token count (and ``max_loras``): a decode graph
(whose sequence segments are padded too) and a piecewise graph (which reads ids, positions,
token rows and the LoRA mapping, ``worker/piecewise_graphs.py``) captured on them replay
after the copy with nothing copied in. Block-table changes travel as ``(flat index, block id)``
pairs, applied by one scatter to the persistent device block table, which every rank keeps
(tensor-parallel workers receive the same buffer, ``worker/step_codec.py``). Under async
scheduling a decode token's id may still be on the device (sampled by the step before,
whose tokens have not reached the host): ``prev_dst``/``prev_src`` gather it from that
step's sampled tokens into ``ids`` after the copy, before the forward pass.

Segments, in order, each starting at a multiple of 16 bytes (int32 unless noted; ``T`` rows
and ``B`` sequences, padding included; ``L = max_loras``):

====================  =============  =================================================
``ids``               T              token ids (0 for padding)
``positions``         T              position of each token in its sequence
``token_rows``        T              each token's block-table row, -1 for padding
``rope_rows``         T              (``longrope`` models only) each token's RoPE table row
LoRA (when present)   2T + 3L + 3NT  ``lora.punica.lora_kernel_meta_from_buffer``'s layout
``seq_rows``          B              each sequence's block-table row (0 for padding)
``query_start``       B              first token row of each sequence
``query_lens``        B              new tokens per sequence (1 for padding)
``seq_lens``          B              tokens in the cache after the step (0 for padding)
``tile_seq``          num_tiles      attention tiles (``ops.attention_metadata.attention_tiles``)
``tile_query``        num_tiles
``table_index``       U              flat ``row * W + col`` of each block-table write
``table_value``       U              the block id written there
``prev_dst``          K              token rows whose id the previous step sampled
``prev_src``          K              that token's index among the previous step's samples
``sample_rows``       N              the token rows whose logits are sampled
``temperature``       N float32      the sampled rows' sampling columns (rank 0 only
``top_k``             N              reads them)
``top_p``             N float32
``min_p``             N float32
``prompt_rows``       P              token rows whose logits give prompt log-probabilities
``prompt_targets``    P              the prompt token each of them predicts (rank 0 reads)
====================  =============  =================================================
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from manylora.lora.kernels.meta import lora_segment_size

#: ``StepLayout.variant`` codes: no LoRA segment, BGMV, SGMV, row tiles.
LORA_VARIANT_CODES = (None, "bgmv", "sgmv", "tiled")


class StepLayout(NamedTuple):
    """The sizes and host constants of one step's buffer (all ints: it travels to the
    tensor-parallel workers as a list).

    Attributes:
        num_tokens: T, token rows including padding (the graph bucket on a graph step, the
            piece bucket on a piecewise step).
        num_seqs: B, sequences including padding.
        num_tiles: attention tiles; num_decode_tiles: the leading decode tiles.
        table_width: W, columns of the step's gathered block table.
        variant: index into ``LORA_VARIANT_CODES`` (0: no LoRA row, no LoRA segment).
        max_seg_len: the LoRA kernels' grid bound (``LoRAKernelMeta.max_seg_len``).
        num_table_updates: U, block-table writes this step.
        num_sampled: N, rows sampled.
        sample_prefix: 1 when the sampled rows are exactly ``0..N-1`` (a decode step).
        bucket: the CUDA-graph batch size, -1: eager.
        table_rows: rows the block table must have (its capacity on rank 0).
        num_prev: K, token ids taken from the previous step's sampled tokens on the device
            (async scheduling; 0 otherwise).
        pieces: the piecewise CUDA-graph token bucket (= ``num_tokens``; the token segments
            padded to it, the sequence segments not), -1: not a piecewise step.
        lora_block_m: the tiled variant's tile height (0: no tiles).
        lora_tiles: NT, entries of the LoRA mapping's tile arrays (``max_row_tiles`` of the
            padded rows on a graph step; 0: no tiles).
        lora_mask: a decode graph step's projection mask (``SlotTable.kind_mask`` of its
            slots, computed on rank 0 so every tensor-parallel rank picks the same graph);
            -1: every projection (eager and piecewise steps, and steps without LoRA).
        num_prompt_lp: P, token rows whose prompt log-probabilities the step computes
            (``SamplingParams.prompt_logprobs``; every rank runs their logits, a
            collective under tensor parallelism); 0: none.
        rope_rows: 1 when the step carries a ``rope_rows`` segment (a ``longrope`` model:
            the rows of its RoPE table the model reads instead of the positions,
            ``model.layers.rotary.rope_rows``); 0: none, the model reads the positions.
    """

    num_tokens: int
    num_seqs: int
    num_tiles: int
    num_decode_tiles: int
    table_width: int
    variant: int
    max_seg_len: int
    num_table_updates: int
    num_sampled: int
    sample_prefix: int
    bucket: int
    table_rows: int
    num_prev: int = 0
    pieces: int = -1
    lora_block_m: int = 0
    lora_tiles: int = 0
    lora_mask: int = -1
    num_prompt_lp: int = 0
    rope_rows: int = 0


class StepInputs(NamedTuple):
    """One step's inputs, the same on every rank.

    Attributes:
        layout: the segment sizes and host constants.
        data: int32 ``[total]`` numpy array, the segments (``segment_sizes``).
    """

    layout: StepLayout
    data: np.ndarray


def segment_sizes(layout: StepLayout, max_loras: int) -> list[tuple[str, int]]:
    """``[(name, length), ...]`` of the segments, in buffer order (module doc)."""
    t, b, nt, n = layout.num_tokens, layout.num_seqs, layout.num_tiles, layout.num_sampled
    sizes = [("ids", t), ("positions", t), ("token_rows", t)]
    if layout.rope_rows:
        sizes.append(("rope_rows", t))
    if layout.variant:
        sizes.append(("lora", lora_segment_size(t, max_loras, layout.lora_tiles)))
    sizes += [("seq_rows", b), ("query_start", b), ("query_lens", b), ("seq_lens", b),
              ("tile_seq", nt), ("tile_query", nt)]
    u = layout.num_table_updates
    k = layout.num_prev
    sizes += [("table_index", u), ("table_value", u), ("prev_dst", k), ("prev_src", k),
              ("sample_rows", n), ("temperature", n),
              ("top_k", n), ("top_p", n), ("min_p", n),
              ("prompt_rows", layout.num_prompt_lp), ("prompt_targets", layout.num_prompt_lp)]
    return sizes


#: Every segment starts at a multiple of this many int32 elements (16 bytes), so each view
#: a Triton kernel receives has the same pointer alignment at every step (Triton
#: specializes its kernels on it: one compiled variant, not one per offset pattern).
ALIGN = 4


def _offsets(layout: StepLayout, max_loras: int) -> tuple[list[tuple[str, int, int]], int]:
    """``([(name, start, length), ...], total)`` with every start aligned to ``ALIGN``."""
    out, start = [], 0
    for name, size in segment_sizes(layout, max_loras):
        out.append((name, start, size))
        start += -(-size // ALIGN) * ALIGN
    return out, start


def split_segments(buf, layout: StepLayout, max_loras: int) -> dict:
    """``{name: view}`` of ``buf`` (a numpy array or a tensor) cut by ``segment_sizes``,
    each segment starting at a multiple of ``ALIGN``; the float32 columns are
    reinterpreted, not converted."""
    views = {name: buf[start:start + size]
             for name, start, size in _offsets(layout, max_loras)[0]}
    for name in ("temperature", "top_p", "min_p"):
        v = views[name]
        views[name] = v.view(np.float32) if isinstance(v, np.ndarray) else v.view(torch.float32)
    return views


def total_size(layout: StepLayout, max_loras: int) -> int:
    """Length of the step buffer, int32 elements (alignment gaps included)."""
    return _offsets(layout, max_loras)[1]


#: Layouts whose device views ``StepBuffers`` keeps (a decode step repeats its layout, so
#: most steps cut no new views: about 20 tensor slices saved per step).
MAX_CACHED_LAYOUTS = 256


class StepBuffers:
    """The persistent buffers a rank copies its steps through: a pinned host buffer, a
    device buffer of the same length, and the device block table.

    A step that fits ``capacity`` goes through the persistent pair (graph steps always do:
    the CUDA graphs read views of the device buffer); a larger eager step gets buffers of
    its own. Before the host buffer is rewritten, the previous step's copy out of it is
    waited for (an event), so the host never overwrites bytes still in flight.

    Args:
        capacity: int32 elements of the persistent pair.
        table_rows: initial rows of the device block table.
        table_width: W, block ids per row (``ceil(max_model_len / block_size)``).
        device: the rank's device.
        long_rows: the model's ``RotaryEmbedding.long_rows`` (``longrope``: every step
            carries a ``rope_rows`` segment); None: no such segment.

    Attributes:
        block_table: int32 ``[rows, W]`` on ``device``, each row a request's physical
            blocks (only ``ceil(seq_len / block_size)`` leading entries are meaningful).
        frozen: once True (a graph captured views of ``block_table``), the table never
            grows again.
    """

    def __init__(self, capacity: int, table_rows: int, table_width: int,
                 device: torch.device, long_rows: tuple[int, int] | None = None) -> None:
        self.device = device
        self.capacity = capacity
        self.long_rows = long_rows
        self.rope_rows = int(long_rows is not None)
        pinned = device.type == "cuda"
        self.host = torch.zeros(capacity, dtype=torch.int32, pin_memory=pinned)
        self.host_np = self.host.numpy()
        self.dev = torch.zeros(capacity, dtype=torch.int32, device=device)
        self.block_table = torch.zeros(table_rows, table_width, dtype=torch.int32,
                                       device=device)
        self.frozen = False
        self._copied = torch.cuda.Event() if pinned else None
        self._views: dict[StepLayout, dict] = {}     # views of ``dev`` by layout

    def host_array(self, size: int) -> np.ndarray:
        """An int32 host array of ``size`` to pack a step into: the persistent pinned
        buffer (once its last copy has left) when the step fits, else a new one."""
        if size <= self.capacity:
            if self._copied is not None:
                self._copied.synchronize()
            return self.host_np[:size]
        return torch.empty(size, dtype=torch.int32,
                           pin_memory=self.device.type == "cuda").numpy()

    def ensure_table_rows(self, rows: int) -> None:
        """Grow the device block table to ``rows`` rows (contents kept).

        Raises:
            RuntimeError: the table is frozen (CUDA graphs hold its address); a graph
                bucket bounds the batch, so this means more rows than the graphs allow.
        """
        have = self.block_table.shape[0]
        if rows <= have:
            return
        if self.frozen:
            raise RuntimeError(f"the block table needs {rows} rows but CUDA graphs were "
                               f"captured on its {have}: raise the largest capture size")
        grown = torch.zeros(rows, self.block_table.shape[1], dtype=torch.int32,
                            device=self.device)
        grown[:have] = self.block_table
        self.block_table = grown

    def upload(self, inputs: StepInputs, max_loras: int,
               prev_sampled: torch.Tensor | None = None) -> dict:
        """Copy the step to the device (one transfer), apply its block-table writes (one
        scatter) and gather the token ids still on the device:
        ``ids[prev_dst[k]] = prev_sampled[prev_src[k]]``; ``{segment name: device view}``.

        Args:
            inputs: the step's buffer.
            max_loras: L, for the LoRA segment's length.
            prev_sampled: int64 ``[N']``, the previous step's sampled tokens on this device;
                needed when ``inputs.layout.num_prev`` > 0.

        Raises:
            RuntimeError: as ``ensure_table_rows``; the step gathers sampled tokens but
                ``prev_sampled`` is None.
        """
        layout, data = inputs
        self.ensure_table_rows(layout.table_rows)
        size = data.shape[0]
        persistent = size <= self.capacity
        if persistent:
            if data.ctypes.data != self.host_np.ctypes.data:
                if self._copied is not None:
                    self._copied.synchronize()
                self.host_np[:size] = data
            src, dst = self.host[:size], self.dev[:size]
        else:
            src = torch.from_numpy(data)
            dst = torch.empty(size, dtype=torch.int32, device=self.device)
        dst.copy_(src, non_blocking=True)
        if persistent and self._copied is not None:
            self._copied.record()
        views = self._views.get(layout) if persistent else None
        if views is None:
            views = split_segments(dst, layout, max_loras)
            if persistent:
                if len(self._views) >= MAX_CACHED_LAYOUTS:
                    self._views.clear()
                self._views[layout] = views
        if layout.num_table_updates:
            self.block_table.view(-1).index_copy_(
                0, views["table_index"].long(), views["table_value"])
        if layout.num_prev:
            if prev_sampled is None:
                raise RuntimeError(f"the step takes {layout.num_prev} token ids from the "
                                   "previous step's samples, but none are on this device")
            views["ids"][views["prev_dst"]] = prev_sampled[views["prev_src"]].to(torch.int32)
        return views
