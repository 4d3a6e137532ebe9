"""A dense GEMM for a decode step's few rows (Pallas Triton): y [M, N] = x [M, K] @ w [K, N].

At M <= 32 a projection is a weight read: its time is w's bytes over HBM bandwidth.  XLA's
GEMMs for these shapes (split-K Triton fusions plus a reduce) read `small`'s decode weights
at 13-49% of the D2D copy rate on the H200.  This kernel gives every program a narrow column
strip of w (block_n) and a slice of K (split_k: fp32 partials [S, M, N] summed by the
consumer's fusion, as XLA's split-K does).  The model uses it for the projections back to
d_model (`kimik3.ops.dense`), where it beat XLA's dot; for the wide input projections XLA's
dot was as fast.
`benchmarks/skinny_tune.py` measures it against XLA's dot on the same shapes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

# (block_n, block_k, split_k, num_warps, num_stages)
Tiling = tuple[int, int, int, int, int]

MAX_ROWS = 32  # past this a projection is no longer a pure weight read
_ROWS_PAD = 16  # Triton's dot needs >= 16 rows


def matmul_ref(x_mk, w_kn):
    """x @ w with fp32 accumulation, in x's dtype."""
    return jnp.dot(x_mk, w_kn, preferred_element_type=jnp.float32).astype(x_mk.dtype)


def default_tiling(k: int, n: int) -> Tiling | None:
    """32-column strips, each program a K-slice of ~768 (split_k = K // 768 where it divides),
    in 128-deep steps when split, 256-deep when not (`benchmarks/skinny_tune.py` on the H200:
    the best or within noise of it at M 8 and 32 for `small`'s out-projections); None where
    no tile divides (the caller keeps XLA's dot)."""
    bn = next((b for b in (32, 16) if n % b == 0), None)
    split = 1
    while k % (2 * split * 128) == 0 and k // (2 * split) >= 768:
        split *= 2
    bk = 128 if split > 1 else next((b for b in (256, 128, 64) if k % b == 0), None)
    if bn is None or bk is None:
        return None
    return (bn, bk, split, 4, 4)


def fits(m: int, k: int, n: int, dtype) -> bool:
    """Whether this kernel takes [m, k] @ [k, n] of dtype (2-byte types: its tiles are sized for them)."""
    return m <= MAX_ROWS and jnp.dtype(dtype).itemsize == 2 and default_tiling(k, n) is not None


def _kernel(x_ref, w_ref, o_ref, *, block_k, n_k, rows):
    """Program (j, s): columns j * block_n of K-slice s (n_k steps of block_k).  Fewer rows than
    Triton's dot takes (16) load masked (zeros) and store masked: no padded copy of x."""
    j, s = pl.program_id(0), pl.program_id(1)
    bn = o_ref.shape[-1]
    mp = -(-rows // _ROWS_PAD) * _ROWS_PAD
    x_mask = jax.lax.broadcasted_iota(jnp.int32, (mp, block_k), 0) < rows

    def body(kk, acc):
        k0 = (s * n_k + kk) * block_k
        if mp == rows:
            xs = x_ref[:, pl.ds(k0, block_k)]
        else:
            xs = pltriton.load(x_ref.at[pl.ds(0, mp), pl.ds(k0, block_k)], mask=x_mask, other=0)
        return acc + jnp.dot(xs, w_ref[pl.ds(k0, block_k), pl.ds(j * bn, bn)], preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, n_k, body, jnp.zeros((mp, bn), jnp.float32)).astype(o_ref.dtype)
    if mp == rows:
        o_ref[...] = acc
    else:
        pltriton.store(o_ref.at[pl.ds(0, mp), :], acc, mask=jax.lax.broadcasted_iota(jnp.int32, (mp, bn), 0) < rows)


def _interpret(interpret):
    return jax.default_backend() != "gpu" if interpret is None else interpret


@functools.partial(jax.jit, static_argnames=("tiling", "interpret"))
def matmul(x_mk, w_kn, *, tiling: Tiling | None = None, interpret=None):
    """x [M, K] @ w [K, N] -> [M, N] in x's dtype, fp32 accumulation; M <= MAX_ROWS, 2-byte
    dtype (`fits`).  tiling: `Tiling`, None for `default_tiling`."""
    m, k = x_mk.shape
    if w_kn.shape[0] != k or w_kn.dtype != x_mk.dtype:
        raise ValueError(f"skinny.matmul: x {x_mk.shape} {x_mk.dtype} and w {w_kn.shape} {w_kn.dtype} "
                         f"must be [M, K] @ [K, N] of one dtype")
    n = w_kn.shape[1]
    if not fits(m, k, n, x_mk.dtype):
        raise ValueError(f"skinny.matmul: [{m}, {k}] @ [{k}, {n}] {x_mk.dtype} needs M <= {MAX_ROWS}, a 2-byte "
                         f"dtype and K, N multiples of 64 and 16")
    block_n, block_k, split, num_warps, num_stages = tiling or default_tiling(k, n)
    if n % block_n or k % (block_k * split):
        raise ValueError(f"skinny.matmul tiling {tiling}: block_n must divide N={n}, block_k * split_k K={k}")
    out_dtype = x_mk.dtype if split == 1 else jnp.float32
    out = pl.pallas_call(
        functools.partial(_kernel, block_k=block_k, n_k=k // (block_k * split), rows=m),
        grid=(n // block_n, split),
        out_specs=pl.BlockSpec((None, m, block_n), lambda j, s: (s, 0, j)),
        out_shape=jax.ShapeDtypeStruct((split, m, n), out_dtype),
        interpret=_interpret(interpret),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name="skinny_matmul",
    )(x_mk, w_kn)
    y = out[0] if split == 1 else out.sum(0).astype(x_mk.dtype)
    return y

