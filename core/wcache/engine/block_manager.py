"""Paged KV block accounting with a chained-hash prefix cache and LRU eviction (pure Python, no torch).

Block hashes are namespaced by the content key of the weights that computed them: the chain starts from
`weights_root(key)`, so KV computed under one checkpoint can never match a lookup under another, even when the
path, the name and the tokens are the same. Each cached block also records that key, and a lookup refuses a
block recorded under other weights (counted, never adopted) should two chains ever collide.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import blake3

ROOT_HASH = b"\x00" * 16


def weights_root(weights: str | None) -> bytes:
    """The chain's first parent for KV computed under the weights with content key digest `weights` (None:
    weights without a key, e.g. tensors handed to the engine directly)."""
    if weights is None:
        return ROOT_HASH
    return blake3.blake3(b"wcache-kv-namespace\0" + weights.encode()).digest(length=16)


def chain_hashes(tokens: Sequence[int], block_size: int, root: bytes = ROOT_HASH) -> list[bytes]:
    """One hash per full block; each covers its parent's hash, so equal hashes mean equal prefixes computed
    under the same weights (`root`, from `weights_root`)."""
    hashes = []
    parent = root
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = array("q", tokens[start : start + block_size]).tobytes()
        parent = blake3.blake3(parent + block).digest(length=16)
        hashes.append(parent)
    return hashes


class KVCacheFullError(RuntimeError):
    """Every block is in use by a running request; nothing can be evicted."""


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None
    weights: str | None = None  # the content key of the weights whose KV the block holds, while cached


class BlockManager:
    """Blocks are free, in use (ref_count > 0), or both free and cached.

    A free block keeps its hash until it is reused, so a later request can still hit it. A new block is, in this
    order: a free block that holds nothing the weights served now can use (cached under other weights, or not
    cached), the least recently released first; a block never used yet; the least recently released cached block
    of the weights served now. So an engine that switches weights again and again (a training loop's versions)
    reuses the blocks older versions filled instead of faulting in its whole KV pool, one never-used block at a
    time, while a switch back to those weights still finds what is left of their blocks.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._fresh: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))  # never used
        self._free: OrderedDict[int, None] = OrderedDict()  # used, free, cached under the weights served now
        self._spare: OrderedDict[int, None] = OrderedDict()  # used, free, of no use to the weights served now
        self._cached: dict[bytes, int] = {}
        self._serving: str | None = None  # the weights `serve` last named
        self.cross_version_refusals = 0  # cached blocks a lookup found under other weights (never adopted)

    @property
    def num_free(self) -> int:
        return len(self._fresh) + len(self._free) + len(self._spare)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def serve(self, weights: str | None) -> None:
        """The engine serves `weights` from now on: free blocks cached under other weights go first."""
        self._serving = weights
        for block_id in list(self._free):
            if self.blocks[block_id].weights != weights:
                del self._free[block_id]
                self._spare[block_id] = None
        for block_id in list(self._spare):
            block = self.blocks[block_id]
            if block.hash is not None and block.weights == weights and self.is_cached(block_id):
                del self._spare[block_id]
                self._free[block_id] = None

    def match(self, hashes: Sequence[bytes], weights: str | None = None) -> list[int]:
        """Block ids of the longest cached prefix of `hashes` computed under `weights` (stops at the first miss)."""
        found = []
        for h in hashes:
            block_id = self._cached.get(h)
            if block_id is None:
                break
            if self.blocks[block_id].weights != weights:
                self.cross_version_refusals += 1
                break
            found.append(block_id)
        return found

    def acquire(self, block_ids: Sequence[int]) -> None:
        """Take references on cached blocks a request adopts."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                self._free.pop(block_id, None)
                self._spare.pop(block_id, None)
            block.ref_count += 1

    def allocate(self) -> int:
        """A block for new tokens: a spare one, else a never-used one, else the least recently used cached one."""
        for pool in (self._spare, self._fresh, self._free):
            if pool:
                block_id, _ = pool.popitem(last=False)
                break
        else:
            raise KVCacheFullError("the KV cache has no free block; raise num_blocks or shorten the request.")
        block = self.blocks[block_id]
        if block.hash is not None:
            if self._cached.get(block.hash) == block_id:
                del self._cached[block.hash]
            block.hash = None
            block.weights = None
        block.ref_count = 1
        return block_id

    def register(self, block_id: int, block_hash: bytes, weights: str | None = None) -> bool:
        """Make a filled block findable; False when an equal block is already cached (the first one stays).
        `weights` is the content key of the weights that computed its KV."""
        if block_hash in self._cached:
            return self._cached[block_hash] == block_id
        block = self.blocks[block_id]
        block.hash = block_hash
        block.weights = weights
        self._cached[block_hash] = block_id
        return True

    def release(self, block_ids: Sequence[int]) -> None:
        """Drop a request's references; unreferenced blocks become free but stay cached until reused."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise AssertionError(f"block {block_id} released more often than acquired")
            block.ref_count -= 1
            if block.ref_count == 0:
                useful = self.is_cached(block_id) and block.weights == self._serving
                (self._free if useful else self._spare)[block_id] = None  # most recently used end

    def is_cached(self, block_id: int) -> bool:
        block = self.blocks[block_id]
        return block.hash is not None and self._cached.get(block.hash) == block_id
