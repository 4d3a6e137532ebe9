"""`fused_recurrent_kda`: decode and speculative verify on a pool of KDA states, in place (a
Pallas kernel, one (sequence, head, V block) a program)."""

from __future__ import annotations

import functools as _functools

import jax
import jax.numpy as jnp
import numpy as _np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.kda.common import _default_interpret, _is_pow2
from pallas_kernels.kda.naive import _check_shapes


def _recurrent_kernel(
    slots_ref,
    n_acc_ref,
    q_ref,
    k_ref,
    v_ref,
    g_ref,
    beta_ref,
    pool_in_ref,
    o_ref,
    pool_out_ref,
    *states_ref,
    n_tokens,
    block_v,
    scale,
    cache_hints=False,
):
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
        o_t = (
            scale * jnp.sum(load(q_ref, (b, t, h, slice(None)), "evict_last").astype(f32)[:, None] * s, axis=0)
        ).astype(o_ref.dtype)
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


@_functools.partial(
    jax.jit,
    static_argnames=("scale", "block_v", "interpret", "export_states", "num_warps", "cache_hints"),
    donate_argnames=("state_pool",),
)
def _fused_recurrent_core(
    q,
    k,
    v,
    g,
    beta,
    state_pool,
    slots,
    n_acc,
    *,
    scale,
    block_v,
    interpret,
    export_states=False,
    num_warps=4,
    cache_hints=False,
):
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


def fused_recurrent_kda(
    q,
    k,
    v,
    g,
    beta,
    *,
    state_pool,
    slots,
    scale=None,
    num_accepted=None,
    interpret=None,
    block_v=None,
    export_states=False,
    num_warps=8,
    cache_hints=False,
):
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
        the fastest of six tilings at B 128-512 with the state landing by a conditional store
        (fla 0.6's tiling is 32 columns on 4 warps; RESULTS.md, KDA kernels).
      cache_hints: fla's L2 eviction hints on q / k / g (kept) and v / o (first out); a
        candidate until `python -m benchmarks.run --only kda_decode --variants hints` has timed it
        (same results).
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
    scale = float(dk**-0.5 if scale is None else scale)
    if dv % block_v:
        raise ValueError(f"block_v {block_v} must divide V={dv}")
    return tuple(
        _fused_recurrent_core(
            q,
            k,
            v,
            g,
            beta,
            state_pool,
            slots,
            n_acc,
            scale=scale,
            block_v=block_v,
            interpret=interpret,
            export_states=export_states,
            num_warps=num_warps,
            cache_hints=bool(cache_hints),
        )
    )
