"""The Pallas grouped expert GEMM (interpret mode on CPU) equals `lax.ragged_dot`.

Interpret mode fills outputs with NaN before the kernel runs, so finite results
prove every tile was written, the empty ones past the last group included.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.moe import grouped_matmul, grouped_matmul_ref


def _groups(rng, m, g, empty=(1,)):
    sizes = rng.multinomial(m, np.ones(g) / g)
    for e in empty:  # some experts get no rows at all
        sizes[(e + 1) % g] += sizes[e]
        sizes[e] = 0
    return jnp.asarray(sizes, jnp.int32)


@pytest.mark.parametrize("m, k, n, g, dtype, block_m", [
    (37, 32, 48, 8, jnp.float32, None),      # decode-like: a few rows per expert, N not a multiple of 32
    (300, 64, 128, 5, jnp.bfloat16, None),   # bf16 operands, fp32 accumulation
    (700, 96, 32, 6, jnp.float32, None),     # M > 512: 64-row tiles; K by 32-wide steps
    (5, 16, 16, 4, jnp.float32, 16),         # fewer rows than experts
])
def test_grouped_matmul_equals_ragged_dot(rng, m, k, n, g, dtype, block_m):
    lhs = jnp.asarray(rng.standard_normal((m, k)), dtype)
    rhs = jnp.asarray(rng.standard_normal((g, k, n)) / k ** 0.5, dtype)
    sizes = _groups(rng, m, g)
    out = grouped_matmul(lhs, rhs, sizes, block_m=block_m)
    ref = grouped_matmul_ref(lhs, rhs, sizes)
    assert out.shape == (m, n) and out.dtype == dtype
    tol = 1e-5 if dtype == jnp.float32 else 1e-2  # bf16: one rounding of the output
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=tol, rtol=tol)


def test_rows_past_the_groups_sum_are_zero(rng):
    lhs = jnp.asarray(rng.standard_normal((20, 16)), jnp.float32)
    rhs = jnp.asarray(rng.standard_normal((3, 16, 16)), jnp.float32)
    sizes = jnp.asarray([4, 0, 9], jnp.int32)  # 13 of 20 rows belong to a group
    out = np.asarray(grouped_matmul(lhs, rhs, sizes))
    np.testing.assert_allclose(out, np.asarray(grouped_matmul_ref(lhs, rhs, sizes)), atol=1e-5, rtol=1e-5)
    assert (out[13:] == 0).all()


@pytest.mark.parametrize("lhs_shape, rhs_shape, sizes_shape, dtype2, match", [
    ((8, 16), (2, 32, 16), (2,), jnp.float32, "do not match"),
    ((8, 16), (2, 16, 16), (3,), jnp.float32, "do not match"),
    ((8, 16), (2, 16, 16), (2,), jnp.bfloat16, "share a dtype"),
    ((8, 24), (2, 24, 16), (2,), jnp.float32, "multiples of 16"),
])
def test_bad_shapes_are_refused_before_launch(lhs_shape, rhs_shape, sizes_shape, dtype2, match):
    with pytest.raises(ValueError, match=match):
        grouped_matmul(jnp.ones(lhs_shape, jnp.float32), jnp.ones(rhs_shape, dtype2), jnp.ones(sizes_shape, jnp.int32))
