"""The paged KV cache's bookkeeping: fixed-size blocks, a free list and block tables.

No tensors here: the model runner owns the cache memory; this hands out block ids
(vLLM's ``KVCacheManager``/``BlockPool``, TurboMind's cache manager without prefix reuse).
"""

from __future__ import annotations

from collections import deque


class KVCacheManager:
    """Allocates blocks of ``block_size`` token slots to requests.

    Args:
        num_blocks: blocks in the cache.
        block_size: tokens per block.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def allocate(self, request_id: str, num_tokens: int) -> bool:
        """Grow the request's block table to hold ``num_tokens`` tokens.

        Returns:
            False, allocating nothing, when the free list is too short.
        """
        table = self._tables.get(request_id, [])
        need = self.blocks_needed(num_tokens) - len(table)
        if need > len(self._free):
            return False
        table.extend(self._free.popleft() for _ in range(max(need, 0)))
        self._tables[request_id] = table
        return True

    def block_table(self, request_id: str) -> list[int]:
        """The request's physical block ids, in token order."""
        return self._tables.get(request_id, [])

    def free(self, request_id: str) -> None:
        """Return every block of the request to the free list."""
        self._free.extend(self._tables.pop(request_id, ()))
