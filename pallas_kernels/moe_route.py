"""A decode step's MoE routing and expert layout in one kernel.

For N tokens (a decode bucket) with fp32 router logits [N, E]::

    scores  = sigmoid(logits)
    chosen  = top_k(scores + bias)              (the lower expert id first among ties)
    weights = scores[chosen] / sum(scores[chosen])
    dest    = each (token, slot)'s row in the group-aligned layout of `pallas_kernels.moe_layout`
    tiles   = the expert of each row tile of that layout (-1 past the last)

which is `kimik3.layers.moe.route` followed by `pallas_kernels.moe_layout.assignment_layout` (the
contract this kernel is tested against).  Unfused, that is ~10 small XLA ops per MoE layer (the
bias add, a sort for top_k, the gather of the chosen scores, the experts' counts, each
assignment's rank, two running sums, the tiles' search, selects); here one program holds the
[N, E] scores and does all of it: top-k by k rounds of argmax, an assignment's rank within its
expert as the exclusive running count of earlier tokens that chose that expert (a token's k
experts are distinct, so no earlier slot of the same token can share it).  Tokens whose `real`
is 0 (a bucket's idle rows, a chunk's pad) are routed to no expert: their dest lies past the
layout, and they count nowhere.

Triton tiles whole arrays here, so N, E and k must be powers of two (`route_layout_fits`); the
tiles' output is padded to a power of two (the grouped GEMM reads only its first n_tiles).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import moe, moe_layout


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


_MAX_SCORES = 1 << 14  # [N, E] scores one program holds in registers


def route_layout_fits(n_tokens: int, n_experts: int, top_k: int) -> bool:
    """Whether `route_layout` serves this routing (one program: a decode step's few tokens)."""
    return (
        _pow2(n_tokens)
        and _pow2(n_experts)
        and _pow2(top_k)
        and top_k <= n_experts
        and n_tokens * n_experts <= _MAX_SCORES
        and n_tokens * top_k <= moe_layout.PAIRWISE_LIMIT
    )


def _route_kernel(logits_ref, bias_ref, real_ref, w_ref, dest_ref, tiles_ref, *, top_k, block_m, past):
    n, e = logits_ref.shape
    scores = jax.nn.sigmoid(logits_ref[...].astype(jnp.float32))  # [N, E]
    sel = scores + bias_ref[...].astype(jnp.float32)[None, :]
    expert = jax.lax.broadcasted_iota(jnp.int32, (n, e), 1)
    real = real_ref[...] > 0  # [N]
    ids, weights, chosen = [], [], jnp.zeros((n, e), jnp.int32)
    for _ in range(top_k):
        best = jnp.max(sel, axis=1, keepdims=True)
        idx = jnp.min(jnp.where(sel == best, expert, e), axis=1)  # the lower id among ties, as top_k
        hit = expert == idx[:, None]
        weights.append(jnp.sum(jnp.where(hit, scores, 0.0), axis=1))
        sel = jnp.where(hit, -jnp.inf, sel)
        ids.append(idx)
        chosen = chosen + hit.astype(jnp.int32)
    chosen = jnp.where(real[:, None], chosen, 0)
    sizes = jnp.sum(chosen, axis=0)  # [E]
    earlier = jnp.cumsum(chosen, axis=0) - chosen  # [N, E]: earlier tokens that chose each expert
    padded = (sizes + block_m - 1) // block_m * block_m
    padded_ends = jnp.cumsum(padded)
    starts = padded_ends - padded
    total = sum(weights)
    for j in range(top_k):
        hit = expert == ids[j][:, None]
        d = jnp.sum(jnp.where(hit, starts[None, :] + earlier, 0), axis=1)
        dest_ref[:, j] = jnp.where(real, d, past)
        w_ref[:, j] = weights[j] / total
    n_tiles_p2 = tiles_ref.shape[0]
    tile_start = jax.lax.broadcasted_iota(jnp.int32, (n_tiles_p2, e), 0) * block_m
    group = jnp.sum((padded_ends[None, :] <= tile_start).astype(jnp.int32), axis=1)  # searchsorted, right
    tiles_ref[...] = jnp.where(group < e, group, -1)


@functools.partial(jax.jit, static_argnames=("top_k", "block_m", "interpret"))
def _route_core(logits, bias, real, *, top_k, block_m, interpret):
    n, e = logits.shape
    n_tiles = moe_layout.layout_tiles(n * top_k, e, block_m)
    return pl.pallas_call(
        functools.partial(_route_kernel, top_k=top_k, block_m=block_m, past=n_tiles * block_m),
        grid=(1,),
        out_shape=[
            jax.ShapeDtypeStruct((n, top_k), jnp.float32),
            jax.ShapeDtypeStruct((n, top_k), jnp.int32),
            jax.ShapeDtypeStruct((_next_pow2(n_tiles),), jnp.int32),
        ],
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        name="moe_route",
    )(logits, bias, real)


def route_layout(logits_ne, bias_e, real_n=None, *, top_k: int, block_m: int | None = None, interpret=None):
    """Routing and layout of N tokens in one kernel.

    Args:
      logits_ne: [N, E] fp32 router logits (before the sigmoid); bias_e: [E] (steers selection only).
      real_n: int32 [N] or None (all real): tokens with 0 go to no expert.
      block_m: the layout's rows per tile (default: `grouped_ffn`'s for N * top_k assignments).
    Returns:
      (weights [N, k] fp32, dest [N, k] int32 rows of the layout (past it for unreal tokens),
      tile_group [>= n_tiles] int32), what `pallas_kernels.moe.grouped_ffn(layout=)` takes.
    """
    n, e = logits_ne.shape
    if not route_layout_fits(n, e, top_k):
        raise ValueError(
            f"route_layout: N={n}, E={e}, k={top_k} must be powers of two with N * E <= {_MAX_SCORES} "
            f"and N * k <= {moe_layout.PAIRWISE_LIMIT} (route_layout_fits)"
        )
    if bias_e.shape != (e,):
        raise ValueError(f"route_layout: bias {bias_e.shape} must be [E={e}]")
    real = jnp.ones((n,), jnp.int32) if real_n is None else jnp.asarray(real_n, jnp.int32).reshape(n)
    block_m = block_m or moe_layout.layout_block_m(n * top_k)
    return _route_core(
        logits_ne.astype(jnp.float32), bias_e, real, top_k=top_k, block_m=block_m, interpret=moe._interpret(interpret)
    )
