"""Block-scaled FP8 GEMMs (`pallas_kernels.qgemm`): the kernel (interpret mode) equals its
reference bit for bit, the reference equals the definition (activations and weights dequantized,
one fp32 matmul) to fp32 rounding, a column's result does not depend on which other columns share
the GEMM, and bad operands are refused before any launch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import qgemm


def _dequantized(fmt, xq, sx, wq, sw, col_block):
    bk = qgemm.block_k(fmt)
    x = xq.astype(jnp.float32) * jnp.repeat(sx, bk, axis=1)
    s_w = sw[:, col_block] if fmt == "fp8" else sw.astype(jnp.float32)
    return x, wq.astype(jnp.float32) * jnp.repeat(s_w, bk, axis=0)


@pytest.mark.parametrize("fmt", qgemm.FORMATS)
@pytest.mark.parametrize("m, k, n", [(3, 256, 200), (20, 384, 72)])  # ragged rows and columns
def test_kernel_equals_reference_and_the_definition(rng, fmt, m, k, n):
    ops = qgemm.reference_inputs(rng, fmt, m, k, n)
    ref = qgemm.qmatmul_ref(fmt, *ops)
    got = qgemm.qmatmul(fmt, *ops, out_dtype=jnp.float32, interpret=True)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
    x, w = _dequantized(fmt, *ops)
    want = jnp.matmul(x, w, precision=jax.lax.Precision.HIGHEST)
    # fp32 sums of K exact products, blocked differently: a few ulps of the sum of |terms|
    bound = 1e-5 * jnp.matmul(jnp.abs(x), jnp.abs(w), precision=jax.lax.Precision.HIGHEST)
    assert bool(jnp.all(jnp.abs(ref - want) <= bound))


@pytest.mark.parametrize("fmt", qgemm.FORMATS)
@pytest.mark.parametrize("gemm", ["reference", "kernel"])
def test_a_column_does_not_depend_on_its_neighbours(rng, fmt, gemm):
    """Fused [W_1 | W_2 | W_3] vs each member alone: array_equal (what fused projections need)."""
    m, k, widths = 5, 256, (136, 12, 96)  # widths off the 64 / 128 tiles, as KDA's beta is
    xq, sx, wq, sw, _ = qgemm.reference_inputs(rng, fmt, m, k, sum(widths))
    if fmt == "fp8":  # each member on its own 128-column blocks, as `formats.concat` lays them out
        col_block = np.concatenate(
            [
                first + np.arange(w) // 128
                for first, w in zip(np.cumsum([0] + [-(-w // 128) for w in widths[:-1]]), widths)
            ]
        )
        sw = jnp.asarray(rng.uniform(1e-3, 1e-2, (k // 128, int(col_block.max()) + 1)), jnp.float32)
        col_block = jnp.asarray(col_block, jnp.int32)
    else:
        col_block = None
    run = (
        (lambda *a: qgemm.qmatmul_ref(fmt, *a))
        if gemm == "reference"
        else (lambda *a: qgemm.qmatmul(fmt, *a, out_dtype=jnp.float32, interpret=True))
    )
    fused = run(xq, sx, wq, sw, col_block)
    start = 0
    for w in widths:
        cols = slice(start, start + w)
        if fmt == "fp8":
            blocks = col_block[cols]
            member = run(xq, sx, wq[:, cols], sw[:, int(blocks[0]) : int(blocks[-1]) + 1], blocks - blocks[0])
        else:
            member = run(xq, sx, wq[:, cols], sw[:, cols], None)
        np.testing.assert_array_equal(np.asarray(fused[:, cols]), np.asarray(member))
        start += w


def test_bad_operands_are_refused_before_any_launch(rng):
    xq, sx, wq, sw, cb = qgemm.reference_inputs(rng, "fp8", 4, 256, 64)
    with pytest.raises(ValueError, match="one K"):
        qgemm.qmatmul("fp8", xq[:, :128], sx[:, :1], wq, sw, cb)
    with pytest.raises(ValueError, match="e4m3 operands"):
        qgemm.qmatmul("fp8", xq.astype(jnp.bfloat16), sx, wq, sw, cb)
    with pytest.raises(ValueError, match="activation scales"):
        qgemm.qmatmul("fp8", xq, sx[:, :1], wq, sw, cb)
    with pytest.raises(ValueError, match="col_block"):
        qgemm.qmatmul("fp8", xq, sx, wq, sw, None)
    with pytest.raises(ValueError, match="e8m0"):
        qgemm.qmatmul("mxfp8", xq, jnp.ones((4, 8), jnp.float32), wq, jnp.ones((8, 64), jnp.float32))
    with pytest.raises(ValueError, match="format"):
        qgemm.qmatmul("int8", xq, sx, wq, sw, cb)
