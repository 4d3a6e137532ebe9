"""MXFP4 expert GEMM: the Hopper kernel (`pallas_kernels.moe_mxfp4_hopper`, weights decoded in
registers as wgmma's A operand) against the Triton MXFP4 kernel and the bf16 Pallas grouped GEMM
on the same weights dequantized, at decode and prefill row counts (issue 20).

Every side runs `iters` calls back to back and one sync (`common.time_pipelined`), including the
group-aligned layout around its kernel.  Ceiling: the torch `copy_` rate of the same run; "of
copy" = the active experts' weight bytes at their storage width plus the rows in and out, over
the time.  Each Hopper tiling's output is checked against the Triton MXFP4 kernel's (same
decoded weights; only fp32 accumulation order differs) before it is timed.

    python3 benchmarks/mxfp4_hopper.py [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import common
from benchmarks.quant_gemm import EXPERTS, _uniform_sizes, random_mxfp4
from pallas_kernels import moe, moe_mxfp4_hopper, mxfp4


def tilings(spec: str, quick: bool):
    """(block_m, block_n, block_k, steps, code_tile, warp_specialized, load4x, overlap) to try: spec
    'bm,bn,bk,st,ct,ws[,l4[,ov]];...', or a sweep (block_n: each consumer warpgroup's columns)."""
    if spec:
        return [(tuple(int(v) for v in t.split(",")) + (0, 0))[:8] for t in spec.split(";") if t]
    if quick:
        return [(16, 128, 128, 4, 64, 0, 0, 0), (16, 64, 128, 4, 64, 1, 1, 0)]
    return [t for t in itertools.product((16,), (64, 128), (128, 256), (4,), (64, 128), (0, 1), (0, 1), (0, 1))
            if t[2] % t[4] == 0 and not (t[5] and t[7])]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rows", default="4,32,128,256,1024")
    ap.add_argument("--cases", default="full EP16 rank gate+up,small gate+up")
    ap.add_argument("--decodes", default=",".join(moe_mxfp4_hopper.DECODES))
    ap.add_argument("--probe-upcast", action="store_true",
                    help="also time the best tiling with the codes' integers as the decode (not MXFP4: the "
                         "kernel's frame without the e2m1 decode; `moe_mxfp4_hopper.PROBE_DECODE`)")
    ap.add_argument("--tilings", default="",
                    help="Hopper tilings 'block_m,block_n,block_k,steps,code_tile,warp_specialized[,load4x[,overlap]];...'")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    copy_torch = common.torch_copy_gbs()
    copy = copy_torch or common.copy_gbs()
    rows_out = [dict(section="ceilings", device=jax.devices()[0].device_kind, copy_gbs=copy, torch_copy_gbs=copy_torch)]
    common.write_results(args.out, "mxfp4_hopper", rows_out)
    for name in args.cases.split(","):
        g, k, n = EXPERTS[name]
        q = random_mxfp4(rng, g, k, n)
        packed = mxfp4.PackedMXFP4(q.values, q.scales)
        hop = {d: jax.jit(moe_mxfp4_hopper.to_hopper, static_argnums=1)(packed, d) for d in moe_mxfp4_hopper.DECODES}
        # one fused program: the fp32 weights (7 GiB at the full-scale rank) never exist, which on
        # an 80 GB H100 beside the torch ceiling's buffers ran out of memory (session 30)
        w16 = jax.jit(lambda v, s: mxfp4.dequantize(v, s).astype(jnp.bfloat16))(q.values, q.scales)
        del q
        for rows in (int(r) for r in args.rows.split(",")):
            x = jnp.asarray(rng.standard_normal((rows, k), np.float32), jnp.bfloat16)
            sizes = _uniform_sizes(rng, rows, g)
            used = int(np.count_nonzero(np.asarray(sizes)))
            triton = jax.jit(moe.grouped_matmul)
            want = np.asarray(triton(x, packed, sizes), np.float32)
            scale = float(np.abs(want).max()) or 1.0
            row = dict(section="experts", case=name, rows=rows, experts_read=used,
                       bf16_ms=common.time_pipelined(jax.jit(moe.grouped_matmul), x, w16, sizes)[0],
                       triton_mxfp4_ms=common.time_pipelined(triton, x, packed, sizes)[0])
            by_tiling, errors = {}, {}
            for (bm, bn, bk, st, ct, ws, l4, ov), dec in itertools.product(tilings(args.tilings, args.quick),
                                                                         args.decodes.split(",")):
                if n % (bn * (1 + ws)) or k % bk:
                    continue
                fn = jax.jit(functools.partial(moe_mxfp4_hopper.grouped_matmul, block_m=bm, block_n=bn, block_k=bk,
                                               steps=st, code_tile=ct, decode=dec, warp_specialized=bool(ws),
                                               load4x=bool(l4), overlap=bool(ov)))
                key = f"{dec}:{bm},{bn},{bk},{st},{ct},{ws},{l4},{ov}"
                try:
                    got = np.asarray(fn(x, hop[dec], sizes), np.float32)
                except Exception as e:  # noqa: BLE001 - a tiling that does not fit (shared memory) is skipped
                    errors[key] = f"{type(e).__name__}: {str(e)[:120]}"
                    continue
                err = float(np.abs(got - want).max()) / scale
                if not err < 2e-2:  # bf16 outputs, fp32 accumulation in another order: ~1e-2 of the max at most
                    errors[key] = f"wrong: max error {err:.3g} of the output's max"
                    continue
                by_tiling[key] = common.time_pipelined(fn, x, hop[dec], sizes)[0]
            best = min(by_tiling, key=by_tiling.get) if by_tiling else None
            if best and args.probe_upcast:  # unchecked: its values are not MXFP4's
                bm, bn, bk, st, ct, ws, l4, ov = (int(v) for v in best.split(":")[1].split(","))
                probe = jax.jit(functools.partial(
                    moe_mxfp4_hopper.grouped_matmul, block_m=bm, block_n=bn, block_k=bk, steps=st, code_tile=ct,
                    decode=moe_mxfp4_hopper.PROBE_DECODE, warp_specialized=bool(ws), load4x=bool(l4),
                    overlap=bool(ov)))
                row["upcast_probe_ms"] = common.time_pipelined(probe, x, hop["arith"], sizes)[0]
            bytes16 = used * k * n * 2 + 2 * rows * (k + n)
            bytes4 = used * k * n * (4.25 / 8) + 2 * rows * (k + n)
            row.update(hopper_ms=by_tiling.get(best), hopper_tiling=best,
                       hopper_vs_bf16=row["bf16_ms"] / by_tiling[best] if best else None,
                       triton_vs_bf16=row["bf16_ms"] / row["triton_mxfp4_ms"],
                       bf16_of_copy=bytes16 / (copy * 1e9) * 1e3 / row["bf16_ms"],
                       hopper_of_copy=bytes4 / (copy * 1e9) * 1e3 / by_tiling[best] if best else None,
                       triton_of_copy=bytes4 / (copy * 1e9) * 1e3 / row["triton_mxfp4_ms"],
                       hopper_ms_by_tiling=by_tiling, hopper_errors=errors)
            print(row, flush=True)
            rows_out.append(row)
            common.write_results(args.out, "mxfp4_hopper", rows_out)


if __name__ == "__main__":
    main()
