"""The engine's pools: every move between a KDA slot, a snapshot block and the exports of a
prefill pass is one program over all layers, and round trips are exact."""

import jax
import jax.numpy as jnp
import numpy as np

from kimik3 import model
from serving import kv_pools, metrics
from serving.kv_pools import KVPools

PAGE = 16


def _pools(cfg):
    return KVPools(cfg, num_pages=8, num_slots=3, num_snapshots=4, page_tokens=PAGE, dtype=jnp.float32)


def _fill(kv, rng):
    """Random contents in every pool."""
    kv.pools = jax.tree_util.tree_map(lambda x: jnp.asarray(rng.standard_normal(x.shape), x.dtype), kv.pools)


def _slot(kv, slot):
    layers = model.pool_layers(kv.cfg, kv.pools)
    return {i: {k: np.asarray(v[slot]) for k, v in layers[i].items()} for i in kv.kda_layers}


def test_save_then_restore_moves_every_kda_layer_of_a_slot(rng, tiny_cfg):
    kv = _pools(tiny_cfg)
    _fill(kv, rng)
    want = _slot(kv, 1)
    kv.save_state(1, 2)
    kv.restore_state(0, 2)
    got = _slot(kv, 0)
    for i in kv.kda_layers:
        for k in want[i]:
            np.testing.assert_array_equal(got[i][k], want[i][k])
    np.testing.assert_array_equal(np.asarray(kv.packed_state(0)), np.asarray(kv.snapshots.data[2]))
    kv.restore_state(1, None)  # a fresh request: zeros
    assert not any(v.any() for layer in _slot(kv, 1).values() for v in layer.values())
    assert all(np.array_equal(_slot(kv, 0)[i][k], want[i][k]) for i in want for k in want[i])  # others untouched


def test_each_move_is_one_program_whatever_the_slot_or_block(rng, tiny_cfg):
    kv = _pools(tiny_cfg)
    _fill(kv, rng)
    kv.save_state(0, 0)
    kv.restore_state(1, 0)
    kv.restore_state(1, None)
    programs = (kv_pools._save_slot, kv_pools._restore_slot, kv_pools._restore_block)
    before = [p._cache_size() for p in programs]
    with metrics.CompileWatch() as watch:  # nor any eager op (indexing the snapshots by a block)
        for slot, block in ((2, 3), (1, 1), (0, 2)):
            kv.save_state(slot, block)
            kv.restore_state(slot, block)
            kv.restore_state(slot, None)
    assert [p._cache_size() for p in programs] == before and watch.count == 0, dict(watch.names)


def test_an_export_is_packed_as_the_slot_it_equals(rng, tiny_cfg, tiny_params):
    """The exports of a pass at 64 tokens pack to the vector the slot packs after a pass over those 64."""
    kv = _pools(tiny_cfg)
    toks = rng.integers(0, 256, (1, 128)).astype(np.int32)
    table, slot = [[1, 2, 3, 4, 5, 6, 7, 0]], [1]
    _, _, exports = model.paged_step_jit(
        tiny_params,
        toks,
        np.arange(128, dtype=np.int32)[None],
        model.paged_view(kv.pools, table, slot, [0]),
        None,
        cfg=tiny_cfg,
        expert_path="grouped",
        export_at=np.asarray([64, -1], np.int32),
    )
    kv.save_export(exports, 0, 3)
    _, alone = model.forward(tiny_params, tiny_cfg, toks[:, :64], cache=model.paged_view(kv.pools, table, slot, [0]))
    kv.pools = model.pools_of(alone)
    np.testing.assert_allclose(np.asarray(kv.snapshots.data[3]), np.asarray(kv.packed_state(1)), atol=2e-4, rtol=0)


def test_pages_round_trip_through_the_block_store(rng, tiny_cfg):
    kv = _pools(tiny_cfg)
    blocks = [np.asarray(rng.standard_normal(kv.pages.block_shape), np.float32) for _ in range(2)]
    kv.pages.write([5, 2], blocks)
    got = kv.pages.read([2, 5])
    np.testing.assert_array_equal(got[0], blocks[1])
    np.testing.assert_array_equal(got[1], blocks[0])
    for k, i in enumerate(kv.mla_layers):
        np.testing.assert_array_equal(np.asarray(model.pool_layers(kv.cfg, kv.pools)[i]["pages"][5]), blocks[0][k])
