"""Host bookkeeping of the persistent block table (vLLM v1's ``BlockTable``): how many
blocks each row holds, and the writes the device table still needs.

The device table itself (``StepBuffers.block_table``, int32 ``[rows, W]``) lives on every
rank; it changes only through the ``(flat index, block id)`` pairs this class hands out
once per step, so a decode step with no new block writes nothing, and a request's table is
never copied or flattened again after it joins.
"""

from __future__ import annotations

import numpy as np


class BlockTable:
    """Per-row block counts and the pending writes of the device block table.

    Args:
        num_rows: rows (requests) the table holds; ``grow`` adds more.
        width: W, block ids per row (``ceil(max_model_len / block_size)``).

    Attributes:
        num_blocks: int64 ``[num_rows]``, blocks each row holds.
    """

    def __init__(self, num_rows: int, width: int) -> None:
        self.width = width
        self.num_blocks = np.zeros(num_rows, dtype=np.int64)
        self._index: list[np.ndarray] = []
        self._value: list[np.ndarray] = []

    @property
    def num_rows(self) -> int:
        return self.num_blocks.shape[0]

    def grow(self, num_rows: int) -> None:
        """Hold ``num_rows`` rows (never fewer than now)."""
        if num_rows > self.num_rows:
            self.num_blocks = np.concatenate(
                [self.num_blocks, np.zeros(num_rows - self.num_rows, dtype=np.int64)])

    def set_row(self, row: int, block_ids) -> None:
        """Row ``row`` becomes ``block_ids`` (a request joins the batch).

        Raises:
            ValueError: more blocks than the width.
        """
        self.num_blocks[row] = 0
        self.append(row, block_ids)

    def append(self, row: int, block_ids) -> None:
        """Append ``block_ids`` to row ``row`` (blocks a running request was given).

        Raises:
            ValueError: the row would hold more than ``width`` blocks.
        """
        ids = np.asarray(block_ids, dtype=np.int32).reshape(-1)
        if not ids.size:
            return
        start = int(self.num_blocks[row])
        end = start + ids.size
        if end > self.width:
            raise ValueError(f"row {row} would hold {end} blocks, more than the table's "
                             f"{self.width} (max_model_len / block_size)")
        self._index.append(np.arange(row * self.width + start, row * self.width + end,
                                     dtype=np.int32))
        self._value.append(ids)
        self.num_blocks[row] = end

    def clear_row(self, row: int) -> None:
        """Forget row ``row`` (its request left the batch); its stale ids are never read."""
        self.num_blocks[row] = 0

    def num_pending(self) -> int:
        """Block-table writes not yet taken."""
        return sum(a.size for a in self._index)

    def take_updates(self, index_out: np.ndarray, value_out: np.ndarray) -> None:
        """Write the pending writes into ``index_out`` / ``value_out`` (int32, length
        ``num_pending()``: flat ``row * W + col`` and the block id) and forget them."""
        if self._index:
            np.concatenate(self._index, out=index_out)
            np.concatenate(self._value, out=value_out)
        self._index.clear()
        self._value.clear()
