"""The exact diagonal sub-blocks of a chunk's A_kk and A_qk, for gates with no lower bound.

The split prepare (`prepare._split_intra_chunk`) forms A's 16 x 16 tiles as dots of rows decayed
to a reference R_i with columns decayed from it.  Left of the diagonal every factor is <= 1; on
the diagonal tile the column factor exp(R_i - G_s) grows as exp(16 |g|), finite only while every
log-decay g is bounded (Kimi-K3's gate: g >= -5).  Kimi-Linear's softplus gate has no bound: a
token's log-decay can be -50 or -500, and the factored diagonal overflows.

This kernel computes the diagonal tiles without factoring, as fla's ``chunk_kda`` intra kernel
does, one column s at a time:

    A[t, s] = sum_k x_t[k] k_s[k] exp(G_t[k] - G_s[k])     (s <= t, both in one 16-token block)

with x = k (A_kk; the strict mask and beta are applied by the caller) or x = q (A_qk), and G the
gate's cumulative sum inside the block.  Every exponent is <= 0: exact for any gate <= 0, at the
price of 16 exps per token per key channel (what the factored form saves).  The tiles are written
in place in a [C, C] array per (chunk, head), zero off the diagonal blocks, which the split intra
kernel adds to its off-diagonal dots.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.kda.common import CHUNK, SUB


def diagonal_tiles(q, k, g):
    """One block's exact tiles: q, k, g [SUB, K] fp32 (g the per-token log-decays) -> (A_kk raw,
    A_qk) [SUB, SUB] fp32 with A[t, s] = sum_k x_t k_s exp(G_t - G_s) for s <= t (0 above the
    diagonal; A_kk keeps its diagonal, which the caller's strict mask drops)."""
    rows = jax.lax.broadcasted_iota(jnp.int32, g.shape, 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, (SUB, SUB), 1)
    gcum = jnp.cumsum(g, axis=0)
    akk = aqk = jnp.zeros((SUB, SUB), jnp.float32)
    for s in range(SUB):
        pick = rows == s
        k_s = jnp.sum(jnp.where(pick, k, 0.0), axis=0)  # [K], exact (a masked sum of one row)
        g_s = jnp.sum(jnp.where(pick, gcum, 0.0), axis=0)
        # rows t >= s: G_t - G_s <= 0; rows above are masked in the exponent (never +inf * 0)
        decayed = k_s[None, :] * jnp.exp(jnp.where(rows >= s, gcum - g_s[None, :], -jnp.inf))
        akk = akk + jnp.where(cols == s, jnp.sum(k * decayed, axis=1)[:, None], 0.0)
        aqk = aqk + jnp.where(cols == s, jnp.sum(q * decayed, axis=1)[:, None], 0.0)
    return akk, aqk


def _diagonal_kernel(q_ref, k_ref, g_ref, akk_ref, aqk_ref):
    """One (chunk, head): q / k / g [C, K] in; A_kk (raw) and A_qk [C, C] fp32 out, the C / SUB
    diagonal tiles exact and every other tile 0.  Each tile is stored once (no two stores of a
    program overlap)."""
    zero = jnp.zeros((SUB, SUB), jnp.float32)
    for i in range(CHUNK // SUB):
        rows = pl.ds(i * SUB, SUB)
        load = lambda ref: ref[rows, :].astype(jnp.float32)
        akk, aqk = diagonal_tiles(load(q_ref), load(k_ref), load(g_ref))
        for j in range(CHUNK // SUB):
            cols = pl.ds(j * SUB, SUB)
            akk_ref[rows, cols] = akk if i == j else zero
            aqk_ref[rows, cols] = aqk if i == j else zero


def diagonal_call(q, k, g, *, interpret: bool, num_warps: int = 4):
    """[T, H, K] q / k / g (T a multiple of CHUNK) -> (A_kk raw, A_qk) [NT, H, C, C] fp32, the
    exact diagonal tiles of each chunk (see the module docstring)."""
    t, h, dk = q.shape
    nt = t // CHUNK
    in_blk = pl.BlockSpec((CHUNK, None, dk), lambda n, hh: (n, hh, 0))
    out_blk = pl.BlockSpec((None, None, CHUNK, CHUNK), lambda n, hh: (n, hh, 0, 0))
    out = jax.ShapeDtypeStruct((nt, h, CHUNK, CHUNK), jnp.float32)
    return pl.pallas_call(
        _diagonal_kernel,
        grid=(nt, h),
        in_specs=[in_blk, in_blk, in_blk],
        out_specs=[out_blk, out_blk],
        out_shape=[out, out],
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        name="kda_exact_diagonal",
    )(q, k, g)
