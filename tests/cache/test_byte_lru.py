"""`cache.byte_lru.ByteBudgetLRU` (cachetools' LRU sized in bytes) and every cache built on it --
the embedded host tier, media L1's blobs, L2's pixels, L3's ViT rows -- against a plain
reference LRU under the same byte budget."""

import collections

import numpy as np
import pytest

from cache.byte_lru import ByteBudgetLRU
from cache.host_tier import EmbeddedHostKVTier, entry_size, make_key
from cache.media.l1 import EmbeddedFetchCache
from cache.media.l2 import PixelCache
from cache.media.l3 import EncoderCache


def test_the_budget_is_bytes_and_a_read_makes_an_entry_the_most_recent():
    c = ByteBudgetLRU(100, len)
    c["a"], c["b"], c["c"] = b"x" * 30, b"y" * 30, b"z" * 30
    assert c["a"] == b"x" * 30  # a is the most recent now; b the least
    assert "b" in c and c.currsize == 90  # `in` reads no recency
    c["d"] = b"w" * 50  # 140 > 100: b goes, then c (a was read after both)
    assert set(c) == {"a", "d"} and c.currsize == 80 and c.evictions == 2
    del c["a"]
    assert c.currsize == 50 and c.evictions == 2  # a deletion is not an eviction


def test_a_value_over_the_budget_raises_and_evicts_nothing():
    c = ByteBudgetLRU(100, len)
    c["a"] = b"x" * 60
    assert c.fits(b"y" * 100) and not c.fits(b"y" * 101)
    with pytest.raises(ValueError):
        c["big"] = b"y" * 101
    assert list(c) == ["a"] and c.currsize == 60 and c.evictions == 0
    with pytest.raises(ValueError, match="budget_bytes"):
        ByteBudgetLRU(-1, len)


class ReferenceLRU:
    """The LRU these caches implement, written out: an ordered dict of sizes; a put of a present
    key keeps its value (`replace` False) or replaces it (`replace` True), and either way makes
    it the most recent; then the least recent go until the budget holds."""

    def __init__(self, budget: int, replace: bool):
        self.budget, self.replace = budget, replace
        self.sizes: collections.OrderedDict = collections.OrderedDict()
        self.evictions = 0

    def get(self, key) -> bool:
        if key in self.sizes:
            self.sizes.move_to_end(key)
            return True
        return False

    def put(self, key, size: int) -> None:
        if size > self.budget:
            return
        if key in self.sizes and self.replace:
            del self.sizes[key]
        self.sizes.setdefault(key, size)
        self.sizes.move_to_end(key)
        while sum(self.sizes.values()) > self.budget:
            self.sizes.popitem(last=False)
            self.evictions += 1


BUDGET = 4096


class Pixels:
    """L2 through its public API: entries of `size` bytes of uint8 pixels (a key keeps its size)."""

    replace = False

    def __init__(self):
        self.c = PixelCache(BUDGET)

    def size(self, key, size):
        return size

    def put(self, key, size):
        self.c.put(self.c.key(bytes([key]), 16, None), np.full((size, 1, 1), key, np.uint8))

    def get(self, key):
        return self.c.get(self.c.key(bytes([key]), 16, None)) is not None

    def held(self):
        return self.c.bytes_held


class Rows(Pixels):
    """L3: ViT rows of `size` bytes by (tenant, content hash)."""

    def __init__(self):
        self.c = EncoderCache(BUDGET)

    def put(self, key, size):
        self.c.put(self.c.key(bytes([key]) * 16, "t"), np.full(size, key, np.uint8))

    def get(self, key):
        return self.c.get(self.c.key(bytes([key]) * 16, "t")) is not None


class Blobs(Pixels):
    """L1: a URL per key, its blob `size` bytes (content-addressed: a key's bytes are fixed)."""

    def __init__(self):
        self.c = EmbeddedFetchCache(BUDGET)

    def put(self, key, size):
        self.c.put(f"https://h/{key}", bytes([key]) * size)

    def get(self, key):
        return self.c.get(f"https://h/{key}") is not None


class HostTier:
    """The embedded host tier: a framed float32 entry of about `size` bytes per key; a put of a
    present key replaces the entry (its size may change)."""

    replace = True

    def __init__(self):
        self.c = EmbeddedHostKVTier(BUDGET)
        self.shapes = {}

    @staticmethod
    def _key(key):
        return make_key("ns", "mla", bytes([key]) * 16)

    def size(self, key, size):
        return entry_size((size // 4,), np.float32)

    def put(self, key, size):
        fits = self.size(key, size) <= BUDGET
        assert self.c.batch_put([self._key(key)], [np.full(size // 4, key, np.float32)]) == [fits]
        if fits:
            self.shapes[key] = size // 4

    def get(self, key):
        out = np.empty(self.shapes.get(key, 0), np.float32)
        return self.c.batch_get_into([self._key(key)], [out])[0]

    def held(self):
        return self.c.used_bytes


CACHES = {"l1": Blobs, "l2": Pixels, "l3": Rows, "host": HostTier}


def _ops(seed: int, n: int = 300):
    """Puts and reads of 8 keys; sizes of up to 1600 bytes (several fit the budget, not all),
    one put in 20 at about the whole budget (it fits alone, or it does not fit)."""
    rng = np.random.default_rng(seed)
    for _ in range(n):
        size = int(rng.integers(BUDGET - 64, BUDGET + 64)) if rng.random() < 0.05 else int(rng.integers(1, 1600))
        yield ("put" if rng.random() < 0.5 else "get"), int(rng.integers(1, 9)), size


@pytest.mark.parametrize("name", CACHES)
def test_each_cache_evicts_by_its_byte_budget_least_recent_first(name):
    """Seeded puts (of random sizes, some over the budget) and reads: the entries each cache
    holds, and the bytes it counts, are the reference LRU's after every step."""
    for seed in range(8):
        cache = CACHES[name]()
        ref = ReferenceLRU(BUDGET, cache.replace)
        sizes = {}
        for op, key, size in _ops(seed):
            if op == "put":
                if not cache.replace:  # a key keeps its first size where a put keeps the first value
                    size = sizes.setdefault(key, size)
                cache.put(key, size)
                ref.put(key, cache.size(key, size))
            else:
                assert cache.get(key) == ref.get(key)
            assert cache.held() == sum(ref.sizes.values()) <= BUDGET
            assert {k for k in range(1, 9) if holds(cache, k)} == set(ref.sizes)
        assert ref.evictions > 10  # the budget was exercised
        if name == "host":
            assert cache.c.stats.evictions == ref.evictions


def holds(cache, key) -> bool:
    """Whether `cache` holds `key`, without a read (which would change the recency under test)."""
    if isinstance(cache, HostTier):
        return cache.c.exists([cache._key(key)])[0]
    if isinstance(cache, Blobs):
        from cache.media.l1 import _url_key

        digest = cache.c._urls.get(_url_key(None, f"https://h/{key}"))
        return digest is not None and digest in cache.c._blobs
    k = cache.c.key(bytes([key]), 16, None) if type(cache) is Pixels else cache.c.key(bytes([key]) * 16, "t")
    return k in cache.c._items
