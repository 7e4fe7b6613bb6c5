"""The paged KV cache's bookkeeping: block tables, the prefix cache and swap space.

No tensors here: the model runner owns the cache memory; this hands out block ids and
says which blocks to copy between device and host (vLLM's ``KVCacheManager``; TurboMind's
cache manager, where a sequence pushed out of the cache keeps its token ids and comes back
by recompute).

* **Prefix caching** (on by default): a request's longest prefix of full blocks already in
  the cache under the same adapter digest (``scheduler.block_pool``) is reused, not prefilled.
* **Swap space** (``num_host_blocks`` > 0): a request preempted under memory pressure may
  have its full blocks copied to host memory, when ``PreemptionCost`` says copying them out
  and back costs less than recomputing them; a later lookup finds them by hash there and
  copies them back into fresh device blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from manylora.request import Request
from manylora.scheduler.block_pool import DeviceBlockPool, HostBlockPool, extend_block_hashes
from manylora.scheduler_output import PreemptionCost, SwapOp


@dataclass
class KVCacheStats:
    """Counters of the KV cache, and (in ``LLMEngine.kv_cache_stats``) its state.

    Attributes:
        num_blocks: device blocks in the pool.
        used_blocks: blocks held by requests or idle sessions.
        cached_blocks: blocks no one holds that keep their contents (reusable prefixes).
        free_blocks: blocks with no contents.
        prefix_queries: prompt tokens looked up in the prefix cache (tokens).
        prefix_hits: of those, tokens found, device or host (tokens).
        prefix_hits_alora: of those, tokens an activated adapter's request found before its
            invocation start, in blocks keyed as the base model's: KV shared across the
            base model and every activated adapter (tokens).
        preemptions: requests preempted, under memory pressure or to share the batch
            between client groups (``Scheduler.fairness_preemptions`` of them).
        recomputed_tokens: tokens computed again because their blocks were lost (preempted
            requests, evicted sessions), after prefix hits and swap-ins.
        swapped_out_blocks, swapped_in_blocks: blocks copied device → host, host → device.
        evicted_blocks: cached blocks reused for new contents.
        evicted_sessions: idle sessions whose KV was released under memory pressure.
    """

    num_blocks: int = 0
    used_blocks: int = 0
    cached_blocks: int = 0
    free_blocks: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    prefix_hits_alora: int = 0
    preemptions: int = 0
    recomputed_tokens: int = 0
    swapped_out_blocks: int = 0
    swapped_in_blocks: int = 0
    evicted_blocks: int = 0
    evicted_sessions: int = 0


class PrefixHit(NamedTuple):
    """The cached prefix of a request: device blocks, then blocks found in swap space."""

    device_blocks: list[int]
    host_blocks: list[tuple[bytes, int]]

    def num_blocks(self) -> int:
        return len(self.device_blocks) + len(self.host_blocks)


class KVCacheManager:
    """Allocates blocks of ``block_size`` token positions to holders (request or session ids).

    Args:
        num_blocks: device blocks in the cache.
        block_size: tokens per block.
        enable_prefix_caching: reuse cached full blocks across requests.
        num_host_blocks: swap-space blocks (0: preemption always recomputes).
        cost: decides swap vs recompute per preempted request (needed with swap space).

    Raises:
        ValueError: swap space without a cost model.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_host_blocks: int = 0, cost: PreemptionCost | None = None) -> None:
        if num_host_blocks and cost is None:
            raise ValueError("swap space needs a PreemptionCost to choose swap or recompute")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = DeviceBlockPool(num_blocks)
        self.host = HostBlockPool(num_host_blocks)
        self.cost = cost
        self.stats = KVCacheStats(num_blocks=num_blocks)
        self._tables: dict[str, list[int]] = {}
        self._registered: dict[str, int] = {}          # holder → leading blocks registered
        self._swaps: list[SwapOp] = []

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take (free and cached)."""
        return self.pool.num_available

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def has_blocks(self, holder: str) -> bool:
        return holder in self._tables

    def block_table(self, holder: str) -> list[int]:
        """The holder's physical block ids, in token order."""
        return self._tables.get(holder, [])

    def _hashes(self, req: Request) -> list[bytes]:
        if req.adapter_pending:
            # its adapter's first read is still in flight: a hash now would be rooted in
            # the base model's and share its blocks
            raise RuntimeError(f"request {req.request_id!r}: its adapter's digest is not "
                               "known yet; it cannot be hashed into the prefix cache")
        return extend_block_hashes(req.block_hashes, req.token_ids, self.block_size,
                                   req.lora_digest, req.cache_salt, req.long_rope,
                                   req.lora_start)

    def lookup(self, req: Request) -> PrefixHit:
        """The longest cached prefix of ``req``'s tokens under its adapter digest: device
        blocks, then swap-space blocks. At most ``num_tokens - 1`` tokens, so the last
        token is always computed (its logits are needed). Takes nothing."""
        limit = (req.num_tokens - 1) // self.block_size
        if limit <= 0 or not (self.enable_prefix_caching or self.host.num_blocks):
            return PrefixHit([], [])
        hashes = self._hashes(req)[:limit]
        device: list[int] = []
        if self.enable_prefix_caching:
            for h in hashes:
                b = self.pool.lookup(h)
                if b is None:
                    break
                device.append(b)
        host: list[tuple[bytes, int]] = []
        for h in hashes[len(device):]:
            hb = self.host.lookup(h)
            if hb is None:
                break
            host.append((h, hb))
        return PrefixHit(device, host)

    def allocate_with_prefix(self, holder: str, num_tokens: int, hit: PrefixHit) -> bool:
        """Give a holder without blocks a table for ``num_tokens`` tokens that starts with
        ``hit`` (from ``lookup``): device hits are shared, swap-space hits get fresh blocks
        and a copy in. False, taking nothing, when the pool is too small."""
        fresh = max(self.blocks_needed(num_tokens) - len(hit.device_blocks), 0)
        if fresh > self.num_free_blocks - self.pool.num_cached_among(hit.device_blocks):
            return False
        self.pool.take(hit.device_blocks)
        table = list(hit.device_blocks)
        new = self.pool.allocate(fresh)
        for (h, hb), b in zip(hit.host_blocks, new):
            self._swaps.append(SwapOp(False, b, hb))
            if self.enable_prefix_caching:
                self.pool.register(b, h)
        self.stats.swapped_in_blocks += len(hit.host_blocks)
        table.extend(new)
        self._tables[holder] = table
        self._registered[holder] = hit.num_blocks()
        return True

    def allocate(self, holder: str, num_tokens: int) -> bool:
        """Grow the holder's table to hold ``num_tokens`` tokens.

        Returns:
            False, allocating nothing, when the pool is too small.
        """
        table = self._tables.get(holder, [])
        need = self.blocks_needed(num_tokens) - len(table)
        if need > self.num_free_blocks:
            return False
        if need > 0:
            table.extend(self.pool.allocate(need))
        self._tables[holder] = table
        self._registered.setdefault(holder, 0)
        return True

    def cache_blocks(self, req: Request) -> None:
        """Give the request's newly computed full blocks their addresses (after a step)."""
        if not self.enable_prefix_caching:
            return
        rid = req.request_id
        table = self._tables.get(rid)
        if table is None:
            return
        done = self._registered.get(rid, 0)
        # tokens whose ids are on the host (a step in flight may have computed one more)
        full = min(min(req.num_computed_tokens, req.num_tokens) // self.block_size, len(table))
        if full <= done:
            return
        hashes = self._hashes(req)
        for i in range(done, full):
            self.pool.register(table[i], hashes[i])
        self._registered[rid] = full

    def swap_out(self, req: Request, holder: str | None = None) -> int:
        """Copy the computed full blocks of ``req`` (held by ``holder``, default the request
        itself) to swap space, before ``free``, when that is cheaper than recomputing them;
        blocks already there are not copied again.

        Returns:
            Blocks scheduled for copying out.
        """
        holder = req.request_id if holder is None else holder
        if not self.host.num_blocks or holder not in self._tables:
            return 0
        table = self._tables[holder]
        # tokens whose ids are on the host (a step in flight may have computed one more)
        full = min(min(req.num_computed_tokens, req.num_tokens) // self.block_size, len(table))
        if full == 0 or not self.cost.prefer_swap(full * self.block_size, full):
            return 0
        hashes = self._hashes(req)
        n = 0
        for i in range(full):
            hb = self.host.put(hashes[i])
            if hb is not None:
                self._swaps.append(SwapOp(True, table[i], hb))
                n += 1
        self.stats.swapped_out_blocks += n
        return n

    def take_swaps(self) -> list[SwapOp]:
        """The block copies planned since the last call, in the order to apply them."""
        swaps, self._swaps = self._swaps, []
        return swaps

    def rename(self, old: str, new: str) -> None:
        """Move a table from one holder to another (a session's turn ends or starts)."""
        if old in self._tables:
            self._tables[new] = self._tables.pop(old)
            self._registered[new] = self._registered.pop(old, 0)

    def free(self, holder: str) -> None:
        """Drop the holder's blocks: full blocks with an address stay cached, the rest are
        free. Unknown holders are ignored."""
        self.pool.release(self._tables.pop(holder, ()))
        self._registered.pop(holder, None)

    def snapshot(self) -> KVCacheStats:
        """A copy of the counters with the pool's state filled in."""
        used = self.num_blocks - self.pool.num_available
        return KVCacheStats(
            **{**self.stats.__dict__, "used_blocks": used,
               "cached_blocks": self.pool.num_cached,
               "free_blocks": self.num_blocks - used - self.pool.num_cached,
               "evicted_blocks": self.pool.num_evictions})
