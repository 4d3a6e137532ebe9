"""ByteLRU: the byte-budgeted LRU under L2 and L3."""

import numpy as np
import pytest

from cache.media.lru import ByteLRU


def test_least_recently_used_goes_first_and_the_budget_holds():
    c = ByteLRU(budget_bytes=300)
    a, b, d = (np.zeros(100, np.uint8) + i for i in range(3))
    assert c.put("a", a) and c.put("b", b) and c.put("d", d)
    assert c.get("a") is a  # a is now the most recent
    c.put("e", np.zeros(100, np.uint8))
    assert c.get("b") is None and c.get("a") is a and c.get("d") is d and len(c) == 3
    assert c.bytes_held == 300
    assert c.stats.hits == 3 and c.stats.misses == 1 and c.stats.bytes_hit == 300


def test_an_entry_over_the_budget_is_not_kept_and_evicts_nothing():
    c = ByteLRU(budget_bytes=100)
    c.put("a", np.zeros(60, np.uint8))
    assert not c.put("big", np.zeros(101, np.uint8))
    assert c.get("big") is None and c.get("a") is not None and c.bytes_held == 60


def test_a_repeated_put_keeps_the_first_value_and_counts_its_bytes_once():
    c = ByteLRU(budget_bytes=1000)
    first = np.zeros(100, np.uint8)
    c.put("k", first)
    c.put("k", np.ones(100, np.uint8))
    assert c.get("k") is first and c.bytes_held == 100


def test_a_negative_budget_is_refused():
    with pytest.raises(ValueError, match="budget_bytes"):
        ByteLRU(-1)
