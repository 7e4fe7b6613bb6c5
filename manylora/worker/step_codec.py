"""A step's host inputs as flat tensors, for rank 0 to broadcast to the other ranks.

Every rank builds the same attention metadata and LoRA mapping from the same
``StepInputs``, so the ranks run the same kernels with the same shapes and their
collectives line up. Only integers travel: token ids and positions (int64), the per-sequence
lengths, block tables and per-row slots (int32), and a few scalars.
"""

from __future__ import annotations

import torch

from manylora.worker.model_runner import StepInputs


def encode_step(inputs: StepInputs) -> dict:
    """``StepInputs`` → ``{name: CPU tensor or int}`` (``broadcast_tensor_dict``'s input).

    Tensors: ``ids``, ``positions`` int64 ``[T]``; ``query_lens``, ``context_lens``,
    ``table_lens`` int32 ``[B]``; ``tables`` int32 ``[sum(table_lens)]`` (the block tables
    concatenated); ``token_slots`` int32 ``[T]``; ``slot_ranks``, ``slot_dora`` int32
    ``[max_loras]``; ``sample_rows`` int64 ``[S]``. Scalar: ``bucket`` (-1: eager).
    """
    return {
        "ids": torch.tensor(inputs.ids, dtype=torch.int64),
        "positions": torch.tensor(inputs.positions, dtype=torch.int64),
        "query_lens": torch.tensor(inputs.query_lens, dtype=torch.int32),
        "context_lens": torch.tensor(inputs.context_lens, dtype=torch.int32),
        "table_lens": torch.tensor([len(t) for t in inputs.block_tables], dtype=torch.int32),
        "tables": torch.tensor([b for t in inputs.block_tables for b in t], dtype=torch.int32),
        "token_slots": torch.tensor(inputs.token_slots, dtype=torch.int32),
        "slot_ranks": torch.tensor(inputs.slot_ranks, dtype=torch.int32),
        "slot_dora": torch.tensor(inputs.slot_dora, dtype=torch.int32),
        "sample_rows": torch.tensor(inputs.sample_rows, dtype=torch.int64),
        "bucket": -1 if inputs.bucket is None else int(inputs.bucket),
    }


def decode_step(data: dict) -> StepInputs:
    """The inverse of :func:`encode_step` (tensors on any device).

    Raises:
        KeyError: a field is missing.
    """
    def ints(name: str) -> list[int]:
        return data[name].cpu().tolist()

    tables, start = [], 0
    flat = ints("tables")
    for n in ints("table_lens"):
        tables.append(flat[start:start + n])
        start += n
    bucket = int(data["bucket"])
    return StepInputs(ints("ids"), ints("positions"), ints("query_lens"), ints("context_lens"),
                      tables, ints("token_slots"), ints("slot_ranks"), ints("slot_dora"),
                      None if bucket < 0 else bucket, ints("sample_rows"))
