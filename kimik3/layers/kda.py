"""KDA token mixer: projections, short convs, gates, and the gated-norm output.

The recurrence itself lives in `pallas_kernels.kda` and is reached through
`kimik3.ops.kda`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import flax.linen as nn

from kimik3 import ops
from kimik3.caches import KDASlots, KDAState
from kimik3.config import ModelConfig
from kimik3.layers.primitives import fan_in_init, gemm_form, l2_normalize, qparam, rms_norm, short_conv


def kda_gate(f_bthk, a_log_h, dt_bias_hk, lower_bound: float | None):
    """The per-channel log-decay g [B, T, H, K], fp32, of the gate projection f [B, T, H, K]:

    * bounded ("safe", Kimi-K3; `lower_bound` < 0): lower_bound * sigmoid(exp(A_log) * (f + dt_bias)),
      so g lies in (lower_bound, 0);
    * unbounded (Kimi-Linear; `lower_bound` None): -exp(A_log) * softplus(f + dt_bias), any g < 0.
    """
    f = f_bthk.astype(jnp.float32) + dt_bias_hk.astype(jnp.float32)
    rate = jnp.exp(a_log_h.astype(jnp.float32))[:, None]
    if lower_bound is None:
        return -rate * jax.nn.softplus(f)
    return lower_bound * jax.nn.sigmoid(rate * f)


def gate_lower_bound(cfg: ModelConfig) -> float | None:
    """The gate's lower bound for `kda_gate` (None: the unbounded softplus form)."""
    return cfg.kda_gate_lower_bound if cfg.kda_gate == "bounded" else None


def init_kda_cache(cfg: ModelConfig, batch: int, dtype) -> KDAState:
    """An empty `KDAState`: recurrent state [B, H, K, V] fp32 and the q, k, v short convs' last
    inputs [B, W-1, 3, H*D] in `dtype`, all zeros."""
    h, d, w = cfg.kda_heads, cfg.kda_head_dim, cfg.kda_conv_size
    return KDAState(jnp.zeros((batch, h, d, d), jnp.float32), jnp.zeros((batch, w - 1, 3, h * d), dtype))


class _KDAParams(NamedTuple):
    """A KDA layer's parameters in either layout (`kimik3.fused`).

    fused: w_in is the one input GEMM [D, 3*H*K + K + H + K] and w_fg the gates' stacked low-rank
    up-projections [2, R, H*K] (w_fb, w_gb None); otherwise w_in is the six projections
    (q, k, v in GEMM form, f_a [D, R], beta [D, H], g_a [D, R]) and w_fb, w_gb [R, H, K] apart
    (w_fg None).  conv: the q, k, v short convs' weights [W, H*K] by name."""

    fused: bool
    w_in: object
    conv: dict
    w_fb: object
    w_gb: object
    w_fg: object
    dt_bias: jax.Array
    a_log: jax.Array
    o_norm: jax.Array
    w_o: object


def _declare_params(m: KDA) -> _KDAParams:
    """Declares `m`'s parameters (within its compact `__call__`).  The declaration order is part of
    the contract: params initialize from per-module counters, so the order is the init."""
    cfg = m.cfg
    d, h, k = cfg.d_model, cfg.kda_heads, cfg.kda_head_dim
    p = lambda name, shape, fan_in: m.param(name, fan_in_init(fan_in), shape)
    in_width = 3 * h * k + k + h + k  # q, k, v, the gate's f_a, beta, the output gate's g_a
    fused = m.has_variable("params", "w_in_dx")  # `kimik3.fused`: the six input projections as one GEMM
    w_in = qparam(m, "w_in_dx", fan_in_init(d), (d, in_width)) if fused else None
    if not fused:
        w_q, w_k, w_v = (qparam(m, n, fan_in_init(d), (d, h, k)) for n in ("w_q_dhk", "w_k_dhk", "w_v_dhv"))
    conv = {n: p(f"conv_{n}_wc", (cfg.kda_conv_size, h * k), cfg.kda_conv_size) for n in "qkv"}
    w_fa = None if fused else qparam(m, "w_fa_dr", fan_in_init(d), (d, k))
    # the gates' low-rank up-projections: apart in the checkpoint, stacked [2, R, H*K] in the
    # serving layout (one batched GEMM for both)
    w_fb = None if fused else p("w_fb_rhk", (k, h, k), k)
    dt_bias = m.param("dt_bias_hk", nn.initializers.zeros, (h, k))
    a_log = m.param("a_log_h", lambda key, s: jnp.log(jax.random.uniform(key, s, minval=1.0, maxval=16.0)), (h,))
    if not fused:
        w_b, w_ga = (
            qparam(m, "w_beta_dh", fan_in_init(d), (d, h)),
            qparam(m, "w_ga_dr", fan_in_init(d), (d, k)),
        )
        w_in = (gemm_form(w_q, 1), gemm_form(w_k, 1), gemm_form(w_v, 1), w_fa, w_b, w_ga)
    w_gb = None if fused else p("w_gb_rhv", (k, h, k), k)
    w_fg = m.param("w_fg_srn", fan_in_init(k), (2, k, h * k)) if fused else None
    o_norm = m.param("o_norm_v", nn.initializers.ones, (k,))
    w_o = qparam(m, "w_o_hvd", fan_in_init(h * k), (h, k, d))
    return _KDAParams(fused, w_in, conv, w_fb, w_gb, w_fg, dt_bias, a_log, o_norm, w_o)


def _cache_parts(cache: KDAState | KDASlots | None):
    """(state, conv_state, slots) of a KDA cache entry: all None for None, slots None for a
    `KDAState` (rows [B, ...]), the pools [num_slots, ...] and slots int32 [B] for `KDASlots`."""
    match cache:
        case None:
            return None, None, None
        case KDASlots():
            return cache.state, cache.conv, cache.slots
        case KDAState():
            return cache.state, cache.conv, None
        case _:
            raise TypeError(f"a KDA layer's cache is a KDAState or KDASlots; got {type(cache).__name__}")


def _project(x_btd, prm: _KDAParams, h: int, k: int, kernels: str):
    """The input projections of x [B, T, D] and the gates' up-projections.

    Returns (x_in, x_qkv [B, T, 3*H*K], xb [B, T, H], f [B, T, H, K], x_gate [B, T, H, K], fg,
    beta_col): x_in and fg are the fused layout's GEMM outputs as they are ([B, T, in_width] and
    [B, T, 2, H*K]; None in the checkpoint layout), beta_col beta's first column in the decode
    kernel's q | k | v | ... | beta input."""
    b, t, _ = x_btd.shape
    if prm.fused:  # q, k, v come out of the one GEMM side by side: the convs' input as it is
        x_in = ops.linear(x_btd, prm.w_in, kernels=kernels)
        x_qkv, xfa, xb, xga = jnp.split(x_in, np.cumsum((3 * h * k, k, h)).tolist(), axis=-1)
        beta_col = 3 * h * k + k
    else:
        xs = [ops.linear(x_btd, w, kernels=kernels) for w in prm.w_in]
        x_qkv, xfa, xb, xga = jnp.concatenate(xs[:3], axis=-1), *xs[3:]
        x_in, beta_col = None, 3 * h * k

    # the gates' projections f and x_gate [B, T, H, K]: one batched GEMM in the serving layout
    # (its [B, T, 2, H*K] output is what the decode kernel reads), two apart in the checkpoint's
    # (whose sharding rules shard each on heads)
    if prm.fused:
        fg = jnp.einsum("btsr,srn->btsn", jnp.stack([xfa, xga], axis=2), prm.w_fg)
        f, x_gate = fg[:, :, 0].reshape(b, t, h, k), fg[:, :, 1].reshape(b, t, h, k)
    else:
        fg = None
        f, x_gate = jnp.einsum("btr,rhk->bthk", xfa, prm.w_fb), jnp.einsum("btr,rhv->bthv", xga, prm.w_gb)
    return x_in, x_qkv, xb, f, x_gate, fg, beta_col


def _decode_token(x_in, x_qkv, xb, f, x_gate, fg, beta_col, prm: _KDAParams, cache_parts, valid_b, cfg):
    """One decode token [B, 1, ...] on slot pools: convs, gates, recurrence and gated norm in one
    kernel (`kimik3.ops.kda_decode`) that updates both pools in place.  It reads q | k | v and
    beta from the projection's output as it is, f | x_gate whole.  cache_parts: (state pool,
    conv pool, slots int32 [B]).  Returns (o [B, H, V], conv pool, state pool)."""
    state, conv_state, slots = cache_parts
    b, t = x_qkv.shape[:2]
    x_in = jnp.concatenate([x_qkv, xb], axis=-1) if x_in is None else x_in  # q | k | v, then beta
    fg = (
        fg.reshape(b, t, -1) if prm.fused else jnp.concatenate([f.reshape(b, t, -1), x_gate.reshape(b, t, -1)], axis=-1)
    )
    return ops.kda_decode(
        x_in[:, 0],
        fg[:, 0],
        conv_state,
        state,
        slots,
        valid_b,
        beta_col=beta_col,
        w_conv=tuple(prm.conv[n] for n in "qkv"),
        a_log=prm.a_log,
        dt_bias=prm.dt_bias,
        o_norm=prm.o_norm,
        lower_bound=gate_lower_bound(cfg),
        eps=cfg.kda_eps,
    )


def _export_entries(out, conv_exports, export_at, valid_b, t: int, chunk_size: int) -> KDAState:
    """The exports `KDAState` (state [B, E, H, K, V], conv [B, E, W-1, 3, H*D]) with the entries
    that name no state zeroed: positions `ops.kda_export_mask` rejects, or past a row's valid
    tokens."""
    named = ops.kda_export_mask(export_at, t, chunk_size)[None]  # [1, E]
    if valid_b is not None:  # a position among a row's pad tokens names no state either
        named = named & (export_at[None] <= valid_b[:, None])
    keep = lambda s: jnp.where(named.reshape(named.shape + (1,) * (s.ndim - 2)), s, 0)
    return KDAState(keep(out[2]), keep(conv_exports))


def _mix_sequence(x_qkv, xb, f, prm: _KDAParams, cache_parts, export_at, valid_b, cfg, kernels):
    """The short convs and the chunked recurrence over x_qkv [B, T, 3*H*K] (`kimik3.ops.kda`).

    cache_parts: (state, conv_state, slots) as `_cache_parts` gives them.  Returns (o [B, T, H, V]
    before the gated norm, the cache entry written, the exports or None), as `KDA` states them;
    pad tokens past valid_b enter with q = k = v = 0, no decay and beta = 0."""
    state, conv_state, slots = cache_parts
    b, t = x_qkv.shape[:2]
    h, k = cfg.kda_heads, cfg.kda_head_dim
    real = None if valid_b is None else (jnp.arange(t)[None] < valid_b[:, None])[..., None, None]  # [B, T, 1, 1]
    pad = (lambda x: x) if real is None else (lambda x: jnp.where(real, x, jnp.zeros((), x.dtype)))

    # The three short convs as one over [q | k | v] channels; their state rows [B, W-1, 3, H*D]
    # (or the pool [num_slots, ...] read and written by slot).
    w_conv = jnp.concatenate([prm.conv[n] for n in "qkv"], axis=-1)
    rows = conv_state if conv_state is None or slots is None else conv_state[slots]
    rows = None if rows is None else rows.reshape(b, cfg.kda_conv_size - 1, 3 * h * k)
    out = short_conv(x_qkv, w_conv, rows, export_at, valid_b)
    new_rows = out[1].reshape(b, cfg.kda_conv_size - 1, 3, h * k)
    new_conv = new_rows if slots is None else conv_state.at[slots].set(new_rows.astype(conv_state.dtype))
    conv_exports = None if export_at is None else out[2].reshape(out[2].shape[:3] + (3, h * k))
    y = jax.nn.silu(out[0]).reshape(b, t, 3, h, k)
    q = pad(l2_normalize(y[:, :, 0]))
    kk = pad(l2_normalize(y[:, :, 1]))
    v = pad(y[:, :, 2])
    g = pad(kda_gate(f, prm.a_log, prm.dt_bias, gate_lower_bound(cfg)))
    beta = jax.nn.sigmoid(xb.astype(jnp.float32))
    if real is not None:
        beta = jnp.where(real[..., 0], beta, 0.0)
    out = ops.kda(
        q,
        kk,
        v,
        g,
        beta,
        initial_state=state,
        chunk_size=cfg.kda_chunk_size,
        kernels=kernels,
        export_at=export_at,
        slots=slots,
        gate_bounded=cfg.kda_gate == "bounded",
    )
    o, new_state = out[:2]
    new_cache = KDAState(new_state, new_conv) if slots is None else KDASlots(new_state, new_conv, slots)
    exports = None
    if export_at is not None:
        exports = _export_entries(out, conv_exports, export_at, valid_b, t, cfg.kda_chunk_size)
    return o, new_cache, exports


class KDA(nn.Module):
    """x [B, T, D], cache -> (y [B, T, D], the cache entry written, the exports or None).

    The cache entry's type picks the path (`kimik3.caches`):

    * None: a pass from the zero state; the entry written is the `KDAState` after it.
    * `KDAState` (rows [B, ...]): the pass continues each row's state; the entry written is
      a `KDAState`.
    * `KDASlots` (pools [num_slots, ...] and slots int32 [B]): row b reads and writes slot
      slots[b]; the entry written is a `KDASlots` over the updated pools.  One decode token on
      the Pallas path (`kimik3.ops.kda_decode_fused`) runs everything after the input
      projections in one kernel that updates both pools in place (`kimik3.ops.kda_decode`).

    export_at (int32 [E] token counts within this call, traced): the exports are the entries as
    they stood after each count, a `KDAState` with state [B, E, H, K, V] and conv
    [B, E, W-1, 3, H*D]: the states a prefix cache snapshots at its block boundaries, from this
    one pass (entries that are not multiples of the chunk size in 1..T, or past a row's valid
    tokens, give zeros).  Without export_at the exports are None.

    valid_b (int32 [B]) marks only the first valid_b[b] tokens of row b as real: the rest pad a
    prefill chunk to its compiled length.  Pad tokens enter the recurrence with q = k = v = 0, no
    decay and beta = 0 (what the chunked kernels pad with themselves), so the state and every
    real token's output are those of the unpadded span."""

    cfg: ModelConfig
    kernels: str = "auto"  # see kimik3.ops

    @nn.compact
    def __call__(self, x_btd, cache: KDAState | KDASlots | None = None, *, export_at=None, valid_b=None):
        cfg = self.cfg
        t = x_btd.shape[1]
        prm = _declare_params(self)
        parts = _cache_parts(cache)
        slots = parts[2]  # None unless the entry is a `KDASlots`
        x_in, x_qkv, xb, f, x_gate, fg, beta_col = _project(x_btd, prm, cfg.kda_heads, cfg.kda_head_dim, self.kernels)
        if slots is not None and t == 1 and export_at is None and ops.kda_decode_fused(self.kernels):
            o, conv_pool, state_pool = _decode_token(x_in, x_qkv, xb, f, x_gate, fg, beta_col, prm, parts, valid_b, cfg)
            new_cache = KDASlots(state_pool, conv_pool, slots)
            return ops.linear_heads(o, prm.w_o, kernels=self.kernels)[:, None], new_cache, None
        o, new_cache, exports = _mix_sequence(x_qkv, xb, f, prm, parts, export_at, valid_b, cfg, self.kernels)
        gate = jax.nn.sigmoid(x_gate.astype(jnp.float32))
        o = (rms_norm(o, prm.o_norm, cfg.kda_eps).astype(jnp.float32) * gate).astype(x_btd.dtype)
        return ops.linear_heads(o, prm.w_o, kernels=self.kernels), new_cache, exports
