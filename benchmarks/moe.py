"""MoE expert kernels: the routed-expert grouped GEMM and a layer's grouped FFN, as `kimik3.ops`
runs them (the Hopper or the Triton kernels by `ops.moe_gmm_impl`), against JAX's Mosaic GPU
`ragged_dot_mgpu` on the GPU.

Registered in `benchmarks.registry` (moe_gemm, moe_ffn).  `hopper_tilings` also serves
tests/gpu/test_moe_hopper.py.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import common
from kimik3 import ops
from kimik3.layers.moe import _SituGLU
from pallas_kernels import moe, moe_hopper

try:  # JAX's own Hopper ragged dot (wgmma + TMA), the peer
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu
except Exception:  # noqa: BLE001 - the peer column stays empty
    ragged_dot_mgpu = None

ACT = _SituGLU((8.0, 8.0))
# Our Hopper tilings the sweep variant times (and tests/gpu checks): (tile_m, tile_n, steps,
# grid_width, m_minor); the first is `moe_hopper.default_tiling`'s where N allows.
HOPPER_SWEEP = [
    (128, 128, 4, 8, True),
    (128, 128, 4, 8, False),
    (128, 64, 4, 8, True),
    (64, 128, 4, 8, True),
    (128, 128, 3, 4, True),
    (64, 64, 4, 8, True),
]
# The Triton grouped FFN's tilings (block_n, block_k, num_warps, num_stages) the sweep variant
# times, for gate/up with down at its default and then for down.
TILINGS = [
    (64, 64, 4, 3),
    (32, 64, 4, 3),
    (32, 128, 4, 3),
    (64, 128, 4, 3),
    (64, 64, 4, 4),
    (32, 64, 2, 4),
    (16, 128, 2, 3),
    (32, 256, 4, 2),
    (128, 128, 8, 3),
    (128, 128, 4, 3),
    (64, 256, 4, 3),
    (16, 256, 4, 4),
]


def hopper_tilings(m: int, n: int, act: bool, quick: bool) -> list[moe_hopper.HopperTiling]:
    """Our Hopper tilings to try for M rows and N output columns (F with act); a decode step's
    few rows (M <= 512) get the default only; quick: one small tiling for interpret mode."""
    if quick:
        return [moe_hopper.HopperTiling(tile_m=64, tile_n=64, steps=2, grid_width=2)]
    out = [
        moe_hopper.HopperTiling(tile_m=tm, tile_n=tn, steps=st, grid_width=w, m_minor=mm)
        for tm, tn, st, w, mm in HOPPER_SWEEP
        if not (act and tn > 64) and n % (2 * tn) == 0
    ]
    return out[:1] if m <= 512 else out


def mgpu_configs(m: int, n: int):
    """The peer's tilings to try (its own sweep's ranges, cut to a few): (block_m, block_n,
    block_k, max_concurrent_steps, grid_block_n)."""
    return [
        c
        for c in itertools.product((64, 128), (128, 256), (64,), (4,), (1, 4))
        if n % (c[1] * c[4]) == 0 and not (m <= 512 and c[0] == 128)
    ]


def _mgpu(a, b, sizes, cfg):
    bm, bn, bk, steps, gbn = cfg
    return ragged_dot_mgpu.ragged_dot(
        a, b, group_sizes=sizes, block_m=bm, block_n=bn, block_k=bk, max_concurrent_steps=steps, grid_block_n=gbn
    )


def _best_peer(ctx, candidates, args, want, tol):
    """(ms, name) of the fastest candidate (name, fn) whose output is within tol of want."""
    best = None
    for name, fn in candidates:
        try:
            if not common.check(fn(*args).astype(jnp.float32), want, tol, relative=False)["ok"]:
                continue
            ms = ctx.time(fn, *args)
        except Exception:  # noqa: BLE001 - a tiling the peer refuses is skipped
            continue
        if best is None or ms < best[0]:
            best = (ms, name)
    return best


HOST_DRAW_VALUES = 1 << 27  # weights past this many values are drawn on the device (numpy's fp64 draw: GBs)


def _case(rng, m, k, n, g):
    """Rows routed to experts (multinomial over G), bf16, and the experts in use."""
    sizes = rng.multinomial(m, np.ones(g) / g).astype(np.int32)
    lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    if g * k * n > HOST_DRAW_VALUES:
        key = jax.random.PRNGKey(int(rng.integers(1 << 31)))
        rhs = (jax.random.normal(key, (g, k, n), jnp.float32) / k**0.5).astype(jnp.bfloat16)
    else:
        rhs = jnp.asarray(rng.standard_normal((g, k, n)) / k**0.5, jnp.bfloat16)
    return lhs, rhs, jnp.asarray(sizes), int((sizes > 0).sum())


DENSE_REF_BYTES = 4 << 30  # past this, `lax.ragged_dot`'s reference may expand lhs to [G, M, K] in fp32


def reference(lhs, rhs, sizes):
    """`moe.grouped_matmul_ref` in fp32 (out[r] = lhs[r] @ rhs[g(r)], rows sorted by group), for any
    M: where the dense expansion of its `lax.ragged_dot` would pass DENSE_REF_BYTES (Kimi-Linear's 256
    experts at a prefill chunk's 65536 rows), one dot per group over a window of the largest group's
    rows instead, each row kept where it belongs to the group."""
    m, k = lhs.shape
    g, _, n = rhs.shape
    if g * m * k * 4 <= DENSE_REF_BYTES:
        return jax.jit(moe.grouped_matmul_ref)(lhs.astype(jnp.float32), rhs.astype(jnp.float32), sizes)
    window = int(np.max(np.asarray(sizes)))

    @jax.jit
    def by_group(lhs, rhs, sizes):
        starts = jnp.cumsum(sizes) - sizes
        padded = jnp.concatenate([lhs, jnp.zeros((window, k), lhs.dtype)]).astype(jnp.float32)
        hi = jax.lax.Precision.HIGHEST

        def one(i):
            rows = jax.lax.dynamic_slice(padded, (starts[i], 0), (window, k))
            return jnp.dot(rows, rhs[i].astype(jnp.float32), precision=hi)

        out = jax.lax.map(one, jnp.arange(g))  # [G, window, N]
        offset = jnp.arange(window)[None]
        index = jnp.where(offset < sizes[:, None], starts[:, None] + offset, m)
        return jnp.zeros((m, n), jnp.float32).at[index.reshape(-1)].set(out.reshape(-1, n), mode="drop")

    return by_group(lhs, rhs, sizes)


def _expert_row(ctx, case, fn, args, want, tol, variant, peer_ms, work, active):
    """A grouped expert kernel's row: `fn` jitted, checked against `want` (absolute `tol`), timed."""
    fn = jax.jit(fn)
    chk = common.check(fn(*args).astype(jnp.float32), want, tol, relative=False)
    return ctx.row(
        case,
        chk,
        lambda: ctx.time(fn, *args),
        variant=variant,
        peer_ms=peer_ms,
        work=work,
        extra={"experts_read": active},
    )


def moe_gemm(ctx):
    """moe_gemm: `ops.grouped_matmul` (Pallas) on M sorted rows, checked against
    `grouped_matmul_ref` in fp32, vs `ragged_dot_mgpu` (best of its sweep) or `lax.ragged_dot`."""
    rng = np.random.default_rng(0)
    interpret = not ctx.on_gpu
    for case in ctx.cases():
        m, k, n, g = case
        lhs, rhs, sizes, active = _case(rng, m, k, n, g)
        args = (lhs, rhs, sizes)
        want = reference(lhs, rhs, sizes)
        tol = 2.0**-6 * float(jnp.max(jnp.abs(want))) + 1e-3  # bf16 output rounding, with margin
        work = {"bytes": active * k * n * 2 + m * (k + n) * 2, "flops": 2 * m * k * n}
        peer = {}

        def peer_ms():
            if ctx.on_gpu and ragged_dot_mgpu is not None:
                cands = [(str(c), jax.jit(functools.partial(_mgpu, cfg=c))) for c in mgpu_configs(m, n)]
                best = _best_peer(ctx, cands, args, want, tol)
                if best is not None:
                    peer.update(name="ragged_dot_mgpu", tiling=best[1])
                    return best[0]
            peer["name"] = "XLA lax.ragged_dot"
            return ctx.time(jax.jit(lambda a, b, s: jax.lax.ragged_dot(a, b, s)), *args)

        block_m = 64 if ctx.ci else 128
        hop = lambda layout, t: functools.partial(
            moe_hopper.grouped_matmul,
            layout=layout,
            tiling=t,
            block_m=block_m if ctx.ci else t.tile_m if t else 128,
            interpret=interpret,
        )
        quick_tiling = hopper_tilings(m, n, False, True)[0] if ctx.ci else None
        fns = {
            "default": lambda a, b, s: ops.grouped_matmul(a, b, s, kernels="pallas"),
            "triton": moe.grouped_matmul,
            "hopper": hop("ragged", quick_tiling),
            "hopper_padded": hop("padded", quick_tiling),
        }
        for t in hopper_tilings(m, n, False, ctx.ci):
            fns[f"hopper_sweep:{t.label}"] = hop("ragged", t)

        def one(variant):
            row = _expert_row(ctx, case, fns[variant], args, want, tol, variant, peer_ms, work, active)
            if row["peer_ms"] is not None:
                row["peer"] = peer.get("name")
                row["extra"]["peer_tiling"] = peer.get("tiling")
            return row

        yield ctx.attempt(case, "default", lambda: one("default"))
        for name in ctx.wanted():
            hopper_fits = moe_hopper.fits(k, n, False) or ctx.ci
            for variant in [v for v in fns if v == name or v.startswith(f"{name}:")]:
                if variant.startswith("hopper") and not hopper_fits:
                    continue
                yield ctx.attempt(case, variant, lambda variant=variant: one(variant))


def ffn_ref(x, ids, w_gu, w_out, act=ACT):
    """The routed experts in fp32: rows sorted by expert, `grouped_matmul_ref` for gate ++ up,
    act(gate, up), `grouped_matmul_ref` for down, unsorted -> [N, k, L]."""
    n, k = ids.shape
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=w_gu.shape[0]).astype(jnp.int32)
    rows = x.astype(jnp.float32)[order // k]
    h = moe.grouped_matmul_ref(rows, w_gu.astype(jnp.float32), sizes)
    f = w_gu.shape[2] // 2
    y = moe.grouped_matmul_ref(act(h[:, :f], h[:, f:]), w_out.astype(jnp.float32), sizes)
    return jnp.zeros_like(y).at[order].set(y).reshape(n, k, -1)


def _peer_ffn(x, ids, w_gu, w_out, cfg_gu, cfg_down):
    """The same experts on the peer: rows sorted by expert, `ragged_dot_mgpu` twice, the
    activation in XLA between them, outputs unsorted -> [N, k, L]."""
    n, k = ids.shape
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=w_gu.shape[0]).astype(jnp.int32)
    h = _mgpu(x[order // k], w_gu, sizes, cfg_gu)
    f = w_gu.shape[2] // 2
    a = ACT(h[:, :f].astype(jnp.float32), h[:, f:].astype(jnp.float32)).astype(x.dtype)
    y = _mgpu(a, w_out, sizes, cfg_down)
    return jnp.zeros_like(y).at[order].set(y).reshape(n, k, -1)


def moe_ffn(ctx):
    """moe_ffn: `ops.grouped_ffn` on T tokens routed top-k of E experts, checked against
    `ffn_ref`, vs the same experts on `ragged_dot_mgpu` (best of a short sweep)."""
    rng = np.random.default_rng(1)
    for case in ctx.cases():
        t, l, f, e, top_k = case
        x = jnp.asarray(rng.standard_normal((t, l)), jnp.bfloat16)
        w_gu = jnp.asarray(rng.standard_normal((e, l, 2 * f)) / l**0.5, jnp.bfloat16)
        w_out = jnp.asarray(rng.standard_normal((e, f, l)) / f**0.5, jnp.bfloat16)
        ids = jnp.asarray(np.argsort(rng.random((t, e)), axis=1)[:, :top_k], jnp.int32)
        args = (x, ids, w_gu, w_out)
        want = jax.jit(ffn_ref)(*args)
        tol = 2.0**-5 * float(jnp.max(jnp.abs(want))) + 1e-3
        active = len(np.unique(np.asarray(ids)))
        work = {"bytes": active * 3 * l * f * 2 + t * l * 2 * (1 + top_k), "flops": 2 * t * top_k * l * f * 3}

        def peer_ms():
            if not ctx.on_gpu or ragged_dot_mgpu is None:
                return None
            m = t * top_k
            cands = [
                (f"{a}/{b}", jax.jit(functools.partial(_peer_ffn, cfg_gu=a, cfg_down=b)))
                for a in mgpu_configs(m, 2 * f)[:4]
                for b in mgpu_configs(m, l)[:2]
            ]
            best = _best_peer(ctx, cands, args, want, tol)
            return best[0] if best else None

        ffn = lambda **kw: functools.partial(moe.grouped_ffn, act=ACT, **kw)
        fns = {
            "default": lambda *a: ops.grouped_ffn(*a, act=ACT),
            "triton": ffn(impl="triton"),
            "hopper": ffn(impl="hopper"),
        }
        for tiling in TILINGS:
            label = ",".join(map(str, tiling))
            fns[f"tiling_sweep:gu={label}"] = ffn(impl="triton", tiling=(tiling, None))
            fns[f"tiling_sweep:down={label}"] = ffn(impl="triton", tiling=(None, tiling))

        def one(variant):
            return _expert_row(ctx, case, fns[variant], args, want, tol, variant, peer_ms, work, active)

        if not ops.grouped_ffn_fits(x, w_gu, w_out, kernels="pallas"):
            yield ctx.error(case, "default", "ops.grouped_ffn does not tile these experts")
            continue
        yield ctx.attempt(case, "default", lambda: one("default"))
        for name in ctx.wanted():
            for variant in [v for v in fns if v == name or v.startswith(f"{name}:")]:
                if variant == "hopper" and not (moe_hopper.fits(l, 2 * f, True) or ctx.ci):
                    continue
                if ":" in variant and any(l % d or f % d for d in map(int, variant.split("=")[1].split(",")[:2])):
                    continue
                yield ctx.attempt(case, variant, lambda variant=variant: one(variant))
