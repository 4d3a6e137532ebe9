"""The fused routing + layout kernel (interpret mode here) equals `kimik3.layers.moe.route`
followed by `pallas_kernels.moe.assignment_layout`, which is its contract, and feeds
`grouped_ffn` the same layout."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kimik3.layers.moe import route_logits
from pallas_kernels import moe
from pallas_kernels.moe_route import route_layout, route_layout_fits


def composed(logits, bias, real, k):
    """The unfused path: route, unreal tokens to expert E, the layout of the assignments."""
    n, e = logits.shape
    ids, weights = route_logits(logits, bias, k)
    ids = jnp.where(real[:, None] > 0, ids, e)
    block_m = moe.layout_block_m(n * k)
    dest, tile_group, n_tiles = moe.assignment_layout(ids.reshape(-1), e, block_m)
    return ids, weights, dest.reshape(n, k), tile_group, n_tiles


@pytest.mark.parametrize("n,e,k", [(8, 32, 4), (32, 32, 4), (64, 16, 2), (8, 8, 2)])
def test_equals_route_then_assignment_layout(rng, n, e, k):
    logits = jnp.asarray(rng.standard_normal((n, e)) * 2, jnp.float32)
    bias = jnp.asarray(rng.standard_normal(e) * 0.1, jnp.float32)
    real = jnp.asarray(rng.random(n) < 0.8, jnp.int32).at[0].set(1)
    ids, w_ref, dest_ref, tiles_ref, n_tiles = composed(logits, bias, real, k)
    w, dest, tiles = route_layout(logits, bias, real, top_k=k)
    np.testing.assert_array_equal(dest, dest_ref)
    np.testing.assert_array_equal(tiles[:n_tiles], tiles_ref)
    assert tiles.shape[0] >= n_tiles and (np.asarray(tiles[n_tiles:]) == -1).all()
    keep = np.asarray(real) > 0
    np.testing.assert_allclose(np.asarray(w)[keep], np.asarray(w_ref)[keep], rtol=1e-6, atol=1e-7)


def test_ties_pick_the_lower_expert_as_top_k_does():
    logits = jnp.zeros((8, 16), jnp.float32).at[:, 5].set(1.0)  # expert 5, then ties among the rest
    bias = jnp.zeros((16,), jnp.float32)
    ids, _, dest_ref, _, _ = composed(logits, bias, jnp.ones((8,), jnp.int32), 2)
    assert (np.asarray(ids) == [5, 0]).all()
    _, dest, _ = route_layout(logits, bias, None, top_k=2)
    np.testing.assert_array_equal(dest, dest_ref)


def test_grouped_ffn_on_the_kernels_layout_equals_on_ids(rng):
    n, e, k, l, f = 16, 16, 2, 32, 16
    logits = jnp.asarray(rng.standard_normal((n, e)), jnp.float32)
    bias = jnp.zeros((e,), jnp.float32)
    real = jnp.ones((n,), jnp.int32).at[3].set(0)
    ids, *_ = composed(logits, bias, real, k)
    x = jnp.asarray(rng.standard_normal((n, l)), jnp.float32)
    w_gateup = jnp.asarray(rng.standard_normal((e, l, 2 * f)) / l**0.5, jnp.float32)
    w_out = jnp.asarray(rng.standard_normal((e, f, l)) / f**0.5, jnp.float32)
    act = lambda g, u: jax.nn.silu(g) * u
    want = moe.grouped_ffn(x, ids, w_gateup, w_out, act=act)
    _, dest, tiles = route_layout(logits, bias, real, top_k=k)
    got = moe.grouped_ffn(x, None, w_gateup, w_out, act=act, layout=(dest, tiles))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.asarray(got)[3], 0.0)


def test_shapes_it_cannot_tile_are_named():
    assert route_layout_fits(32, 32, 4) and route_layout_fits(8, 8, 2)
    assert not route_layout_fits(24, 32, 4) and not route_layout_fits(32, 48, 4) and not route_layout_fits(512, 64, 4)
    with pytest.raises(ValueError, match="powers of two"):
        route_layout(jnp.zeros((24, 32)), jnp.zeros((32,)), top_k=4)


def test_layer_in_the_serving_layout_routes_through_the_kernel_and_equals_the_reference(rng, tiny_cfg, monkeypatch):
    """LatentMoE with fused gate/up (`kimik3.fused`) and kernels="pallas" on 8 tokens takes
    `route_layout` (KIMIK3_MOE_ROUTE=kernel, the default; =xla keeps routing in XLA ops); its
    output equals the reference path's, idle tokens included."""
    import dataclasses

    from kimik3 import ops
    from kimik3.fused import fuse_projections
    from kimik3.layers.moe import LatentMoE

    x = jnp.asarray(rng.standard_normal((2, 4, tiny_cfg.d_model)), jnp.float32)
    params = LatentMoE(tiny_cfg).init(jax.random.PRNGKey(6), x)["params"]
    params = dict(params, router_bias_e=jnp.asarray(rng.standard_normal(tiny_cfg.n_routed_experts) * 0.1))
    fused = {
        "params": fuse_projections({"layer_0": {"moe": params}}, dataclasses.replace(tiny_cfg, n_layers=1))["layer_0"][
            "moe"
        ]
    }
    fits = lambda: ops.routed_ffn_fits(
        jnp.zeros((8, tiny_cfg.moe_latent_dim)),
        fused["params"]["w_gateup_elf"],
        fused["params"]["w_out_efl"],
        tiny_cfg.n_active_experts,
        "pallas",
    )
    monkeypatch.delenv("KIMIK3_MOE_ROUTE", raising=False)
    assert fits()  # on by default
    monkeypatch.setenv("KIMIK3_MOE_ROUTE", "xla")
    assert not fits()
    monkeypatch.setenv("KIMIK3_MOE_ROUTE", "fast")
    with pytest.raises(ValueError, match="KIMIK3_MOE_ROUTE"):
        fits()
    monkeypatch.setenv("KIMIK3_MOE_ROUTE", "kernel")
    real = jnp.asarray([[True, True, False, True], [True, False, False, True]])
    want = LatentMoE(tiny_cfg, "grouped", "reference").apply(fused, x, real)
    got = LatentMoE(tiny_cfg, "grouped", "pallas").apply(fused, x, real)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
