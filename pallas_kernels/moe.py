"""Grouped (ragged) expert GEMM for the MoE, and its reference.

``out[r] = lhs[r] @ rhs[g(r)]`` where rows arrive sorted by group and group g
owns ``group_sizes[g]`` consecutive rows: what `jax.lax.ragged_dot` computes,
and what every routed-expert projection of LatentMoE is.  On the H200,
`lax.ragged_dot` runs 15-39x slower than a Pallas grouped kernel, and the
routed experts are most of the weights a decode step reads.

`grouped_matmul` (Pallas, Triton backend) first scatters the rows into a padded
layout where every group starts on a `block_m` boundary, so each row tile
belongs to one group; the kernel then runs one (row tile, column tile) program
each, reading that group's weight slice once per tile (a decode step with a few
rows per expert reads each active expert's weights once), and tiles past the
last group write zeros.  The scatter / gather around it moves only activations.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import dots


def grouped_matmul_ref(lhs_mk, rhs_gkn, group_sizes_g):
    """Reference: `jax.lax.ragged_dot` (fp32 accumulation).  lhs [M, K], rhs [G, K, N],
    group_sizes [G] int32 (rows past their sum give 0) -> [M, N] in lhs's dtype."""
    out = jax.lax.ragged_dot(lhs_mk, rhs_gkn, group_sizes_g.astype(jnp.int32),
                             preferred_element_type=jnp.float32,
                             precision=jax.lax.Precision.HIGHEST if lhs_mk.dtype == jnp.float32 else None)
    return out.astype(lhs_mk.dtype)


def _pick(n: int, choices) -> int | None:
    return next((c for c in choices if n % c == 0), None)


def kernel_dims_ok(k: int, n: int) -> bool:
    """Whether `grouped_matmul` tiles these dims (K by 64/32/16, N by 128/64/32/16)."""
    return _pick(k, (64, 32, 16)) is not None and _pick(n, (128, 64, 32, 16)) is not None


def _gmm_kernel(tile_group_ref, x_ref, w_ref, o_ref, *, block_k, n_k, precision):
    i, j = pl.program_id(0), pl.program_id(1)
    bm, bn = o_ref.shape
    g = tile_group_ref[i]

    @pl.when(g >= 0)
    def _():
        def body(kk, acc):
            xs = x_ref[pl.ds(i * bm, bm), pl.ds(kk * block_k, block_k)]
            ws = w_ref[g, pl.ds(kk * block_k, block_k), pl.ds(j * bn, bn)]
            return acc + jnp.dot(xs, ws, preferred_element_type=jnp.float32, precision=precision)

        acc = jax.lax.fori_loop(0, n_k, body, jnp.zeros((bm, bn), jnp.float32))
        o_ref[...] = acc.astype(o_ref.dtype)

    @pl.when(g < 0)
    def _():
        o_ref[...] = jnp.zeros((bm, bn), o_ref.dtype)


def _padded_layout(group_sizes, m: int, block_m: int, n_tiles: int):
    """Where each sorted row goes in the group-aligned layout, and each tile's group.

    Returns (dest [M] int32: padded row of row r, or -1 for rows past the groups' sum;
    tile_group [n_tiles] int32: the group of tile i, -1 past the last group)."""
    sizes = group_sizes.astype(jnp.int32)
    padded = (sizes + block_m - 1) // block_m * block_m
    ends, padded_ends = jnp.cumsum(sizes), jnp.cumsum(padded)
    rows = jnp.arange(m, dtype=jnp.int32)
    # compare_all: one fused compare-and-count.  The default scan method is an XLA while loop
    # (several launches and a host round trip per iteration; 30 loops in a `small` decode step).
    group_of_row = jnp.searchsorted(ends, rows, side="right", method="compare_all").astype(jnp.int32)
    valid = group_of_row < sizes.shape[0]
    gr = jnp.minimum(group_of_row, sizes.shape[0] - 1)
    dest = (padded_ends - padded)[gr] + rows - (ends - sizes)[gr]
    tile_start = jnp.arange(n_tiles, dtype=jnp.int32) * block_m
    tile_group = jnp.searchsorted(padded_ends, tile_start, side="right", method="compare_all").astype(jnp.int32)
    tile_group = jnp.where(tile_group < sizes.shape[0], tile_group, -1)
    return jnp.where(valid, dest, -1), tile_group


@functools.partial(jax.jit, static_argnames=("block_m", "interpret"))
def grouped_matmul(lhs_mk, rhs_gkn, group_sizes_g, *, block_m=None, interpret=None):
    """Pallas grouped GEMM, the contract of `grouped_matmul_ref`.

    lhs [M, K] rows sorted by group; rhs [G, K, N] (same dtype); group_sizes [G]
    int32.  block_m: rows per tile (default 16 for M <= 512, a decode step's
    few rows per expert; else 64).  K must divide by 16 and N by 16
    (`kernel_dims_ok`).  fp32 inputs multiply in 3xTF32 on the GPU (exact fp32
    in interpret mode), bf16 inputs on bf16 tensor cores, accumulating in fp32.
    """
    m, k = lhs_mk.shape
    g, k2, n = rhs_gkn.shape
    if k2 != k or group_sizes_g.shape != (g,):
        raise ValueError(f"grouped_matmul: lhs {lhs_mk.shape}, rhs {rhs_gkn.shape}, group_sizes "
                         f"{group_sizes_g.shape} do not match ([M, K], [G, K, N], [G])")
    if lhs_mk.dtype != rhs_gkn.dtype:
        raise ValueError(f"grouped_matmul: lhs {lhs_mk.dtype} and rhs {rhs_gkn.dtype} must share a dtype")
    if not kernel_dims_ok(k, n):
        raise ValueError(f"grouped_matmul: K={k} and N={n} must be multiples of 16")
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    block_m = block_m or (16 if m <= 512 else 64)
    block_k, block_n = _pick(k, (64, 32, 16)), _pick(n, (128, 64, 32, 16))
    # Every group may leave up to block_m - 1 rows of its last tile empty.
    n_tiles = -(-(m + g * (block_m - 1)) // block_m)
    dest, tile_group = _padded_layout(group_sizes_g, m, block_m, n_tiles)
    # rows past the groups (dest -1) go out of range and are dropped (a -1 would wrap to the last row)
    x_pad = jnp.zeros((n_tiles * block_m, k), lhs_mk.dtype).at[jnp.where(dest >= 0, dest, n_tiles * block_m)].set(
        lhs_mk, mode="drop")
    precision = dots.fp32_precision(interpret) if lhs_mk.dtype == jnp.float32 else None
    out = pl.pallas_call(
        functools.partial(_gmm_kernel, block_k=block_k, n_k=k // block_k, precision=precision),
        grid=(n_tiles, n // block_n),
        out_specs=pl.BlockSpec((block_m, block_n), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((n_tiles * block_m, n), lhs_mk.dtype),
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=3),
        name="moe_grouped_matmul",
    )(tile_group, x_pad, rhs_gkn)
    return jnp.where((dest >= 0)[:, None], out[jnp.maximum(dest, 0)], 0).astype(lhs_mk.dtype)
