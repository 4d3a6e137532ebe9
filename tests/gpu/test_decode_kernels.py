"""The decode step's few-row dense GEMM (`pallas_kernels.skinny`) on the GPU: Triton's compile
of its tilings (shared memory, PTX) and its numbers, and the model's projections dispatching to it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kimik3 import ops
from pallas_kernels import skinny


@pytest.mark.parametrize("m, k, n", [(8, 1536, 1536), (32, 768, 1536), (8, 2048, 1536), (1, 1536, 4928), (20, 1536, 1536)])
def test_skinny_matmul_equals_the_fp32_accumulated_product(rng, m, k, n):
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((k, n)) / k ** 0.5, jnp.bfloat16)
    got = np.asarray(skinny.matmul(x, w, interpret=False), np.float64)
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    np.testing.assert_allclose(got, want, rtol=2 ** -7, atol=2 ** -7)


def test_dense_takes_the_kernel_for_a_decode_steps_rows_and_xla_past_them():
    w = jnp.zeros((1536, 1536), jnp.bfloat16)
    hlo = lambda m: jax.jit(lambda x: ops.dense(x, w, "pallas")).lower(jnp.zeros((m, 1536), jnp.bfloat16)).as_text()
    assert "skinny_matmul" in hlo(8) and "skinny_matmul" not in hlo(ops.DENSE_KERNEL_ROWS + 1)
