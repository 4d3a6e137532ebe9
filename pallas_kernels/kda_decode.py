"""KDA's decode token in one kernel: short convs, gates, the recurrence and the gated output norm.

One decode token of a KDA layer, after its input projections, is (per row b, head h)::

    q, k, v  = silu(conv_W([conv rows of slot b ; x_in's q | k | v]))  (q, k then L2-normalized)
    g        = lower_bound * sigmoid(exp(A_log) * (f + dt_bias))        (log-decay, fp32; bounded)
             = -exp(A_log) * softplus(f + dt_bias)                      (lower_bound None: unbounded)
    beta     = sigmoid(x_in's beta column)
    S, o     = one step of the delta rule on the pooled state S (`pallas_kernels.kda.kda_step`)
    out      = rms_norm(o) * norm * sigmoid(x_gate)

Unfused, that is ~15 small XLA fusions a layer around the recurrence (the conv rows' gather and
scatter by slot, the activation, two norms, the gate math, the pad selects, the output norm);
here it is one program per (row, head) that reads the conv rows and the state from their pools
by slot and writes both back in place.  A program owns its head's conv channels whole (q, k and
every V block), so it reads the old rows before it writes the new ones: no other program touches
them.  Rows whose `valid` is 0 (a decode bucket's idle rows) read nothing, leave both pools as
they were and give 0; they may share a slot only if its contents are scratch.

`kda_decode_ref` is the same math in jnp (fp32 throughout, like the kernel), on the same pools.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.kda import kda_step

HIGHEST = jax.lax.Precision.HIGHEST


def log_decay(rate, f, lower_bound: float | None):
    """The gate's log-decay (fp32) from exp(A_log) `rate` and f + dt_bias `f`: bounded
    (lower_bound * sigmoid(rate * f)) or, with lower_bound None, -rate * softplus(f), the softplus
    written as max(f, 0) + log1p(exp(-|f|)) (finite for any f; lowers inside a kernel)."""
    if lower_bound is None:
        return -rate * (jnp.maximum(f, 0.0) + jnp.log1p(jnp.exp(-jnp.abs(f))))
    return lower_bound * jax.nn.sigmoid(rate * f)


def kda_decode_ref(
    x_in,
    fg,
    conv_pool,
    state_pool,
    slots,
    valid,
    *,
    beta_col: int,
    w_conv,
    a_log,
    dt_bias,
    o_norm,
    lower_bound: float | None,
    eps: float,
    l2_eps: float = 1e-6,
    scale=None,
):
    """The reference: same arguments and results as `kda_decode`, in jnp."""
    f32 = jnp.float32
    b = x_in.shape[0]
    n_slots, taps, _, hk = conv_pool.shape
    h, dk = dt_bias.shape
    f, x_gate = fg[:, :hk].reshape(b, h, dk), fg[:, hk:].reshape(b, h, -1)
    scale = dk**-0.5 if scale is None else scale
    real = (jnp.ones((b,), jnp.int32) if valid is None else valid) > 0
    rows = conv_pool[slots].astype(f32)  # [B, W-1, 3, H*K]
    ext = jnp.concatenate([rows, x_in[:, : 3 * hk].reshape(b, 1, 3, hk).astype(f32)], axis=1)  # [B, W, 3, H*K]
    taps_w = jnp.stack([w.astype(f32) for w in w_conv], axis=1)  # [W, 3, H*K]
    y = jnp.einsum("bwcn,wcn->bcn", ext, taps_w, precision=HIGHEST)
    y = (y * jax.nn.sigmoid(y)).reshape(b, 3, h, dk)
    l2 = lambda u: u * jax.lax.rsqrt(jnp.sum(u * u, axis=-1, keepdims=True) + l2_eps)
    mask = lambda u: jnp.where(real.reshape((b,) + (1,) * (u.ndim - 1)), u, 0.0)
    q, k, v = mask(l2(y[:, 0])), mask(l2(y[:, 1])), mask(y[:, 2])
    g = log_decay(jnp.exp(a_log.astype(f32))[:, None], f.astype(f32) + dt_bias.astype(f32), lower_bound)
    beta = jax.nn.sigmoid(x_in[:, beta_col : beta_col + h].astype(f32))
    o, s_new = kda_step(state_pool[slots], q, k, v, mask(g), mask(beta), scale)
    o = o * jax.lax.rsqrt(jnp.mean(o * o, axis=-1, keepdims=True) + eps) * o_norm.astype(f32)
    o = mask(o * jax.nn.sigmoid(x_gate.astype(f32))).astype(x_in.dtype)
    keep = real.reshape(b, 1, 1, 1)
    new_rows = jnp.where(keep, ext[:, 1:], rows).astype(conv_pool.dtype)
    # rows sharing a (scratch) slot: the last write wins here, any one in the kernel
    return o, conv_pool.at[slots].set(new_rows), state_pool.at[slots].set(jnp.where(keep, s_new, state_pool[slots]))


def _decode_kernel(
    slots_ref,
    valid_ref,
    x_ref,
    wq_ref,
    wk_ref,
    wv_ref,
    fg_ref,
    a_ref,
    dtb_ref,
    norm_ref,
    conv_in_ref,
    state_in_ref,
    o_ref,
    conv_out_ref,
    state_out_ref,
    *,
    beta_col,
    block_v,
    lower_bound,
    eps,
    l2_eps,
    scale,
):
    """One (row, head).  x [B, N] (q | k | v in its first 3*H*K columns); fg [B, H*K + H*V] (f,
    then the output gate's projection); w_* [W, H*K]; conv pool [S, W-1, 3, H*K]; state pool
    [S, H, K, V].  conv_out / state_out alias conv_in / state_in."""
    f32 = jnp.float32
    b, h = pl.program_id(0), pl.program_id(1)
    n_heads, dk = dtb_ref.shape
    dv = state_in_ref.shape[-1]
    taps = conv_in_ref.shape[1]
    hk = n_heads * dk
    slot = slots_ref[b]
    real = valid_ref[b] > 0
    w_refs = (wq_ref, wk_ref, wv_ref)

    def conv(c, start, n):
        """silu(conv) of channel group c (0 q, 1 k, 2 v) over head h's lanes [start, start + n), and
        (the lanes, the W inputs: W-1 old rows, then this token's)."""
        lanes = pl.ds(h * dk + start, n)
        rows = [conv_in_ref[slot, j, c, lanes].astype(f32) for j in range(taps)]
        ext = rows + [x_ref[b, pl.ds(c * hk + h * dk + start, n)].astype(f32)]
        y = ext[0] * w_refs[c][0, lanes].astype(f32)
        for j in range(1, taps + 1):
            y = y + ext[j] * w_refs[c][j, lanes].astype(f32)
        return y * jax.nn.sigmoid(y), (lanes, ext)

    def l2(u):
        return u * jax.lax.rsqrt(jnp.sum(u * u) + l2_eps)

    @pl.when(~real)
    def _():  # an idle row: its (scratch) slot is left alone, its output is 0
        o_ref[b, h, :] = jnp.zeros((dv,), o_ref.dtype)

    @pl.when(real)
    def _():
        q, q_io = conv(0, 0, dk)
        k, k_io = conv(1, 0, dk)
        q, k = l2(q), l2(k)
        f = fg_ref[b, pl.ds(h * dk, dk)].astype(f32) + dtb_ref[h, :].astype(f32)
        decay = jnp.exp(log_decay(jnp.exp(a_ref[h].astype(f32)), f, lower_bound))
        beta = jax.nn.sigmoid(x_ref[b, beta_col + h].astype(f32))

        outs, v_ios = [], []
        for vb in range(dv // block_v):
            vs = pl.ds(vb * block_v, block_v)
            v, v_io = conv(2, vb * block_v, block_v)
            s = state_in_ref[slot, h, :, vs] * decay[:, None]  # [K, BV] fp32
            pred = jnp.sum(k[:, None] * s, axis=0)
            s = s + (beta * k)[:, None] * (v - pred)[None, :]
            outs.append(scale * jnp.sum(q[:, None] * s, axis=0))
            # only this program reads this state block: it lands at once (one block live at a time)
            state_out_ref[slot, h, :, vs] = s
            v_ios.append(v_io)

        r = jax.lax.rsqrt(sum(jnp.sum(o * o) for o in outs) / dv + eps)
        for vb, o in enumerate(outs):
            vs = pl.ds(vb * block_v, block_v)
            gate = jax.nn.sigmoid(fg_ref[b, pl.ds(hk + h * dv + vb * block_v, block_v)].astype(f32))
            o_ref[b, h, vs] = (o * r * norm_ref[vs].astype(f32) * gate).astype(o_ref.dtype)
        # every read of this (slot, head)'s conv rows is done: the new rows (the last W-1 inputs) may land
        for c, (lanes, ext) in [(2, v_io) for v_io in v_ios] + [(0, q_io), (1, k_io)]:
            for jj in range(taps):
                conv_out_ref[slot, jj, c, lanes] = ext[jj + 1].astype(conv_out_ref.dtype)


@functools.partial(
    jax.jit,
    static_argnames=("beta_col", "lower_bound", "eps", "l2_eps", "scale", "block_v", "num_warps", "interpret"),
    donate_argnames=("conv_pool", "state_pool"),
)
def _decode_core(
    x_in,
    fg,
    conv_pool,
    state_pool,
    slots,
    valid,
    w_conv,
    a_log,
    dt_bias,
    o_norm,
    *,
    beta_col,
    lower_bound,
    eps,
    l2_eps,
    scale,
    block_v,
    num_warps,
    interpret,
):
    b = x_in.shape[0]
    h, dv = dt_bias.shape[0], state_pool.shape[-1]
    return pl.pallas_call(
        functools.partial(
            _decode_kernel,
            beta_col=beta_col,
            block_v=block_v,
            lower_bound=lower_bound,
            eps=eps,
            l2_eps=l2_eps,
            scale=scale,
        ),
        grid=(b, h),
        out_shape=[
            jax.ShapeDtypeStruct((b, h, dv), x_in.dtype),
            jax.ShapeDtypeStruct(conv_pool.shape, conv_pool.dtype),
            jax.ShapeDtypeStruct(state_pool.shape, jnp.float32),
        ],
        input_output_aliases={10: 1, 11: 2},
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        name="kda_decode",
    )(slots, valid, x_in, *w_conv, fg, a_log, dt_bias, o_norm, conv_pool, state_pool)


def kda_decode(
    x_in,
    fg,
    conv_pool,
    state_pool,
    slots,
    valid=None,
    *,
    beta_col: int,
    w_conv,
    a_log,
    dt_bias,
    o_norm,
    lower_bound: float | None,
    eps: float,
    l2_eps: float = 1e-6,
    scale=None,
    block_v=None,
    num_warps=4,
    interpret=None,
):
    """One decode token of a KDA layer on pooled conv rows and states, both updated in place.

    Args:
      x_in: [B, N] the input projections: q | k | v (before the convs) in columns [0, 3*H*K), the
        beta projection in [beta_col, beta_col + H) (the layer's fused GEMM output as it is).
      fg: [B, H*K + H*V] the gates' projections side by side, as one GEMM gives them: the decay
        gate's f (before dt_bias) in the first H*K columns, the output gate's (before the
        sigmoid) in the next H*V.
      conv_pool: [S, W-1, 3, H*K], row b's last W-1 conv inputs at slot slots[b]; donated.
      state_pool: [S, H, K, V] float32; donated.
      slots: int32 [B]; valid: int32 [B] or None (all real): rows with 0 change nothing.
      w_conv: (q, k, v) taps, each [W, H*K], oldest first; a_log: [H]; dt_bias: [H, K]; o_norm: [V].
      lower_bound: the bounded gate's bound (< 0), or None for the unbounded softplus gate.
    Returns:
      (out [B, H, V] in x_in's dtype, the conv pool, the state pool).
    """
    b = x_in.shape[0]
    n_slots, taps, three, hk = conv_pool.shape
    h, dk = dt_bias.shape
    dv = state_pool.shape[-1]
    w_conv = tuple(w_conv)
    if (
        three != 3
        or hk != h * dk
        or x_in.ndim != 2
        or x_in.shape[1] < max(3 * hk, beta_col + h)
        or len(w_conv) != 3
        or any(w.shape != (taps + 1, hk) for w in w_conv)
    ):
        raise ValueError(
            f"kda_decode: x_in [B, >= 3*H*K = {3 * hk}] with beta at column {beta_col}, conv_pool "
            f"[S, W-1, 3, H*K] and three w_conv [W, H*K] disagree: {x_in.shape}, {conv_pool.shape}, "
            f"{[w.shape for w in w_conv]}"
        )
    if state_pool.shape != (n_slots, h, dk, dv) or state_pool.dtype != jnp.float32:
        raise ValueError(
            f"kda_decode: state_pool must be float32 [{n_slots}, {h}, {dk}, V]; "
            f"got {state_pool.dtype} {state_pool.shape}"
        )
    if fg.shape != (b, hk + h * dv) or o_norm.shape != (dv,) or a_log.shape != (h,):
        raise ValueError(
            f"kda_decode: fg [B, H*K + H*V], o_norm [V], a_log [H] expected; got "
            f"{fg.shape}, {o_norm.shape}, {a_log.shape}"
        )
    if dk & (dk - 1) or dv & (dv - 1):
        raise ValueError(f"kda_decode: head dims must be powers of two; got K={dk}, V={dv}")
    slots = jnp.asarray(slots, jnp.int32)
    valid = jnp.ones((b,), jnp.int32) if valid is None else jnp.asarray(valid, jnp.int32)
    if slots.shape != (b,) or valid.shape != (b,):
        raise ValueError(f"kda_decode: slots and valid must be [B] = [{b}]; got {slots.shape}, {valid.shape}")
    interpret = jax.default_backend() != "gpu" if interpret is None else interpret
    return _decode_core(
        x_in,
        fg,
        conv_pool,
        state_pool,
        slots,
        valid,
        w_conv,
        a_log,
        dt_bias,
        o_norm,
        beta_col=int(beta_col),
        lower_bound=None if lower_bound is None else float(lower_bound),
        eps=float(eps),
        l2_eps=float(l2_eps),
        scale=float(dk**-0.5 if scale is None else scale),
        block_v=block_v or min(dv, 64),
        num_warps=num_warps,
        interpret=interpret,
    )
