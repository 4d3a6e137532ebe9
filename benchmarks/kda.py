"""KDA kernels: chunked prefill (`chunk_kda`), pooled decode (`fused_recurrent_kda`) and a KDA
layer's fused decode token (`kda_decode`), against fla where it imports (fla-core with torch).

Registered in `benchmarks.registry` (kda_chunk, kda_decode, kda_decode_fused): each function takes
a `registry.Context` and yields one row per case and variant.
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp

from benchmarks import common
from kimik3 import ops
from kimik3.layers.kda import kda_gate
from pallas_kernels import kda
from pallas_kernels import kda_decode as kd

log = logging.getLogger("benchmarks.kda")

TUNINGS = {  # kda_chunk's variants: `chunk_kda(tuning=...)` overrides of `kda.TUNING`
    "intra16": {"intra": (16, 1)},
    "intra4x2": {"intra": (4, 2)},
    "intra8x2": {"intra": (8, 2)},
    "intra_solve": {"prepare_impl": "intra_solve"},
    "prepare_fused": {"prepare_impl": "fused", "prepare": (4, 1), "prepare_dot": "bf16"},
    "tf32x3": {"prepare_dot": "tf32x3"},
    "state_bv32": {"state_block_v": 32},
    "state8x3": {"state": (8, 3)},
}
DECODE_TILINGS = {  # kda_decode's variants: fused_recurrent_kda keyword overrides
    "bv32w4": dict(block_v=32, num_warps=4),
    "bv64w4": dict(block_v=64, num_warps=4),
    "bv32w2": dict(block_v=32, num_warps=2),
    "bv128w8": dict(block_v=128, num_warps=8),
    "hints": dict(cache_hints=True),
}
FUSED_TILINGS = {  # kda_decode_fused's variants: kda_decode keyword overrides
    "w8": dict(num_warps=8),
    "bv128w4": dict(block_v=128, num_warps=4),
    "bv128w8": dict(block_v=128, num_warps=8),
    "bv32w4": dict(block_v=32, num_warps=4),
    "bv32w2": dict(block_v=32, num_warps=2),
}
TOL = 2e-2  # bf16 inputs against an fp32 reference: relative L2 error


def fla():
    """(torch, fla's chunk_kda, fla's fused_recurrent_kda_fwd), or None where fla, torch or a CUDA
    device is missing."""
    if jax.default_backend() != "gpu":
        return None
    try:
        import torch
        from fla.ops.kda import chunk_kda
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    except Exception as e:  # noqa: BLE001 - the peer is optional
        log.info("fla unavailable (%r): no KDA peer", e)
        return None
    return torch, chunk_kda, fused_recurrent_kda_fwd


def to_torch(x):
    import torch

    return torch.from_dlpack(jax.block_until_ready(x))


def inputs(key, b, t, h, d, dtype, gate: str = "bounded"):
    """q, k (L2-normalized), v, g (fp32 log decay), beta: the layer's value ranges.  gate
    "bounded": g in (-5, 0); "softplus": Kimi-Linear's unbounded gate `kda_gate(f, A_log, 0, None)`
    = -e^A softplus(f) with f ~ N(0, 1) and A_log = log U(1, 16) per head, log-decays far below -5."""
    ks = jax.random.split(key, 5)
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
    q = unit(jax.random.normal(ks[0], (b, t, h, d))).astype(dtype)
    k = unit(jax.random.normal(ks[1], (b, t, h, d))).astype(dtype)
    v = jax.random.normal(ks[2], (b, t, h, d)).astype(dtype)
    f = jax.random.normal(ks[3], (b, t, h, d))
    if gate == "softplus":
        a_log = jnp.log(jax.random.uniform(jax.random.fold_in(key, 5), (h,), minval=1.0, maxval=16.0))
        g = kda_gate(f, a_log, jnp.zeros((h, d)), None).astype(jnp.float32)
    else:
        g = (-5.0 * jax.nn.sigmoid(f - 2.0)).astype(jnp.float32)
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (b, t, h))).astype(dtype)
    return q, k, v, g, beta


def _f32(*xs):
    return [x.astype(jnp.float32) for x in xs]


def kda_chunk(ctx):
    """kda_chunk: `chunk_kda` with the final state (and with export, the states after every 128th
    and 1536th token), checked against `kda_chunked_ref`, vs fla's `chunk_kda`.  gate "softplus":
    the unbounded gate through `ops.kda(..., gate_bounded=False)` (what a Kimi-Linear layer calls)."""
    peer = fla()
    for case in ctx.cases():
        b, t, h, d, export, gate = case
        args = inputs(jax.random.PRNGKey(1), b, t, h, d, jnp.bfloat16, gate)
        positions = sorted(set(range(128, t + 1, 128)) | set(range(1536, t + 1, 1536))) if export else None
        at = jnp.asarray(positions, jnp.int32) if positions else None
        want = jax.jit(functools.partial(kda.kda_chunked_ref, export_at=at))(*_f32(*args))
        n_ckpt = len(positions or [])
        work = {"bytes": b * t * h * (3 * d * 2 + d * 4 + 2 + d * 2) + b * h * d * d * 4 * (1 + n_ckpt)}

        def peer_ms():
            if peer is None:
                return None
            torch, chunk, _ = peer
            tq = [to_torch(x) for x in args]
            return ctx.time_torch(lambda: chunk(*tq, output_final_state=True))

        def one(tuning, variant):
            if gate == "softplus":  # the layer's entry point: the exact-diagonal kernel
                fn = jax.jit(lambda *a: (ops.kda(*a, kernels="pallas", export_at=at, gate_bounded=False) + (None,))[:3])
            else:
                fn = jax.jit(
                    lambda *a: kda.chunk_kda(*a, output_final_state=True, checkpoint_positions=positions, tuning=tuning)
                )
            o, s, ck = fn(*args)
            checks = [common.check(o, want[0], TOL, l2=True), common.check(s, want[1], TOL, l2=True)]
            if positions:
                checks.append(common.check(ck, want[2], TOL, l2=True))
            return ctx.row(
                case,
                common.merge_checks(*checks),
                lambda: ctx.time(fn, *args),
                variant=variant,
                peer_ms=peer_ms,
                work=work,
                extra={"exported_states": n_ckpt, "min_log_decay": float(jnp.min(args[3]))},
            )

        yield ctx.attempt(case, "default", lambda: one(None, "default"))
        if gate == "softplus":  # the tunings are the kernel's own: the bounded cases time them
            continue
        for name in ctx.wanted():
            yield ctx.attempt(case, name, lambda name=name: one(TUNINGS[name], name))


def kda_decode(ctx):
    """kda_decode: one token of `fused_recurrent_kda` on a pool of 2B slots (B rows at shuffled
    slots, the pool donated and fed forward), checked against `kda_recurrent_ref`, vs fla's
    `fused_recurrent_kda_fwd` on the same pool in place."""
    peer = fla()
    for case in ctx.cases():
        b, h, d = case
        q, k, v, g, beta = inputs(jax.random.PRNGKey(3), b, 1, h, d, jnp.bfloat16)
        n_slots = 2 * b
        pool = jax.random.normal(jax.random.PRNGKey(4), (n_slots, h, d, d), jnp.float32)
        slots = jax.random.permutation(jax.random.PRNGKey(5), n_slots)[:b].astype(jnp.int32)
        o_ref, s_ref = jax.jit(kda.kda_recurrent_ref)(*_f32(q, k, v, g, beta), initial_state=pool[slots])
        work = {"bytes": 2 * b * h * d * d * 4 + b * h * (4 * d * 2 + d * 4 + 2)}

        def peer_ms():
            if peer is None:
                return None
            torch, _, fwd = peer
            tq, tk, tv, tg, tb = (to_torch(x) for x in (q, k, v, g, beta))
            pool_t, slots_t, out_t = to_torch(jnp.copy(pool)), to_torch(slots), torch.empty_like(tv)
            return ctx.time_torch(
                lambda: fwd(
                    tq,
                    tk,
                    tv,
                    tg,
                    tb,
                    initial_state=pool_t,
                    scale=d**-0.5,
                    inplace_final_state=True,
                    ssm_state_indices=slots_t,
                    out=out_t,
                )
            )

        def one(kw, variant):
            # the inputs as arguments and the pool donated, as a serving step calls the kernel
            call = jax.jit(
                lambda p, *a: kda.fused_recurrent_kda(*a[:5], state_pool=p, slots=a[5], **kw), donate_argnums=0
            )
            step = lambda p: call(p, q, k, v, g, beta, slots)
            o, p2 = step(jnp.copy(pool))
            chk = common.merge_checks(
                common.check(o, o_ref, TOL, l2=True), common.check(p2[slots], s_ref, TOL, l2=True)
            )
            return ctx.row(
                case, chk, lambda: ctx.time_carried(step, jnp.copy(pool)), variant=variant, peer_ms=peer_ms, work=work
            )

        yield ctx.attempt(case, "default", lambda: one({}, "default"))
        for name in ctx.wanted():
            kw = DECODE_TILINGS[name]
            if d % kw.get("block_v", 1) == 0:
                yield ctx.attempt(case, name, lambda kw=kw, name=name: one(kw, name))


W = 4  # the short convs' taps


def _fused_inputs(key, b, n_slots, h, k):
    ks = iter(jax.random.split(key, 16))
    r = lambda *s, scale=1.0: (jax.random.normal(next(ks), s, jnp.float32) * scale).astype(jnp.bfloat16)
    hk = h * k
    params = dict(
        beta_col=3 * hk + k,
        w_conv=tuple(r(W, hk, scale=0.5) for _ in range(3)),
        a_log=jnp.log(jnp.linspace(1.0, 16.0, h)),
        dt_bias=jnp.zeros((h, k)),
        o_norm=jnp.ones((k,)),
        lower_bound=-5.0,
        eps=1e-6,
    )
    x_in, fg = r(b, 3 * hk + k + h + k), r(b, 2 * hk)
    conv = r(n_slots, W - 1, 3, hk, scale=0.1)
    state = jax.random.normal(next(ks), (n_slots, h, k, k), jnp.float32) * 0.1
    slots = jax.random.permutation(next(ks), n_slots)[:b].astype(jnp.int32)
    return x_in, fg, conv, state, slots, params


def kda_decode_fused(ctx):
    """kda_decode_fused: one `kda_decode` call (a KDA layer's decode token) on conv and state pools
    of 2B slots at shuffled slots, donated and fed forward, checked against `kda_decode_ref`."""
    for case in ctx.cases():
        b, h, k = case
        x_in, fg, conv, state, slots, params = _fused_inputs(jax.random.PRNGKey(b), b, 2 * b, h, k)
        want = jax.jit(functools.partial(kd.kda_decode_ref, **params))(x_in, fg, conv, state, slots, None)
        work = {
            "bytes": 2 * b * h * k * k * 4 + 2 * b * (W - 1) * 3 * h * k * 2 + x_in.nbytes + fg.nbytes + b * h * k * 2
        }

        arrays = {n: params[n] for n in ("w_conv", "a_log", "dt_bias", "o_norm")}
        static = {n: v for n, v in params.items() if n not in arrays}

        def one(kw, variant):
            # the inputs as arguments and the pools donated, as a serving step calls the kernel
            @functools.partial(jax.jit, donate_argnums=0)
            def call(pools, x_in, fg, slots, arrays):
                o, c, s = kd.kda_decode(x_in, fg, *pools, slots, None, **arrays, **static, **kw)
                return o, (c, s)

            step = lambda pools: call(pools, x_in, fg, slots, arrays)

            o, (c, s) = step((jnp.copy(conv), jnp.copy(state)))
            chk = common.merge_checks(
                common.check(o, want[0], TOL, l2=True),
                common.check(c, want[1], TOL, l2=True),
                common.check(s, want[2], TOL, l2=True),
            )
            return ctx.row(
                case, chk, lambda: ctx.time_carried(step, (jnp.copy(conv), jnp.copy(state))), variant=variant, work=work
            )

        yield ctx.attempt(case, "default", lambda: one({}, "default"))
        for name in ctx.wanted():
            kw = FUSED_TILINGS[name]
            if k % kw.get("block_v", 1) == 0:
                yield ctx.attempt(case, name, lambda kw=kw, name=name: one(kw, name))
