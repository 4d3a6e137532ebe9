"""The decode step's dense projections at a few rows: XLA's dot vs `pallas_kernels.skinny`.

    PYTHONPATH=$PWD python3 benchmarks/skinny_tune.py [--out DIR] [--rows 8,32] [--quick]

A decode step of `small` runs each projection once per layer over that layer's own weights,
so the weights come from HBM.  Each case runs `layers` of one shape back to back in one jitted
program, x fed forward so the layers stay serial (the same feed for both sides), and reports ms
per layer and the weights' bytes over that time against torch's D2D copy rate of the same run.
Every tiling is checked against XLA's output first (bf16 output: one rounding apart).
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
from pallas_kernels import skinny

# (name, K, N, layers): `small`'s decode projections (serving layout, `kimik3.fused`)
SHAPES = [("kda in (N padded 4876 -> 4928)", 1536, 4928, 12), ("kda out", 1536, 1536, 12),
          ("moe in", 1536, 3840, 15), ("moe latent up", 768, 1536, 15), ("shared out", 1536, 1536, 15)]
CANDIDATES = [None, (32, 256, 1, 4, 4), (32, 128, 2, 4, 4), (64, 128, 2, 4, 4), (64, 128, 4, 4, 3),
              (128, 128, 2, 4, 3)]


def _feed(x, y):
    return x + y[:, :1] * 1e-3  # serial layers; the same elementwise op on both sides


@functools.partial(jax.jit, static_argnames=("tiling",))
def _ours(x, ws, *, tiling):
    for w in ws:
        x = _feed(x, skinny.matmul(x, w, tiling=tiling))
    return x


@jax.jit
def _xla(x, ws):
    for w in ws:
        x = _feed(x, jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype))
    return x


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--rows", default="8,32")
    ap.add_argument("--quick", action="store_true", help="the default tiling only, one shape")
    args = ap.parse_args()
    torch_gbs = common.torch_copy_gbs()
    gbs = torch_gbs or common.copy_gbs()
    rows = [dict(section="roofline", case=jax.devices()[0].device_kind, copy_gbs=gbs, torch_copy_gbs=torch_gbs)]
    shapes = SHAPES[:1] if args.quick else SHAPES
    cands = CANDIDATES[:1] if args.quick else CANDIDATES
    for name, k, n, layers in shapes:
        keys = jax.random.split(jax.random.PRNGKey(k * n), layers)
        ws = [(jax.random.normal(kk, (k, n), jnp.float32) / k ** 0.5).astype(jnp.bfloat16) for kk in keys]
        nbytes = layers * k * n * 2
        for m in (int(r) for r in args.rows.split(",")):
            x = jnp.asarray(np.random.default_rng(m).standard_normal((m, k)), jnp.bfloat16)
            want = np.asarray(_xla(x, ws), np.float32)
            ms = common.time_pipelined(lambda: _xla(x, ws), iters=30)[0]
            rows.append(dict(section="skinny", shape=name, M=m, K=k, N=n, layers=layers, impl="xla dot",
                             tiling="-", ms_per_layer=ms / layers, of_copy_rate=nbytes / (ms * 1e-3) / 1e9 / gbs))
            print(rows[-1], flush=True)
            for t in cands:
                row = dict(section="skinny", shape=name, M=m, K=k, N=n, layers=layers, impl="pallas skinny",
                           tiling=str(t or skinny.default_tiling(k, n)))
                try:
                    got = np.asarray(_ours(x, ws, tiling=t), np.float32)
                    row["max_err"] = float(np.max(np.abs(got - want)))
                    ms = common.time_pipelined(lambda: _ours(x, ws, tiling=t), iters=30)[0]
                    row.update(ms_per_layer=ms / layers, of_copy_rate=nbytes / (ms * 1e-3) / 1e9 / gbs)
                except Exception as e:  # noqa: BLE001 - a tiling the compiler refuses is a row, not a stop
                    row["error"] = str(e)[:160]
                rows.append(row)
                print(row, flush=True)
                common.write_results(args.out, "skinny_tune", rows)
    print(common.write_results(args.out, "skinny_tune", rows))


if __name__ == "__main__":
    main()
