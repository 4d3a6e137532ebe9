"""Grouped (ragged) expert GEMM on MXFP4 weights, dequantized inside the kernel.

``out[r] = lhs[r] @ dequant(W[g(r)])`` as `pallas_kernels.moe.grouped_matmul` computes it for
bf16 weights, with W stored as OCP MXFP4 (`kimik3.quant.formats`): e2m1 codes packed two per
byte along N (column 2c in the low nibble, 2c + 1 in the high), one e8m0 scale per 32 K of each
column: 4.25 bits a weight.  Each program reads its weight tile as those bytes, decodes the two
nibbles of each byte into the even and odd columns' values times their scales (exact in the
activations' dtype: two significant bits times a power of two), and runs one MMA per half into
two fp32 accumulators; the halves are interleaved back into [M, N] after the kernel (an
activation-sized copy).  The weights are never expanded in HBM: a decode step reads its experts
at 4.25 bits, where the bf16 kernel reads 16.

Rows arrive sorted by group and go through the same group-aligned layout as the bf16 kernel
(`moe._padded_layout`): each row tile belongs to one group.  The reference is the bf16 path on
the dequantized weights (`grouped_matmul_mxfp4_ref`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import moe

MX_BLOCK = 32


def dequantize(values_gkp, scales_gbn):
    """float32 [G, K, N] weights of packed e2m1 codes [G, K, N / 2] uint8 and e8m0 scales
    [G, K / 32, N] (float8_e8m0fnu): the format's definition, in plain jnp."""
    codes = jnp.stack([values_gkp & 0xF, values_gkp >> 4], axis=-1).reshape(values_gkp.shape[:-1] + (-1,))
    return _decode(codes.astype(jnp.int32)) * jnp.repeat(scales_gbn.astype(jnp.float32), MX_BLOCK, axis=-2)


def _decode(code):
    """int32 4-bit e2m1 codes -> float32 values (0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives):
    exponent e = code[2:1], mantissa m = code[0]: m / 2 for e = 0, (1 + m / 2) 2^(e - 1) else."""
    c = code & 7
    e, m = c >> 1, (c & 1).astype(jnp.float32)
    pow2 = jax.lax.bitcast_convert_type(jax.lax.shift_left(e + 125, 23), jnp.float32)  # 2^(e - 2)
    mag = jnp.where(e == 0, m * 0.5, (m + 2.0) * pow2)
    return jnp.where(code >= 8, -mag, mag)


def _pow2_of_e8m0(bits):
    """int32 e8m0 bit patterns (biased exponents) -> float32 2^(bits - 127)."""
    return jax.lax.bitcast_convert_type(jax.lax.shift_left(bits, 23), jnp.float32)


def _kernel(tile_group_ref, x_ref, wp_ref, ws_ref, oe_ref, oo_ref, *, block_k, n_k):
    """One (row tile, packed-column tile): bnp bytes per K row = 2 bnp output columns."""
    i, j = pl.program_id(0), pl.program_id(1)
    bm, bnp = oe_ref.shape
    g = tile_group_ref[i]

    @pl.when(g >= 0)
    def _():
        packed_cols = j * bnp + jax.lax.broadcasted_iota(jnp.int32, (1, bnp), 1)  # [1, bnp]
        krow = jax.lax.broadcasted_iota(jnp.int32, (block_k, 1), 0)

        def body(s, accs):
            xs = x_ref[pl.ds(i * bm, bm), pl.ds(s * block_k, block_k)]  # [bm, bk]
            packed = wp_ref[g, pl.ds(s * block_k, block_k), pl.ds(j * bnp, bnp)].astype(jnp.int32)  # [bk, bnp]
            srow = (s * block_k + krow) // MX_BLOCK  # [bk, 1]: each K row's scale row
            halves = []
            for half in (0, 1):  # even columns from the low nibbles, odd from the high
                bits = pltriton.load(ws_ref.at[g, srow, 2 * packed_cols + half]).astype(jnp.int32)  # [bk, bnp]
                code = (packed >> (4 * half)) & 0xF
                halves.append((_decode(code) * _pow2_of_e8m0(bits)).astype(xs.dtype))
            return tuple(acc + jnp.dot(xs, w, preferred_element_type=jnp.float32) for acc, w in zip(accs, halves))

        zeros = jnp.zeros((bm, bnp), jnp.float32)
        acc_e, acc_o = jax.lax.fori_loop(0, n_k, body, (zeros, zeros))
        oe_ref[...] = acc_e.astype(oe_ref.dtype)
        oo_ref[...] = acc_o.astype(oo_ref.dtype)

    @pl.when(g < 0)
    def _():
        oe_ref[...] = jnp.zeros((bm, bnp), oe_ref.dtype)
        oo_ref[...] = jnp.zeros((bm, bnp), oo_ref.dtype)


def check_operands(lhs_mk, values_gkp, scales_gbn, group_sizes_g):
    m, k = lhs_mk.shape
    g, k2, p = values_gkp.shape
    if k2 != k or values_gkp.dtype != jnp.uint8:
        raise ValueError(f"MXFP4 grouped GEMM: rows [M, {k}] need packed uint8 weights [G, {k}, N / 2]; "
                         f"got {values_gkp.dtype} {values_gkp.shape}")
    if k % MX_BLOCK or scales_gbn.shape != (g, k // MX_BLOCK, 2 * p) or scales_gbn.dtype != jnp.float8_e8m0fnu:
        raise ValueError(f"MXFP4 grouped GEMM: scales must be e8m0 [G, K / 32, N] = {(g, k // MX_BLOCK, 2 * p)}; "
                         f"got {scales_gbn.dtype} {scales_gbn.shape}")
    if group_sizes_g.shape != (g,):
        raise ValueError(f"MXFP4 grouped GEMM: group_sizes {group_sizes_g.shape} must be [G={g}]")
    if jnp.dtype(lhs_mk.dtype).itemsize != 2:
        raise ValueError(f"MXFP4 grouped GEMM multiplies 16-bit activations; got {lhs_mk.dtype}")


def grouped_matmul_mxfp4_ref(lhs_mk, values_gkp, scales_gbn, group_sizes_g):
    """The reference: the bf16 grouped GEMM's reference on the dequantized weights (exact in
    lhs's dtype) -> [M, N] in lhs's dtype."""
    check_operands(lhs_mk, values_gkp, scales_gbn, group_sizes_g)
    w = dequantize(values_gkp, scales_gbn).astype(lhs_mk.dtype)
    return moe.grouped_matmul_ref(lhs_mk, w, group_sizes_g)


def tiling(rows: int, k: int, p: int) -> tuple[int, int, int, int]:
    """(block_k, packed block_n, num_warps, num_stages): a decode step's few rows spread each
    expert's columns over more programs (the GEMM is a read of the weights)."""
    bnp = next(c for c in ((32, 16) if rows <= moe.FEW_ROWS else (64, 32, 16)) if p % c == 0)
    bk = next(c for c in (128, 64, 32) if k % c == 0)
    return bk, bnp, 4, 3


@functools.partial(jax.jit, static_argnames=("block_m", "interpret", "tiles"))
def grouped_matmul_mxfp4(lhs_mk, values_gkp, scales_gbn, group_sizes_g, *, block_m=None, interpret=None,
                         tiles=None):
    """Pallas grouped GEMM on MXFP4 weights (see the module comment): lhs [M, K] (bf16 / fp16)
    rows sorted by group, values [G, K, N / 2] uint8, scales [G, K / 32, N] e8m0, group_sizes
    [G] int32 -> [M, N] in lhs's dtype (rows past the groups' sum give 0)."""
    check_operands(lhs_mk, values_gkp, scales_gbn, group_sizes_g)
    m, k = lhs_mk.shape
    g, _, p = values_gkp.shape
    if p % 16:
        raise ValueError(f"MXFP4 grouped GEMM tiles N / 2 by 16; N = {2 * p}")
    block_k, bnp, num_warps, num_stages = tiles or tiling(m, k, p)
    block_m = block_m or moe.layout_block_m(m)
    n_tiles = moe._n_tiles(m, g, block_m)
    dest, tile_group = moe._padded_layout(group_sizes_g, m, block_m, n_tiles)
    rows = n_tiles * block_m
    x_pad = jnp.zeros((rows, k), lhs_mk.dtype).at[jnp.where(dest >= 0, dest, rows)].set(lhs_mk, mode="drop")
    interpret = jax.default_backend() != "gpu" if interpret is None else interpret
    half = jax.ShapeDtypeStruct((rows, p), lhs_mk.dtype)
    spec = pl.BlockSpec((block_m, bnp), lambda i, j: (i, j))
    even, odd = pl.pallas_call(
        functools.partial(_kernel, block_k=block_k, n_k=k // block_k),
        grid=(n_tiles, p // bnp),
        out_specs=(spec, spec),
        out_shape=(half, half),
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name="moe_grouped_matmul_mxfp4",
    )(tile_group, x_pad, values_gkp, jax.lax.bitcast_convert_type(scales_gbn, jnp.uint8))
    out = jnp.stack([even, odd], axis=-1).reshape(rows, 2 * p)
    return jnp.where((dest >= 0)[:, None], out[jnp.maximum(dest, 0)], 0).astype(lhs_mk.dtype)
