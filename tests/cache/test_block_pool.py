"""Block pool: LRU reuse, tail-first eviction, eviction callbacks; invariants under random use."""

import pytest
from hypothesis import given, settings, strategies as st

from cache.block_pool import NULL_BLOCK, BlockPool, NoFreeBlocks


def test_null_block_is_never_handed_out():
    pool = BlockPool(4)
    assert NULL_BLOCK not in pool.allocate(3)
    with pytest.raises(NoFreeBlocks):
        pool.allocate(1)


def test_freed_prompt_tail_is_evicted_first_and_reported():
    evicted = []
    pool = BlockPool(5, on_evict=lambda b, h: evicted.append((b, h)))
    blocks = pool.allocate(3)  # a prompt's blocks, head to tail
    for i, b in enumerate(blocks):
        pool.cache_block(b, f"h{i}".encode())
    pool.free(blocks)
    spare = pool.allocate(1)  # the never-cached block goes first (freed earliest)
    assert evicted == []
    pool.allocate(1)
    assert evicted == [(blocks[2], b"h2")]  # the tail
    assert pool.lookup(b"h0") == blocks[0] and pool.lookup(b"h2") is None
    assert spare[0] not in blocks


def test_touch_revives_a_free_cached_block():
    pool = BlockPool(3)
    (b,) = pool.allocate(1)
    pool.cache_block(b, b"x")
    pool.free([b])
    assert pool.is_free(b)
    pool.touch([pool.lookup(b"x")])
    assert not pool.is_free(b) and pool.ref_cnt[b] == 1
    pool.check_invariants()


def test_misuse_raises():
    pool = BlockPool(3)
    (b,) = pool.allocate(1)
    pool.free([b])
    with pytest.raises(ValueError, match="freed more"):
        pool.free([b])
    with pytest.raises(ValueError, match="outside"):
        pool.touch([0])
    with pytest.raises(ValueError, match="in use"):
        pool.cache_block(b, b"h")


ops = st.lists(st.tuples(st.sampled_from(["alloc", "free", "cache", "touch"]), st.integers(0, 7)), max_size=80)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_invariants_hold_under_random_operations(seq):
    pool = BlockPool(8)
    held: list[int] = []  # one entry per reference we own
    for op, x in seq:
        if op == "alloc":
            n = x % 3 + 1
            if n <= pool.num_free:
                held += pool.allocate(n)
            else:
                with pytest.raises(NoFreeBlocks):
                    pool.allocate(n)
        elif op == "free" and held:
            pool.free([held.pop(x % len(held))])
        elif op == "cache" and held:
            b = held[x % len(held)]
            if pool.block_hash[b] is None:
                pool.cache_block(b, bytes([x]))
        elif op == "touch":
            b = pool.lookup(bytes([x]))
            if b is not None:
                pool.touch([b])
                held.append(b)
        pool.check_invariants()
        assert sorted(set(held)) == sorted(b for b in range(1, 8) if pool.ref_cnt[b] > 0)
        assert all(pool.ref_cnt[b] == held.count(b) for b in set(held))
