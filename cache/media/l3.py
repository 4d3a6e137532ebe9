"""L3 of the media cache: ViT embeddings by image.

(tenant salt, image content hash) -> the image's embedding rows [tokens_per_image, D] on the
device, under a byte budget, least recently used out first.  One engine holds one set of
weights, so its cache needs no weights id; the tenant salt keeps one tenant's images from
speeding up (and so revealing themselves to) another's.  A hit skips the ViT for that image; a
turn whose prefix misses the prefix cache (L4) can still hit here.  Rows are what the ViT
computed for the image alone, so a hit splices exactly the rows a miss would compute.
"""

from __future__ import annotations

from cache.media.lru import ByteLRU


class EncoderCache(ByteLRU):
    def __init__(self, budget_bytes: int):
        super().__init__(budget_bytes)
        self.host_hits = 0  # misses here that the host tier answered (`EngineConfig.encoder_cache_to_host`)

    @staticmethod
    def key(content_hash: bytes, tenant: str | None) -> tuple:
        return tenant or "", content_hash
