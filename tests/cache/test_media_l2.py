"""L2 of the media cache (`cache.media.l2`): decoded pixels by (tenant, content, processor)."""

import numpy as np
import pytest

from cache.media.l2 import PixelCache


def test_a_hit_is_the_same_read_only_pixels_for_the_same_tenant_and_content(rng):
    c = PixelCache(budget_bytes=1 << 20)
    px = rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)
    key = c.key(b"png bytes", 16, "a")
    assert c.get(key) is None
    stored = c.put(key, px)
    got = c.get(key)
    assert got is stored and (got == px).all() and not got.flags.writeable
    with pytest.raises(ValueError):
        got[0, 0, 0] = 1
    assert c.get(c.key(b"png bytes", 16, "b")) is None  # another tenant
    assert c.get(c.key(b"png bytes", 32, "a")) is None  # another size
    assert c.get(c.key(b"png bytez", 16, "a")) is None  # other bytes
    assert c.stats.hits == 1 and c.stats.misses == 4


def test_the_budget_evicts_least_recent_first(rng):
    c = PixelCache(budget_bytes=3 * 768)
    keys = [c.key(bytes([i]), 16, None) for i in range(4)]
    for k in keys[:3]:
        c.put(k, rng.integers(0, 256, (16, 16, 3), dtype=np.uint8))
    c.get(keys[0])
    c.put(keys[3], rng.integers(0, 256, (16, 16, 3), dtype=np.uint8))
    assert c.get(keys[1]) is None and c.get(keys[0]) is not None and c.bytes_held == 3 * 768
