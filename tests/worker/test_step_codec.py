"""``encode_step`` / ``decode_step``: a step's packed inputs survive the trip, and a
malformed message is refused by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from manylora.worker.step_codec import decode_step, encode_step
from manylora.worker.step_inputs import StepInputs, StepLayout

LAYOUT = StepLayout(num_tokens=4, num_seqs=2, num_tiles=2, num_decode_tiles=1, table_width=3,
                    variant=0, max_seg_len=0, num_table_updates=2, num_sampled=2,
                    sample_prefix=0, bucket=-1, table_rows=16)


def test_round_trip_copies_the_buffer():
    data = np.arange(40, dtype=np.int32)
    msg = encode_step(StepInputs(LAYOUT, data))
    data[:] = -1                                   # the sender reuses its buffer at once
    back = decode_step(msg)
    assert back.layout == LAYOUT
    assert back.data.tolist() == list(range(40))


def test_malformed_messages_are_refused():
    msg = encode_step(StepInputs(LAYOUT, np.zeros(3, np.int32)))
    with pytest.raises(ValueError, match="layout"):
        decode_step({**msg, "layout": msg["layout"][:-1]})
    with pytest.raises(ValueError, match="int32"):
        decode_step({**msg, "step": torch.zeros(3, dtype=torch.int64)})
