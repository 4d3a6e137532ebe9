"""A thread-safe LRU under a byte budget: what L2 (pixels) and L3 (ViT rows) keep their entries in.

Values carry their size as `.nbytes` (numpy and JAX arrays do); one larger than the budget is
not kept (it would evict everything and then itself).  The entries live in a
`cache.byte_lru.ByteBudgetLRU` (cachetools' LRU sized in bytes).  Counts hits, misses, puts and
bytes served in a `CacheStats`.
"""

from __future__ import annotations

import operator
import threading

from cache.byte_lru import ByteBudgetLRU
from cache.media.l1 import CacheStats


class ByteLRU:
    """At most `budget_bytes` bytes of values (by `.nbytes`), least recently used out first."""

    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self._items = ByteBudgetLRU(budget_bytes, operator.attrgetter("nbytes"))
        self._lock = threading.Lock()
        self.stats = CacheStats()

    def get(self, key):
        """The value under `key` (now the most recent), or None (a miss)."""
        with self._lock:
            value = self._items.get(key)
            if value is None:
                self.stats.misses += 1
                return None
            self.stats.hits += 1
            self.stats.bytes_hit += value.nbytes
            return value

    def put(self, key, value) -> bool:
        """Keep `value` under `key` (an existing entry stays and becomes the most recent), evicting
        the least recently used past the budget.  False: larger than the budget, not kept."""
        if not self._items.fits(value):
            return False
        with self._lock:
            if key in self._items:
                self._items.touch(key)
            else:
                self._items[key] = value
            self.stats.puts += 1
        return True

    def __len__(self) -> int:
        return len(self._items)

    @property
    def bytes_held(self) -> int:
        return self._items.currsize
