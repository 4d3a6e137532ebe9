"""The media cache: a safe fetcher for remote images and the tiers that keep what it
fetched (`l1`: bytes by URL, embedded or Redis).  `MediaFetcher` is what the serving layer holds."""

from __future__ import annotations

import dataclasses
import threading
import time

from cache.media.fetch import FetchError, FetchPolicy, check_url, fetch  # noqa: F401 (re-exported)
from cache.media.l1 import EmbeddedFetchCache, RedisFetchCache
from cache.media.l2 import PixelCache


@dataclasses.dataclass
class FetchTiming:
    fetches: int = 0
    fetch_s: float = 0.0


class MediaFetcher:
    """Remote image bytes through L1: `get(url, tenant)` returns the cached bytes of the URL for
    this tenant, or fetches them under `policy` (refusals are `FetchError`) and caches them.
    cache None: every image is fetched (the ablation's "no L1")."""

    def __init__(self, policy: FetchPolicy = FetchPolicy(), cache=None, *, pixels=None, fetch_fn=fetch):
        self.policy, self.cache, self.pixels, self._fetch = policy, cache, pixels, fetch_fn
        self.timing = FetchTiming()
        self._lock = threading.Lock()

    def decoded(self, raw: bytes, size: int, tenant: str | None, decode):
        """decode(raw, size) (-> uint8 pixels), through L2 (`pixels`, a `l2.PixelCache`) if there is one."""
        if self.pixels is None:
            return decode(raw, size)
        key = self.pixels.key(raw, size, tenant)
        hit = self.pixels.get(key)
        return hit if hit is not None else self.pixels.put(key, decode(raw, size))

    def get(self, url: str, tenant: str | None = None) -> bytes:
        # The URL checks that need no DNS come before L1 (a refused URL is refused, cached or not),
        # and entries are keyed by the policy too (see `FetchPolicy.fingerprint`).
        check_url(url, self.policy)
        key = f"{self.policy.fingerprint()}/{tenant or ''}"
        if self.cache is not None:
            data = self.cache.get(url, key)
            if data is not None:
                return data
        t0 = time.monotonic()
        data = self._fetch(url, self.policy)
        with self._lock:
            self.timing.fetches += 1
            self.timing.fetch_s += time.monotonic() - t0
        if self.cache is not None:
            self.cache.put(url, data, key)
        return data

    def stats(self) -> dict:
        out = {"fetches": self.timing.fetches, "fetch_s": round(self.timing.fetch_s, 4)}
        if self.cache is not None:
            out.update({f"l1_{k}": v for k, v in self.cache.stats.as_dict().items()})
        if self.pixels is not None:
            out.update(
                {f"l2_{k}": v for k, v in self.pixels.stats.as_dict().items() if k in ("hits", "misses", "bytes_hit")}
            )
            out["l2_bytes_held"] = self.pixels.bytes_held
        return out


def build_fetcher(
    *,
    enabled: bool = True,
    allow_hosts=None,
    allow_networks=(),
    timeout_s: float = 10.0,
    max_bytes: int = 16 << 20,
    l1_bytes: int = 256 << 20,
    l1_redis: str | None = None,
    l1_ttl_s: float = 3600.0,
    l2_bytes: int = 256 << 20,
) -> MediaFetcher | None:
    """The serving layer's fetcher from its options: None when remote fetching is off; L1 in
    Redis with `l1_redis` (a URL), else embedded with `l1_bytes` (0: no L1); L2 pixels under
    `l2_bytes` (0: none)."""
    if not enabled:
        return None

    policy = FetchPolicy(
        allow_hosts=tuple(allow_hosts) if allow_hosts else None,
        allow_networks=tuple(allow_networks or ()),
        timeout_s=timeout_s,
        max_bytes=max_bytes,
    )
    if l1_redis:
        cache = RedisFetchCache(l1_redis, ttl_s=l1_ttl_s)
    else:
        cache = EmbeddedFetchCache(l1_bytes, ttl_s=l1_ttl_s) if l1_bytes > 0 else None
    return MediaFetcher(policy, cache, pixels=PixelCache(l2_bytes) if l2_bytes > 0 else None)
