"""Kimi Delta Attention (KDA), the references: the math, once, in pure jnp.

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
    s_bhkv = s_bhkv + jnp.einsum("bhk,bhv->bhkv", k_bhk * beta_bh[..., None], v_bhv - pred_bhv, precision=HIGHEST)
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

    s_final, o_tbhv = jax.lax.scan(body, _initial(q, v, initial_state), (f32(q), f32(k), f32(v), f32(g), f32(beta)))
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
        q_decayed=q_c * jnp.exp(gcum),
        w=w,
        u=u,
        a_qk=a_qk,
        k_to_end=k_c * jnp.exp(g_end - gcum),
        decay_end=jnp.exp(g_end[..., 0, :]),
    )


def kda_chunk_step(s_bhkv, prep, scale):
    """Advance the state over one chunk.  `prep` holds one chunk of
    `kda_chunk_prepare`'s arrays ([B, H, C, ...]).  Returns (o [B, H, C, V], state)."""
    v_new = prep["u"] - jnp.einsum("bhck,bhkv->bhcv", prep["w"], s_bhkv, precision=HIGHEST)
    o = scale * (
        jnp.einsum("bhck,bhkv->bhcv", prep["q_decayed"], s_bhkv, precision=HIGHEST)
        + jnp.einsum("bhcs,bhsv->bhcv", prep["a_qk"], v_new, precision=HIGHEST)
    )
    s_bhkv = prep["decay_end"][..., None] * s_bhkv + jnp.einsum(
        "bhck,bhcv->bhkv", prep["k_to_end"], v_new, precision=HIGHEST
    )
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
