"""What the model reads of a step besides its token ids and positions, built on the device
from the step's buffer views: the attention metadata (cache locations, block tables) and
the LoRA kernels' ``LoRAKernelMeta``, with the projection mask a decode graph step
replays, and the mapping of the rows whose logits are computed (``lm_head`` adapters)."""

from __future__ import annotations

import numpy as np
import torch

from manylora.config import MODEL_LAYER
from manylora.lora.kernels.cost_model import LoRAVariantModel, ProjectionShape, gpu_model
from manylora.lora.kernels.meta import (
    LoRAKernelMeta,
    build_lora_kernel_meta,
    lora_kernel_meta_from_buffer,
)
from manylora.lora.linear import LoRALinear
from manylora.lora.slot_table import SlotTable
from manylora.model.llama import LlamaForCausalLM
from manylora.ops.attention_metadata import AttentionMetadata, cache_loc_from_block_table
from manylora.worker.step_inputs import (
    LORA_VARIANT_CODES,
    StepInputs,
    StepLayout,
    split_segments,
)


def attention_metadata(views: dict, layout: StepLayout, block_table: torch.Tensor,
                       block_size: int, block_q: int, num_queries_per_kv: int
                       ) -> AttentionMetadata:
    """The step's ``AttentionMetadata``: the cache location of every token row (-1 on
    padding) and the step's block tables gathered from the persistent device table
    (int32 ``[rows, max_blocks_per_seq]``)."""
    return AttentionMetadata(
        cache_loc=cache_loc_from_block_table(views["positions"], views["token_rows"],
                                                block_table, block_size),
        block_tables=block_table[:, :layout.table_width].index_select(0, views["seq_rows"]),
        query_start=views["query_start"], query_lens=views["query_lens"],
        context_lens=views["seq_lens"], tile_seq=views["tile_seq"],
        tile_query=views["tile_query"], num_decode_tiles=layout.num_decode_tiles,
        prefill_block_q=block_q, block_size=block_size,
        num_queries_per_kv=num_queries_per_kv, seqs=())


def lora_kernel_meta(views: dict, layout: StepLayout, max_loras: int,
                     table: SlotTable | None, host: np.ndarray | None = None,
                     mask: int | None = None) -> LoRAKernelMeta | None:
    """The step's ``LoRAKernelMeta`` over its device buffer (None without a LoRA row).
    Graph steps get fixed shapes (``padded``); a piecewise step on the CPU keeps the host
    segments the PyTorch reference reads (its ``max_seg_len`` is the bucket). An unpadded
    step with ``host`` (its host buffer) carries ``used_columns`` from the slot table's
    host mirror: its projections that none of its slots targets launch nothing. Every
    tensor-parallel rank computes the same from its own table. A padded mapping with a
    ``mask`` short of every kind launches only the projections of the mask's kinds
    (``SlotTable.mask_columns``)."""
    if not layout.variant:
        return None
    buf = views["lora"]
    padded = layout.bucket >= 0 or (layout.pieces >= 0 and buf.is_cuda)
    lora_host = None
    if host is not None and table is not None and not padded:
        lora_host = split_segments(host, layout, max_loras)["lora"]
    columns = None
    if padded and table is not None and mask is not None and mask != table.full_mask:
        columns = table.mask_columns(mask)
    return lora_kernel_meta_from_buffer(buf, layout.num_tokens, max_loras,
                                        layout.max_seg_len, LORA_VARIANT_CODES[layout.variant],
                                        padded=padded,
                                        ranks_host=None if table is None else table.ranks_host,
                                        host=lora_host, num_tiles=layout.lora_tiles,
                                        block_m=layout.lora_block_m, columns=columns)


def logits_rows_meta(host: np.ndarray, layout: StepLayout, max_loras: int,
                     table: SlotTable, device: torch.device, segment: str,
                     span: tuple[int, int] | None = None) -> LoRAKernelMeta | None:
    """The LoRA mapping of the rows whose logits a step computes (the reference's
    ``prompt_lora_mapping``, one slot per row): the slot of each of the token rows listed
    in ``segment`` of the step's host buffer (``"sample_rows"`` or ``"prompt_rows"``;
    ``span``: its entries ``[lo, hi)`` only), from the step's per-token slots; built on the
    host and copied once (``build_lora_kernel_meta``), with ``used_columns`` from the slot
    table's host mirror. None when the step has no LoRA row or none of these rows' adapters
    targets ``lm_head`` (``table`` has its column). Every tensor-parallel rank computes the
    same from its own copy of the buffer.
    """
    if not layout.variant:
        return None
    views = split_segments(host, layout, max_loras)
    rows = views[segment] if span is None else views[segment][span[0]: span[1]]
    slots = views["lora"][: layout.num_tokens][rows]
    head = table.ranks_host[:, table.column(MODEL_LAYER, "lm_head")]
    if not head[slots[slots >= 0]].any():
        return None
    return build_lora_kernel_meta(slots, max_loras, device, ranks_host=table.ranks_host)


def with_projection_mask(inputs: StepInputs, table: SlotTable | None, max_loras: int
                         ) -> StepInputs:
    """A decode graph step with LoRA rows gets its projection mask in its layout
    (``SlotTable.kind_mask`` of its active slots, from the host mirror); other steps are
    returned as they are."""
    layout = inputs.layout
    if layout.bucket < 0 or not layout.variant or table is None:
        return inputs
    lora = split_segments(inputs.data, layout, max_loras)["lora"]
    start = 2 * layout.num_tokens
    mask = table.kind_mask(lora[start: start + max_loras])
    return StepInputs(layout._replace(lora_mask=mask), inputs.data)


def lora_variant_model(model: LlamaForCausalLM, device: torch.device
                       ) -> LoRAVariantModel | None:
    """The ``LoRAVariantModel`` of ``model``'s first layer (its LoRA projections' ``in``
    and slice widths, the slot buffers' rank and element size) on ``device``'s
    ``gpu_model``; None without LoRA slots."""
    shapes, rank, size = [], 0, 2
    for m in model.model.layers[0].modules():
        slots = getattr(m, "lora", None)
        if isinstance(m, LoRALinear) and slots is not None:
            a = slots.lora_a_stacked[0]
            shapes.append(ProjectionShape(a.shape[2], tuple(n for _, n in slots.output_slices)))
            rank, size = max(rank, a.shape[1]), a.element_size()
    if not shapes:
        return None
    return LoRAVariantModel(tuple(shapes), rank, gpu_model(device), size)
