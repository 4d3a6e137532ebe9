"""`pallas_kernels.skinny`: the few-row dense GEMM equals x @ w with fp32 accumulation."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import skinny


@pytest.mark.parametrize("m, k, n, tiling", [
    (1, 256, 64, None),                   # one token, no split
    (8, 1536, 96, None),                  # the default's split-K (2 slices of 768)
    (32, 512, 128, (64, 128, 2, 4, 3)),   # the bucket's most rows, a given tiling
    (5, 128, 48, (16, 64, 2, 4, 3)),      # fewer rows than Triton's dot: masked loads and stores
    (20, 256, 64, None),                  # between multiples of 16
])
def test_matmul_equals_the_fp32_accumulated_product(rng, m, k, n, tiling):
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((k, n)) / k ** 0.5, jnp.bfloat16)
    got = skinny.matmul(x, w, tiling=tiling)
    assert got.shape == (m, n) and got.dtype == jnp.bfloat16
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    # one bf16 rounding of an fp32 sum (2^-8 relative) whatever the K blocking
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2 ** -7, atol=2 ** -7)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(skinny.matmul_ref(x, w), np.float32),
                               rtol=2 ** -7, atol=2 ** -7)


def test_default_tiling_splits_k_into_slices_of_about_768():
    assert skinny.default_tiling(1536, 1536) == (32, 128, 2, 4, 4)
    assert skinny.default_tiling(768, 1536) == (32, 256, 1, 4, 4)
    assert skinny.default_tiling(3072, 1536)[2] == 4
    assert skinny.default_tiling(1536, 40) is None  # no column tile divides


@pytest.mark.parametrize("m, k, n, dtype, tiling, match", [
    (33, 256, 64, jnp.bfloat16, None, "M <= 32"),
    (8, 256, 64, jnp.float32, None, "2-byte"),
    (8, 256, 64, jnp.bfloat16, (48, 128, 1, 4, 3), "block_n must divide"),
    (8, 256, 64, jnp.bfloat16, (32, 128, 4, 4, 3), "block_k \\* split_k"),
])
def test_shapes_it_does_not_take_are_refused_before_launch(m, k, n, dtype, tiling, match):
    with pytest.raises(ValueError, match=match):
        skinny.matmul(jnp.zeros((m, k), dtype), jnp.zeros((k, n), dtype), tiling=tiling)
