"""KV block pools with content addresses: the device pool (prefix cache) and the host pool
(swap space). No tensors: block ids and their hashes only.

A full block of ``block_size`` tokens is addressed by a hash chained over its parent
block's hash, its token ids and the identity of the adapter that produced its keys and
values (vLLM's prefix-caching block hash with the LoRA "extra key", keyed here by the
digest of the adapter's weights, so two adapters that share a name never share KV; an
activated adapter's blocks before its invocation start are the base model's). Blocks
that no request holds stay addressable in an LRU list until a new allocation needs them
(vLLM's ``BlockPool`` free queue; TurboMind's "cache of KV caches").
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence

#: Bytes of a block hash (BLAKE2b; 128 bits make a collision negligible).
HASH_BYTES = 16


def root_hash(lora_digest: str | None, cache_salt: str | None = None,
              long_rope: bool = False) -> bytes:
    """The parent hash of a sequence's first block: the adapter's identity (the digest of
    its weights, ``Request.lora_digest``), or the base model's, whether its keys all rotate
    with ``longrope``'s long factors (``Request.long_rope``), and the request's cache
    salt (vLLM's ``cache_salt``: only requests with the same salt share cached blocks)."""
    tag = b"base" if lora_digest is None else b"lora:" + lora_digest.encode()
    if long_rope:
        tag += b"\0longrope"
    if cache_salt is not None:
        tag += b"\0salt:" + cache_salt.encode("utf-8", "surrogatepass")
    return hashlib.blake2b(tag, digest_size=HASH_BYTES).digest()


def extend_block_hashes(hashes: list[bytes], token_ids: Sequence[int], block_size: int,
                        lora_digest: str | None, cache_salt: str | None = None,
                        long_rope: bool = False, lora_start: int = 0) -> list[bytes]:
    """Append the hashes of the full blocks of ``token_ids`` that ``hashes`` lacks.

    ``hashes[i] = BLAKE2b(hashes[i-1] ‖ token_ids[i*bs:(i+1)*bs] as int64)``, with
    ``hashes[-1] = root_hash(lora_digest, cache_salt, long_rope)``. Token ids only grow, so
    the list is extended in place and returned.

    An activated adapter (``lora_start`` > 0, ``Request.lora_start``) computes its tokens
    before ``lora_start`` with the base model's weights: its ``s = lora_start // bs`` full
    blocks that end at or before it are hashed as the base model's (rooted in
    ``root_hash(None, ...)``), so the base model's requests and every activated adapter's
    find them, and block ``s`` is chained from them with the adapter's identity added
    (``BLAKE2b(hashes[s-1] ‖ "lora:" digest ‖ tokens)``), so it and every later block are
    the adapter's alone.
    """
    shared = lora_start // block_size if lora_digest is not None else 0
    for i in range(len(hashes), len(token_ids) // block_size):
        parent = hashes[i - 1] if i else root_hash(None if shared else lora_digest,
                                                   cache_salt, long_rope)
        h = hashlib.blake2b(parent, digest_size=HASH_BYTES)
        if shared and i == shared:
            h.update(b"lora:" + lora_digest.encode())
        h.update(array("q", token_ids[i * block_size:(i + 1) * block_size]).tobytes())
        hashes.append(h.digest())
    return hashes


class DeviceBlockPool:
    """The device KV blocks: reference counts, the prefix cache and the LRU of cached blocks.

    A block is *used* (held by one or more requests or sessions: ``ref > 0``), *cached*
    (``ref == 0`` but addressable by its hash, reusable by a prefix hit) or *free*. New
    blocks come from the free list first, then from the least recently released cached
    block, which loses its address (an eviction).

    Args:
        num_blocks: blocks in the pool.
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref = [0] * num_blocks
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self._by_hash: dict[bytes, int] = {}
        self._free: deque[int] = deque(range(num_blocks))
        self._cached: OrderedDict[int, None] = OrderedDict()   # ref 0 with a hash, LRU first
        self.num_evictions = 0

    @property
    def num_available(self) -> int:
        """Blocks a new allocation may take: free plus cached."""
        return len(self._free) + len(self._cached)

    @property
    def num_cached(self) -> int:
        """Blocks no one holds that keep their contents (prefix-cache hits)."""
        return len(self._cached)

    def lookup(self, block_hash: bytes) -> int | None:
        """The block holding ``block_hash``'s contents, or None."""
        return self._by_hash.get(block_hash)

    def num_cached_among(self, blocks: Sequence[int]) -> int:
        """How many of ``blocks`` sit in the cached LRU (taking them lowers num_available)."""
        return sum(1 for b in blocks if self.ref[b] == 0)

    def take(self, blocks: Sequence[int]) -> None:
        """Hold ``blocks`` (prefix hits) once more each."""
        for b in blocks:
            if self.ref[b] == 0:
                del self._cached[b]
            self.ref[b] += 1

    def allocate(self, n: int) -> list[int]:
        """``n`` fresh blocks (ref 1, no address).

        Raises:
            RuntimeError: fewer than ``n`` blocks available (callers check first).
        """
        if n > self.num_available:
            raise RuntimeError(f"{n} KV blocks asked, {self.num_available} available")
        out = []
        for _ in range(n):
            if self._free:
                b = self._free.popleft()
            else:
                b, _ = self._cached.popitem(last=False)
                del self._by_hash[self.hash_of[b]]
                self.hash_of[b] = None
                self.num_evictions += 1
            self.ref[b] = 1
            out.append(b)
        return out

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one hold on each block, last block first, so a released sequence's tail is
        evicted before its head (a prefix is useless without its first blocks)."""
        for b in reversed(blocks):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                if self.hash_of[b] is None:
                    self._free.append(b)
                else:
                    self._cached[b] = None

    def register(self, block: int, block_hash: bytes) -> bool:
        """Give a held, fully written block its address. False (and no address) when another
        block already has it: the duplicate stays private and is freed, not cached."""
        if block_hash in self._by_hash or self.hash_of[block] is not None:
            return False
        self._by_hash[block_hash] = block
        self.hash_of[block] = block_hash
        return True


class HostBlockPool:
    """Swap space: host copies of device blocks, addressed by the same hashes, LRU.

    Args:
        num_blocks: host blocks (``swap_space`` GiB over the bytes of one block).
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._by_hash: OrderedDict[bytes, int] = OrderedDict()   # LRU first

    def lookup(self, block_hash: bytes) -> int | None:
        """The host block holding ``block_hash``, marked recently used; or None."""
        hb = self._by_hash.get(block_hash)
        if hb is not None:
            self._by_hash.move_to_end(block_hash)
        return hb

    def put(self, block_hash: bytes) -> int | None:
        """A host block to copy ``block_hash``'s contents into, evicting the least recently
        used one if needed; None when the contents are already here or the pool is empty."""
        if block_hash in self._by_hash or self.num_blocks == 0:
            return None
        if self._free:
            hb = self._free.popleft()
        else:
            _, hb = self._by_hash.popitem(last=False)
        self._by_hash[block_hash] = hb
        return hb

    @property
    def num_used(self) -> int:
        return len(self._by_hash)
