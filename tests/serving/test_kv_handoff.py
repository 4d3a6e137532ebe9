"""The held KV of direct P/D handoffs: taken once, bounded in bytes and in time."""

import numpy as np
import pytest

from serving.kv_handoff import HeldKV, pack, unpack


def test_a_handoff_packs_and_unpacks_and_junk_is_refused(rng):
    pages = rng.standard_normal((3, 2, 4)).astype(np.float32)
    state = rng.standard_normal(7).astype(np.float32)
    prompt, token, got_pages, got_state, images = unpack(pack([5, 6, 7], 9, pages, state))
    assert (prompt, token, images) == ([5, 6, 7], 9, None)
    assert np.array_equal(np.stack(got_pages), pages) and np.array_equal(got_state, state)
    with pytest.raises(ValueError, match="not a KV handoff"):
        unpack(b"junk")


def test_held_kv_is_taken_once_and_bounded_in_bytes_and_time():
    now = [0.0]
    held = HeldKV(max_bytes=100, ttl_s=10, clock=lambda: now[0])
    a = held.put(b"a" * 60)
    assert held.take(a) == b"a" * 60 and held.take(a) is None and held.take("never") is None
    b, c = held.put(b"b" * 60), held.put(b"c" * 60)  # c needs b's room: the oldest goes
    assert held.take(b) is None and held.stats()["kv_dropped"] == 1 and held.stats()["kv_held_bytes"] == 60
    now[0] = 11
    assert held.take(c) is None and held.stats() == {"kv_held": 0, "kv_held_bytes": 0, "kv_served": 1, "kv_dropped": 2}
    with pytest.raises(ValueError, match="over the held budget"):
        held.put(b"x" * 101)
    assert len({held.put(b"") for _ in range(50)}) == 50  # handles do not repeat
