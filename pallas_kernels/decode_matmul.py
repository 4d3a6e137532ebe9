"""Few-row matmul for the decode step's dense projections, and its reference.

``out = x @ w`` for x [M, K] with M a decode bucket's rows (at most a few dozen) and w
[K, N] a projection's weights: a weight stream, bound by HBM bandwidth.  XLA's Triton
GEMM for these shapes reads the weights at a third of the copy rate on the H200
(split-K tiles of 32 x 64 at one pipeline stage, its autotuner timing them on weights that
sit in L2); this kernel gives every program a narrow column strip (and, with `splits`, one
slice of K), streams it through a pipelined loop with an evict-first policy (each weight is
read once a step), and keeps x's rows whole in registers.

    decode_matmul(x_mk, w_kn, tiling=None) -> [M, N] in x's dtype (fp32 accumulation)

N need not divide by the strip (the last strip is masked); K must divide by splits x block_k.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

# (block_n, block_k, splits, num_warps, num_stages)
Tiling = tuple[int, int, int, int, int]
MAX_ROWS = 64  # above this the projection is no longer a weight stream: XLA's GEMM serves it


def decode_matmul_ref(x_mk, w_kn):
    """Reference: XLA's dot, fp32 accumulation, in x's dtype."""
    return jnp.dot(x_mk, w_kn, preferred_element_type=jnp.float32).astype(x_mk.dtype)


def default_tiling(m: int, k: int, n: int) -> Tiling:
    """Strips narrow enough that every SM streams (`benchmarks/decode_matmul.py` chose these)."""
    block_k = next(b for b in (128, 64, 32, 16) if k % b == 0)
    splits = 2 if n <= 2048 and k % (2 * block_k) == 0 else 1
    return (32, block_k, splits, 4, 4)


def fits(x_mk, w_kn) -> bool:
    """Whether `decode_matmul` serves this product: 2-D, few rows, one 16-bit dtype, K by 16."""
    return (x_mk.ndim == 2 and w_kn.ndim == 2 and x_mk.shape[1] == w_kn.shape[0]
            and 1 <= x_mk.shape[0] <= MAX_ROWS and x_mk.dtype == w_kn.dtype
            and x_mk.dtype in (jnp.bfloat16, jnp.float16) and w_kn.shape[0] % 16 == 0)


def _kernel(x_ref, w_ref, o_ref, *, n: int, block_n: int, block_k: int, k_split: int):
    j, s = pl.program_id(0), pl.program_id(1)
    cols = j * block_n + jnp.arange(block_n)
    ok = (cols < n)[None, :]

    def body(i, acc):
        k0 = s * k_split + i * block_k
        xs = x_ref[:, pl.ds(k0, block_k)]
        ws = pltriton.load(w_ref.at[pl.ds(k0, block_k), pl.ds(j * block_n, block_n)], mask=ok, other=0,
                           eviction_policy="evict_first")
        return acc + jnp.dot(xs, ws, preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, k_split // block_k, body, jnp.zeros((x_ref.shape[0], block_n), jnp.float32))
    pltriton.store(o_ref.at[s, :, pl.ds(j * block_n, block_n)], acc.astype(o_ref.dtype), mask=ok)


@functools.partial(jax.jit, static_argnames=("tiling", "interpret"))
def decode_matmul(x_mk, w_kn, *, tiling: Tiling | None = None, interpret: bool | None = None):
    """x [M, K] @ w [K, N] -> [M, N] in x's dtype, accumulating in fp32 (`fits` says when).

    Rows are padded to 16 (the tensor-core tile); with splits > 1 each program sums one slice of
    K and the slices' fp32 partials are added after (XLA fuses that sum into the consumer)."""
    if not fits(x_mk, w_kn):
        raise ValueError(f"decode_matmul: x {x_mk.shape} {x_mk.dtype} @ w {w_kn.shape} {w_kn.dtype} needs 2-D "
                         f"operands of one 16-bit dtype, 1..{MAX_ROWS} rows and K a multiple of 16")
    m, k = x_mk.shape
    n = w_kn.shape[1]
    block_n, block_k, splits, num_warps, num_stages = tiling or default_tiling(m, k, n)
    if k % (splits * block_k):
        raise ValueError(f"decode_matmul tiling {tiling}: K={k} must divide by splits {splits} x block_k {block_k}")
    interpret = jax.default_backend() != "gpu" if interpret is None else interpret
    m_pad = -(-m // 16) * 16
    x = jnp.pad(x_mk, ((0, m_pad - m), (0, 0))) if m_pad != m else x_mk
    out_dtype = x_mk.dtype if splits == 1 else jnp.float32
    out = pl.pallas_call(
        functools.partial(_kernel, n=n, block_n=block_n, block_k=block_k, k_split=k // splits),
        grid=(pl.cdiv(n, block_n), splits),
        out_shape=jax.ShapeDtypeStruct((splits, m_pad, n), out_dtype),
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name="decode_matmul",
    )(x, w_kn)
    out = out[0] if splits == 1 else out.sum(0)
    return out[:m].astype(x_mk.dtype)
