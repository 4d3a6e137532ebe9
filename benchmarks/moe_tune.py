"""Tilings of the decode step's routed-expert GEMMs (`pallas_kernels.moe.grouped_ffn`) on the GPU.

    PYTHONPATH=$PWD python3 benchmarks/moe_tune.py [--out DIR] [--layers 15] [--quick]

A decode step runs `grouped_ffn` once per MoE layer, each over its own weights (so the
active experts' weights come from HBM, not L2).  This times `--layers` of them in one
program, back to back, for the `small` config's experts (E 32, L 768, F 768, top-4) at the
engine's decode buckets: B8 holding one request (its seven padding rows share one token, so
one set of experts: ~8 experts read) and B32 of distinct requests (~32 experts).  Each row is
one (gate/up tiling, down tiling) pair (`pallas_kernels.moe.Tiling`: block_n, block_k,
num_warps, num_stages; "default" is `grouped_ffn`'s own choice: `few_rows_tiling` at B8), with
the active experts' weight bytes over the time against torch's D2D copy rate of the same run.  Every tiling is checked
against the default's output first.
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
from pallas_kernels import moe

E, L, F, K = 32, 768, 768, 4
# (block_n, block_k, num_warps, num_stages); None: the default
CANDIDATES = [None, (64, 64, 4, 3), (32, 64, 4, 3), (32, 128, 4, 3), (64, 128, 4, 3), (64, 64, 4, 4),
              (32, 64, 2, 4), (16, 128, 2, 3), (32, 256, 4, 2), (128, 128, 8, 3), (128, 128, 4, 3),
              (64, 256, 4, 3), (32, 256, 4, 4), (16, 256, 4, 4)]


def _act(gate, up):
    return (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(gate.dtype)


def _case(rng, bucket: int, real: int, idle_to_none: bool = False):
    """x [bucket, L] bf16 and ids [bucket, K]: `real` distinct rows, the rest one shared padding
    row, routed to experts 0..K-1 or (idle_to_none, as the engine's decode step does since the
    idle rows' valid is 0) to no expert (id E)."""
    pad = [np.full(K, E) if idle_to_none else np.arange(K)] * (bucket - real)
    ids = np.stack([rng.choice(E, K, replace=False) for _ in range(real)] + pad)
    x = rng.standard_normal((bucket, L)).astype(np.float32)
    x[real:] = x[-1]
    return jnp.asarray(x, jnp.bfloat16), jnp.asarray(ids, jnp.int32), len(set(ids.reshape(-1).tolist()) - {E})


def _weights(key, layers: int):
    """Per layer its own arrays (a slice of one stacked array would be copied before each kernel)."""
    out = []
    for k in jax.random.split(key, layers):
        k1, k2 = jax.random.split(k)
        out.append(((jax.random.normal(k1, (E, L, 2 * F), jnp.float32) / L ** 0.5).astype(jnp.bfloat16),
                    (jax.random.normal(k2, (E, F, L), jnp.float32) / F ** 0.5).astype(jnp.bfloat16)))
    return out


@functools.partial(jax.jit, static_argnames=("tiling",))
def _layers(x, ids, weights, *, tiling):
    """grouped_ffn over each layer's weights in turn (x fed forward: the layers stay serial),
    unrolled as the decode step is."""
    for w_gateup, w_out in weights:
        y = moe.grouped_ffn(x, ids, w_gateup, w_out, act=_act, tiling=tiling)
        x = x + y.sum(1).astype(x.dtype) * 1e-3
    return x


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--layers", type=int, default=15)
    ap.add_argument("--quick", action="store_true", help="two tilings, one case (a smoke run)")
    ap.add_argument("--cases", default="b1,b8,b32",
                    help="b1: one request in the B8 bucket, idle rows to no expert (the engine's decode); "
                         "b8: the same with the idle rows routed; b32: 32 distinct requests")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    torch_gbs = common.torch_copy_gbs()
    gbs = torch_gbs or common.copy_gbs()
    rows = [dict(section="roofline", case=jax.devices()[0].device_kind, copy_gbs=gbs, torch_copy_gbs=torch_gbs)]
    weights = _weights(jax.random.PRNGKey(0), args.layers)
    expert_bytes = (L * 2 * F + F * L) * 2
    every = {"b1": ("B8 one request, idle rows to no expert", 8, 1, True), "b8": ("B8 one request", 8, 1, False),
             "b32": ("B32", 32, 32, False)}
    cases = [every[c] for c in args.cases.split(",")][: 1 if args.quick else None]
    cands = CANDIDATES[:2] if args.quick else CANDIDATES
    for name, bucket, real, idle_to_none in cases:
        x, ids, active = _case(rng, bucket, real, idle_to_none)
        want = np.asarray(_layers(x, ids, weights, tiling=(None, None)), np.float32)
        for part in (0, 1):  # tune gate/up with down at its default, then down
            for t in cands:
                if part == 1 and t is None:
                    continue  # the default pair ran in part 0
                tiling = (t, None) if part == 0 else (None, t)
                row = dict(section="tiling", case=name, experts_read=active, gemm=("gate/up", "down")[part],
                           tiling=str(t or "default"))
                try:
                    got = np.asarray(_layers(x, ids, weights, tiling=tiling), np.float32)
                    row["max_err"] = float(np.max(np.abs(got - want)))
                    ms = common.time_pipelined(lambda: _layers(x, ids, weights, tiling=tiling), iters=20)[0]
                    row.update(ms_per_layer=ms / args.layers,
                               of_copy_rate=args.layers * active * expert_bytes / (ms * 1e-3) / 1e9 / gbs)
                except Exception as e:  # noqa: BLE001 - a tiling the compiler refuses is a row, not a stop
                    row["error"] = str(e)[:160]
                rows.append(row)
                print(row, flush=True)
                common.write_results(args.out, "moe_tune", rows)
    print(common.write_results(args.out, "moe_tune", rows))


if __name__ == "__main__":
    main()
