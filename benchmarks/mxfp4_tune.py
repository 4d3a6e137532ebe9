"""Tilings of the MXFP4 expert GEMM (`pallas_kernels.moe` on `mxfp4.PackedMXFP4`).

    PYTHONPATH=$PWD python3 benchmarks/mxfp4_tune.py [--out DIR] [--rows 32,256]

A full-scale EP16 rank's gate ++ up experts (56 x [4096, 8192]: 0.94 GB packed, far past L2)
at decode row counts, uniform routing, against the bf16 Pallas kernel on the same weights
dequantized, in the same run.  Each row: one tiling (`moe.Tiling`; None: `moe.mx_tiling`), the
time (calls back to back, one sync) and the packed bytes read over it against torch's D2D copy
rate of the same run, and its largest difference from the bf16 kernel's output.  (Kernel
variants measured with this script at d349ac4 -- the weights as the MMA's A operand, scales
applied to the partial sums, register prefetch, no decode at all -- are in RESULTS.md.)
"""

from __future__ import annotations

import argparse
import functools
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import common
from pallas_kernels import moe, mxfp4

G, K, N = 56, 4096, 8192
TILINGS = [None, (128, 64, 4, 4), (128, 128, 4, 3), (256, 64, 4, 3), (256, 64, 8, 4), (256, 128, 8, 3)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--rows", default="4,32,256,1024")
    ap.add_argument("--tilings", default="", help="'bn,bk,warps,stages;...' in place of TILINGS (None first)")
    args = ap.parse_args()
    tilings = [None] + [tuple(int(v) for v in t.split(",")) for t in args.tilings.split(";") if t] if args.tilings \
        else TILINGS
    os.makedirs(args.out, exist_ok=True)
    rng = np.random.default_rng(0)
    copy_gbs = common.torch_copy_gbs() or common.copy_gbs()
    rows_out = [dict(section="ceilings", device=jax.devices()[0].device_kind, copy_gbs=copy_gbs)]
    print(rows_out[0], flush=True)
    values = jnp.asarray(rng.integers(0, 256, (G, K, N // 2), dtype=np.uint8))
    scales = jnp.asarray(np.ldexp(1.0, rng.integers(-10, -4, (G, K // 32, N))), jnp.float32).astype(jnp.float8_e8m0fnu)
    packed = mxfp4.PackedMXFP4(values, scales)
    w16 = mxfp4.dequantize(values, scales).astype(jnp.bfloat16)
    for rows in (int(r) for r in args.rows.split(",")):
        x = jnp.asarray(rng.standard_normal((rows, K), np.float32), jnp.bfloat16)
        sizes = jnp.asarray(np.bincount(rng.integers(0, G, rows), minlength=G), jnp.int32)
        used = int(np.count_nonzero(np.asarray(sizes)))
        bytes4, bytes16 = used * K * N * 4.25 / 8, used * K * N * 2
        want = np.asarray(moe.grouped_matmul(x, w16, sizes), np.float32)
        bf16_ms = common.time_pipelined(jax.jit(moe.grouped_matmul), x, w16, sizes)[0]
        print(dict(rows=rows, used=used, bf16_ms=bf16_ms, bf16_of_copy=bytes16 / (copy_gbs * 1e9) * 1e3 / bf16_ms),
              flush=True)
        for tiling in tilings:
            row = dict(section="mxfp4", rows=rows, experts_read=used,
                       tiling=str(tiling or moe.mx_tiling(rows, moe.layout_block_m(rows), False, K, N)), bf16_ms=bf16_ms)
            try:
                fn = jax.jit(functools.partial(moe.grouped_matmul, tiling=tiling))
                got = np.asarray(fn(x, packed, sizes), np.float32)
                row["max_err_of_max"] = float(np.abs(got - want).max() / np.abs(want).max())
                ms = common.time_pipelined(fn, x, packed, sizes)[0]
                row.update(mxfp4_ms=ms, speedup=bf16_ms / ms, of_copy=bytes4 / (copy_gbs * 1e9) * 1e3 / ms)
            except Exception as e:  # noqa: BLE001 - a tiling past shared memory: recorded, the sweep goes on
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            print(row, flush=True)
            rows_out.append(row)
            common.write_results(args.out, "mxfp4_tune", rows_out)


if __name__ == "__main__":
    main()
