"""KDA layer: decode through the cache (recurrent form) equals one-shot prefill (chunked)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kimik3.caches import KDASlots, KDAState
from kimik3.layers.kda import KDA, init_kda_cache, kda_gate


def test_layer_streamed_token_by_token_equals_one_shot(rng, tiny_cfg):
    x = jnp.asarray(rng.standard_normal((2, 70, tiny_cfg.d_model)), jnp.float32)
    layer = KDA(tiny_cfg)
    params = layer.init(jax.random.PRNGKey(0), x)
    full, final, exports = layer.apply(params, x)
    assert isinstance(final, KDAState) and exports is None
    cache = init_kda_cache(tiny_cfg, 2, jnp.float32)
    y, cache, _ = layer.apply(params, x[:, :66], cache)
    ys = [y]
    for t in range(66, 70):
        y, cache, _ = layer.apply(params, x[:, t : t + 1], cache)
        ys.append(y)
    np.testing.assert_allclose(jnp.concatenate(ys, 1), full, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(cache.state, final.state, atol=1e-5, rtol=1e-5)


def test_the_entrys_type_picks_the_path_and_exports_come_back_beside_it(rng, tiny_cfg):
    """Slots over pools (`KDASlots`) give the rows a `KDAState` gives, written into the slots;
    export_at's states come back as a third output, not inside the entry; any other entry is
    refused."""
    cfg = tiny_cfg.replace(kda_chunk_size=4)  # exports land on multiples of the chunk
    x = jnp.asarray(rng.standard_normal((2, 8, cfg.d_model)), jnp.float32)
    layer = KDA(cfg)
    params = layer.init(jax.random.PRNGKey(1), x)
    start = init_kda_cache(cfg, 2, jnp.float32)
    start = KDAState(start.state + 0.1, start.conv + 0.2)
    at = jnp.asarray([4, 8], jnp.int32)
    y, rows, exports = layer.apply(params, x, start, export_at=at)
    pools = jax.tree.map(lambda r: jnp.zeros((5,) + r.shape[1:], r.dtype).at[jnp.asarray([3, 1])].set(r), start)
    y_slots, slotted, exports_slots = layer.apply(
        params, x, KDASlots(pools.state, pools.conv, jnp.asarray([3, 1], jnp.int32)), export_at=at
    )
    assert isinstance(rows, KDAState) and isinstance(slotted, KDASlots) and isinstance(exports, KDAState)
    np.testing.assert_array_equal(y_slots, y)
    np.testing.assert_array_equal(slotted.state[jnp.asarray([3, 1])], rows.state)
    np.testing.assert_array_equal(slotted.conv[jnp.asarray([3, 1])], rows.conv)
    jax.tree.map(np.testing.assert_array_equal, exports_slots, exports)
    assert exports.state.shape == (2, 2) + rows.state.shape[1:] and exports.conv.shape == (2, 2) + rows.conv.shape[1:]
    np.testing.assert_allclose(exports.state[:, 1], rows.state, atol=1e-6, rtol=1e-6)  # after all 8 tokens
    with pytest.raises(TypeError, match="KDAState or KDASlots"):
        layer.apply(params, x, {"state": start.state, "conv": start.conv})


def test_gate_is_bounded_in_lower_bound_to_zero(rng):
    f = jnp.asarray(rng.standard_normal((2, 5, 3, 4)) * 20, jnp.float32)
    g = kda_gate(f, jnp.log(jnp.array([1.0, 4.0, 16.0])), jnp.zeros((3, 4)), -5.0)
    assert g.dtype == jnp.float32 and (g <= 0).all() and (g >= -5).all()
