"""KDA's fused decode kernel (`pallas_kernels.kda_decode`) against the recurrence-only kernel, on the GPU.

    PYTHONPATH=$PWD python3 benchmarks/kda_decode_tune.py [--out DIR] [--layers 12] [--quick]

A `small` decode step runs one KDA decode per KDA layer (12), each on its own conv and state
pools.  This times `--layers` of them in one program, back to back (pools donated and fed
forward, as the engine's step does), for `small`'s heads (12 x 128) at the B8 and B32 buckets:
each (block_v, num_warps) of the fused kernel (convs + gates + recurrence + gated norm), and
`fused_recurrent_kda` (the recurrence alone, the kernel the fused one replaced, whose
q / k / v / g / beta were ~15 XLA fusions a layer).  Bytes: the state rows read and written
(fp32) at the copy rate of the same run.  Every variant is checked against the default first.
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
from pallas_kernels import kda_decode as kd
from pallas_kernels.kda import fused_recurrent_kda

W = 4
# (block_v, num_warps); block_v None: the kernel's default (min(V, 64))
CANDIDATES = [(None, 4), (None, 8), (128, 4), (128, 8), (32, 4), (32, 2)]


def _inputs(key, b, n_slots, layers, H, K):
    ks = iter(jax.random.split(key, 16))
    bf = jnp.bfloat16
    r = lambda *s, scale=1.0: (jax.random.normal(next(ks), s, jnp.float32) * scale).astype(bf)
    x = dict(x_in=r(b, 3 * H * K + K + H + K), fg=r(b, 2 * H * K),
             w_conv=tuple(r(W, H * K, scale=0.5) for _ in range(3)),
             a_log=jnp.log(jnp.linspace(1.0, 16.0, H)), dt_bias=jnp.zeros((H, K)), o_norm=jnp.ones((K,)),
             slots=jnp.arange(b, dtype=jnp.int32) * 2 + 1)  # every other slot: not a contiguous block
    pools = [(jnp.zeros((n_slots, W - 1, 3, H * K), bf) + 0.1 * i,
              jnp.full((n_slots, H, K, K), 0.01 * i, jnp.float32)) for i in range(layers)]
    return x, pools


@functools.partial(jax.jit, static_argnames=("tiling",), donate_argnames=("pools",))
def _fused(x, pools, *, tiling):
    H, K = x["dt_bias"].shape
    out, acc = [], 0.0
    for conv, state in pools:
        o, conv, state = kd.kda_decode(x["x_in"], x["fg"], conv, state, x["slots"], None,
                                       beta_col=3 * H * K + K, w_conv=x["w_conv"], a_log=x["a_log"],
                                       dt_bias=x["dt_bias"], o_norm=x["o_norm"], lower_bound=-5.0, eps=1e-6,
                                       block_v=tiling[0], num_warps=tiling[1])
        out.append((conv, state))
        acc = acc + o.astype(jnp.float32).sum()
    return acc, out


@functools.partial(jax.jit, donate_argnames=("pools",))
def _recurrence_only(x, pools):
    b = x["x_in"].shape[0]
    H, K = x["dt_bias"].shape
    q = x["x_in"][:, None, :H * K].reshape(b, 1, H, K).astype(jnp.float32)
    q = (q * jax.lax.rsqrt(jnp.sum(q * q, -1, keepdims=True) + 1e-6)).astype(jnp.bfloat16)  # unit k: a stable state
    g = -jnp.abs(x["fg"][:, None, :H * K].reshape(b, 1, H, K).astype(jnp.float32))
    beta = jax.nn.sigmoid(x["x_in"][:, None, -H:].astype(jnp.float32))
    out, acc = [], 0.0
    for conv, state in pools:
        o, state = fused_recurrent_kda(q, q, q, g, beta, state_pool=state, slots=x["slots"])
        out.append((conv, state))
        acc = acc + o.astype(jnp.float32).sum()
    return acc, out


def _time(step, pools, iters=20, warmup=3):
    """ms per call, `iters` calls back to back then one sync (pools fed forward)."""
    for _ in range(warmup):
        acc, pools = step(pools)
    jax.block_until_ready(acc)
    t0 = time.perf_counter()
    for _ in range(iters):
        acc, pools = step(pools)
    jax.block_until_ready(acc)
    return (time.perf_counter() - t0) / iters * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--heads", type=int, default=12, help="KDA heads (small: 12)")
    ap.add_argument("--head-dim", type=int, default=128, help="KDA head dim (small: 128)")
    ap.add_argument("--quick", action="store_true", help="two variants, one bucket (a smoke run)")
    args = ap.parse_args()
    torch_gbs = common.torch_copy_gbs()
    gbs = torch_gbs or common.copy_gbs()
    rows = [dict(section="roofline", case=jax.devices()[0].device_kind, copy_gbs=gbs, torch_copy_gbs=torch_gbs)]
    for b in ((8,) if args.quick else (8, 32)):
        H, K = args.heads, args.head_dim
        x, pools = _inputs(jax.random.PRNGKey(b), b, 2 * b + 2, args.layers, H, K)
        fresh = lambda: [tuple(jnp.copy(a) for a in p) for p in pools]
        state_bytes = 2 * b * H * K * K * 4 * args.layers
        want, _ = _fused(x, fresh(), tiling=CANDIDATES[0])
        for tiling in [None] + [c for c in (CANDIDATES[:2] if args.quick else CANDIDATES)
                                  if c[0] is None or c[0] <= K]:
            row = dict(section="kda decode", case=f"B{b}", kernel="fused_recurrent (recurrence only)" if tiling is None
                       else f"kda_decode block_v={tiling[0] or 'default'} warps={tiling[1]}")
            try:
                if tiling is None:
                    ms = _time(lambda p: _recurrence_only(x, p), fresh())
                else:
                    got, _ = _fused(x, fresh(), tiling=tiling)
                    row["rel_err"] = float(abs(got - want) / max(abs(float(want)), 1e-6))
                    ms = _time(lambda p: _fused(x, p, tiling=tiling), fresh())
                row.update(us_per_layer=ms * 1e3 / args.layers, of_copy_rate=state_bytes / (ms * 1e-3) / 1e9 / gbs)
            except Exception as e:  # noqa: BLE001 - a variant the compiler refuses is a row, not a stop
                row["error"] = str(e)[:160]
            rows.append(row)
            print(row, flush=True)
            common.write_results(args.out, "kda_decode_tune", rows)
    print(common.write_results(args.out, "kda_decode_tune", rows))


if __name__ == "__main__":
    main()
