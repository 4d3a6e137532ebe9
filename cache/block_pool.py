"""A pool of fixed-size cache blocks: ref counts, an LRU free list, prefix-hash lookup.

Block 0 is the null block: it is never handed out and pads block tables.
A block is either *in use* (ref count > 0) or *free* (ref count 0, on the free
list).  A free block may still hold a cached prefix (its hash is kept) until
it is reused.  Allocation takes blocks from the head of the free list: every
free block without a hash (nothing a lookup can hit) comes before any cached
one, and cached blocks go least recently freed first.  Reusing a cached block
evicts its hash, reporting the eviction so its contents can be offloaded to
the host tier before they are overwritten.

Freeing puts a block without a hash at the head of the free list and a cached
block at the tail; a request's blocks are freed in reverse order, so the tail
of a prompt (least likely to be shared) is evicted before its head.  Every
operation is O(1) per block.
"""

from __future__ import annotations

import collections
from typing import Callable, Iterable

NULL_BLOCK = 0


class NoFreeBlocks(RuntimeError):
    """Raised when an allocation asks for more blocks than are free."""


class BlockPool:
    def __init__(self, num_blocks: int, on_evict: Callable[[int, bytes], None] | None = None):
        """`num_blocks` includes the null block.  `on_evict(block_id, hash)` runs before a
        cached block is reused (its contents are still intact then)."""
        if num_blocks < 2:
            raise ValueError(f"a pool needs the null block and at least one more; got {num_blocks}")
        self.num_blocks = num_blocks
        self.on_evict = on_evict
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}
        self._free: collections.OrderedDict[int, None] = collections.OrderedDict.fromkeys(range(1, num_blocks))

    # ---- queries ------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Blocks holding a hashed entry a later lookup can hit (in use or free)."""
        return len(self._cached)

    def lookup(self, block_hash: bytes) -> int | None:
        """The block holding `block_hash`, in use or free, or None."""
        return self._cached.get(block_hash)

    def is_free(self, block: int) -> bool:
        return block in self._free

    # ---- operations ---------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """n fresh blocks (ref count 1, no hash): free blocks without a hash first, then cached
        ones least recently freed first, each evicted (`on_evict`) as it is taken."""
        if n > len(self._free):
            raise NoFreeBlocks(f"asked for {n} blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            h = self.block_hash[block]
            if h is not None:
                self.block_hash[block] = None
                del self._cached[h]
                if self.on_evict is not None:
                    self.on_evict(block, h)
            self.ref_cnt[block] = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[int]) -> None:
        """Take a reference on (possibly free) cached blocks: a prefix hit."""
        for block in blocks:
            self._check(block)
            if self.ref_cnt[block] == 0:
                del self._free[block]
            self.ref_cnt[block] += 1

    def free(self, blocks: Iterable[int]) -> None:
        """Drop a reference on each block, last to first.  A block reaching zero joins the free
        list: at its head (the next allocated) without a hash, at its tail (evicted after every
        block already free; the tail of `blocks` before its head) with one."""
        for block in reversed(list(blocks)):
            self._check(block)
            if self.ref_cnt[block] <= 0:
                raise ValueError(f"block {block} freed more often than taken")
            self.ref_cnt[block] -= 1
            if self.ref_cnt[block] == 0:
                self._free[block] = None
                if self.block_hash[block] is None:  # nothing to keep: reuse it before any cached block
                    self._free.move_to_end(block, last=False)

    def cache_block(self, block: int, block_hash: bytes) -> bool:
        """Publish a full, committed block under its hash.  False if another block already
        holds that hash (the caller's copy stays private and is not indexed)."""
        self._check(block)
        if self.ref_cnt[block] <= 0:
            raise ValueError(f"block {block} must be in use to be published")
        if block_hash in self._cached:
            return self._cached[block_hash] == block
        if self.block_hash[block] is not None:
            raise ValueError(f"block {block} already holds another hash")
        self.block_hash[block] = block_hash
        self._cached[block_hash] = block
        return True

    def _check(self, block: int) -> None:
        if not 0 < block < self.num_blocks:
            raise ValueError(f"block id {block} is outside [1, {self.num_blocks})")

    def check_invariants(self) -> None:
        """Raise AssertionError if the pool's bookkeeping is inconsistent (used by tests)."""
        assert NULL_BLOCK not in self._free and self.ref_cnt[NULL_BLOCK] == 0
        for b in range(1, self.num_blocks):
            assert (self.ref_cnt[b] == 0) == (b in self._free), b
            assert self.ref_cnt[b] >= 0
        for h, b in self._cached.items():
            assert self.block_hash[b] == h
        assert sum(h is not None for h in self.block_hash) == len(self._cached)
        cached = [self.block_hash[b] is not None for b in self._free]
        assert cached == sorted(cached), "a free block without a hash sits behind a cached one"
