"""``encode_step`` / ``decode_step``: a step's inputs survive the trip as flat tensors."""

from __future__ import annotations

import pytest

from manylora.worker.model_runner import StepInputs
from manylora.worker.step_codec import decode_step, encode_step


@pytest.mark.parametrize("inputs", [
    StepInputs([5, 6, 7, 8], [0, 1, 2, 9], [3, 1], [3, 10], [[4], [1, 2, 3]], [-1, -1, -1, 2],
               [0, 0, 8, 0], [0, 0, 1, 0], None, [2, 3]),
    StepInputs([1], [0], [1], [1], [[0]], [-1], [], [], 8, [0]),
    StepInputs([], [], [], [], [], [], [4], [0], None, []),
])
def test_round_trip(inputs):
    data = encode_step(inputs)
    assert decode_step(data) == inputs
