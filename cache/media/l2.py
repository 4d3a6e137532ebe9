"""L2 of the media cache: decoded, resized pixels by content (issue 19).

(tenant, content hash of the encoded bytes, processor config) -> uint8 pixels [S, S, 3], in host
memory under a byte budget, least recently used out first.  A hit skips the decode and resize
(PIL: milliseconds to seconds for large images, the router's CPU).  The tenant is part of the
key, so whether an image was decoded recently says nothing about another tenant's requests.
"""

from __future__ import annotations

import collections
import threading

import numpy as np

from cache.media.l1 import CacheStats, content_hash

PROCESSOR = "rgb-bilinear-v1"  # what decode_image_bytes does; a change of it must change this name


class PixelCache:
    def __init__(self, budget_bytes: int = 256 << 20):
        self.budget_bytes = budget_bytes
        self._items: collections.OrderedDict[tuple, np.ndarray] = collections.OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.stats = CacheStats()

    @staticmethod
    def key(raw: bytes, size: int, tenant: str | None) -> tuple:
        return tenant or "", content_hash(raw), size, PROCESSOR

    def get(self, key: tuple) -> np.ndarray | None:
        with self._lock:
            arr = self._items.get(key)
            if arr is None:
                self.stats.misses += 1
                return None
            self._items.move_to_end(key)
            self.stats.hits += 1
            self.stats.bytes_hit += arr.nbytes
            return arr

    def put(self, key: tuple, pixels: np.ndarray) -> np.ndarray:
        arr = np.array(pixels, copy=True)
        arr.flags.writeable = False  # shared between requests: nobody may change it
        if arr.nbytes > self.budget_bytes:
            return arr
        with self._lock:
            if key not in self._items:
                self._items[key] = arr
                self._bytes += arr.nbytes
            self._items.move_to_end(key)
            while self._bytes > self.budget_bytes:
                _, old = self._items.popitem(last=False)
                self._bytes -= old.nbytes
            self.stats.puts += 1
        return arr

    @property
    def bytes_held(self) -> int:
        return self._bytes
