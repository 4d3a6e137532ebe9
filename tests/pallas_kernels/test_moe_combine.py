"""The routed experts' combine + latent RMSNorm kernel (interpret mode here) equals its jnp
reference, and the reference equals what `LatentMoE` computes unfused: `combine` of the
gathered rows, then `rms_norm`."""

import jax.numpy as jnp
import numpy as np
import pytest

from kimik3.layers.moe import combine
from kimik3.layers.primitives import rms_norm
from pallas_kernels.moe_combine import combine_norm, combine_norm_ref


def inputs(rng, n, k, rows, width, dtype, dead=()):
    y = jnp.asarray(rng.standard_normal((rows, width)), dtype)
    dest = rng.permutation(rows)[: n * k].reshape(n, k).astype(np.int32)
    for token in dead:  # a token routed to no expert: every dest past the rows
        dest[token] = rows + 3
    w = jnp.asarray(rng.random((n, k)), jnp.float32)
    norm = jnp.asarray(1.0 + 0.1 * rng.standard_normal(width), dtype)
    return y, jnp.asarray(dest), w / w.sum(1, keepdims=True), norm


def unfused(y, dest, w, norm, eps):
    gathered = jnp.take(y, dest, axis=0, mode="fill", fill_value=0)  # what grouped_ffn(gather=True) gives
    return rms_norm(combine(w, gathered), norm, eps)


@pytest.mark.parametrize("n,k,width", [(8, 4, 768), (32, 4, 256), (8, 2, 48)])
def test_kernel_equals_reference_fp32(rng, n, k, width):
    y, dest, w, norm = inputs(rng, n, k, 16 * (n * k // 16 + 2), width, jnp.float32, dead=(1,))
    got = combine_norm(y, dest, w, norm, eps=1e-6)
    want = combine_norm_ref(y, dest, w, norm, eps=1e-6)
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=2e-6)
    np.testing.assert_array_equal(np.asarray(got)[1], 0.0)  # no expert: rms_norm(0) = 0
    np.testing.assert_allclose(want, unfused(y, dest, w, norm, 1e-6), atol=2e-6, rtol=2e-6)


def test_bf16_rounds_where_the_unfused_path_does(rng):
    y, dest, w, norm = inputs(rng, 8, 4, 64, 768, jnp.bfloat16, dead=(5, 6))
    got = combine_norm(y, dest, w, norm, eps=1e-6)
    assert got.dtype == jnp.bfloat16
    want = combine_norm_ref(y, dest, w, norm, eps=1e-6)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=1e-2, rtol=1e-2)
    np.testing.assert_allclose(
        np.asarray(want, np.float32), np.asarray(unfused(y, dest, w, norm, 1e-6), np.float32), atol=2e-2, rtol=2e-2
    )


def test_bad_shapes_are_named_before_any_launch(rng):
    y, dest, w, norm = inputs(rng, 8, 4, 64, 48, jnp.float32)
    with pytest.raises(ValueError, match="norm"):
        combine_norm(y, dest, w, norm[:16], eps=1e-6)
    with pytest.raises(ValueError, match="multiple of 16"):
        combine_norm(y[:, :40], dest, w, norm[:40], eps=1e-6)
