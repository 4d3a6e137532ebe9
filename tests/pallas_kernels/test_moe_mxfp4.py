"""The grouped expert GEMM on MXFP4 weights (`pallas_kernels.moe_mxfp4`): the in-kernel decode
of the packed codes is the format's (every code, every scale), and the kernel (interpret mode)
equals its reference (the bf16 grouped GEMM on the dequantized weights) on fresh random
weights, ragged groups, empty groups and rows past the groups."""

import jax.numpy as jnp
import numpy as np
import pytest

from kimik3.quant import formats
from pallas_kernels import moe_mxfp4


def test_the_kernels_decode_is_the_formats():
    codes = jnp.arange(16, dtype=jnp.int32)
    packed = (jnp.arange(16, dtype=jnp.uint8) | (jnp.arange(16, dtype=jnp.uint8)[::-1] << 4))[None]
    np.testing.assert_array_equal(np.asarray(moe_mxfp4._decode(codes)),
                                  np.asarray(formats.unpack_e2m1(packed))[0, ::2])
    bits = jnp.asarray([1, 100, 127, 130, 254], jnp.int32)
    np.testing.assert_array_equal(np.asarray(moe_mxfp4._pow2_of_e8m0(bits)), np.ldexp(1.0, np.asarray(bits) - 127))


@pytest.mark.parametrize("m, sizes, k, n", [(12, (3, 0, 7, 1), 64, 96), (40, (30, 8), 128, 64)])
def test_kernel_equals_the_dequantized_reference(rng, m, sizes, k, n):
    g = len(sizes)
    q = formats.quantize(rng.standard_normal((g, k, n)).astype(np.float32), "mxfp4")
    np.testing.assert_array_equal(np.asarray(moe_mxfp4.dequantize(q.values, q.scales)),
                                  np.asarray(formats.dequantize(q)))
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    group_sizes = jnp.asarray(sizes, jnp.int32)  # sum < m: the last rows belong to no group
    ref = moe_mxfp4.grouped_matmul_mxfp4_ref(x, q.values, q.scales, group_sizes)
    got = moe_mxfp4.grouped_matmul_mxfp4(x, q.values, q.scales, group_sizes, interpret=True)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(ref, np.float32))
    assert not np.any(np.asarray(got[sum(sizes):], np.float32))


def test_bad_operands_are_refused(rng):
    q = formats.quantize(rng.standard_normal((2, 64, 32)).astype(np.float32), "mxfp4")
    x = jnp.zeros((4, 64), jnp.bfloat16)
    sizes = jnp.asarray([2, 2], jnp.int32)
    with pytest.raises(ValueError, match="16-bit"):
        moe_mxfp4.grouped_matmul_mxfp4(x.astype(jnp.float32), q.values, q.scales, sizes)
    with pytest.raises(ValueError, match="scales must be e8m0"):
        moe_mxfp4.grouped_matmul_mxfp4(x, q.values, q.scales[:, :1], sizes)
    with pytest.raises(ValueError, match="packed uint8"):
        moe_mxfp4.grouped_matmul_mxfp4(x[:, :32], q.values, q.scales, sizes)
    with pytest.raises(ValueError, match="group_sizes"):
        moe_mxfp4.grouped_matmul_mxfp4(x, q.values, q.scales, sizes[:1])
