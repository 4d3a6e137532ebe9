"""MLA: the absorbed (latent MQA) form equals the naive (expanded) form."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kimik3 import config
from kimik3.layers.mla import MLA, init_mla_cache, mla_absorbed, mla_naive, write_rows


@pytest.mark.parametrize("t_new", [1, 3])
def test_absorbed_equals_naive_over_a_cached_prefix(rng, t_new):
    b, s, h, r, nope, rope, dv = 2, 40, 3, 32, 16, 8, 16
    latent = jnp.asarray(rng.standard_normal((b, s, r + rope)), jnp.float32)
    q = jnp.asarray(rng.standard_normal((b, t_new, h, nope + rope)), jnp.float32)
    w_kb = jnp.asarray(rng.standard_normal((r, h, nope)) / r**0.5, jnp.float32)
    w_vb = jnp.asarray(rng.standard_normal((r, h, dv)) / r**0.5, jnp.float32)
    lengths = np.array([17, 33])  # tokens cached including the new ones
    q_pos = jnp.asarray(lengths[:, None] - t_new + np.arange(t_new)[None])
    k_pos = jnp.broadcast_to(jnp.arange(s)[None], (b, s))
    args = dict(scale=(nope + rope) ** -0.5, q_pos_bt=q_pos, k_pos_bs=k_pos)
    naive = mla_naive(q, latent, w_kb, w_vb, **args)
    absorbed = mla_absorbed(q, latent, w_kb, w_vb, **args)
    np.testing.assert_allclose(absorbed, naive, atol=1e-5, rtol=1e-5)


def test_rows_beyond_the_query_position_are_invisible(rng):
    """Changing cache rows after the last query position changes nothing."""
    b, s, h, r, rope = 1, 20, 2, 8, 4
    latent = jnp.asarray(rng.standard_normal((b, s, r + rope)), jnp.float32)
    q = jnp.asarray(rng.standard_normal((b, 1, h, 4 + rope)), jnp.float32)
    w_kb = jnp.asarray(rng.standard_normal((r, h, 4)), jnp.float32)
    w_vb = jnp.asarray(rng.standard_normal((r, h, 4)), jnp.float32)
    args = dict(scale=0.3, q_pos_bt=jnp.array([[9]]), k_pos_bs=jnp.arange(s)[None])
    poisoned = latent.at[:, 10:].set(1e4)
    for form in (mla_naive, mla_absorbed):
        np.testing.assert_array_equal(form(q, latent, w_kb, w_vb, **args), form(q, poisoned, w_kb, w_vb, **args))


def test_layer_decode_through_cache_equals_full_prefill(rng):
    cfg = config.tiny()
    layer = MLA(cfg)
    x = jnp.asarray(rng.standard_normal((2, 12, cfg.d_model)), jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(12)[None], (2, 12))
    params = layer.init(jax.random.PRNGKey(0), x, pos)
    full, _ = layer.apply(params, x, pos)
    cache = init_mla_cache(cfg, 2, 16, jnp.float32)
    y1, cache = layer.apply(params, x[:, :9], pos[:, :9], cache)  # naive form (9 > absorb limit)
    y2, cache = layer.apply(params, x[:, 9:10], pos[:, 9:10], cache)  # absorbed
    y3, cache = layer.apply(params, x[:, 10:], pos[:, 10:], cache)  # absorbed, 2 tokens
    np.testing.assert_allclose(jnp.concatenate([y1, y2, y3], 1), full, atol=1e-5, rtol=1e-5)


def test_write_rows_places_each_sequence_at_its_offset():
    cache = jnp.zeros((2, 6, 1))
    rows = jnp.array([[[1.0], [2.0]], [[3.0], [4.0]]])
    out = write_rows(cache, rows, jnp.array([0, 3]))
    np.testing.assert_array_equal(out[..., 0], [[1, 2, 0, 0, 0, 0], [0, 0, 0, 3, 4, 0]])
