"""Block-scaled FP8 GEMMs (W8A8) for the attention projections, and their reference.

``y[m, n] = sum_b  (xq[m, B_b] . wq[B_b, n]) * sx[m, b] * sw[b, n]``

over K blocks B_b of `block_k(fmt)` contracted values: e4m3 activations with one scale per row
per block (`kimik3.quant.formats.quantize_rows`) times e4m3 weights with one scale per block per
column (``fp8``: 128-K blocks, the weight's 128 x 128 block scale of that column; ``mxfp8``:
32-K blocks, the e8m0 scale of each (32 K, column), emulated on Hopper, which has no MX tensor
cores, by scaling each 32-deep FP8 MMA's partial sum).  Each block's partial dot accumulates in
fp32 and is scaled before it joins the fp32 sum (DeepSeek-V3's promotion of FP8 partial sums
out of the tensor cores), blocks in order.

Column n's result reads only column n of the weight and of its scales, in a fixed block order:
a fused GEMM over [W_1 | W_2 | ...] gives each member's columns bit for bit what the member's
own GEMM gives (`kimik3.fused`'s quantized groups rely on it; tested with array_equal).

Arrays, not `kimik3.quant` tensors (kernels import nothing from the model package):
xq [M, K] e4m3, sx [M, K / bk] fp32, wq [K, N] e4m3, and the weight scales: fp8: block scales
[K / 128, NB] fp32 with `col_block` int32 [N], each column's block (a fused group's members
keep their own block grids); mxfp8: e8m0 scales [K / 32, N].
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

FORMATS = ("fp8", "mxfp8")


def block_k(fmt: str) -> int:
    return {"fp8": 128, "mxfp8": 32}[fmt]


def _column_scales(fmt: str, sw, col_block):
    """fp32 [K / bk, N]: each (K block, column)'s weight scale."""
    return sw[:, col_block] if fmt == "fp8" else sw.astype(jnp.float32)


def check_operands(fmt: str, xq_mk, sx_mb, wq_kn, sw, col_block=None):
    """ValueError naming the mismatch, before any launch."""
    if fmt not in FORMATS:
        raise ValueError(f"block-scaled GEMM format must be one of {FORMATS}; got {fmt!r}")
    bk = block_k(fmt)
    (m, k), (k2, n) = xq_mk.shape, wq_kn.shape
    if k != k2 or k % bk:
        raise ValueError(
            f"{fmt} GEMM: x [M, K] {xq_mk.shape} and w [K, N] {wq_kn.shape} need one K, a multiple of {bk}"
        )
    if xq_mk.dtype != jnp.float8_e4m3fn or wq_kn.dtype != jnp.float8_e4m3fn:
        raise ValueError(f"{fmt} GEMM takes e4m3 operands; got {xq_mk.dtype} and {wq_kn.dtype}")
    if sx_mb.shape != (m, k // bk):
        raise ValueError(f"{fmt} GEMM: activation scales {sx_mb.shape} must be [M, K / {bk}] = {(m, k // bk)}")
    if fmt == "fp8":
        if col_block is None or tuple(col_block.shape) != (n,) or sw.shape[0] != k // bk:
            raise ValueError(f"fp8 GEMM: block scales {sw.shape} need K / 128 = {k // bk} rows and col_block [N={n}]")
    elif sw.shape != (k // bk, n) or sw.dtype != jnp.float8_e8m0fnu:
        raise ValueError(f"mxfp8 GEMM: scales must be e8m0 [K / 32, N] = {(k // bk, n)}; got {sw.dtype} {sw.shape}")


# The reference's column tile: every partial dot is [M, bk] x [bk, REF_TILE_N] whatever N is.
# XLA:CPU picks a dot's blocking from its operand shapes, so one [M, bk] x [bk, N] dot sums a
# column's products in an order that depends on N (fused vs member results differed by an ulp);
# at one fixed shape every column is summed alike, as each kernel program does on the GPU.
REF_TILE_N = 64


def qmatmul_ref(fmt: str, xq_mk, sx_mb, wq_kn, sw, col_block=None, *, out_dtype=jnp.float32):
    """The contract in plain jnp (CPU; the kernel's reference): per K block, fixed-shape dots over
    column tiles of REF_TILE_N (exact fp32 products of e4m3 operands), scaled, summed in block
    order.  -> [M, N]."""
    check_operands(fmt, xq_mk, sx_mb, wq_kn, sw, col_block)
    bk = block_k(fmt)
    m, k = xq_mk.shape
    n = wq_kn.shape[1]
    n_pad = -(-n // REF_TILE_N) * REF_TILE_N
    x = xq_mk.astype(jnp.float32).reshape(m, k // bk, bk).transpose(1, 0, 2)  # [KB, M, bk]
    w = jnp.pad(wq_kn.astype(jnp.float32), ((0, 0), (0, n_pad - n)))
    w = w.reshape(k // bk, bk, n_pad // REF_TILE_N, REF_TILE_N).transpose(0, 2, 1, 3)  # [KB, NT, bk, TN]
    s_w = jnp.pad(_column_scales(fmt, sw, col_block), ((0, 0), (0, n_pad - n)))
    s_x = sx_mb.T.astype(jnp.float32)

    def body(b, acc):
        part = jnp.einsum("mk,tkn->mtn", x[b], w[b], precision=jax.lax.Precision.HIGHEST).reshape(m, n_pad)
        return acc + part * s_x[b][:, None] * s_w[b][None, :]

    acc = jax.lax.fori_loop(0, k // bk, body, jnp.zeros((m, n_pad), jnp.float32))
    return acc[:, :n].astype(out_dtype)


def _kernel(xq_ref, sx_ref, wq_ref, sw_ref, *refs, bk, n_kb, n, fp8):
    """One (row tile, column tile): the K blocks in order, each an FP8 MMA scaled into fp32."""
    o_ref = refs[-1]
    i, j = pl.program_id(0), pl.program_id(1)
    bm, bn = o_ref.shape
    cols = j * bn + jax.lax.broadcasted_iota(jnp.int32, (1, bn), 1)  # [1, bn]
    live = cols < n
    if fp8:
        col_block = pltriton.load(refs[0].at[cols[0]], mask=live[0], other=0)  # [bn]
    kk = jax.lax.broadcasted_iota(jnp.int32, (bk, 1), 0)

    def body(b, acc):
        xs = xq_ref[pl.ds(i * bm, bm), pl.ds(b * bk, bk)]  # [bm, bk] (rows padded to the tile)
        ws = pltriton.load(wq_ref.at[b * bk + kk, cols], mask=jnp.broadcast_to(live, (bk, bn)), other=0.0)
        part = jnp.dot(xs, ws, preferred_element_type=jnp.float32)
        s_x = sx_ref[b, pl.ds(i * bm, bm)]  # [bm] (scales transposed: [KB, M_pad])
        if fp8:
            s_w = pltriton.load(sw_ref.at[b, col_block], mask=live[0], other=0.0)
        else:  # e8m0 bits -> 2^(e - 127) as fp32: the bits are fp32's exponent field
            e = pltriton.load(sw_ref.at[b, cols[0]], mask=live[0], other=127).astype(jnp.int32)
            s_w = jax.lax.bitcast_convert_type(jax.lax.shift_left(e, 23), jnp.float32)
        return acc + part * s_x[:, None] * s_w[None, :]

    acc = jax.lax.fori_loop(0, n_kb, body, jnp.zeros((bm, bn), jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


def tiling(m: int, n: int) -> tuple[int, int, int, int]:
    """(block_m, block_n, num_warps, num_stages): a decode step's few rows take narrow column
    tiles (more programs over the weight: the GEMM is a read of it), prefill wide ones."""
    if m <= 16:
        return 16, 64, 4, 4
    if m <= 64:
        return 64, 64, 4, 4
    return 128, 128, 8, 3


@functools.partial(jax.jit, static_argnames=("fmt", "out_dtype", "interpret", "tiles"))
def qmatmul(fmt: str, xq_mk, sx_mb, wq_kn, sw, col_block=None, *, out_dtype=jnp.bfloat16, interpret=None, tiles=None):
    """Pallas (Triton backend) block-scaled GEMM, the contract of `qmatmul_ref` -> [M, N] out_dtype.
    tiles: `tiling`'s tuple, or None to pick by M.  interpret: None = off the GPU only."""
    check_operands(fmt, xq_mk, sx_mb, wq_kn, sw, col_block)
    interpret = jax.default_backend() != "gpu" if interpret is None else interpret
    bk = block_k(fmt)
    m, k = xq_mk.shape
    n = wq_kn.shape[1]
    bm, bn, num_warps, num_stages = tiles or tiling(m, n)
    m_pad = -(-m // bm) * bm
    xq = jnp.pad(xq_mk, ((0, m_pad - m), (0, 0)))
    sx_t = jnp.pad(sx_mb.astype(jnp.float32), ((0, m_pad - m), (0, 0))).T  # [KB, M_pad]
    if fmt == "fp8":
        extra, sw_in = (col_block.astype(jnp.int32),), sw.astype(jnp.float32)
    else:
        extra, sw_in = (), jax.lax.bitcast_convert_type(sw, jnp.uint8)
    n_tiles = -(-n // bn)
    out = pl.pallas_call(
        functools.partial(_kernel, bk=bk, n_kb=k // bk, n=n, fp8=fmt == "fp8"),
        grid=(m_pad // bm, n_tiles),
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((m_pad, n_tiles * bn), out_dtype),
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name=f"{fmt}_block_scaled_gemm",
    )(xq, sx_t, wq_kn, sw_in, *extra)
    return out[:m, :n]


def reference_inputs(rng: np.random.Generator, fmt: str, m: int, k: int, n: int):
    """Random operands of the contract (tests and benchmarks): e4m3 values from normal draws,
    activation scales log-uniform over a few binades, weight scales as the formats make them."""
    xq = jnp.asarray(rng.standard_normal((m, k)) * 64, jnp.float32).clip(-448, 448).astype(jnp.float8_e4m3fn)
    wq = jnp.asarray(rng.standard_normal((k, n)) * 64, jnp.float32).clip(-448, 448).astype(jnp.float8_e4m3fn)
    bk = block_k(fmt)
    sx = jnp.asarray(2.0 ** rng.uniform(-12, -6, (m, k // bk)), jnp.float32)
    if fmt == "fp8":
        nb = -(-n // 128)
        sw = jnp.asarray(2.0 ** rng.uniform(-12, -6, (k // bk, nb)), jnp.float32)
        return xq, sx, wq, sw, jnp.asarray(np.arange(n) // 128, jnp.int32)
    e = rng.integers(-12, -6, (k // bk, n))
    return xq, sx, wq, jnp.asarray(np.ldexp(1.0, e), jnp.float32).astype(jnp.float8_e8m0fnu), None
