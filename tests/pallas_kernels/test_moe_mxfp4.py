"""The grouped expert GEMM on MXFP4 weights (`pallas_kernels.moe_mxfp4`): the in-kernel decode
of the packed codes is the format's (every code, every scale), and the kernel (interpret mode)
equals its reference (the bf16 grouped GEMM on the dequantized weights) on fresh random
weights, ragged groups, empty groups and rows past the groups."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kimik3.quant import formats
from pallas_kernels import moe, moe_mxfp4, mxfp4


def test_the_kernels_decode_is_the_formats():
    codes = jnp.arange(16, dtype=jnp.int32)
    packed = (jnp.arange(16, dtype=jnp.uint8) | (jnp.arange(16, dtype=jnp.uint8)[::-1] << 4))[None]
    np.testing.assert_array_equal(np.asarray(mxfp4.decode_e2m1(codes)), np.asarray(formats.unpack_e2m1(packed))[0, ::2])
    bits = jnp.asarray([1, 100, 127, 130, 254], jnp.int32)
    np.testing.assert_array_equal(np.asarray(mxfp4.pow2_of_e8m0(bits)), np.ldexp(1.0, np.asarray(bits) - 127))


@pytest.mark.parametrize("m, sizes, k, n", [(12, (3, 0, 7, 1), 64, 96), (40, (30, 8), 128, 64)])
def test_kernel_equals_the_dequantized_reference(rng, m, sizes, k, n):
    g = len(sizes)
    q = formats.quantize(rng.standard_normal((g, k, n)).astype(np.float32), "mxfp4")
    np.testing.assert_array_equal(np.asarray(mxfp4.dequantize(q.values, q.scales)), np.asarray(formats.dequantize(q)))
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    group_sizes = jnp.asarray(sizes, jnp.int32)  # sum < m: the last rows belong to no group
    ref = moe_mxfp4.grouped_matmul_mxfp4_ref(x, q.values, q.scales, group_sizes)
    got = moe_mxfp4.grouped_matmul_mxfp4(x, q.values, q.scales, group_sizes, interpret=True)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(ref, np.float32))
    assert not np.any(np.asarray(got[sum(sizes) :], np.float32))


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


def test_one_hot_rows_read_back_the_dequantized_weights(rng):
    """Rows of the identity times W: each output row is one weight row, a single exact product,
    so the kernel's decode (every code, both nibbles, scales from 2^-127 up) shows bit for bit."""
    k, n = 64, 64
    q = formats.quantize(
        rng.standard_normal((2, k, n)).astype(np.float32) * 4.0 ** rng.integers(-3, 3, (2, 1, n)), "mxfp4"
    )
    scales = np.asarray(jax_bits(q.scales)).copy()
    scales[0, 0, :4] = (0, 1, 126, 133)  # the extreme exponents: 2^-127 (a subnormal), 2^-126, ...
    scales = jnp.asarray(scales).view(jnp.float8_e8m0fnu)
    eye = jnp.eye(k, dtype=jnp.bfloat16)
    got = moe_mxfp4.grouped_matmul_mxfp4(
        jnp.concatenate([eye, eye]), q.values, scales, jnp.asarray([k, k], jnp.int32), interpret=True
    )
    want = mxfp4.dequantize(q.values, scales).astype(jnp.bfloat16).reshape(2 * k, n)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def jax_bits(x):
    return jnp.asarray(x).view(jnp.uint8)


@pytest.mark.parametrize("n_tokens", [4, 40])  # the gathered decode path, the padded copy
def test_grouped_ffn_on_mxfp4_experts_equals_it_on_their_dequantized_weights(rng, n_tokens):
    """`moe.grouped_ffn` with MXFP4 gate/up and down (the activation in the gate/up epilogue,
    even and odd columns stored apart) against the same kernel on the bf16 dequantized weights."""
    e, l, f, top_k = 4, 64, 64, 2
    w_gu = formats.quantize(rng.standard_normal((e, l, 2 * f)).astype(np.float32) * 0.1, "mxfp4")
    w_out = formats.quantize(rng.standard_normal((e, f, l)).astype(np.float32) * 0.1, "mxfp4")
    x = jnp.asarray(rng.standard_normal((n_tokens, l)), jnp.bfloat16)
    ids = jnp.asarray(np.stack([rng.permutation(e)[:top_k] for _ in range(n_tokens)]), jnp.int32)
    ids = ids.at[0, 1].set(e)  # no expert: zeros
    act = lambda gate, up: jax.nn.silu(gate) * up
    packed = [mxfp4.PackedMXFP4(w.values, w.scales) for w in (w_gu, w_out)]
    dense = [mxfp4.dequantize(w.values, w.scales).astype(jnp.bfloat16) for w in (w_gu, w_out)]
    got = moe.grouped_ffn(x, ids, *packed, act=act, interpret=True)
    want = moe.grouped_ffn(x, ids, *dense, act=act, interpret=True)
    # same weights, fp32 sums in another order (32-K steps): within a bf16 rounding of each output
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2**-7, atol=1e-3)
    assert not np.any(np.asarray(got[0, 1], np.float32))
