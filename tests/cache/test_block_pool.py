"""Block pool: blocks without a hash reused first, LRU eviction of cached blocks, tail-first
eviction, eviction callbacks; invariants under random use."""

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
    spare = pool.allocate(1)  # the never-cached block goes first (no hash to keep)
    assert evicted == []
    pool.allocate(1)
    assert evicted == [(blocks[2], b"h2")]  # the tail
    assert pool.lookup(b"h0") == blocks[0] and pool.lookup(b"h2") is None
    assert spare[0] not in blocks


def test_a_freed_block_without_a_hash_is_reused_before_any_cached_block():
    evicted = []
    pool = BlockPool(4, on_evict=lambda b, h: evicted.append(h))
    plain, x, y = pool.allocate(3)
    pool.cache_block(x, b"x")
    pool.cache_block(y, b"y")
    pool.free([x, y])
    pool.free([plain])  # freed last, but nothing a lookup could hit
    assert pool.allocate(1) == [plain] and evicted == []
    assert pool.lookup(b"x") == x and pool.lookup(b"y") == y
    pool.check_invariants()


def test_cached_blocks_are_evicted_least_recently_freed_first():
    evicted = []
    pool = BlockPool(6, on_evict=lambda b, h: evicted.append(h))
    a, b, c, p, q = pool.allocate(5)
    for block, h in ((a, b"a"), (b, b"b"), (c, b"c")):
        pool.cache_block(block, h)
    for block in (a, p, b, q, c):  # cached and hash-less blocks freed in turn
        pool.free([block])
    pool.touch([a])  # a prefix hit on the least recently freed...
    pool.free([a])  # ...makes it the most recently freed
    assert sorted(pool.allocate(2)) == sorted([p, q]) and evicted == []
    assert pool.allocate(3) == [b, c, a] and evicted == [b"b", b"c", b"a"]
    pool.check_invariants()


def test_a_cached_prefix_survives_allocations_that_blocks_without_a_hash_can_serve():
    pool = BlockPool(7)
    prefix = pool.allocate(3)
    for i, block in enumerate(prefix):
        pool.cache_block(block, bytes([i]))
    scratch = pool.allocate(3)  # e.g. decode pages, or a prompt cancelled before it was committed
    pool.free(prefix)
    pool.free(scratch)  # freed after the prefix
    assert sorted(pool.allocate(3)) == sorted(scratch)
    assert [pool.lookup(bytes([i])) for i in range(3)] == prefix
    pool.check_invariants()


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
