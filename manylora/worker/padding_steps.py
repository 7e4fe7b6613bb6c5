"""The all-padding steps CUDA graphs are captured with: a decode step of ``size`` padding
rows (``DecodeGraphs``) and a piecewise step of ``size`` padding tokens and no sequence
(``PiecewiseGraphs``), in the runner's persistent host buffer. Padding rows write nothing
to the KV cache (token rows -1) and sit on no adapter."""

from __future__ import annotations

import numpy as np

from manylora.lora.kernels.cost_model import graph_block_m
from manylora.lora.kernels.meta import fill_lora_segment, lora_kernel_meta_arrays
from manylora.lora.kernels.row_tiles import max_row_tiles
from manylora.worker.step_inputs import (
    LORA_VARIANT_CODES,
    StepBuffers,
    StepInputs,
    StepLayout,
    split_segments,
    total_size,
)


def padding_decode_step(buffers: StepBuffers, size: int, variant: int, max_loras: int,
                        max_blocks_per_seq: int) -> StepInputs:
    """A decode step of ``size`` padding rows under LoRA kernel ``variant`` (an index of
    ``LORA_VARIANT_CODES``): the layout decode graphs are captured with."""
    layout = StepLayout(num_tokens=size, num_seqs=size, num_tiles=size,
                        num_decode_tiles=size, table_width=max_blocks_per_seq,
                        variant=variant, max_seg_len=size, num_table_updates=0,
                        num_sampled=0, sample_prefix=1, bucket=size,
                        table_rows=buffers.block_table.shape[0], rope_rows=buffers.rope_rows,
                        **graph_tiles(size, variant, max_loras))
    data = buffers.host_array(total_size(layout, max_loras))
    v = split_segments(data, layout, max_loras)
    data[:] = 0
    v["token_rows"][:] = -1
    v["query_start"][:] = np.arange(size)
    v["query_lens"][:] = 1
    v["tile_seq"][:] = np.arange(size)
    if variant:
        _base_rows_lora(v["lora"], size, max_loras, layout)
    return StepInputs(layout, data)


def padding_piece_step(buffers: StepBuffers, size: int, variant: int, max_loras: int
                       ) -> StepInputs:
    """A piecewise step of ``size`` padding tokens and no sequence: the layout piece graphs
    are captured with (the token segments at the bucket's offsets)."""
    layout = StepLayout(num_tokens=size, num_seqs=0, num_tiles=0, num_decode_tiles=0,
                        table_width=1, variant=variant, max_seg_len=size,
                        num_table_updates=0, num_sampled=0, sample_prefix=1, bucket=-1,
                        table_rows=buffers.block_table.shape[0], pieces=size,
                        rope_rows=buffers.rope_rows, **graph_tiles(size, variant, max_loras))
    data = buffers.host_array(total_size(layout, max_loras))
    v = split_segments(data, layout, max_loras)
    data[:] = 0
    v["token_rows"][:] = -1
    if variant:
        _base_rows_lora(v["lora"], size, max_loras, layout)
    return StepInputs(layout, data)


def graph_tiles(size: int, variant: int, max_loras: int) -> dict:
    """The tile fields of a graph layout of ``size`` rows: ``graph_block_m`` and its
    ``max_row_tiles`` bound for the tiled variant, none otherwise."""
    if LORA_VARIANT_CODES[variant] != "tiled":
        return {}
    block_m = graph_block_m(size, max_loras)
    return dict(lora_block_m=block_m, lora_tiles=max_row_tiles(size, max_loras, block_m))


def _base_rows_lora(lora: np.ndarray, size: int, max_loras: int, layout: StepLayout) -> None:
    """Fill a LoRA segment (``lora_kernel_meta_from_buffer``'s layout) with the mapping of
    ``size`` base rows: no row on an adapter, no active slot, only padding tiles."""
    arrays = lora_kernel_meta_arrays(np.full(size, -1), max_loras)
    fill_lora_segment(lora, arrays, layout.lora_block_m,
                      layout.lora_tiles if layout.lora_block_m else None)
