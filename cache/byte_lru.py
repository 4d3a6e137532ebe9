"""Least recently used maps under a byte budget: `cachetools.LRUCache` with its size in bytes.

The in-process caches keep their entries in one: the embedded host tier (`cache.host_tier`),
media L1's blobs (`cache.media.l1`), L2's pixels and L3's ViT rows (`cache.media.lru`).  Like
every cachetools cache it is not thread-safe: each of them holds its own lock around it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import cachetools


class ByteBudgetLRU(cachetools.LRUCache):
    """A mapping of at most `budget_bytes` bytes in all, an entry weighing `sizeof(value)` bytes.

    Reading an entry (``cache[key]``, `get`) makes it the most recent; ``key in cache`` does not.
    Setting an entry evicts least recently used entries until it fits (`currsize`, the bytes
    held, never exceeds `maxsize`, the budget); a value larger than the whole budget raises
    ValueError and evicts nothing (`fits` tells beforehand).  `evictions` counts the entries the
    budget pushed out (not those deleted or replaced)."""

    def __init__(self, budget_bytes: int, sizeof: Callable[[Any], int]):
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0; got {budget_bytes}")
        super().__init__(maxsize=budget_bytes, getsizeof=sizeof)
        self.evictions = 0

    def fits(self, value) -> bool:
        """Whether `value` fits the budget at all (setting it would not raise)."""
        return self.getsizeof(value) <= self.maxsize

    def touch(self, key) -> None:
        """Make the entry under `key` the most recent (KeyError if there is none)."""
        self[key]

    def popitem(self):
        """Remove and return the least recently used (key, value): how the budget evicts."""
        item = super().popitem()
        self.evictions += 1
        return item
