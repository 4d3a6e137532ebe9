"""L3 of the media cache: ViT embeddings by image (issue 19).

(tenant salt, image content hash) -> the image's embedding rows [tokens_per_image, D] on the
device, under a byte budget, least recently used out first.  One engine holds one set of
weights, so its cache needs no weights id; the tenant salt keeps one tenant's images from
speeding up (and so revealing themselves to) another's.  A hit skips the ViT for that image; a
turn whose prefix misses the prefix cache (L4) can still hit here.  Rows are what the ViT
computed for the image alone, so a hit splices exactly the rows a miss would compute.
"""

from __future__ import annotations

import collections
import threading

from cache.media.l1 import CacheStats


class EncoderCache:
    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self._items: collections.OrderedDict[tuple, object] = collections.OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.stats = CacheStats()
        self.host_hits = 0  # misses here that the host tier answered (`EngineConfig.encoder_cache_to_host`)

    @staticmethod
    def key(content_hash: bytes, tenant: str | None) -> tuple:
        return tenant or "", content_hash

    def get(self, key: tuple):
        with self._lock:
            rows = self._items.get(key)
            if rows is None:
                self.stats.misses += 1
                return None
            self._items.move_to_end(key)
            self.stats.hits += 1
            self.stats.bytes_hit += rows.nbytes
            return rows

    def put(self, key: tuple, rows) -> None:
        if rows.nbytes > self.budget_bytes:
            return
        with self._lock:
            if key not in self._items:
                self._items[key] = rows
                self._bytes += rows.nbytes
            self._items.move_to_end(key)
            while self._bytes > self.budget_bytes:
                _, old = self._items.popitem(last=False)
                self._bytes -= old.nbytes
            self.stats.puts += 1

    @property
    def bytes_held(self) -> int:
        return self._bytes
