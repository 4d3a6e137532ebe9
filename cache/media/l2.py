"""L2 of the media cache: decoded, resized pixels by content.

(tenant, content hash of the encoded bytes, processor config) -> uint8 pixels [S, S, 3], in host
memory under a byte budget, least recently used out first.  A hit skips the decode and resize
(PIL: milliseconds to seconds for large images, the router's CPU).  The tenant is part of the
key, so whether an image was decoded recently says nothing about another tenant's requests.
"""

from __future__ import annotations

import numpy as np

from cache.media.l1 import content_hash
from cache.media.lru import ByteLRU

PROCESSOR = "rgb-bilinear-v1"  # what decode_image_bytes does; a change of it must change this name


class PixelCache(ByteLRU):
    def __init__(self, budget_bytes: int = 256 << 20):
        super().__init__(budget_bytes)

    @staticmethod
    def key(raw: bytes, size: int, tenant: str | None) -> tuple:
        return tenant or "", content_hash(raw), size, PROCESSOR

    def put(self, key: tuple, pixels: np.ndarray) -> np.ndarray:
        """Keep a read-only copy (shared between requests: nobody may change it) and return it."""
        arr = np.array(pixels, copy=True)
        arr.flags.writeable = False
        super().put(key, arr)
        return arr
