"""Host tier: bit-exact round trips, LRU byte budget, corrupt entries are counted misses."""

import numpy as np
import pytest

from cache.host_tier import EmbeddedHostKVTier, decode_entry, entry_size, make_key
from tests.cache.corrupt import corrupt_entry


def _page(rng, dtype=np.float32):
    return rng.standard_normal((128, 48)).astype(dtype)


def test_round_trip_is_bit_exact(rng):
    tier = EmbeddedHostKVTier(1 << 20)
    pages = [_page(rng), _page(rng).astype(np.float16)]
    keys = [make_key("tiny/f32", "mla", bytes([i]) * 16) for i in range(2)]
    assert tier.batch_put(keys, pages) == [True, True]
    outs = [np.empty_like(p) for p in pages]
    assert tier.batch_get_into(keys, outs) == [True, True]
    for a, b in zip(outs, pages):
        np.testing.assert_array_equal(a, b)
    assert tier.exists(keys + ["tiny/f32/mla/00"]) == [True, True, False]


def test_lru_byte_budget_evicts_least_recently_used(rng):
    one = entry_size((128, 48), np.float32)
    tier = EmbeddedHostKVTier(3 * one)
    keys = [make_key("ns", "kda", bytes([i]) * 16) for i in range(4)]
    tier.batch_put(keys[:3], [_page(rng) for _ in range(3)])
    tier.batch_get_into([keys[0]], [np.empty((128, 48), np.float32)])  # key 0 becomes most recent
    tier.batch_put([keys[3]], [_page(rng)])
    assert tier.exists(keys) == [True, False, True, True]
    assert tier.used_bytes <= tier.capacity_bytes and tier.stats.evictions == 1


@pytest.mark.parametrize("where", [0, 40, -1])
def test_a_corrupt_entry_is_a_counted_miss(rng, where):
    tier = EmbeddedHostKVTier(1 << 20)
    key = make_key("ns", "mla", b"\x07" * 16)
    tier.batch_put([key], [_page(rng)])
    corrupt_entry(tier, key, where)
    out = np.full((128, 48), 3.0, np.float32)
    assert tier.batch_get_into([key], [out]) == [False]
    assert tier.stats.corrupt == 1 and tier.stats.misses == 1
    assert (out == 3.0).all()  # the destination is untouched


def test_shape_or_dtype_mismatch_is_a_miss(rng):
    tier = EmbeddedHostKVTier(1 << 20)
    key = make_key("ns", "mla", b"\x01" * 16)
    tier.batch_put([key], [_page(rng)])
    assert tier.batch_get_into([key], [np.empty((64, 48), np.float32)]) == [False]
    assert tier.batch_get_into([key], [np.empty((128, 48), np.float16)]) == [False]
    assert decode_entry(b"garbage", key, tier.auth) is None and decode_entry(b"", key, tier.auth) is None


def test_bad_keys_and_budgets():
    with pytest.raises(ValueError, match="kind"):
        make_key("ns", "audio", b"x")
    with pytest.raises(ValueError, match="namespace"):
        make_key("", "mla", b"x")
    with pytest.raises(ValueError, match="capacity"):
        EmbeddedHostKVTier(0)
