"""Shared primitives: short conv streams, SiTU has its published form."""

import jax
import jax.numpy as jnp
import numpy as np

from kimik3.layers.primitives import l2_normalize, rms_norm, short_conv, situ, situ_glu


def test_short_conv_streamed_in_pieces_equals_one_shot(rng):
    x = jnp.asarray(rng.standard_normal((2, 11, 5)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((4, 5)), jnp.float32)
    full, state_full = short_conv(x, w)
    y1, s = short_conv(x[:, :1], w)
    y2, s = short_conv(x[:, 1:6], w, s)
    y3, s = short_conv(x[:, 6:], w, s)
    np.testing.assert_allclose(jnp.concatenate([y1, y2, y3], 1), full, atol=1e-6)
    np.testing.assert_array_equal(s, state_full)
    np.testing.assert_array_equal(state_full, x[:, -3:])


def test_short_conv_is_causal_with_oldest_tap_first(rng):
    x = jnp.zeros((1, 6, 1)).at[0, 2, 0].set(1.0)
    w = jnp.array([[1.0], [2.0], [3.0], [4.0]])
    y, _ = short_conv(x, w)
    np.testing.assert_array_equal(y[0, :, 0], [0, 0, 4, 3, 2, 1])


def test_situ_form():
    x = jnp.linspace(-30, 30, 101)
    np.testing.assert_allclose(situ(x, 10.0), 10 * jnp.tanh(x / 10) * jax.nn.sigmoid(x), rtol=1e-6)
    assert jnp.abs(situ_glu(x, x, 10.0, 10.0)).max() <= 100.0  # both halves soft-capped


def test_norms(rng):
    x = jnp.asarray(rng.standard_normal((3, 8)) * 5, jnp.float32)
    np.testing.assert_allclose(jnp.linalg.norm(l2_normalize(x), axis=-1), 1.0, rtol=1e-5)
    y = rms_norm(x, jnp.ones(8), 1e-6)
    np.testing.assert_allclose(jnp.mean(y * y, -1), 1.0, rtol=1e-4)
