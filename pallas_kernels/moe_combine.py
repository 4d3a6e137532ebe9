"""The routed experts' combine and the latent RMSNorm after it, in one kernel.

After `pallas_kernels.moe.grouped_ffn` a token's k expert outputs lie in the group-aligned
layout's rows, at dest[n, j].  `LatentMoE` then takes::

    z[n]   = sum_j w[n, j] * y[dest[n, j]]        (w rounded to y's dtype, sums in fp32, z in y's dtype)
    out[n] = rms_norm(z[n]) * norm                (fp32 inside, out in y's dtype)

Unfused that is two XLA launches a MoE layer (the gather and weighted sum, then the norm); here
one program per token reads its k rows, sums, normalizes and writes.  Assignments whose dest
lies past the rows (a bucket's idle tokens, routed to no expert) add nothing, so such a token
gives rms_norm(0) = 0.  `combine_norm_ref` is the same math in jnp.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton


def combine_norm_ref(y_rl, dest_nk, weights_nk, norm_l, *, eps: float):
    """The reference: same arguments and result as `combine_norm`."""
    y = jnp.take(y_rl, dest_nk, axis=0, mode="fill", fill_value=0)  # [N, k, L]: rows past y read 0
    w = weights_nk.astype(y_rl.dtype).astype(jnp.float32)
    z = jnp.sum(w[..., None] * y.astype(jnp.float32), axis=1).astype(y_rl.dtype)
    z32 = z.astype(jnp.float32)
    out = z32 * jax.lax.rsqrt(jnp.mean(z32 * z32, axis=-1, keepdims=True) + eps) * norm_l.astype(jnp.float32)
    return out.astype(y_rl.dtype)


def _chunk(n: int) -> int:
    """The widest power of two up to 512 dividing n (Triton tiles power-of-two shapes)."""
    c = 512
    while n % c:
        c //= 2
    return c


def _combine_norm_kernel(dest_ref, w_ref, y_ref, norm_ref, o_ref, *, chunk, eps):
    n = pl.program_id(0)
    rows, width = y_ref.shape
    k = dest_ref.shape[1]
    f32 = jnp.float32
    accs = [jnp.zeros((chunk,), f32) for _ in range(width // chunk)]
    for j in range(k):
        row = dest_ref[n, j]
        live = row < rows
        w = w_ref[n, j].astype(y_ref.dtype).astype(f32)
        row = jnp.where(live, row, 0)  # a dead assignment reads row 0 and adds nothing
        for c in range(len(accs)):
            accs[c] = accs[c] + jnp.where(live, w * y_ref[row, pl.ds(c * chunk, chunk)].astype(f32), 0.0)
    zs = [a.astype(y_ref.dtype).astype(f32) for a in accs]  # z in y's dtype, as the unfused combine gives it
    r = jax.lax.rsqrt(sum(jnp.sum(z * z) for z in zs) / width + eps)
    for c, z in enumerate(zs):
        o_ref[n, pl.ds(c * chunk, chunk)] = (z * r * norm_ref[pl.ds(c * chunk, chunk)].astype(f32)).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def _combine_norm_core(y_rl, dest_nk, weights_nk, norm_l, *, eps, interpret):
    n = dest_nk.shape[0]
    width = y_rl.shape[1]
    return pl.pallas_call(
        functools.partial(_combine_norm_kernel, chunk=_chunk(width), eps=eps),
        grid=(n,),
        out_shape=jax.ShapeDtypeStruct((n, width), y_rl.dtype),
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        name="moe_combine_norm",
    )(dest_nk, weights_nk, y_rl, norm_l)


def combine_norm_fits(width: int) -> bool:
    """Whether `combine_norm` tiles rows of this width (a multiple of 16)."""
    return width % 16 == 0


def combine_norm(y_rl, dest_nk, weights_nk, norm_l, *, eps: float, interpret=None):
    """rms_norm of each token's routing-weighted expert outputs.

    Args:
      y_rl: [R, L] the experts' outputs in the group-aligned layout (`grouped_ffn(gather=False)`).
      dest_nk: int32 [N, k] each assignment's row of y (>= R: none).
      weights_nk: [N, k] the routing weights; norm_l: [L] the latent norm's scale.
    Returns:
      [N, L] in y's dtype.
    """
    n, k = dest_nk.shape
    width = y_rl.shape[1]
    if y_rl.ndim != 2 or weights_nk.shape != (n, k) or norm_l.shape != (width,):
        raise ValueError(
            f"combine_norm: y [R, L], dest and weights [N, k], norm [L] expected; got {y_rl.shape}, "
            f"{dest_nk.shape}, {weights_nk.shape}, {norm_l.shape}"
        )
    if not combine_norm_fits(width):
        raise ValueError(f"combine_norm: L={width} must be a multiple of 16")
    interpret = jax.default_backend() != "gpu" if interpret is None else interpret
    return _combine_norm_core(
        y_rl,
        jnp.asarray(dest_nk, jnp.int32),
        weights_nk.astype(jnp.float32),
        norm_l,
        eps=float(eps),
        interpret=interpret,
    )
