"""A thread-safe LRU under a byte budget: what L2 (pixels) and L3 (ViT rows) keep their entries in.

Values carry their size as `.nbytes` (numpy and JAX arrays do); one larger than the budget is
not kept (it would evict everything and then itself).  Counts hits, misses, puts and bytes
served in a `CacheStats`.
"""

from __future__ import annotations

import collections
import threading

from cache.media.l1 import CacheStats


class ByteLRU:
    def __init__(self, budget_bytes: int):
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0; got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self._items: collections.OrderedDict = collections.OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.stats = CacheStats()

    def get(self, key):
        """The value under `key` (now the most recent), or None (a miss)."""
        with self._lock:
            value = self._items.get(key)
            if value is None:
                self.stats.misses += 1
                return None
            self._items.move_to_end(key)
            self.stats.hits += 1
            self.stats.bytes_hit += value.nbytes
            return value

    def put(self, key, value) -> bool:
        """Keep `value` under `key` (an existing entry stays and becomes the most recent), evicting
        the least recently used past the budget.  False: larger than the budget, not kept."""
        if value.nbytes > self.budget_bytes:
            return False
        with self._lock:
            if key not in self._items:
                self._items[key] = value
                self._bytes += value.nbytes
            self._items.move_to_end(key)
            while self._bytes > self.budget_bytes:
                _, old = self._items.popitem(last=False)
                self._bytes -= old.nbytes
            self.stats.puts += 1
        return True

    def __len__(self) -> int:
        return len(self._items)

    @property
    def bytes_held(self) -> int:
        return self._bytes
