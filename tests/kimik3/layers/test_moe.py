"""LatentMoE: routing rules, and the grouped ragged_dot path equals the dense loop."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kimik3.layers.moe import LatentMoE, experts_dense_ref, experts_grouped, route


def test_grouped_experts_equal_the_dense_reference(rng):
    n, l, f, e, k = 37, 16, 24, 6, 3
    x = jnp.asarray(rng.standard_normal((n, l)), jnp.float32)
    w = [jnp.asarray(rng.standard_normal(s) / s[1] ** 0.5, jnp.float32) for s in [(e, l, f), (e, l, f), (e, f, l)]]
    ids, weights = route(x, jnp.asarray(rng.standard_normal((l, e)), jnp.float32), jnp.zeros(e), k)
    caps = (10.0, 10.0)
    np.testing.assert_allclose(
        experts_grouped(x, ids, weights, *w, caps), experts_dense_ref(x, ids, weights, *w, caps), atol=1e-5, rtol=1e-5
    )


def test_bias_steers_selection_but_not_weights(rng):
    x = jnp.asarray(rng.standard_normal((50, 8)), jnp.float32)
    w_router = jnp.asarray(rng.standard_normal((8, 6)), jnp.float32)
    bias = jnp.zeros(6).at[5].set(100.0)  # force expert 5 into every selection
    ids, weights = route(x, w_router, bias, 2)
    assert (ids == 5).any(axis=-1).all()
    scores = jax.nn.sigmoid(x @ w_router)
    chosen = jnp.take_along_axis(scores, ids, axis=-1)
    np.testing.assert_allclose(weights, chosen / chosen.sum(-1, keepdims=True), rtol=1e-6)
    np.testing.assert_allclose(weights.sum(-1), 1.0, rtol=1e-6)


def test_layer_grouped_equals_dense(rng, tiny_cfg):
    x = jnp.asarray(rng.standard_normal((2, 9, tiny_cfg.d_model)), jnp.float32)
    params = LatentMoE(tiny_cfg).init(jax.random.PRNGKey(3), x)
    params["params"]["router_bias_e"] = jnp.asarray(rng.standard_normal(tiny_cfg.n_routed_experts) * 0.1)
    grouped = LatentMoE(tiny_cfg, "grouped").apply(params, x)
    dense = LatentMoE(tiny_cfg, "dense").apply(params, x)
    np.testing.assert_allclose(grouped, dense, atol=1e-5, rtol=1e-5)


def test_layer_on_the_pallas_grouped_kernel_equals_the_reference(rng, tiny_cfg):
    """`kernels="pallas"` routes the expert GEMMs through `pallas_kernels.moe.grouped_matmul`."""
    x = jnp.asarray(rng.standard_normal((2, 9, tiny_cfg.d_model)), jnp.float32)
    params = LatentMoE(tiny_cfg).init(jax.random.PRNGKey(4), x)
    pallas = LatentMoE(tiny_cfg, "grouped", "pallas").apply(params, x)
    reference = LatentMoE(tiny_cfg, "grouped", "reference").apply(params, x)
    np.testing.assert_allclose(pallas, reference, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("path, kernels", [("grouped", "reference"), ("grouped", "pallas"), ("dense", "auto")])
def test_padding_tokens_get_no_experts_and_leave_the_real_tokens_unchanged(rng, tiny_cfg, path, kernels):
    """real_bt False (a padded chunk's tail, a decode bucket's idle rows): the token's routed part
    is 0, so it equals the layer with every expert's output zeroed; real tokens are untouched."""
    x = jnp.asarray(rng.standard_normal((2, 9, tiny_cfg.d_model)), jnp.float32)
    params = LatentMoE(tiny_cfg).init(jax.random.PRNGKey(5), x)
    real = jnp.asarray(np.arange(9)[None] < np.array([[6], [9]]))  # row 0: 3 pad tokens
    layer = LatentMoE(tiny_cfg, path, kernels)
    masked = np.asarray(layer.apply(params, x, real))
    np.testing.assert_allclose(
        masked[np.asarray(real)], np.asarray(layer.apply(params, x))[np.asarray(real)], atol=1e-6, rtol=1e-6
    )
    no_experts = jax.tree_util.tree_map(lambda a: a, params)
    no_experts["params"]["w_out_efl"] = jnp.zeros_like(params["params"]["w_out_efl"])
    np.testing.assert_allclose(masked[0, 6:], np.asarray(layer.apply(no_experts, x))[0, 6:], atol=1e-6, rtol=1e-6)
