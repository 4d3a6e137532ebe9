"""Paged KV manager: the hybrid hit rule, private checkpoint blocks, offload and reload."""

import numpy as np
import pytest

from cache.block_pool import NoFreeBlocks
from cache.host_tier import EmbeddedHostKVTier
from cache.manager import ArrayBlockStore, CacheSpec, PagedKVManager
from tests.cache.corrupt import corrupt_entry

PAGE = 16  # small pages keep the tests fast; the rules are the same at 128
SPEC = CacheSpec(namespace="test/f32", page_tokens=PAGE, kda_block_tokens=4 * PAGE)


def make(num_pages=32, num_snaps=8, host=None):
    return PagedKVManager(
        SPEC,
        ArrayBlockStore(num_pages, (2, PAGE, 4), np.float32),
        num_pages,
        ArrayBlockStore(num_snaps, (3, 4, 4), np.float32),
        num_snaps,
        host,
    )


def run_prefill(mgr, rid, tokens, rng, contents=None):
    """What an engine does: write the new pages, commit them, export and commit snapshots."""
    req = mgr.begin(rid, tokens)
    first_new = req.hit.tokens // PAGE
    new_pages = req.page_table[first_new:]
    data = (
        contents if contents is not None else [rng.standard_normal((2, PAGE, 4)).astype(np.float32) for _ in new_pages]
    )
    mgr.pages.write(new_pages, data)
    mgr.commit_pages(rid, len(tokens))
    for boundary in mgr.snapshot_boundaries(rid):
        mgr.commit_snapshot(rid, boundary, np.full((3, 4, 4), boundary, np.float32))
    return req


def test_second_turn_hits_the_shared_prefix_capped_at_n_minus_1(rng):
    mgr = make()
    turn1 = list(range(5 * PAGE))  # exactly 5 pages
    run_prefill(mgr, "a", turn1, rng)
    mgr.finish("a")
    # the same prompt again: the last token must be recomputed -> 4 pages, snapshot at 4 pages (a KDA block)
    assert mgr.lookup(turn1).tokens == 4 * PAGE
    turn2 = turn1 + list(range(100, 100 + 2 * PAGE + 3))
    hit = mgr.lookup(turn2)
    assert hit.tokens == 5 * PAGE and hit.snapshot_tier == "gpu" and hit.pages_gpu == 5


def test_a_missing_kda_snapshot_shortens_the_hit(rng):
    mgr = make()
    tokens = list(range(6 * PAGE))
    mgr.begin("a", tokens)
    mgr.commit_pages("a", len(tokens))  # pages shared, but no snapshot committed at all
    mgr.finish("a")
    assert mgr.lookup(tokens + [1]).tokens == 0
    run_prefill(mgr, "b", tokens[: 4 * PAGE] + [7] * PAGE, rng)  # snapshot at 4 pages (KDA block) and 5
    mgr.finish("b")
    hit = mgr.lookup(tokens + [1])
    assert hit.tokens == 4 * PAGE  # pages 5-6 exist, but the only matching snapshot is at 4 pages


def test_mid_pass_states_never_touch_shared_blocks(rng):
    mgr = make()
    tokens = list(range(4 * PAGE + 5))
    run_prefill(mgr, "a", tokens, rng)
    mgr.finish("a")
    shared_snaps = {mgr.snap_pool.lookup(h) for h in mgr.hashes(tokens)} - {None}
    shared_before = {b: mgr.snapshots.read([b])[0].copy() for b in shared_snaps}
    req = mgr.begin("b", tokens + list(range(3 * PAGE)))
    assert req.checkpoint_block not in shared_snaps and req.snapshot_block in shared_snaps
    hit_pages = set(req.page_table[: req.hit.tokens // PAGE])
    assert not hit_pages & set(req.page_table[req.hit.tokens // PAGE :])
    mgr.snapshots.write([req.checkpoint_block], [np.full((3, 4, 4), -1.0, np.float32)])  # a mid-pass export
    for b, before in shared_before.items():
        np.testing.assert_array_equal(mgr.snapshots.read([b])[0], before)
    with pytest.raises(ValueError, match="not committed"):
        mgr.commit_snapshot("b", 6 * PAGE)


def test_evicted_blocks_come_back_from_the_host_tier_bit_exact(rng):
    host = EmbeddedHostKVTier(1 << 20)
    mgr = make(num_pages=8, num_snaps=4, host=host)
    tokens = list(range(4 * PAGE))
    contents = [rng.standard_normal((2, PAGE, 4)).astype(np.float32) for _ in range(4)]
    run_prefill(mgr, "a", tokens, rng, contents)
    mgr.finish("a")
    # an unrelated request fills the pool and evicts everything of "a"
    run_prefill(mgr, "b", list(range(1000, 1000 + 7 * PAGE)), rng)
    mgr.finish("b")
    assert mgr.stats.offloaded_pages >= 3 and mgr.stats.offloaded_snapshots >= 1
    hit = mgr.lookup(tokens + [5])
    assert hit.tokens == 4 * PAGE and hit.pages_host == 4 - hit.pages_gpu and hit.snapshot_tier in ("host", "gpu")
    req = mgr.begin("c", tokens + [5])
    for i in range(4):
        np.testing.assert_array_equal(mgr.pages.read([req.page_table[i]])[0], contents[i])
    assert mgr.stats.loaded_pages == hit.pages_host


def test_a_corrupt_host_entry_is_a_miss_and_recomputes(rng):
    host = EmbeddedHostKVTier(1 << 20)
    mgr = make(num_pages=8, num_snaps=4, host=host)
    tokens = list(range(4 * PAGE))
    run_prefill(mgr, "a", tokens, rng)
    mgr.finish("a")
    run_prefill(mgr, "b", list(range(1000, 1000 + 7 * PAGE)), rng)
    mgr.finish("b")
    for key in list(host._data):
        if "/mla/" in key:
            corrupt_entry(host, key)
    req = mgr.begin("c", tokens + [5])
    assert req.hit.tokens == 0 and host.stats.corrupt >= 1  # reported, and nothing wrong was served


def test_a_cached_prefix_outlives_a_later_request_that_cached_nothing(rng):
    mgr = make(num_pages=9, num_snaps=4)  # 8 pages, 3 snapshot blocks
    tokens = list(range(4 * PAGE))
    run_prefill(mgr, "a", tokens, rng)
    mgr.finish("a")  # its 4 pages and its snapshot stay cached
    run_prefill(mgr, "b", list(range(500, 500 + PAGE - 1)), rng)  # under a page: nothing to hash
    mgr.extend("b", 4 * PAGE)  # decode pages are never hashed either
    mgr.finish("b")  # freed after "a"
    mgr.begin("c", list(range(900, 900 + 4 * PAGE)))  # 4 pages and a checkpoint, all hash-less ones
    hit = mgr.lookup(tokens + [5])
    assert hit.tokens == 4 * PAGE and hit.pages_gpu == 4 and hit.snapshot_tier == "gpu"
    mgr.page_pool.check_invariants()
    mgr.snap_pool.check_invariants()


def test_admission_and_pool_exhaustion():
    mgr = make(num_pages=5, num_snaps=3)
    assert mgr.can_admit(4 * PAGE) and not mgr.can_admit(5 * PAGE)
    mgr.begin("a", list(range(3 * PAGE)))
    with pytest.raises(NoFreeBlocks):
        mgr.begin("b", list(range(500, 500 + 2 * PAGE)))
    assert "b" not in mgr.requests
    mgr.page_pool.check_invariants()
    mgr.snap_pool.check_invariants()
    with pytest.raises(ValueError, match="already"):
        mgr.begin("a", [1])


def test_a_refused_request_takes_nothing_even_when_its_hit_pages_were_free(rng):
    mgr = make(num_pages=6, num_snaps=4)
    tokens = list(range(4 * PAGE))
    run_prefill(mgr, "a", tokens, rng)
    mgr.finish("a")  # 4 cached pages on the free list, 5 free in all
    with pytest.raises(NoFreeBlocks):
        mgr.begin("b", tokens + list(range(3 * PAGE)))  # hits 3 pages, needs 4 more: only 2 left once hit
    assert mgr.page_pool.num_free == 5 and all(r == 0 for r in mgr.page_pool.ref_cnt)
    mgr.page_pool.check_invariants()
