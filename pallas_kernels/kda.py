"""Kimi Delta Attention (KDA): the math, once, as pure-jnp references.

Conventions follow fla (`fla.ops.kda`): ``[B, T, H, D]`` layouts, a log-space
per-channel gate ``g`` (``g <= 0``), fp32 state ``[B, H, K, V]``; q and k arrive
already L2-normalized.  Per head, per token::

    S <- Diag(exp(g_t)) S
    S <- S + beta_t k_t (v_t - S^T k_t)^T
    o_t = S^T (scale q_t)

`kda_recurrent_ref` is that loop.  `kda_chunked_ref` is the chunked (WY / UT)
form that the Pallas kernels implement: within a chunk of C tokens, with
cumulative log-decay ``G_t = sum_{s<=t} g_s`` (per channel) and chunk-start
state ``S0``::

    A[t, s]  = beta_t sum_c k_t[c] k_s[c] exp(G_t[c] - G_s[c])      (s < t)
    T        = (I + A)^-1                                  (unit lower triangular)
    W        = T (beta * exp(G) * k)        U = T (beta * v)
    V'       = U - W S0                     (the delta-rule-corrected values)
    o_t      = scale * [ (q_t * exp(G_t)) S0 + sum_{s<=t} (q_t . k_s exp(G_t - G_s)) V'_s ]
    S_C      = exp(G_C) * S0 + sum_s (k_s * exp(G_C - G_s)) V'_s^T

Every exponent is of a non-positive number, so nothing overflows.  Tokens
padded with ``k = v = g = beta = 0`` leave the state unchanged, which is how
lengths that are not multiples of C are handled.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

HIGHEST = jax.lax.Precision.HIGHEST  # references stay fp32 on GPU too (no TF32)


def _check_shapes(q, k, v, g, beta, initial_state):
    if q.ndim != 4 or k.shape != q.shape or g.shape != q.shape:
        raise ValueError(f"q, k, g must share one [B, T, H, K] shape; got q{q.shape} k{k.shape} g{g.shape}")
    b, t, h, _ = q.shape
    if v.ndim != 4 or v.shape[:3] != (b, t, h):
        raise ValueError(f"v must be [B, T, H, V] = [{b}, {t}, {h}, V]; got {v.shape}")
    if beta.shape != (b, t, h):
        raise ValueError(f"beta must be [B, T, H] = {(b, t, h)}; got {beta.shape}")
    if initial_state is not None:
        want = (b, h, q.shape[-1], v.shape[-1])
        if initial_state.shape != want:
            raise ValueError(f"initial_state must be [B, H, K, V] = {want}; got {initial_state.shape}")
        if initial_state.dtype != jnp.float32:
            raise ValueError(f"initial_state must be float32; got {initial_state.dtype}")


def _initial(q, v, initial_state):
    b, _, h, dk = q.shape
    if initial_state is None:
        return jnp.zeros((b, h, dk, v.shape[-1]), jnp.float32)
    return initial_state


def kda_step(s_bhkv, q_bhk, k_bhk, v_bhv, g_bhk, beta_bh, scale):
    """One token of the recurrence (fp32).  Returns (o [B, H, V], new state [B, H, K, V])."""
    s_bhkv = s_bhkv * jnp.exp(g_bhk)[..., None]
    pred_bhv = jnp.einsum("bhk,bhkv->bhv", k_bhk, s_bhkv, precision=HIGHEST)
    s_bhkv = s_bhkv + jnp.einsum("bhk,bhv->bhkv", k_bhk * beta_bh[..., None], v_bhv - pred_bhv,
                                 precision=HIGHEST)
    o_bhv = jnp.einsum("bhk,bhkv->bhv", q_bhk * scale, s_bhkv, precision=HIGHEST)
    return o_bhv, s_bhkv


def kda_recurrent_ref(q, k, v, g, beta, *, scale=None, initial_state=None):
    """Token-by-token KDA.

    Args:
      q, k: [B, T, H, K] (L2-normalized), v: [B, T, H, V], g: [B, T, H, K] log
        decay, beta: [B, T, H]; any float dtype, computed in fp32.
      scale: query scale, default K ** -0.5.
      initial_state: [B, H, K, V] float32 or None (zeros).
    Returns:
      o [B, T, H, V] in v's dtype, final_state [B, H, K, V] float32.
    """
    _check_shapes(q, k, v, g, beta, initial_state)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    f32 = lambda x: jnp.moveaxis(x.astype(jnp.float32), 1, 0)  # time-major for scan

    def body(s, xs):
        o, s = kda_step(s, *xs, scale)
        return s, o

    s_final, o_tbhv = jax.lax.scan(body, _initial(q, v, initial_state),
                                   (f32(q), f32(k), f32(v), f32(g), f32(beta)))
    return jnp.moveaxis(o_tbhv, 0, 1).astype(v.dtype), s_final


def kda_chunk_prepare(q, k, v, g, beta, *, chunk_size):
    """Per-chunk quantities that do not depend on the carried state (fp32).

    Inputs as in `kda_chunked_ref` with T a multiple of `chunk_size`.  Returns a
    dict of chunk-major arrays ``[N, B, H, C, ...]``: q_decayed (q * exp(G)),
    w, u, a_qk (causal incl. diagonal), k_to_end (k * exp(G_C - G)), decay_end
    (exp(G_C), [N, B, H, K]).
    """
    b, t, h, dk = q.shape
    c = chunk_size
    n = t // c

    def chunks(x):  # [B, T, H, ...] -> [N, B, H, C, ...]
        x = x.astype(jnp.float32).reshape(b, n, c, h, *x.shape[3:])
        return jnp.moveaxis(jnp.moveaxis(x, 1, 0), 2, 3)

    q_c, k_c, v_c, g_c = chunks(q), chunks(k), chunks(v), chunks(g)
    beta_c = chunks(beta)  # [N, B, H, C]
    gcum = jnp.cumsum(g_c, axis=-2)  # G_t, [N, B, H, C, K]
    diff = gcum[..., :, None, :] - gcum[..., None, :, :]  # G_t - G_s, [N, B, H, C(t), C(s), K]
    t_idx = jnp.arange(c)
    strict = (t_idx[None, :] < t_idx[:, None])[..., None]  # s < t
    incl = (t_idx[None, :] <= t_idx[:, None])[..., None]  # s <= t
    # Mask before exp: above the diagonal G_t - G_s > 0 and could overflow.
    decay_strict = jnp.exp(jnp.where(strict, diff, -jnp.inf))
    decay_incl = jnp.exp(jnp.where(incl, diff, -jnp.inf))
    a_kk = jnp.einsum("...tk,...sk,...tsk->...ts", k_c, k_c, decay_strict, precision=HIGHEST)
    a_kk = a_kk * beta_c[..., :, None]
    a_qk = jnp.einsum("...tk,...sk,...tsk->...ts", q_c, k_c, decay_incl, precision=HIGHEST)
    eye = jnp.eye(c, dtype=jnp.float32)
    lhs = eye + a_kk
    solve = lambda rhs: jax.scipy.linalg.solve_triangular(lhs, rhs, lower=True, unit_diagonal=True)
    w = solve(beta_c[..., None] * jnp.exp(gcum) * k_c)
    u = solve(beta_c[..., None] * v_c)
    g_end = gcum[..., -1:, :]  # [N, B, H, 1, K]
    return dict(
        q_decayed=q_c * jnp.exp(gcum), w=w, u=u, a_qk=a_qk,
        k_to_end=k_c * jnp.exp(g_end - gcum), decay_end=jnp.exp(g_end[..., 0, :]),
    )


def kda_chunk_step(s_bhkv, prep, scale):
    """Advance the state over one chunk.  `prep` holds one chunk of
    `kda_chunk_prepare`'s arrays ([B, H, C, ...]).  Returns (o [B, H, C, V], state)."""
    v_new = prep["u"] - jnp.einsum("bhck,bhkv->bhcv", prep["w"], s_bhkv, precision=HIGHEST)
    o = scale * (jnp.einsum("bhck,bhkv->bhcv", prep["q_decayed"], s_bhkv, precision=HIGHEST)
                 + jnp.einsum("bhcs,bhsv->bhcv", prep["a_qk"], v_new, precision=HIGHEST))
    s_bhkv = (prep["decay_end"][..., None] * s_bhkv
              + jnp.einsum("bhck,bhcv->bhkv", prep["k_to_end"], v_new, precision=HIGHEST))
    return o, s_bhkv


def pad_to_chunks(x, chunk_size: int):
    """Zero-pad axis 1 (time) up to a multiple of `chunk_size`."""
    t = x.shape[1]
    pad = (-t) % chunk_size
    if pad == 0:
        return x
    return jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))


def export_mask(export_at, t: int, chunk: int):
    """Which entries of export_at [E] (token counts, traced) name a state that a chunked pass
    over t tokens produces: positive multiples of `chunk`, at most t.  Others export zeros."""
    return (export_at > 0) & (export_at % chunk == 0) & (export_at <= t)


def kda_chunked_ref(q, k, v, g, beta, *, scale=None, initial_state=None, chunk_size=64, export_at=None):
    """Chunked KDA (see module docstring).  Same contract as `kda_recurrent_ref`; with
    export_at (int32 [E] token counts, traced; see `export_mask`) a third output holds the
    state after each of them, [B, E, H, K, V] fp32 (zeros for entries that name none)."""
    _check_shapes(q, k, v, g, beta, initial_state)
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive; got {chunk_size}")
    b, t, h, _ = q.shape
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    padded = [pad_to_chunks(x, chunk_size) for x in (q, k, v, g, beta)]
    prep = kda_chunk_prepare(*padded, chunk_size=chunk_size)

    def body(s, prep_chunk):
        o, s = kda_chunk_step(s, prep_chunk, scale)
        return s, ((o, s) if export_at is not None else o)

    s_final, out = jax.lax.scan(body, _initial(q, v, initial_state), prep)
    o_nbhcv = out[0] if export_at is not None else out
    # [N, B, H, C, V] -> [B, N*C, H, V]
    o = jnp.moveaxis(o_nbhcv, 0, 1)  # [B, N, H, C, V]
    o = jnp.swapaxes(o, 2, 3).reshape(b, -1, h, v.shape[-1])[:, :t]
    if export_at is None:
        return o.astype(v.dtype), s_final
    states_nbhkv = out[1]
    idx = jnp.clip(export_at // chunk_size - 1, 0, states_nbhkv.shape[0] - 1)
    valid = export_mask(export_at, t, chunk_size)
    exports = jnp.where(valid[:, None, None, None, None], states_nbhkv[idx], 0.0)  # [E, B, H, K, V]
    return o.astype(v.dtype), s_final, jnp.moveaxis(exports, 0, 1)


# =================================================================================================
# Pallas kernels (Triton backend on GPU; interpret mode on CPU)
# =================================================================================================
#
# chunk_kda runs a fully parallel prepare step, then the sequential state pass:
#
# 1. The prepare step, grid (chunks, heads): by default ("split") two kernels,
#    `_split_intra_kernel` then `_split_solve_kernel` (described below them); or
#    one, `_chunk_prepare_kernel` ("fused"): everything in
#    `kda_chunk_prepare` for one chunk, computed in 16-token sub-blocks so no
#    exponent is ever large: for row block i with reference R_i = G just before
#    the block, exp(G_t - G_s) = exp(G_t - R_i) * exp(R_i - G_s); both factors
#    are <= 1 off the diagonal block and <= exp(16 * 5) on it (fits fp32).
#    (I + A)^-1 is applied by block forward substitution with 16x16 diagonal
#    inverses from the product formula (I + N)^-1 = (I - N)(I + N^2)(I + N^4)(I + N^8).
# 2. `_chunk_state_kernel`, grid (sequences, heads, V blocks): the sequential pass
#    over a sequence's chunks carrying the fp32 state.  It writes the outputs
#    and, when a chunk ends at a requested position, the state: checkpoint
#    export costs one extra store of the state in the same pass.
#
# Every sequence starts at a chunk boundary (varlen batches are laid out padded
# to multiples of the chunk), so chunks never straddle sequences.

import functools as _functools

import numpy as _np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import dots

CHUNK = 64
SUB = 16


def _default_interpret() -> bool:
    return jax.default_backend() != "gpu"


def _precise_dot(interpret: bool, algorithm: str = "tf32x3"):
    """Dot for the prepare kernel: `algorithm` on the GPU ("bf16": bf16 operands
    with fp32 accumulation, as fla does for bf16 inputs); exact fp32 in
    interpret mode unless the algorithm is "bf16"."""
    if algorithm == "bf16":
        return _fast_dot(True, interpret)
    precision = dots.fp32_precision(interpret, algorithm)

    def dot(a, b):
        return jnp.dot(a, b, precision=precision, preferred_element_type=jnp.float32)

    return dot


def _fast_dot(low_precision: bool, interpret: bool):
    """Dot for the state pass: bf16 operands (fp32 accumulate) for bf16 inputs, else fp32."""
    if not low_precision:
        return _precise_dot(interpret)

    def dot(a, b):
        return jnp.dot(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), preferred_element_type=jnp.float32)

    return dot


def _unit_lower_inverse(a, dot, n: int):
    """(I + a)^-1 for a [m, m] with a^n = 0 (n a power of two), e.g. strictly
    lower-triangular n x n, or block-diagonal with strictly lower n x n blocks:
    the product formula (I - a)(I + a^2)(I + a^4)...(I + a^(n/2))."""
    m = a.shape[0]
    r = jax.lax.broadcasted_iota(jnp.int32, (m, m), 0)
    c = jax.lax.broadcasted_iota(jnp.int32, (m, m), 1)
    eye = jnp.where(r == c, 1.0, 0.0).astype(jnp.float32)
    power = -a
    inv = eye + power
    span = 2
    while span < n:
        power = dot(power, power)
        inv = dot(inv, eye + power)
        span *= 2
    return inv


def _decayed_q_k(q, k, gcum, g_end):
    """q exp(G) and k exp(G_C - G) for rows [R, K] of a chunk (G = gcum, G_C = g_end [K])."""
    return q * jnp.exp(gcum), k * jnp.exp(g_end[None, :] - gcum)


def _a_tiles(kd, qd, kr, beta_rows, row0, col0, dot):
    """Rows [R] x columns [S] tiles of A_kk (strictly causal, times beta_t) and A_qk
    (causal incl. the diagonal) from row operands kd / qd [R, K] (k, q decayed to a
    reference) and the column operand kr [S, K] (k decayed from it); row0 / col0:
    the tile's first token in the chunk.  Masking by token index is a no-op for
    tiles left of the diagonal block."""
    t = row0 + jax.lax.broadcasted_iota(jnp.int32, (kd.shape[0], kr.shape[0]), 0)
    s = col0 + jax.lax.broadcasted_iota(jnp.int32, (kd.shape[0], kr.shape[0]), 1)
    akk = jnp.where(s < t, dot(kd, kr.T), 0.0) * beta_rows[:, None]
    aqk = jnp.where(s <= t, dot(qd, kr.T), 0.0)
    return akk, aqk


def _column_operand(k, gcum, ref, row, end_row):
    """k [C, K] decayed from the reference ref [K] (G just before a row block): exp(R - G_s) <= 1
    before the block, <= exp(SUB * max|g|) inside it; rows from end_row on (past the block, where
    R - G_s could overflow) masked to 0 by an exponent of -inf.  row: the rows' index [C, K]."""
    return k * jnp.exp(jnp.where(row < end_row, ref[None, :] - gcum, -jnp.inf))


def _chunk_output(qd, aqk, s, v_new, scale, dot):
    """A chunk's output: scale (q_decayed S_before + A_qk v_new)."""
    return scale * (dot(qd, s) + dot(aqk, v_new))


def _w_rhs(k, gcum, beta):
    """beta exp(G) k [R, K]: what (I + A)^-1 maps to W."""
    return beta[:, None] * jnp.exp(gcum) * k


def _chunk_prepare_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref,
                          w_ref, u_ref, qd_ref, ke_ref, aqk_ref, de_ref, *, interpret, algorithm):
    """One (chunk, head): refs are [C, K] / [C, V] / [C] in, intermediates out.

    Works in 16-token sub-blocks: A's blocks (i, j <= i) are dots of row block i
    decayed relative to R_i with column block j decayed from R_i, and
    (I + A)^-1 is applied by block forward substitution whose 16 x 16 diagonal
    inverses come from the product formula.  Sub-blocks are re-read from the
    refs where needed rather than kept live, and A_qk tiles are stored as soon
    as they exist: what stays in registers is the A_kk tiles and the finished
    W / U blocks.
    """
    f32 = jnp.float32
    dot = _precise_dot(interpret, algorithm)
    n_sub = CHUNK // SUB
    rows = lambda ref, i: ref[pl.ds(i * SUB, SUB), :].astype(f32)
    base = [None] * (n_sub + 1)  # R_i = G just before sub-block i, [K]
    base[0] = jnp.zeros((g_ref.shape[-1],), f32)
    for i in range(n_sub):
        base[i + 1] = base[i] + jnp.sum(rows(g_ref, i), axis=0)
    gcum = lambda i: jnp.cumsum(rows(g_ref, i), axis=0) + base[i][None, :]  # G of sub-block i
    g_end = base[n_sub]
    de_ref[...] = jnp.exp(g_end)

    a_kk = {}
    w_blocks, u_blocks = [], []
    for i in range(n_sub):
        sl = pl.ds(i * SUB, SUB)
        g_i = gcum(i)
        k_i, q_i = rows(k_ref, i), rows(q_ref, i)
        beta_i = beta_ref[sl].astype(f32)
        qd_i, ke_i = _decayed_q_k(q_i, k_i, g_i, g_end)
        qd_ref[sl, :] = qd_i.astype(qd_ref.dtype)
        ke_ref[sl, :] = ke_i.astype(ke_ref.dtype)
        row_decay = jnp.exp(g_i - base[i][None, :])  # <= 1
        kd, qd = k_i * row_decay, q_i * row_decay
        for j in range(i + 1):
            k_j, g_j = (k_i, g_i) if j == i else (rows(k_ref, j), gcum(j))
            kr = k_j * jnp.exp(base[i][None, :] - g_j)  # <= 1 for j < i, <= exp(SUB * 5) for j == i
            a_kk[i, j], aqk = _a_tiles(kd, qd, kr, beta_i, i * SUB, j * SUB, dot)
            aqk_ref[sl, pl.ds(j * SUB, SUB)] = aqk.astype(aqk_ref.dtype)
        for j in range(i + 1, n_sub):
            aqk_ref[sl, pl.ds(j * SUB, SUB)] = jnp.zeros((SUB, SUB), aqk_ref.dtype)
        # W_i = T_ii (beta exp(G) k - sum_j A_ij W_j), likewise U with beta v.
        rhs_w = _w_rhs(k_i, g_i, beta_i)
        rhs_u = beta_i[:, None] * rows(v_ref, i)
        for j in range(i):
            rhs_w = rhs_w - dot(a_kk[i, j], w_blocks[j])
            rhs_u = rhs_u - dot(a_kk[i, j], u_blocks[j])
        inv = _unit_lower_inverse(a_kk[i, i], dot, SUB)
        w_blocks.append(dot(inv, rhs_w))
        u_blocks.append(dot(inv, rhs_u))
        w_ref[sl, :] = w_blocks[i].astype(w_ref.dtype)
        u_ref[sl, :] = u_blocks[i].astype(u_ref.dtype)


# ---- "split" prepare (TUNING["prepare_impl"] = "split") -----------------------------------------
#
# The same intermediates as `_chunk_prepare_kernel`, from two kernels shaped like
# fla's (chunk_intra + solve_tril + recompute_w_u), with no chain of dependent
# tiny dots:
#
# 1. `_split_intra_kernel`, grid (chunks, heads): G by one scan, q exp(G),
#    k exp(G_C - G), beta exp(G) k elementwise, and A_kk / A_qk as four full
#    [C, K] x [K, C] dots, one per 16-row block i, of which only block i's rows
#    are kept.  Rows are decayed relative to R_i = G just before their block,
#    columns from R_i with the exponent masked to -inf past block i (where
#    R_i - G_s > 0 could overflow), so as in the fused kernel every factor is
#    <= exp(16 * 5).
#    A_kk and beta exp(G) k go through HBM to kernel 2 (bf16 with bf16 dots).
# 2. `_split_solve_kernel`, grid (chunks, heads): T = (I + A)^-1 with 64 x 64
#    dots only.  Writing A = D + L (D: the 16 x 16 diagonal blocks, L: the
#    blocks below them), I + A = (I + D)(I + X L) with X = (I + D)^-1, so
#    T = (I + X L)^-1 X.  X is the product formula applied to all four diagonal
#    blocks at once (D^16 = 0); X L is strictly block-lower over 4 blocks, so
#    (I + X L)^-1 = (I - X L)(I + (X L)^2).  Then W = T (beta exp(G) k) and
#    U = T (beta v).


def _each_chunk(n_chunks: int, one):
    """one(c) for a program's chunks c < n_chunks: inline for one, else a loop (which Triton's
    pipeliner can overlap)."""
    if n_chunks == 1:
        one(0)
    else:
        jax.lax.fori_loop(0, n_chunks, lambda c, carry: (one(c), carry)[1], 0)


def _intra_loader(q_ref, k_ref, g_ref, beta_ref, rows):
    """load(name) for `_split_intra_chunk`: q, k, g [C, K] or beta [C] of the chunk at `rows`, fp32."""
    refs = dict(q=q_ref, k=k_ref, g=g_ref)
    return lambda name: (beta_ref[rows] if name == "beta" else refs[name][rows, :]).astype(jnp.float32)


def _split_intra_chunk(load, dot, store):
    """One (chunk, head) of `_split_intra_kernel`: load(name) gives q, k, g [C, K] or beta [C] in
    fp32, each read where it is first needed (beta, g, then q and k: the order the kernel's PTX was
    measured in); each output goes to store(i, value) as soon as it exists (i: its place in the
    kernel's output refs), so nothing stays live past its store: held to the end, q exp(G),
    k exp(G_C - G) and beta exp(G) k spill the kernel's registers at 8 warps (ptxas)."""
    beta = load("beta")
    t = jax.lax.broadcasted_iota(jnp.int32, (CHUNK, CHUNK), 0)
    s = jax.lax.broadcasted_iota(jnp.int32, (CHUNK, CHUNK), 1)
    t_block = jax.lax.div(t, SUB)

    g_all = jnp.cumsum(load("g"), axis=0)  # G, [C, K]
    row = jax.lax.broadcasted_iota(jnp.int32, g_all.shape, 0)
    block = jax.lax.div(row, SUB)
    g_end = jnp.sum(jnp.where(row == CHUNK - 1, g_all, 0.0), axis=0)  # G_C, [K]
    store(3, jnp.exp(g_end))
    q, k = load("q"), load("k")
    exp_g = jnp.exp(g_all)
    store(0, q * exp_g)
    store(1, k * jnp.exp(g_end[None, :] - g_all))
    store(5, beta[:, None] * exp_g * k)
    # R_i = G just before row block i (0 for i = 0), and each row's own R.
    refs = [jnp.zeros_like(g_end)] + [jnp.sum(jnp.where(row == i * SUB - 1, g_all, 0.0), axis=0)
                                      for i in range(1, CHUNK // SUB)]
    ref_rows = sum(jnp.where(block == i, r[None, :], 0.0) for i, r in enumerate(refs))
    row_decay = jnp.exp(g_all - ref_rows)  # exp(G_t - R_i) <= 1
    kd, qd = k * row_decay, q * row_decay
    akk = aqk = jnp.zeros((CHUNK, CHUNK), jnp.float32)
    for i, r in enumerate(refs):  # row block i's rows of A (the causal masks come once, after)
        kr = _column_operand(k, g_all, r, row, (i + 1) * SUB)
        mine = t_block == i
        akk = akk + jnp.where(mine, dot(kd, kr.T), 0.0)
        aqk = aqk + jnp.where(mine, dot(qd, kr.T), 0.0)
    store(4, jnp.where(s < t, akk, 0.0) * beta[:, None])
    store(2, jnp.where(s <= t, aqk, 0.0))


def _split_intra_kernel(q_ref, k_ref, g_ref, beta_ref, qd_ref, ke_ref, aqk_ref, de_ref, akk_ref, kbg_ref, *,
                        interpret, algorithm, n_chunks=1):
    """One head's `n_chunks` chunks: q, k, g [n C, K], beta [n C] in; q exp(G), k exp(G_C - G)
    [n, C, K], A_qk [n, C, C], exp(G_C) [n, K] out, plus A_kk [n, C, C] (times beta, strictly
    lower) and beta exp(G) k [n, C, K] for `_split_solve_kernel`.

    Whole-chunk values only (Triton cannot slice values): one scan gives G; the
    16-row references R_i come out as masked row sums; row block i of A is the
    rows of a full [C, K] x [K, C] dot against the columns decayed from R_i,
    kept by a row-block mask.  The four full dots cost 4x the FLOPs of the
    causal tiles, but tensor cores have them to spare, while per-sub-block
    scans and ref re-reads made the earlier version latency-bound.  (Measured and dropped:
    K in column slices one after another, and a program per 16-row block: both fewer live
    arrays, both 14-58% slower; RESULTS.md, KDA kernels, sessions 30 and 32.)

    With n_chunks > 1 (TUNING["intra_chunks"]) the chunks go through a loop, whose loads Triton's
    pipeliner (num_stages > 1) issues while the chunk before is computed (at 255 registers one
    program fills an SM).  Measured 2-9% slower at the issue's three shapes on an H100 (RESULTS.md,
    KDA kernels, session 39): the loads are not what the kernel waits on, so the default is 1.
    """
    dot = _precise_dot(interpret, algorithm)

    out_refs = (qd_ref, ke_ref, aqk_ref, de_ref, akk_ref, kbg_ref)

    def one(c):
        rows = pl.ds(c * CHUNK, CHUNK)

        def store(i, x):
            out_refs[i][c] = x.astype(out_refs[i].dtype)

        _split_intra_chunk(_intra_loader(q_ref, k_ref, g_ref, beta_ref, rows), dot, store)

    _each_chunk(n_chunks, one)


def _inverse_t(a, dot):
    """T = (I + a)^-1 [C, C] for one chunk's a = A_kk times beta (strictly lower, fp32); then
    W = T beta exp(G) k and U = T beta v."""
    r = jax.lax.broadcasted_iota(jnp.int32, a.shape, 0)
    c = jax.lax.broadcasted_iota(jnp.int32, a.shape, 1)
    same_block = jax.lax.div(r, SUB) == jax.lax.div(c, SUB)
    x = _unit_lower_inverse(jnp.where(same_block, a, 0.0), dot, SUB)  # (I + D)^-1
    return dot(_unit_lower_inverse(dot(x, jnp.where(same_block, 0.0, a)), dot, CHUNK // SUB), x)


def _split_solve_kernel(akk_ref, kbg_ref, v_ref, beta_ref, w_ref, u_ref, *, interpret, algorithm, n_chunks=1):
    """One head's `n_chunks` chunks (looped as in `_split_intra_kernel`): A_kk [n, C, C], beta
    exp(G) k [n, C, K], v [n C, V], beta [n C] in; W = (I + A_kk)^-1 beta exp(G) k [n, C, K] and
    U = (I + A_kk)^-1 beta v [n, C, V] out."""
    f32 = jnp.float32
    dot = _precise_dot(interpret, algorithm)

    def one(n):
        rows = pl.ds(n * CHUNK, CHUNK)
        t = _inverse_t(akk_ref[n].astype(f32), dot)
        w_ref[n] = dot(t, kbg_ref[n].astype(f32)).astype(w_ref.dtype)
        u_ref[n] = dot(t, beta_ref[rows].astype(f32)[:, None] * v_ref[rows, :].astype(f32)).astype(u_ref.dtype)

    _each_chunk(n_chunks, one)


def _intra_solve_kernel(q_ref, k_ref, g_ref, beta_ref, v_ref, qd_ref, ke_ref, aqk_ref, de_ref, w_ref, u_ref, *,
                        interpret, algorithm, solve_in):
    """One (chunk, head), TUNING["prepare_impl"] = "intra_solve": `_split_intra_kernel` and
    `_split_solve_kernel` in one program, so A_kk and beta exp(G) k never go through HBM (nor
    beta and the launch of a second kernel).  They are rounded to `solve_in` (the split's HBM
    dtype) before the solve, so the intermediates are the split's.  Measured slower than the split
    at the issue's three shapes on an H100 (RESULTS.md, KDA kernels, session 40): the solve's
    arrays on top of the intra kernel's 255 registers spill, with one 8-warp program an SM."""
    f32 = jnp.float32
    dot = _precise_dot(interpret, algorithm)
    out_refs = (qd_ref, ke_ref, aqk_ref, de_ref)
    held = {}

    def store(i, x):
        if i < len(out_refs):
            out_refs[i][...] = x.astype(out_refs[i].dtype)
        else:  # A_kk (4) and beta exp(G) k (5): kept for the solve, in solve_in (bf16: half the
            # registers; formed after the A loop instead, ptxas finds more spills: 604 B against 212)
            held[i] = x.astype(solve_in)

    load = _intra_loader(q_ref, k_ref, g_ref, beta_ref, pl.ds(0, CHUNK))
    _split_intra_chunk(load, dot, store)
    t = _inverse_t(held[4].astype(f32), dot)
    w_ref[...] = dot(t, held[5].astype(f32)).astype(w_ref.dtype)
    u_ref[...] = dot(t, load("beta")[:, None] * v_ref[...].astype(f32)).astype(u_ref.dtype)


def _chunk_state_kernel(chunk_start_ref, ckpt_slot_ref, h0_ref, w_ref, u_ref, qd_ref, ke_ref, aqk_ref, de_ref,
                        o_ref, ht_ref, ckpt_ref, *, block_v, scale, low_precision, interpret):
    """One (sequence, head, V block): the sequential pass over the sequence's chunks, o computed
    in its loop (four dots a chunk).  fla's structure instead (each chunk's state and v_new
    written, o in a parallel pass after) was 24-39% slower: the HBM round trip costs more than
    the shorter serial loop saves (RESULTS.md, KDA kernels, session 30)."""
    dot = _fast_dot(low_precision, interpret)
    seq, h, vb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    vs = pl.ds(vb * block_v, block_v)
    c0, c1 = chunk_start_ref[seq], chunk_start_ref[seq + 1]

    def body(n, s):
        v_new = u_ref[n, h, :, vs].astype(jnp.float32) - dot(w_ref[n, h], s)
        o_ref[n, :, h, vs] = _chunk_output(qd_ref[n, h], aqk_ref[n, h], s, v_new, scale, dot).astype(o_ref.dtype)
        s = de_ref[n, h][:, None] * s + dot(ke_ref[n, h].T, v_new)
        slot = ckpt_slot_ref[n]

        @pl.when(slot >= 0)
        def _export():
            ckpt_ref[slot, h, :, vs] = s

        return s

    s = jax.lax.fori_loop(c0, c1, body, h0_ref[seq, h, :, vs].astype(jnp.float32))
    ht_ref[seq, h, :, vs] = s


# (num_warps, num_stages) of the prepare and state kernels, and the prepare
# kernel's dot algorithm; tuned on H200 (benchmarks/kda_tune.py, benchmarks/kda.py).
# prepare_dot "auto": bf16 operands for bf16/fp16 inputs (the inputs carry no more
# precision; what fla does; 2.5x faster than 3xTF32 on H200, same error against the
# fp32 recurrence as fla), 3xTF32 for fp32 inputs (fp32-level agreement).
# prepare_impl: "split" (`_split_intra_kernel` with the "intra" warps / stages, then
# `_split_solve_kernel` with the "solve" ones), "intra_solve" (both as one program,
# `_intra_solve_kernel`, "intra_solve"; the split's numbers) or "fused" (`_chunk_prepare_kernel`,
# one kernel, "prepare"); split is faster on H200 at every benchmarked shape, same error
# (RESULTS.md).  "intra" at B1 T32768 H32 on H200: 8 warps 1.85 ms, 4 warps 3.89, 16 warps
# 2.65, 8 warps x 2 stages 1.91; "solve": 4 warps 0.57 ms.
# "state_block_v": V columns per state-pass program; "auto": 64, or 32 when that leaves
# fewer than 96 programs (sequences x heads x V / 64) for 132 SMs.  H200, B1 T32768 H32
# (64 programs at 64): 3.34 ms at 32 vs 3.43 at 64, with a state exported every 128
# tokens ~0.2 vs ~0.4 ms more; B8 T4096 H32 3.03 at 64 vs 3.51; B4 T8192 H12 1.32 vs 1.54.
# "state_fp32": the state kernel for fp32 inputs, whose pipelined chunk operands
# would need ~350 KiB of shared memory at 3 stages (H200 has 227 KiB).
TUNING = {"prepare": (4, 1), "intra": (8, 1), "solve": (4, 1), "state": (4, 3), "state_fp32": (4, 1),
          "prepare_dot": "auto", "prepare_impl": "split", "state_block_v": "auto", "intra_chunks": 1,
          "solve_chunks": 1, "intra_solve": (8, 1)}
PREPARE_IMPLS = ("fused", "split", "intra_solve")


def _tuned(tuning):
    return dict(TUNING, **dict(tuning or ()))


def _params(name, tuning):
    warps, stages = _tuned(tuning)[name]
    return pltriton.CompilerParams(num_warps=warps, num_stages=stages)


def _state_block_v(n_seq: int, heads: int, dv: int, tuning) -> int:
    """V columns per state-pass program (TUNING["state_block_v"])."""
    block_v = _tuned(tuning)["state_block_v"]
    if block_v == "auto":
        block_v = 64 if n_seq * heads * dv // 64 >= 96 else 32
    return min(dv, int(block_v))


def _loop_chunks(nt: int, name: str, tuning) -> int:
    """Chunks a prepare program loops over (TUNING["intra_chunks"] / ["solve_chunks"]), halved
    until it divides nt (the chunks of every head)."""
    n = max(1, int(_tuned(tuning)[name]))
    while nt % n:
        n //= 2
    return max(n, 1)


def _looped_blocks(n_chunks: int):
    """BlockSpec makers for a (chunk group, head) grid over n_chunks chunks: in_blk(*d) takes a [T, H,
    *d] input's n C rows of one head; out_blk(*shape) an [NT, H, *shape] array's n chunks of one head."""
    in_blk = lambda *d: pl.BlockSpec((n_chunks * CHUNK, None) + d, lambda n, hh: (n, hh) + (0,) * len(d))
    out_blk = lambda *shape: pl.BlockSpec((n_chunks, None) + shape, lambda n, hh: (n, hh) + (0,) * len(shape))
    return in_blk, out_blk


def _prepare_algorithm(dtype, tuning):
    """The prepare dot algorithm after resolving "auto" for the input dtype."""
    algorithm = _tuned(tuning)["prepare_dot"]
    if algorithm == "auto":
        algorithm = "tf32x3" if dtype == jnp.float32 else "bf16"
    return algorithm


def _out_blk(*shape):  # [NT, H, *shape] chunk-major array -> one (chunk, head) block
    return pl.BlockSpec((None, None) + shape, lambda n, hh: (n, hh) + (0,) * len(shape))


def _chunk_prepare_call(q, k, v, g, beta, *, interpret, tuning=None):
    """[T, H, D] inputs (T a multiple of CHUNK) -> per-chunk intermediates [NT, H, ...]:
    (w [NT, H, C, K], u [NT, H, C, V], q_decayed [NT, H, C, K], k_to_end [NT, H, C, K],
    a_qk [NT, H, C, C] in the inputs' dtype (fp32 for fp32), decay_end [NT, H, K] fp32)."""
    impl = _tuned(tuning)["prepare_impl"]
    if impl == "split":
        return _split_prepare_call(q, k, v, g, beta, interpret=interpret, tuning=tuning)
    if impl == "intra_solve":
        return _intra_solve_call(q, k, v, g, beta, interpret=interpret, tuning=tuning)
    if impl != "fused":
        raise ValueError(f"prepare_impl must be one of {PREPARE_IMPLS}; got {impl!r}")
    t, h, dk = q.shape
    dv = v.shape[-1]
    nt = t // CHUNK
    inter = jnp.float32 if q.dtype == jnp.float32 else q.dtype
    in_blk, _ = _looped_blocks(1)  # one chunk of one head: [C, d] / [C]
    sds = jax.ShapeDtypeStruct
    return pl.pallas_call(
        _functools.partial(_chunk_prepare_kernel, interpret=interpret,
                           algorithm=_prepare_algorithm(q.dtype, tuning)),
        grid=(nt, h),
        in_specs=[in_blk(dk), in_blk(dk), in_blk(dv), in_blk(dk), in_blk()],
        out_specs=[_out_blk(CHUNK, dk), _out_blk(CHUNK, dv), _out_blk(CHUNK, dk), _out_blk(CHUNK, dk),
                   _out_blk(CHUNK, CHUNK), _out_blk(dk)],
        out_shape=[sds((nt, h, CHUNK, dk), inter), sds((nt, h, CHUNK, dv), inter), sds((nt, h, CHUNK, dk), inter),
                   sds((nt, h, CHUNK, dk), inter), sds((nt, h, CHUNK, CHUNK), inter), sds((nt, h, dk), jnp.float32)],
        interpret=interpret,
        compiler_params=_params("prepare", tuning),
        name="kda_chunk_prepare",
    )(q, k, v, g, beta)


def _split_intra_call(q, k, g, beta, *, interpret, tuning=None):
    """Kernel 1 of the split prepare.  [T, H, K] q / k / g, [T, H] beta ->
    (q_decayed, k_to_end, a_qk, decay_end) as `_chunk_prepare_call` returns them,
    plus a_kk [NT, H, C, C] and beta exp(G) k [NT, H, C, K].  Those two are bf16
    when the dots take bf16 operands anyway (half the HBM round trip), else fp32."""
    t, h, dk = q.shape
    nt = t // CHUNK
    inter = jnp.float32 if q.dtype == jnp.float32 else q.dtype
    algorithm = _prepare_algorithm(q.dtype, tuning)
    solve_in = jnp.bfloat16 if algorithm == "bf16" else jnp.float32
    n_chunks = _loop_chunks(nt, "intra_chunks", tuning)
    sds = jax.ShapeDtypeStruct
    out_shape = [sds((nt, h, CHUNK, dk), inter), sds((nt, h, CHUNK, dk), inter), sds((nt, h, CHUNK, CHUNK), inter),
                 sds((nt, h, dk), jnp.float32), sds((nt, h, CHUNK, CHUNK), solve_in), sds((nt, h, CHUNK, dk), solve_in)]
    in_blk, out_blk = _looped_blocks(n_chunks)
    return pl.pallas_call(
        _functools.partial(_split_intra_kernel, interpret=interpret, algorithm=algorithm, n_chunks=n_chunks),
        grid=(nt // n_chunks, h),
        in_specs=[in_blk(dk), in_blk(dk), in_blk(dk), in_blk()],
        out_specs=[out_blk(CHUNK, dk), out_blk(CHUNK, dk), out_blk(CHUNK, CHUNK), out_blk(dk),
                   out_blk(CHUNK, CHUNK), out_blk(CHUNK, dk)],
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=_params("intra", tuning),
        name="kda_split_intra",
    )(q, k, g, beta)


def _split_solve_call(akk, kbg, v, beta, *, interpret, tuning=None, in_dtype=None):
    """Kernel 2 of the split prepare.  a_kk [NT, H, C, C], beta exp(G) k [NT, H, C, K],
    v [T, H, V], beta [T, H] -> (w [NT, H, C, K], u [NT, H, C, V]) in `in_dtype` (q's
    dtype, which picks the dot algorithm as in kernel 1; default v's)."""
    nt, h, _, dk = kbg.shape
    dv = v.shape[-1]
    in_dtype = v.dtype if in_dtype is None else in_dtype
    inter = jnp.float32 if in_dtype == jnp.float32 else in_dtype
    n_chunks = _loop_chunks(nt, "solve_chunks", tuning)
    sds = jax.ShapeDtypeStruct
    in_blk, out_blk = _looped_blocks(n_chunks)
    return pl.pallas_call(
        _functools.partial(_split_solve_kernel, interpret=interpret,
                           algorithm=_prepare_algorithm(in_dtype, tuning), n_chunks=n_chunks),
        grid=(nt // n_chunks, h),
        in_specs=[out_blk(CHUNK, CHUNK), out_blk(CHUNK, dk), in_blk(dv), in_blk()],
        out_specs=[out_blk(CHUNK, dk), out_blk(CHUNK, dv)],
        out_shape=[sds((nt, h, CHUNK, dk), inter), sds((nt, h, CHUNK, dv), inter)],
        interpret=interpret,
        compiler_params=_params("solve", tuning),
        name="kda_split_solve",
    )(akk, kbg, v, beta)


def _intra_solve_call(q, k, v, g, beta, *, interpret, tuning=None):
    """`_chunk_prepare_call` by one kernel, `_intra_solve_kernel`: the split's intermediates."""
    t, h, dk = q.shape
    dv = v.shape[-1]
    nt = t // CHUNK
    inter = jnp.float32 if q.dtype == jnp.float32 else q.dtype
    algorithm = _prepare_algorithm(q.dtype, tuning)
    solve_in = jnp.bfloat16 if algorithm == "bf16" else jnp.float32
    in_blk, _ = _looped_blocks(1)
    sds = jax.ShapeDtypeStruct
    qd, ke, aqk, de, w, u = pl.pallas_call(
        _functools.partial(_intra_solve_kernel, interpret=interpret, algorithm=algorithm, solve_in=solve_in),
        grid=(nt, h),
        in_specs=[in_blk(dk), in_blk(dk), in_blk(dk), in_blk(), in_blk(dv)],
        out_specs=[_out_blk(CHUNK, dk), _out_blk(CHUNK, dk), _out_blk(CHUNK, CHUNK), _out_blk(dk),
                   _out_blk(CHUNK, dk), _out_blk(CHUNK, dv)],
        out_shape=[sds((nt, h, CHUNK, dk), inter), sds((nt, h, CHUNK, dk), inter), sds((nt, h, CHUNK, CHUNK), inter),
                   sds((nt, h, dk), jnp.float32), sds((nt, h, CHUNK, dk), inter), sds((nt, h, CHUNK, dv), inter)],
        interpret=interpret,
        compiler_params=_params("intra_solve", tuning),
        name="kda_intra_solve",
    )(q, k, g, beta, v)
    return w, u, qd, ke, aqk, de


def _split_prepare_call(q, k, v, g, beta, *, interpret, tuning=None):
    """`_chunk_prepare_call` by the split kernels: the same intermediates."""
    qd, ke, aqk, de, akk, kbg = _split_intra_call(q, k, g, beta, interpret=interpret, tuning=tuning)
    w, u = _split_solve_call(akk, kbg, v, beta, interpret=interpret, tuning=tuning, in_dtype=q.dtype)
    return w, u, qd, ke, aqk, de


def _chunk_state_call(prep, h0, chunk_start, ckpt_slot, *, out_dtype, n_ckpt, scale, block_v, interpret,
                      tuning=None):
    """The sequential pass.  Returns o [NT, C, H, V], ht [N, H, K, V], checkpoints
    [max(n_ckpt, 1), H, K, V]."""
    w, u, qd, ke, aqk, de = prep
    nt, h, _, dk = w.shape
    dv = u.shape[-1]
    n_seq = h0.shape[0]
    sds = jax.ShapeDtypeStruct
    low_precision = bool(w.dtype != jnp.float32)
    return pl.pallas_call(
        _functools.partial(_chunk_state_kernel, block_v=block_v, scale=scale, low_precision=low_precision,
                           interpret=interpret),
        grid=(n_seq, h, dv // block_v),
        out_shape=[sds((nt, CHUNK, h, dv), out_dtype), sds((n_seq, h, dk, dv), jnp.float32),
                   sds((max(n_ckpt, 1), h, dk, dv), jnp.float32)],
        interpret=interpret,
        compiler_params=_params("state_fp32" if w.dtype == jnp.float32 else "state", tuning),
        name="kda_chunk_state",
    )(chunk_start, ckpt_slot, h0, w, u, qd, ke, aqk, de)


@_functools.partial(jax.jit, static_argnames=("n_ckpt", "scale", "block_v", "interpret", "tuning"))
def _chunk_kda_core(q, k, v, g, beta, h0, chunk_start, ckpt_slot, *, n_ckpt, scale, block_v, interpret,
                    tuning=None):
    """q/k/g [1, T, H, K], v [1, T, H, V], beta [1, T, H] with T a multiple of CHUNK and
    sequences starting at chunk boundaries.  Returns o [1, T, H, V], ht [N, H, K, V],
    checkpoints [max(n_ckpt, 1), H, K, V]."""
    _, t, h, _ = q.shape
    prep = _chunk_prepare_call(q[0], k[0], v[0], g[0], beta[0], interpret=interpret, tuning=tuning)
    o, ht, ckpt = _chunk_state_call(prep, h0, chunk_start, ckpt_slot, out_dtype=v.dtype, n_ckpt=n_ckpt,
                                    scale=scale, block_v=block_v, interpret=interpret, tuning=tuning)
    return o.reshape(1, t, h, v.shape[-1]), ht, ckpt


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _plan_layout(seq_lens, checkpoint_positions):
    """Host-side plan: where each sequence's chunks start in the padded layout,
    and which chunk ends export to which checkpoint slot."""
    seq_lens = [int(x) for x in seq_lens]
    n_chunks = [-(-n // CHUNK) for n in seq_lens]
    chunk_start = _np.concatenate([[0], _np.cumsum(n_chunks)]).astype(_np.int32)
    ckpt_slot = _np.full(max(int(chunk_start[-1]), 1), -1, _np.int32)
    slot = 0
    for i, positions in enumerate(checkpoint_positions):
        for p in positions:
            p = int(p)
            if p <= 0 or p % CHUNK:
                raise ValueError(f"checkpoint position {p} must be a positive multiple of {CHUNK}")
            if p > seq_lens[i]:
                raise ValueError(f"checkpoint position {p} is beyond sequence {i}'s {seq_lens[i]} tokens")
            ckpt_slot[chunk_start[i] + p // CHUNK - 1] = slot
            slot += 1
    return chunk_start, ckpt_slot, slot


def chunk_kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
              checkpoint_positions=None, cu_seqlens=None, interpret=None, block_v=None, tuning=None,
              export_at=None):
    """Chunked KDA prefill (Pallas) exporting states at `checkpoint_positions` in the same pass.

    Args:
      q, k: [B, T, H, K] (L2-normalized), v: [B, T, H, V], g: [B, T, H, K] log
        decay (fp32 recommended), beta: [B, T, H]; bf16 or fp32.  K and V must
        be powers of two >= 16.
      scale: default K ** -0.5.
      initial_state: [N, H, K, V] float32 (N = B, or the number of sequences
        with `cu_seqlens`), or None for zeros.
      output_final_state: return the state after each sequence.
      checkpoint_positions: token counts (positive multiples of 64, at most the
        sequence length) after which to export the state.  Without
        `cu_seqlens`: one list for every sequence; with it: one list per sequence.
      cu_seqlens: int [N + 1] cumulative lengths of N sequences packed into
        T with B == 1 (concrete values: the layout is planned on the host).
      export_at: int32 [E], the traced form of checkpoint_positions (one list for
        every sequence, no cu_seqlens): positions known only on the device, one
        compiled program for any values.  Entries that are not positive multiples
        of 64 within T (`export_mask`) export zeros.
    Returns:
      (o [B, T, H, V] in v's dtype,
       final_state [N, H, K, V] fp32 or None,
       checkpoints fp32 or None: [B, P, H, K, V] without `cu_seqlens`,
         [sum P_i, H, K, V] in sequence order with it).
    """
    _check_shapes(q, k, v, g, beta, None)
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    if not (_is_pow2(dk) and _is_pow2(dv) and dk >= 16 and dv >= 16):
        raise ValueError(f"head dims must be powers of two >= 16; got K={dk}, V={dv}")
    if cu_seqlens is None:
        seq_lens = [t] * b
        per_seq_positions = [list(checkpoint_positions or [])] * b
    else:
        if b != 1:
            raise ValueError(f"with cu_seqlens the batch dim must be 1 (sequences packed in T); got B={b}")
        cu = _np.asarray(cu_seqlens).astype(_np.int64)
        if cu.ndim != 1 or cu.size < 2 or cu[0] != 0 or cu[-1] != t or _np.any(_np.diff(cu) <= 0):
            raise ValueError(f"cu_seqlens must rise strictly from 0 to T={t}; got {cu.tolist()}")
        seq_lens = _np.diff(cu).tolist()
        if checkpoint_positions is None:
            per_seq_positions = [[] for _ in seq_lens]
        else:
            per_seq_positions = [list(p) for p in checkpoint_positions]
            if len(per_seq_positions) != len(seq_lens):
                raise ValueError(f"with cu_seqlens give one list of checkpoint positions per sequence "
                                 f"({len(seq_lens)}); got {len(per_seq_positions)}")
    n_seq = len(seq_lens)
    if initial_state is None:
        initial_state = jnp.zeros((n_seq, h, dk, dv), jnp.float32)
    elif initial_state.shape != (n_seq, h, dk, dv) or initial_state.dtype != jnp.float32:
        raise ValueError(f"initial_state must be float32 [{n_seq}, {h}, {dk}, {dv}]; "
                         f"got {initial_state.dtype} {tuple(initial_state.shape)}")
    chunk_start, ckpt_slot, n_ckpt = _plan_layout(seq_lens, per_seq_positions)
    if export_at is not None:
        if cu_seqlens is not None or checkpoint_positions is not None:
            raise ValueError("export_at takes neither cu_seqlens nor checkpoint_positions")
        e = export_at.shape[0]
        export_valid = export_mask(export_at, t, CHUNK)
        chunk_of = jnp.asarray(chunk_start[:-1])[:, None] + export_at[None, :] // CHUNK - 1  # [B, E]
        chunk_of = jnp.where(export_valid[None, :], chunk_of, ckpt_slot.shape[0])  # invalid: dropped
        ckpt_slot = jnp.asarray(ckpt_slot).at[chunk_of].set(jnp.arange(b * e, dtype=jnp.int32).reshape(b, e),
                                                            mode="drop")
        n_ckpt = b * e
    interpret = _default_interpret() if interpret is None else interpret
    block_v = block_v or _state_block_v(n_seq, h, dv, tuning)
    scale = float(dk ** -0.5 if scale is None else scale)

    # Pad every sequence to whole chunks (zero k/v/g/beta leave the state unchanged).
    padded_len = int(chunk_start[-1]) * CHUNK
    if cu_seqlens is None and t % CHUNK == 0:
        flat = lambda x: x.reshape((1, b * t) + x.shape[2:])
        unflat = lambda o: o.reshape(b, t, h, dv)
    else:
        starts = _np.concatenate([[0], _np.cumsum(seq_lens)])
        src = _np.full(padded_len, -1, _np.int64)
        for i, n in enumerate(seq_lens):
            src[chunk_start[i] * CHUNK: chunk_start[i] * CHUNK + n] = starts[i] + _np.arange(n)
        valid = jnp.asarray(src >= 0)
        gather_idx = jnp.asarray(_np.maximum(src, 0))
        dst = jnp.asarray(_np.flatnonzero(src >= 0))

        def flat(x):
            x = x.reshape((b * t,) + x.shape[2:])[gather_idx]
            return jnp.where(valid.reshape((-1,) + (1,) * (x.ndim - 1)), x, 0)[None]

        unflat = lambda o: o[0][dst].reshape(b, t, h, dv)

    o, ht, ckpt = _chunk_kda_core(flat(q), flat(k), flat(v), flat(g.astype(jnp.float32)), flat(beta),
                                  initial_state, jnp.asarray(chunk_start), jnp.asarray(ckpt_slot),
                                  n_ckpt=n_ckpt, scale=scale, block_v=block_v, interpret=interpret,
                                  tuning=tuple(sorted(dict(tuning or {}).items())) or None)
    o = unflat(o)
    checkpoints = None
    if export_at is not None:
        checkpoints = jnp.where(export_valid[None, :, None, None, None], ckpt[:n_ckpt].reshape(b, -1, h, dk, dv), 0.0)
    elif checkpoint_positions is not None:
        checkpoints = ckpt[:n_ckpt]
        if cu_seqlens is None:
            checkpoints = checkpoints.reshape(b, -1, h, dk, dv)
    return o, (ht if output_final_state else None), checkpoints


def _recurrent_kernel(slots_ref, n_acc_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, pool_in_ref,
                      o_ref, pool_out_ref, *states_ref, n_tokens, block_v, scale, cache_hints=False):
    """One (sequence, head, V block): T tokens of the recurrence on the pooled state.
    pool_out_ref aliases pool_in_ref: only this program's (slot, head, V block) is touched.
    states_ref (optional): [B, T, H, K, V] the state after each token.
    cache_hints: fla's L2 eviction hints: q, k and g, which every V block of a head reads, stay
    (evict_last); v and o, read or written once, go first (evict_first)."""
    f32 = jnp.float32
    vb, h, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)  # V blocks fastest: see the grid
    vs = pl.ds(vb * block_v, block_v)
    slot, n_acc = slots_ref[b], n_acc_ref[b]

    def hinted(idx):  # a Python int index fails the interpreter's hinted load / store
        return tuple(jnp.int32(i) if isinstance(i, int) else i for i in idx)

    def load(ref, idx, policy):
        return pltriton.load(ref.at[hinted(idx)], eviction_policy=policy) if cache_hints else ref[idx]

    def store(ref, idx, val, policy):
        if cache_hints:
            pltriton.store(ref.at[hinted(idx)], val, eviction_policy=policy)
        else:
            ref[idx] = val

    s = pool_in_ref[slot, h, :, vs]  # [K, BV] fp32
    for t in range(n_tokens):  # T is small (decode / speculative verify): unrolled
        k_t = load(k_ref, (b, t, h, slice(None)), "evict_last").astype(f32)
        s = s * jnp.exp(load(g_ref, (b, t, h, slice(None)), "evict_last").astype(f32))[:, None]
        pred = jnp.sum(k_t[:, None] * s, axis=0)
        v_t = load(v_ref, (b, t, h, vs), "evict_first").astype(f32)
        s = s + (beta_ref[b, t, h].astype(f32) * k_t)[:, None] * (v_t - pred)[None, :]
        o_t = (scale * jnp.sum(load(q_ref, (b, t, h, slice(None)), "evict_last").astype(f32)[:, None] * s,
                               axis=0)).astype(o_ref.dtype)
        store(o_ref, (b, t, h, vs), o_t, "evict_first")
        if states_ref:
            states_ref[0][b, t, h, :, vs] = s

        # the state after the last accepted token lands in place; with none accepted nothing is
        # written and the aliased pool keeps the old state.  A select against the old state
        # instead would hold a second [K, BV] tile in registers for the whole pass (fewer
        # programs per SM for a kernel whose speed is bytes in flight).
        @pl.when(n_acc == t + 1)
        def _(s=s):
            pool_out_ref[slot, h, :, vs] = s


@_functools.partial(jax.jit, static_argnames=("scale", "block_v", "interpret", "export_states", "num_warps",
                                             "cache_hints"),
                    donate_argnames=("state_pool",))
def _fused_recurrent_core(q, k, v, g, beta, state_pool, slots, n_acc, *, scale, block_v, interpret,
                          export_states=False, num_warps=4, cache_hints=False):
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    states = [jax.ShapeDtypeStruct((b, t, h, dk, dv), jnp.float32)] if export_states else []
    # V blocks vary fastest, then heads, then sequences (fla's order): CTAs launched together read
    # the neighbouring column blocks of one state's K rows, not the same columns of B states
    return pl.pallas_call(
        _functools.partial(_recurrent_kernel, n_tokens=t, block_v=block_v, scale=scale, cache_hints=cache_hints),
        grid=(dv // block_v, h, b),
        out_shape=[jax.ShapeDtypeStruct(v.shape, v.dtype), jax.ShapeDtypeStruct(state_pool.shape, jnp.float32)]
        + states,
        input_output_aliases={7: 1},
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        name="kda_fused_recurrent",
    )(slots, n_acc, q, k, v, g, beta, state_pool)


def fused_recurrent_kda(q, k, v, g, beta, *, state_pool, slots, scale=None, num_accepted=None,
                        interpret=None, block_v=None, export_states=False, num_warps=8, cache_hints=False):
    """Decode / speculative verify on pooled states, updated in place.

    Args:
      q, k, g: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H]; T >= 1 tokens per
        sequence (T > 1: a speculative draft being verified).
      state_pool: [num_slots, H, K, V] float32; donated: the returned pool is
        the same buffer, updated in place.
      slots: int [B] distinct pool rows holding each sequence's state (any order).
      num_accepted: int [B] in [0, T] or None (= T): keep the state after this
        many tokens.  Outputs are produced for all T tokens either way, so
        verification runs once with num_accepted = 0 (state untouched), and the
        accepted prefix is committed by a second call over those tokens.
      export_states: also return the state after every token (a verify pass that
        commits the accepted prefix's state itself, in one call).
      block_v / num_warps: each program's V columns (default min(V, 64)) and warps (default 8):
        the fastest of six tilings at B 128-512 since the state lands by a conditional store
        (fla 0.6's 32 columns on 4 warps was, before it; RESULTS.md, sessions 30 and 32).
      cache_hints: fla's L2 eviction hints on q / k / g (kept) and v / o (first out); a
        candidate until `benchmarks/kda.py --sections decode` has timed it (same results).
    Returns:
      (o [B, T, H, V] in v's dtype, the updated state_pool), and with export_states
      a third output: float32 [B, T, H, K, V], the state after tokens 1 .. T.
    """
    _check_shapes(q, k, v, g, beta, None)
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    if not (_is_pow2(dk) and _is_pow2(dv)):
        raise ValueError(f"head dims must be powers of two; got K={dk}, V={dv}")
    if state_pool.ndim != 4 or state_pool.shape[1:] != (h, dk, dv):
        raise ValueError(f"state_pool must be [num_slots, {h}, {dk}, {dv}]; got {tuple(state_pool.shape)}")
    if state_pool.dtype != jnp.float32:
        raise ValueError(f"state_pool must be float32; got {state_pool.dtype}")
    slots = jnp.asarray(slots, jnp.int32)
    if slots.shape != (b,):
        raise ValueError(f"slots must be [B] = [{b}]; got {tuple(slots.shape)}")
    n_acc = jnp.full((b,), t, jnp.int32) if num_accepted is None else jnp.asarray(num_accepted, jnp.int32)
    if n_acc.shape != (b,):
        raise ValueError(f"num_accepted must be [B] = [{b}]; got {tuple(n_acc.shape)}")
    if not isinstance(slots, jax.core.Tracer):
        s_np = _np.asarray(slots)
        if s_np.min() < 0 or s_np.max() >= state_pool.shape[0]:
            raise ValueError(f"slots must lie in [0, {state_pool.shape[0]}); got {s_np.tolist()}")
        if len(set(s_np.tolist())) != b:
            raise ValueError(f"slots must be distinct (two sequences cannot share a state); got {s_np.tolist()}")
    if not isinstance(n_acc, jax.core.Tracer):
        a_np = _np.asarray(n_acc)
        if a_np.min() < 0 or a_np.max() > t:
            raise ValueError(f"num_accepted must lie in [0, T={t}]; got {a_np.tolist()}")
    interpret = _default_interpret() if interpret is None else interpret
    block_v = block_v or min(dv, 64)
    scale = float(dk ** -0.5 if scale is None else scale)
    if dv % block_v:
        raise ValueError(f"block_v {block_v} must divide V={dv}")
    return tuple(_fused_recurrent_core(q, k, v, g, beta, state_pool, slots, n_acc, scale=scale, block_v=block_v,
                                       interpret=interpret, export_states=export_states, num_warps=num_warps,
                                       cache_hints=bool(cache_hints)))


# ---- replay baselines (for comparison only) ---------------------------------------------------
#
# Before single-pass export, states at cache boundaries were obtained by
# replaying the prefix through a kernel that only returns its final state:
#   align:   the prefill, plus one replay in KDA-block segments (1536) -> 2 passes
#   partial: align, plus one replay in partial-unit segments (128)    -> 3 passes


def _replay_states(q, k, v, g, beta, segment, n_tokens, initial_state, scale, interpret):
    """States after every `segment` tokens up to `n_tokens`, by running the kernel
    segment after segment (each launch returns only its final state)."""
    n_seg = n_tokens // segment
    seg = lambda x: jnp.moveaxis(x[:, :n_seg * segment].reshape((x.shape[0], n_seg, segment) + x.shape[2:]), 1, 0)

    def step(s, xs):
        _, s, _ = chunk_kda(*xs, scale=scale, initial_state=s, output_final_state=True, interpret=interpret)
        return s, s

    _, states = jax.lax.scan(step, initial_state, tuple(seg(x) for x in (q, k, v, g, beta)))
    return jnp.moveaxis(states, 0, 1)  # [B, n_seg, H, K, V]


def chunk_kda_replay(q, k, v, g, beta, *, mode, block_tokens=1536, unit_tokens=128, scale=None,
                     initial_state=None, interpret=None):
    """The replay baselines.  Returns (o, block_states [B, n_blocks, ...],
    unit_states [B, n_units, ...] or None for mode 'align')."""
    if mode not in ("align", "partial"):
        raise ValueError(f"mode must be 'align' or 'partial'; got {mode!r}")
    b, t, h, dk = q.shape
    if initial_state is None:
        initial_state = jnp.zeros((b, h, dk, v.shape[-1]), jnp.float32)
    o, _, _ = chunk_kda(q, k, v, g, beta, scale=scale, initial_state=initial_state, interpret=interpret)
    blocks = _replay_states(q, k, v, g, beta, block_tokens, t, initial_state, scale, interpret)
    units = None
    if mode == "partial":
        units = _replay_states(q, k, v, g, beta, unit_tokens, t, initial_state, scale, interpret)
    return o, blocks, units
