"""DP decode over pools each rank owns (`sharding.decode.PagedDecode`, `sharding.rank_pools`):
every rank's rows give what the single-device paged forward gives on that rank's pool alone,
each rank's pool is written only by its own rows, and the compiled step holds no collective but
the MoE all-to-alls (no pool gather).  Pools and tables are drawn fresh at random."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kimik3 import model
from sharding import plan, rank_pools
from sharding.decode import PagedDecode
from sharding.mesh import MeshShape, decode_mesh
from tests.sharding.conftest import hlo_bytes, hlo_collectives

PAGE, PAGES, SLOTS, MAX_PAGES, ROWS = 4, 9, 3, 3, 2  # per rank: 8 pages + null, 2 slots + scratch


def _random_pools(cfg, rng, device):
    pools = model.init_paged_cache(cfg, PAGES, SLOTS, PAGE, "float32")
    pools = jax.tree_util.tree_map(lambda x: rng.standard_normal(x.shape).astype(np.float32) * 0.5, pools)
    return jax.device_put(pools, device)


def _rank_rows(rng, last_is_padding: bool):
    """ROWS rows of one rank: distinct pages of its pool, distinct slots, lengths in [1, capacity);
    the last row may be a padding row (scratch slot, null pages, length 0)."""
    pages = rng.permutation(np.arange(1, PAGES))
    tables = pages[: ROWS * MAX_PAGES].reshape(ROWS, MAX_PAGES)
    slots = rng.permutation(SLOTS - 1)[:ROWS]
    lengths = rng.integers(1, MAX_PAGES * PAGE - 1, ROWS)
    if last_is_padding:
        tables[-1], slots[-1], lengths[-1] = 0, SLOTS - 1, 0
    return tables.astype(np.int32), slots.astype(np.int32), lengths.astype(np.int32)


@pytest.fixture(scope="module", params=[(2, 2), (8, 8)], ids=lambda c: f"dp{c[0]}-ep{c[1]}")
def stepped(request, tiny_cfg, tiny_params, devices):
    dp, ep = request.param
    cfg = tiny_cfg
    mesh = decode_mesh(dp, ep, devices=devices[:dp], cfg=cfg)
    rng = np.random.default_rng(100 + dp)
    ranks = [_random_pools(cfg, rng, d) for d in rank_pools.rank_devices(mesh)]
    rows = [_rank_rows(rng, last_is_padding=r % 2 == 1) for r in range(dp)]
    tokens = rng.integers(0, cfg.vocab_size, (dp * ROWS, 1)).astype(np.int32)
    # the reference first: the step donates the ranks' buffers
    refs = []
    for r, (pools, (tables, slots, lengths)) in enumerate(zip(ranks, rows)):
        host = jax.tree_util.tree_map(np.asarray, pools)
        logits, out = model.forward(
            tiny_params, cfg, tokens[r * ROWS : (r + 1) * ROWS], cache=model.paged_view(host, tables, slots, lengths)
        )
        refs.append((np.asarray(logits), jax.tree_util.tree_map(np.asarray, model.pools_of(out)), host))
    pools = rank_pools.assemble(ranks, mesh)
    step = PagedDecode(cfg, mesh, dispatch="dense", kernels="reference")
    params = step.place_params(tiny_params)
    cat = lambda i: np.concatenate([r[i] for r in rows])
    args = (tokens, cat(0), cat(1), cat(2))
    hlo = step.lower(params, pools, *map(jnp.asarray, args)).compile().as_text()
    logits, pools = step(params, pools, *args)
    return dict(
        dp=dp,
        ep=ep,
        logits=np.asarray(logits),
        ranks=rank_pools.split(pools, mesh),
        refs=refs,
        rows=rows,
        hlo=hlo,
        mesh=mesh,
    )


def test_each_ranks_rows_equal_the_paged_forward_on_its_own_pool(stepped):
    for r, (want_logits, _, _) in enumerate(stepped["refs"]):
        got = stepped["logits"][r * ROWS : (r + 1) * ROWS]
        # fp32, another batch and device: measured max |diff| 2.4e-6 to 3.0e-6 over 4 seeds
        np.testing.assert_allclose(got, want_logits, rtol=1e-5, atol=1e-5, err_msg=f"rank {r}")


def test_each_rank_writes_only_its_own_pool(stepped):
    """A rank's pool after the step is what the forward wrote into that pool, and nothing else
    (the other ranks' rows, which use the same ids, never reach it)."""
    for r, (pools, (_, want, before)) in enumerate(zip(stepped["ranks"], stepped["refs"])):
        (device,) = jax.tree_util.tree_leaves(pools)[0].devices()
        assert device == rank_pools.rank_devices(stepped["mesh"])[r]
        for path, got in jax.tree_util.tree_leaves_with_path(pools):
            ref = want
            for k in path:
                ref = ref[k.key]
            np.testing.assert_allclose(
                np.asarray(got), ref, rtol=1e-5, atol=1e-5, err_msg=f"rank {r} {jax.tree_util.keystr(path)}"
            )
        # and the step did change it (the rank's real rows wrote their latents and states)
        assert not np.allclose(np.asarray(pools["kda"]["state"]), before["kda"]["state"])


def test_assembling_the_ranks_pools_moves_nothing(tiny_cfg, devices):
    mesh = decode_mesh(2, 2, devices=devices[:2], cfg=tiny_cfg)
    rng = np.random.default_rng(5)
    ranks = [_random_pools(tiny_cfg, rng, d) for d in rank_pools.rank_devices(mesh)]
    pools = rank_pools.assemble(ranks, mesh)
    for leaf, parts in zip(jax.tree_util.tree_leaves(pools), zip(*map(jax.tree_util.tree_leaves, ranks))):
        assert leaf.shape[0] == 2 * parts[0].shape[0]
        shards = sorted(leaf.addressable_shards, key=lambda s: s.device.id)
        assert [s.data.unsafe_buffer_pointer() for s in shards] == [p.unsafe_buffer_pointer() for p in parts]
    back = rank_pools.split(pools, mesh)
    for a, b in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(ranks)):
        assert a.unsafe_buffer_pointer() == b.unsafe_buffer_pointer()
    with pytest.raises(ValueError, match="not its device"):
        rank_pools.assemble(ranks[::-1], mesh)


def test_hlo_holds_only_the_expert_all_to_alls(stepped, tiny_cfg):
    """No collective touches the pools: the step's only collectives are the MoE's all-to-alls,
    exactly those `sharding.plan` budgets for dp * ROWS decode rows."""
    found = hlo_collectives(stepped["hlo"])
    assert {k for k, _, _ in found} <= {"all-to-all"}
    shape = MeshShape("decode", stepped["dp"], stepped["ep"])
    planned = plan.collectives(tiny_cfg, shape, stepped["dp"] * ROWS, 1, "float32", "dense")
    assert collections.Counter((c.kind, c.bytes, c.group) for c in planned) == collections.Counter(
        (k, hlo_bytes(k, s, g), g) for k, s, g in found
    )


def test_a_batch_that_does_not_split_over_the_ranks_is_refused(tiny_cfg, tiny_params, devices):
    step = PagedDecode(tiny_cfg, decode_mesh(2, 2, devices=devices[:2], cfg=tiny_cfg))
    with pytest.raises(ValueError, match="dp=2"):
        step(tiny_params, None, np.zeros((3, 1), np.int32), np.zeros((3, 2)), np.zeros(3), np.zeros(3))
