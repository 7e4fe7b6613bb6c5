"""A step's host inputs as flat tensors, for rank 0 to broadcast to the other ranks.

Every rank builds the same attention metadata and LoRA mapping from the same
``StepInputs``, so the ranks run the same kernels with the same shapes and their
collectives line up. Only integers travel: token ids and positions, the per-sequence
lengths, block tables and per-row slots, all in one int64 tensor, and a few scalars.
"""

from __future__ import annotations

import torch

from manylora.worker.model_runner import StepInputs

_FIELDS = ("ids", "positions", "query_lens", "context_lens", "table_lens", "tables",
           "token_slots", "slot_ranks", "slot_dora", "sample_rows")


def encode_step(inputs: StepInputs) -> dict:
    """``StepInputs`` → ``{"step": int64 CPU tensor, "lens": [int, ...], "bucket": int}``.

    ``step`` holds, one after the other, the token ids, positions, per-sequence query and
    context lengths, block-table lengths, the block tables concatenated, the per-row slots,
    the slots' ranks and DoRA flags, and the sampled rows; ``lens`` gives each part's
    length, ``bucket`` the graph batch size (-1: eager). One tensor, so a step costs one
    tensor broadcast besides the header.
    """
    parts = [inputs.ids, inputs.positions, inputs.query_lens, inputs.context_lens,
             [len(t) for t in inputs.block_tables], [b for t in inputs.block_tables for b in t],
             inputs.token_slots, inputs.slot_ranks, inputs.slot_dora, inputs.sample_rows]
    return {"step": torch.tensor([v for part in parts for v in part], dtype=torch.int64),
            "lens": [len(part) for part in parts],
            "bucket": -1 if inputs.bucket is None else int(inputs.bucket)}


def decode_step(data: dict) -> StepInputs:
    """The inverse of :func:`encode_step` (the tensor on any device).

    Raises:
        KeyError: a field is missing; ValueError: ``lens`` does not match the tensor.
    """
    flat = data["step"].cpu().tolist()
    lens = [int(n) for n in data["lens"]]
    if len(lens) != len(_FIELDS) or sum(lens) != len(flat):
        raise ValueError(f"a step message of {len(flat)} values with part lengths {lens}")
    parts, start = {}, 0
    for name, n in zip(_FIELDS, lens):
        parts[name], start = flat[start:start + n], start + n
    tables, start = [], 0
    for n in parts["table_lens"]:
        tables.append(parts["tables"][start:start + n])
        start += n
    bucket = int(data["bucket"])
    return StepInputs(parts["ids"], parts["positions"], parts["query_lens"],
                      parts["context_lens"], tables, parts["token_slots"], parts["slot_ranks"],
                      parts["slot_dora"], None if bucket < 0 else bucket, parts["sample_rows"])
