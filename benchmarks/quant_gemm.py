"""Quantized GEMMs: projections on fp8 / mxfp8 weights (`ops.linear` on a `QTensor`) against bf16,
and routed experts on MXFP4 weights (the grouped GEMM and a decode step's grouped FFN) against
the same experts dequantized to bf16.

Registered in `benchmarks.registry` (quant_linear, mxfp4_experts, mxfp4_ffn).  Weights are drawn
as well-formed codes and scales (no quantization pass: a full-scale rank's experts would take
minutes to quantize).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import common
from benchmarks.moe import ffn_ref
from kimik3 import ops
from kimik3.quant import formats
from pallas_kernels import moe, moe_mxfp4_hopper, mxfp4

TOL = 2e-2
# mxfp4_experts' sweep variants: Triton MXFP4 tilings (block_n, block_k, num_warps, num_stages)
MX_TILINGS = [(128, 64, 4, 4), (128, 128, 4, 3), (256, 64, 4, 3), (256, 64, 8, 4), (256, 128, 8, 3)]
# and Hopper MXFP4 tilings (block_m, block_n, block_k, steps, code_tile, warp_specialized, load4x, overlap)
HOPPER_MX_TILINGS = [
    (16, 128, 256, 4, 64, 0, 0, 0),
    (16, 64, 256, 4, 128, 1, 0, 0),
    (16, 128, 128, 4, 64, 0, 1, 0),
    (16, 64, 128, 4, 64, 1, 1, 0),
    (16, 128, 256, 4, 128, 0, 0, 1),
]


def random_qtensor(rng, fmt: str, k: int, n: int) -> formats.QTensor:
    """A well-formed fp8 / mxfp8 [K, N] weight: random e4m3 values and scales."""
    values = jnp.asarray(rng.standard_normal((k, n), np.float32) * 64).clip(-448, 448).astype(jnp.float8_e4m3fn)
    if fmt == "fp8":
        scales = jnp.asarray(rng.uniform(1e-4, 1e-3, (-(-k // 128), -(-n // 128))), jnp.float32)
    else:
        scales = jnp.asarray(np.ldexp(1.0, rng.integers(-14, -8, (k // 32, n))), jnp.float32).astype(jnp.float8_e8m0fnu)
    return formats.check(formats.QTensor(values, scales, fmt, (k, n)))


def random_mxfp4(rng, g: int, k: int, n: int) -> formats.QTensor:
    """Well-formed MXFP4 experts [G, K, N]: random e2m1 code pairs and e8m0 scales."""
    values = jnp.asarray(rng.integers(0, 256, (g, k, n // 2), dtype=np.uint8))
    scales = jnp.asarray(np.ldexp(1.0, rng.integers(-10, -4, (g, k // 32, n))), jnp.float32).astype(jnp.float8_e8m0fnu)
    return formats.QTensor(values, scales, "mxfp4", (g, k, n))


@jax.jit
def _dequantized_bf16(values, scales):  # one program: a rank's fp32 weights never exist whole
    return mxfp4.dequantize(values, scales).astype(jnp.bfloat16)


def _uniform_sizes(rng, rows: int, g: int):
    return jnp.asarray(np.bincount(rng.integers(0, g, rows), minlength=g), jnp.int32)


def quant_linear(ctx):
    """quant_linear: `ops.linear(x, w)` on an fp8 / mxfp8 `QTensor`, checked against its reference
    path, vs `x @ w` in bf16 on the dequantized weights."""
    rng = np.random.default_rng(0)
    for case in ctx.cases():
        m, k, n, fmt = case
        q = random_qtensor(rng, fmt, k, n)
        w16 = formats.dequantize(q).astype(jnp.bfloat16)
        x = jnp.asarray(rng.standard_normal((m, k), np.float32), jnp.bfloat16)
        fn = jax.jit(lambda x, q: ops.linear(x, q, kernels="pallas"))
        want = jax.jit(lambda x, q: ops.linear(x, q, kernels="reference"))(x, q)
        peer = jax.jit(lambda x, w: x @ w)
        work = {"bytes": k * n + 2 * m * (k + n), "flops": 2 * m * k * n}
        chk = lambda: common.check(fn(x, q).astype(jnp.float32), want.astype(jnp.float32), TOL)
        yield ctx.attempt(
            case,
            "default",
            lambda: ctx.row(case, chk(), lambda: ctx.time(fn, x, q), peer_ms=lambda: ctx.time(peer, x, w16), work=work),
        )


def mxfp4_experts(ctx):
    """mxfp4_experts: `ops.grouped_matmul` on MXFP4 experts (moved to the Hopper layout where
    `ops.moe_mxfp4_impl` names it), checked against `grouped_matmul_ref` on the dequantized
    weights, vs `ops.grouped_matmul` on those bf16 weights."""
    rng = np.random.default_rng(1)
    interpret = not ctx.on_gpu
    for case in ctx.cases():
        rows, g, k, n = case
        q = random_mxfp4(rng, g, k, n)
        packed = mxfp4.PackedMXFP4(q.values, q.scales)
        w16 = _dequantized_bf16(q.values, q.scales)
        served = ops.hopper_mxfp4_experts({"w": q})["w"]
        x = jnp.asarray(rng.standard_normal((rows, k), np.float32), jnp.bfloat16)
        sizes = _uniform_sizes(rng, rows, g)
        used = int(np.count_nonzero(np.asarray(sizes)))
        want = jax.jit(moe.grouped_matmul_ref)(x, w16, sizes)
        work = {"bytes": used * k * n * 4.25 / 8 + 2 * rows * (k + n)}
        bf16 = jax.jit(lambda x, w, s: ops.grouped_matmul(x, w, s, kernels="pallas"))
        fns = {
            "default": (lambda x, w, s: ops.grouped_matmul(x, w, s, kernels="pallas"), served),
            "triton": (moe.grouped_matmul, packed),
            "hopper": (
                functools.partial(moe_mxfp4_hopper.grouped_matmul, interpret=interpret),
                moe_mxfp4_hopper.DEFAULT_DECODE,
            ),
        }
        for t in MX_TILINGS:
            if n % t[0] == 0 and k % t[1] == 0:
                fns["triton_sweep:" + ",".join(map(str, t))] = (functools.partial(moe.grouped_matmul, tiling=t), packed)
        for bm, bn, bk, st, ct, ws, l4, ov in HOPPER_MX_TILINGS:
            if n % (bn * (1 + ws)) == 0 and k % bk == 0:
                decode = "lut" if l4 else moe_mxfp4_hopper.DEFAULT_DECODE  # load4x shuffles the codes itself
                kw = dict(
                    block_m=bm,
                    block_n=bn,
                    block_k=bk,
                    steps=st,
                    code_tile=ct,
                    warp_specialized=bool(ws),
                    load4x=bool(l4),
                    overlap=bool(ov),
                    decode=decode,
                    interpret=interpret,
                )
                fns[f"hopper_sweep:{bm},{bn},{bk},{st},{ct},{ws},{l4},{ov}"] = (
                    functools.partial(moe_mxfp4_hopper.grouped_matmul, **kw),
                    decode,
                )

        def one(variant):
            kernel, w = fns[variant]
            if isinstance(w, str):  # a Hopper kernel: the codes in its layout for that decode
                w = jax.jit(moe_mxfp4_hopper.to_hopper, static_argnums=1)(packed, w)
            fn = jax.jit(kernel)
            chk = common.check(fn(x, w, sizes).astype(jnp.float32), want.astype(jnp.float32), TOL)
            return ctx.row(
                case,
                chk,
                lambda: ctx.time(fn, x, w, sizes),
                variant=variant,
                peer_ms=lambda: ctx.time(bf16, x, w16, sizes),
                work=work,
                extra={"experts_read": used, "kernel": type(w).__name__},
            )

        yield ctx.attempt(case, "default", lambda: one("default"))
        for name in ctx.wanted():
            for variant in [v for v in fns if v == name or v.startswith(f"{name}:")]:
                if variant == "hopper" and (k % 256 or n % 128):  # the Hopper kernel's default tiles
                    continue
                yield ctx.attempt(case, variant, lambda variant=variant: one(variant))


def _silu_glu(gate, up):
    return jax.nn.silu(gate) * up


def mxfp4_ffn(ctx):
    """mxfp4_ffn: `ops.grouped_ffn` on MXFP4 experts (gate ++ up [E, L, 2F], down [E, F, L]), T
    tokens each routed to top-k distinct experts, checked against the fp32 FFN on the dequantized
    weights, vs `ops.grouped_ffn` on those bf16 weights."""
    rng = np.random.default_rng(2)
    for case in ctx.cases():
        t, e, l, f, top_k = case
        q_gu, q_out = random_mxfp4(rng, e, l, 2 * f), random_mxfp4(rng, e, f, l)
        dense = [_dequantized_bf16(q.values, q.scales) for q in (q_gu, q_out)]
        served = ops.hopper_mxfp4_experts({"gu": q_gu, "out": q_out})
        x = jnp.asarray(rng.standard_normal((t, l), np.float32), jnp.bfloat16)
        ids = jnp.asarray(np.stack([rng.permutation(e)[:top_k] for _ in range(t)]), jnp.int32)
        used = len(np.unique(np.asarray(ids)))
        if not ops.grouped_ffn_fits(x, served["gu"], served["out"], kernels="pallas"):
            yield ctx.error(case, "default", "ops.grouped_ffn does not tile these experts")
            continue
        fn = jax.jit(lambda x, ids, a, b: ops.grouped_ffn(x, ids, a, b, act=_silu_glu))
        want = jax.jit(functools.partial(ffn_ref, act=_silu_glu))(x, ids, *dense)
        work = {"bytes": used * 3 * l * f * 4.25 / 8 + t * l * 2 * (1 + top_k)}
        chk = lambda: common.check(fn(x, ids, served["gu"], served["out"]).astype(jnp.float32), want, 3e-2)
        yield ctx.attempt(
            case,
            "default",
            lambda: ctx.row(
                case,
                chk(),
                lambda: ctx.time(fn, x, ids, served["gu"], served["out"]),
                peer_ms=lambda: ctx.time(fn, x, ids, *dense),
                work=work,
                extra={"experts_read": used},
            ),
        )
