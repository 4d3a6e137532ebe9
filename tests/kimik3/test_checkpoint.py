"""Orbax checkpoints: bit-exact round trip, and restore into another dtype."""

import jax
import jax.numpy as jnp
import numpy as np

from kimik3 import checkpoint, model


def test_round_trip_is_bit_exact(tmp_path, tiny_cfg, tiny_params):
    checkpoint.save(tmp_path / "ckpt", tiny_params, tiny_cfg)
    params, cfg = checkpoint.restore(tmp_path / "ckpt")
    assert cfg == tiny_cfg
    assert jax.tree.structure(params) == jax.tree.structure(tiny_params)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(tiny_params)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_restore_to_bf16_equals_casting(tmp_path, tiny_cfg, tiny_params):
    checkpoint.save(tmp_path / "ckpt", tiny_params, tiny_cfg)
    params, _ = checkpoint.restore(tmp_path / "ckpt", dtype=jnp.bfloat16)
    expected = model.cast_params(tiny_params, jnp.bfloat16)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(expected)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    assert params["layer_1"]["moe"]["w_router_de"].dtype == jnp.float32
