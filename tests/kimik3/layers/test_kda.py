"""KDA layer: decode through the cache (recurrent form) equals one-shot prefill (chunked)."""

import jax
import jax.numpy as jnp
import numpy as np

from kimik3.layers.kda import KDA, init_kda_cache, kda_gate


def test_layer_streamed_token_by_token_equals_one_shot(rng, tiny_cfg):
    x = jnp.asarray(rng.standard_normal((2, 70, tiny_cfg.d_model)), jnp.float32)
    layer = KDA(tiny_cfg)
    params = layer.init(jax.random.PRNGKey(0), x)
    full, final = layer.apply(params, x)
    cache = init_kda_cache(tiny_cfg, 2, jnp.float32)
    y, cache = layer.apply(params, x[:, :66], cache)
    ys = [y]
    for t in range(66, 70):
        y, cache = layer.apply(params, x[:, t : t + 1], cache)
        ys.append(y)
    np.testing.assert_allclose(jnp.concatenate(ys, 1), full, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(cache["state"], final["state"], atol=1e-5, rtol=1e-5)


def test_gate_is_bounded_in_lower_bound_to_zero(rng):
    f = jnp.asarray(rng.standard_normal((2, 5, 3, 4)) * 20, jnp.float32)
    g = kda_gate(f, jnp.log(jnp.array([1.0, 4.0, 16.0])), jnp.zeros((3, 4)), -5.0)
    assert g.dtype == jnp.float32 and (g <= 0).all() and (g >= -5).all()
