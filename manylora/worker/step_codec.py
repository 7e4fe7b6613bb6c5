"""A step's packed inputs as a message, for rank 0 to send to the other ranks.

Every rank keeps its own persistent device buffers and block table (``StepBuffers``) and
runs the same forward pass on the same ``StepInputs``, so the ranks launch the same kernels
with the same shapes and their collectives line up. What travels is the step's one int32
buffer (ids, positions, lengths, tiles, LoRA mapping, and the block-table *writes* of the
step, not the tables) and its ``StepLayout`` as a list of ints: O(tokens + sequences + new
blocks) per step, never O(context).
"""

from __future__ import annotations

import numpy as np
import torch

from manylora.worker.step_inputs import StepInputs, StepLayout


def encode_step(inputs: StepInputs) -> dict:
    """``StepInputs`` → ``{"step": int32 CPU tensor [total], "layout": [int, ...]}`` (a copy:
    the sender may reuse its buffer at once)."""
    return {"step": torch.from_numpy(np.array(inputs.data, dtype=np.int32, copy=True)),
            "layout": [int(v) for v in inputs.layout]}


def decode_step(data: dict) -> StepInputs:
    """The inverse of :func:`encode_step` (the tensor on any device).

    Raises:
        KeyError: a field is missing; ValueError: the layout does not have
            ``StepLayout``'s fields, or the tensor is not int32 1-D.
    """
    layout = [int(v) for v in data["layout"]]
    if len(layout) != len(StepLayout._fields):
        raise ValueError(f"a step layout of {len(layout)} values, expected "
                         f"{len(StepLayout._fields)} ({', '.join(StepLayout._fields)})")
    step = data["step"]
    if step.dtype != torch.int32 or step.dim() != 1:
        raise ValueError(f"a step buffer must be int32 1-D, got {step.dtype} "
                         f"{tuple(step.shape)}")
    return StepInputs(StepLayout(*layout), step.cpu().numpy())
