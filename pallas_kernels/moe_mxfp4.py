"""Grouped (ragged) expert GEMM on MXFP4 weights, dequantized inside the kernel, and its reference.

``out[r] = lhs[r] @ dequant(W[g(r)])`` as `pallas_kernels.moe.grouped_matmul` computes it for
bf16 weights, with W stored as OCP MXFP4 (`pallas_kernels.mxfp4`: e2m1 codes packed two per byte
along N, one e8m0 scale per 32 K of each column; 4.25 bits a weight).  It is the same kernel
(`moe._gmm_kernel`) with an MXFP4 weight loader: each program reads its weight tile as packed
bytes, decodes each 32-K step's even and odd columns (`mxfp4.decode_tile`: inline PTX on the
GPU), runs one MMA per half into two fp32 accumulators and stores them to the even and odd
columns.  So `moe.grouped_ffn` (gate/up with the activation in the epilogue, then down) and the
decode step's `routed_ffn` take MXFP4 experts as they take bf16 ones, and the weights are never
expanded in HBM.

The reference is the bf16 path on the dequantized weights (`grouped_matmul_mxfp4_ref`): the
kernel's decoded tile equals the dequantized weights bit for bit, so only the fp32 accumulation
order differs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import moe, mxfp4


def check_operands(lhs_mk, values_gkp, scales_gbn, group_sizes_g):
    """ValueError naming the mismatch, before any launch."""
    m, k = lhs_mk.shape
    g, k2, p = values_gkp.shape
    if k2 != k or values_gkp.dtype != jnp.uint8:
        raise ValueError(
            f"MXFP4 grouped GEMM: rows [M, {k}] need packed uint8 weights [G, {k}, N / 2]; "
            f"got {values_gkp.dtype} {values_gkp.shape}"
        )
    mxfp4.check(mxfp4.PackedMXFP4(values_gkp, scales_gbn), "MXFP4 grouped GEMM")
    if group_sizes_g.shape != (g,):
        raise ValueError(f"MXFP4 grouped GEMM: group_sizes {group_sizes_g.shape} must be [G={g}]")
    if jnp.dtype(lhs_mk.dtype).itemsize != 2:
        raise ValueError(f"MXFP4 grouped GEMM multiplies 16-bit activations; got {lhs_mk.dtype}")


def grouped_matmul_mxfp4_ref(lhs_mk, values_gkp, scales_gbn, group_sizes_g):
    """The reference: the bf16 grouped GEMM's reference on the dequantized weights (exact in
    lhs's dtype) -> [M, N] in lhs's dtype."""
    check_operands(lhs_mk, values_gkp, scales_gbn, group_sizes_g)
    w = mxfp4.dequantize(values_gkp, scales_gbn).astype(lhs_mk.dtype)
    return moe.grouped_matmul_ref(lhs_mk, w, group_sizes_g)


@functools.partial(jax.jit, static_argnames=("block_m", "interpret", "tiling"))
def grouped_matmul_mxfp4(lhs_mk, values_gkp, scales_gbn, group_sizes_g, *, block_m=None, interpret=None, tiling=None):
    """Pallas grouped GEMM on MXFP4 weights (see the module comment): lhs [M, K] (bf16 / fp16)
    rows sorted by group, values [G, K, N / 2] uint8, scales [G, K / 32, N] e8m0, group_sizes
    [G] int32 -> [M, N] in lhs's dtype (rows past the groups' sum give 0).  tiling: `moe.Tiling`
    (block_n and block_k multiples of 32), or None for `moe.mx_tiling`."""
    check_operands(lhs_mk, values_gkp, scales_gbn, group_sizes_g)
    return moe.grouped_matmul(
        lhs_mk,
        mxfp4.PackedMXFP4(values_gkp, scales_gbn),
        group_sizes_g,
        block_m=block_m,
        interpret=interpret,
        tiling=tiling,
    )
