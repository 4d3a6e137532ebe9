"""The decode step's dense projections: `pallas_kernels.decode_matmul` vs XLA's GEMM, on the GPU.

    PYTHONPATH=$PWD python3 benchmarks/decode_matmul.py [--out DIR] [--rows 8,32] [--quick]

Each shape is one kind of `small`'s projections at its count per decode step, every one over
its own weights (as the step reads them: from HBM, not L2), chained in one program and timed
back to back.  Rows: XLA's `jnp.dot` (the step's GEMM today) and our kernel at each tiling
(`Tiling`: block_n, block_k, splits, num_warps, num_stages), with the weight bytes over the
time against torch's D2D copy rate of the same run.  Each of ours is checked against XLA's
output first (bf16 outputs of fp32 sums: a few bf16 ulps).
"""

from __future__ import annotations

import argparse
import functools
import os
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import common
from pallas_kernels import decode_matmul as dm

# (name, K, N, per step): small's fused projections (kimik3.fused)
SHAPES = [("kda in (q,k,v,gates)", 1536, 4876, 12), ("kda out", 1536, 1536, 12),
          ("moe in (latent, shared gate/up)", 1536, 3840, 15), ("moe shared out", 1536, 1536, 15),
          ("moe latent up", 768, 1536, 15), ("lm head", 1536, 32768, 1)]
TILINGS = [None, (32, 128, 1, 4, 4), (32, 128, 2, 4, 4), (64, 128, 1, 4, 4), (64, 128, 2, 4, 3),
           (16, 128, 1, 4, 4), (32, 64, 2, 4, 4), (32, 256, 1, 4, 3), (64, 64, 4, 4, 4), (128, 64, 2, 4, 3)]


@functools.partial(jax.jit, static_argnames=("tiling", "xla"))
def _chain(x, ws, *, tiling, xla):
    """Each weight's product in turn, the next input depending on the last (serial, as layers are)."""
    total = jnp.zeros((), jnp.float32)
    for w in ws:
        y = jnp.dot(x, w) if xla else dm.decode_matmul(x, w, tiling=tiling)
        total = total + y[0, 0].astype(jnp.float32)
        x = x + (total * 0).astype(x.dtype)  # a data dependence, no change
    return total, y


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--rows", default="8,32")
    ap.add_argument("--quick", action="store_true", help="one small shape, two tilings (a smoke run)")
    ap.add_argument("--budget-s", type=float, default=1e9, help="stop starting shapes after this many seconds")
    args = ap.parse_args()
    t_start = time.monotonic()
    torch_gbs = common.torch_copy_gbs()
    gbs = torch_gbs or common.copy_gbs()
    rows = [dict(section="roofline", case=jax.devices()[0].device_kind, copy_gbs=gbs, torch_copy_gbs=torch_gbs)]
    shapes = [("quick", 256, 300, 2)] if args.quick else SHAPES
    tilings = TILINGS[:2] if args.quick else TILINGS
    key = jax.random.PRNGKey(0)
    for name, k, n, count in shapes:
        if time.monotonic() - t_start > args.budget_s:
            break
        ws = [(jax.random.normal(kk, (k, n), jnp.float32) / k ** 0.5).astype(jnp.bfloat16)
              for kk in jax.random.split(key, count)]
        for m in [int(r) for r in args.rows.split(",")]:
            x = jax.random.normal(jax.random.PRNGKey(m), (m, k), jnp.float32).astype(jnp.bfloat16)
            want = np.asarray(_chain(x, ws, tiling=None, xla=True)[1], np.float32)
            for t in ["xla"] + tilings:
                row = dict(section="projection", case=name, rows=m, k=k, n=n, per_step=count,
                           impl="xla" if t == "xla" else f"ours {t or 'default'}")
                fn = functools.partial(_chain, x, ws, tiling=None if t == "xla" else t, xla=t == "xla")
                try:
                    got = np.asarray(fn()[1], np.float32)
                    row["max_err"] = float(np.max(np.abs(got - want)))
                    ms = common.time_pipelined(fn, iters=20)[0]
                    row.update(us_each=1e3 * ms / count, of_copy_rate=count * k * n * 2 / (ms * 1e-3) / 1e9 / gbs)
                except Exception as e:  # noqa: BLE001 - a tiling the compiler refuses is a row, not a stop
                    row["error"] = str(e)[:160]
                rows.append(row)
                print(row, flush=True)
            common.write_results(args.out, "decode_matmul", rows)
    print(common.write_results(args.out, "decode_matmul", rows))


if __name__ == "__main__":
    main()
