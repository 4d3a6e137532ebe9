"""A few launches of the kernels whose gap to their ceiling is not yet explained, for Nsight
Compute to read their hardware counters (achieved DRAM throughput, stall reasons, occupancy,
registers).  Issue 22's KDA decode (ours vs fla at B256) and issue 20's MXFP4 expert GEMM (the
Hopper kernels vs the bf16 Pallas grouped GEMM at the full-scale rank, 32 rows); KDA prefill
(ours with a state every 128 tokens vs fla's `chunk_kda`, B1 T8192 H32).

Inputs are built on the host and put on the device, so the first kernels launched are the ones
probed.  On the GPU machine (Firecracker runtime; ncu leaves the clocks alone)::

    ncu --clock-control none --kernel-name regex:'kda|recurrent|mxfp4|moe_grouped|_kernel' \
        --launch-count 12 --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section WarpStateStats --section Occupancy --section LaunchStats \
        python3 benchmarks/ncu_probe.py --what kda,mxfp4

With --time (not under ncu) it prints each side's time (back to back, one sync).
"""

from __future__ import annotations

import argparse
import functools
import json
import os

# ncu saves and restores every device allocation around each replayed kernel: without this, JAX's
# 75% preallocation made each kernel's replay take most of a minute (session 31)
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import common


def probe_kda(timed: bool, b: int = 256, h: int = 32, d: int = 128, reps: int = 2):
    from pallas_kernels import kda

    rng = np.random.default_rng(0)
    put = lambda a, dt: jax.device_put(np.asarray(a, np.float32)).astype(dt)
    q, k = (put(rng.standard_normal((b, 1, h, d)) / np.sqrt(d), jnp.bfloat16) for _ in range(2))
    v = put(rng.standard_normal((b, 1, h, d)), jnp.bfloat16)
    g = put(-np.abs(rng.standard_normal((b, 1, h, d))) * 0.1, jnp.bfloat16)
    beta = put(rng.uniform(0, 1, (b, 1, h)), jnp.bfloat16)
    pool = put(rng.standard_normal((2 * b, h, d, d)), jnp.float32)
    slots = jnp.asarray(rng.permutation(2 * b)[:b], jnp.int32)
    n_acc = jnp.ones((b,), jnp.int32)
    step = jax.jit(functools.partial(kda._fused_recurrent_core, scale=d ** -0.5, block_v=64, interpret=False,
                                     num_warps=8), donate_argnums=5)  # the default tiling
    for _ in range(reps):
        _, pool = step(q, k, v, g, beta, pool, slots, n_acc)
    if timed:
        ms = common.time_pipelined(lambda p: step(q, k, v, g, beta, p, slots, n_acc)[1], pool)[0]
        print(f"kda decode B{b} H{h} D{d}: ours {ms:.4f} ms", flush=True)
    try:
        import torch
        from fla.ops.kda import fused_recurrent_kda
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    except ImportError:
        return
    tt = lambda x: torch.from_numpy(np.asarray(x.astype(jnp.float32))).cuda().to(
        torch.float32 if x.dtype == jnp.float32 else torch.bfloat16)
    tq, tk, tv, tg, tb = (tt(x) for x in (q, k, v, g, beta))
    h0 = torch.randn(b, h, d, d, device="cuda", dtype=torch.float32)
    for _ in range(reps):  # fla's own call: a fresh final state
        fused_recurrent_kda(tq, tk, tv, tg, tb, initial_state=h0, output_final_state=True)
    pool_t = torch.randn(2 * b, h, d, d, device="cuda", dtype=torch.float32)
    slots_t, out = tt(slots.astype(jnp.float32)).to(torch.int32), torch.empty_like(tv)
    for _ in range(reps):  # as vLLM calls it: the pool by slot, in place (our work)
        fused_recurrent_kda_fwd(tq, tk, tv, tg, tb, initial_state=pool_t, inplace_final_state=True,
                                ssm_state_indices=slots_t, out=out)
    torch.cuda.synchronize()


def probe_mxfp4(timed: bool, rows: int = 32, reps: int = 2):
    from benchmarks.quant_gemm import EXPERTS, _uniform_sizes, random_mxfp4
    from pallas_kernels import moe, moe_mxfp4_hopper, mxfp4

    rng = np.random.default_rng(0)
    g, k, n = EXPERTS["full EP16 rank gate+up"]
    q = random_mxfp4(rng, g, k, n)
    packed = mxfp4.PackedMXFP4(q.values, q.scales)
    w16 = jax.jit(lambda v, s: mxfp4.dequantize(v, s).astype(jnp.bfloat16))(q.values, q.scales)
    hop = jax.jit(moe_mxfp4_hopper.to_hopper)(packed)  # the default decode's layout
    x = jnp.asarray(rng.standard_normal((rows, k), np.float32), jnp.bfloat16)
    sizes = _uniform_sizes(rng, rows, g)
    sides = {"bf16": (jax.jit(moe.grouped_matmul), w16), "triton_mxfp4": (jax.jit(moe.grouped_matmul), packed)}
    for ws, bn in ((0, 128), (1, 64)):  # gmm_padded's default tiling and decode (`DEFAULT_DECODE`)
        sides[f"hopper_ws{ws}"] = (jax.jit(functools.partial(
            moe_mxfp4_hopper.grouped_matmul, block_m=16, block_n=bn, warp_specialized=bool(ws))), hop)
    for name, (fn, w) in sides.items():
        for _ in range(reps):
            jax.block_until_ready(fn(x, w, sizes))
        if timed:
            print(f"mxfp4 rows {rows}: {name} {common.time_pipelined(fn, x, w, sizes)[0]:.4f} ms", flush=True)


def probe_kda_prefill(timed: bool, tuning=None, b: int = 1, t: int = 8192, h: int = 32, d: int = 128):
    """One call of ours (a state every 128 tokens) and one of fla's `chunk_kda`: each kernel of
    both (ours: prepare / intra, solve, state passes) once."""
    from benchmarks.kda import inputs
    from pallas_kernels import kda

    q, k, v, g, beta = inputs(jax.random.PRNGKey(0), b, t, h, d, jnp.bfloat16)
    ours = jax.jit(functools.partial(kda.chunk_kda, checkpoint_positions=list(range(128, t + 1, 128)),
                                     tuning=tuning))
    jax.block_until_ready(ours(q, k, v, g, beta))
    if timed:
        print(f"kda prefill B{b} T{t} H{h}: ours {common.time_pipelined(ours, q, k, v, g, beta)[0]:.4f} ms")
    try:
        import torch
        from fla.ops.kda import chunk_kda
    except ImportError:
        return
    tt = lambda x: torch.from_numpy(np.asarray(x.astype(jnp.float32))).cuda()
    tq, tk, tv, tb = (tt(x).to(torch.bfloat16) for x in (q, k, v, beta))
    chunk_kda(tq, tk, tv, tt(g), tb, output_final_state=True)
    torch.cuda.synchronize()


def probe_mla_decode(timed: bool, b: int = 64, h: int = 128, ctx: int = 8192, r: int = 512, p: int = 64,
                     page: int = 128, reps: int = 2, **decode_kw):
    """The Hopper MLA decode at issue 22's compute-bound row (H128 B64 ctx8k, pages scattered as
    `mla.py` lays them): where its time goes against the 65%-of-matmul target (DRAM against L2
    traffic: the two 64-row tiles of a sequence read the same keys; tensor-core issue; stalls).
    decode_kw: `mla_decode_hopper`'s options (cluster, block_kv, steps)."""
    from pallas_kernels import mla_decode_hopper

    key = jax.random.PRNGKey(0)
    n = ctx // page
    pages = jax.random.normal(key, (b * n + 8, page, r + p), jnp.bfloat16)
    table = jax.random.permutation(key, b * n + 8)[:b * n].reshape(b, n).astype(jnp.int32)
    lens = jnp.full((b,), ctx, jnp.int32)
    ql = jax.random.normal(key, (b, 1, h, r), jnp.bfloat16)
    qp = jax.random.normal(key, (b, 1, h, p), jnp.bfloat16)
    fn = jax.jit(lambda a, c, pg, t, n_: mla_decode_hopper.mla_decode_hopper(a, c, pg, t, n_, scale=0.1,
                                                                                      **decode_kw)[0])
    for _ in range(reps):
        jax.block_until_ready(fn(ql, qp, pages, table, lens))
    try:  # under `ncu --profile-from-start off`: only this call's kernels (inputs and warm-up left out)
        import torch
        cudart = torch.cuda.cudart()
    except (ImportError, RuntimeError):
        cudart = None
    if cudart is not None:
        cudart.cudaProfilerStart()
    jax.block_until_ready(fn(ql, qp, pages, table, lens))
    if cudart is not None:
        cudart.cudaProfilerStop()
    if timed:
        ms = common.time_pipelined(fn, ql, qp, pages, table, lens)[0]
        print(f"mla decode H{h} B{b} ctx{ctx}: {ms:.4f} ms, {2 * b * h * ctx * (r + p + r) / ms / 1e9:.0f} TFLOP/s")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--what", default="kda,mxfp4")
    ap.add_argument("--time", action="store_true", help="also time each side (not under ncu: it would profile those)")
    ap.add_argument("--tuning", default="", help='kda.TUNING overrides for kda_prefill, JSON: {"intra": [16, 1]}')
    ap.add_argument("--decode-kw", default="", help='mla_decode_hopper options for mla_decode, JSON: {"cluster": 2}')
    args = ap.parse_args()
    for what in args.what.split(","):
        if what == "kda_prefill":
            probe_kda_prefill(args.time, tuple(json.loads(args.tuning).items()) if args.tuning else None)
        elif what == "mla_decode":
            probe_mla_decode(args.time, **(json.loads(args.decode_kw) if args.decode_kw else {}))
        else:
            {"kda": probe_kda, "mxfp4": probe_mxfp4}[what](args.time)


if __name__ == "__main__":
    main()
