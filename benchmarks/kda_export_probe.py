"""Where a KDA prefill's state export costs (issue 22: +144% at B1 T32768 H32 on an H100,
session 32, against +3-7% at B8 T4096 and B4 T8192 with as many states exported).

Times, back to back then one sync (`common.time_pipelined`): the pass without export, with a
state every 128 tokens (the V-block width `auto` picks and the other one), every 1536 tokens,
and the Pallas core alone (no wrapper) with each, so the kernel and what XLA adds around it
separate.  Prints a row a case and writes them under --out.

    PYTHONPATH=$PWD python3 benchmarks/kda_export_probe.py [--shapes 1x32768x32,8x4096x32] [--out DIR]

A shape is BxTxH; T a multiple of 1536 gives the every-1536 case states (else it exports none).
"""

from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp

from benchmarks import common
from benchmarks.kda import inputs
from pallas_kernels import kda


def rows_for(b, t, h, d=128, iters=10):
    q, k, v, g, beta = inputs(jax.random.PRNGKey(1), b, t, h, d, jnp.bfloat16)
    every = lambda n: list(range(n, t + 1, n))
    cases = [("no export", None, None), ("every 128", every(128), None), ("every 128, V block 64", every(128), 64),
             ("every 128, V block 32", every(128), 32), ("every 1536", every(1536), None)]
    out = []
    for name, pos, bv in cases:
        tuning = {"state_block_v": bv} if bv else None
        fn = jax.jit(lambda *a, pos=pos, tu=tuning: kda.chunk_kda(*a, output_final_state=True,
                                                                  checkpoint_positions=pos, tuning=tu))
        ms, host_ms = common.time_pipelined(fn, q, k, v, g, beta, iters=iters, warmup=min(3, iters))
        # the Pallas core alone, on the wrapper's own plan
        chunk_start, ckpt_slot, n_ckpt = kda._plan_layout([t] * b, [pos or []] * b)
        block_v = min(bv, d) if bv else kda._state_block_v(b, h, d, None)
        flat = lambda x: x.reshape((1, b * t) + x.shape[2:])
        args = (flat(q), flat(k), flat(v), flat(g.astype(jnp.float32)), flat(beta),
                jnp.zeros((b, h, d, d), jnp.float32), jnp.asarray(chunk_start), jnp.asarray(ckpt_slot))
        core = lambda *a, n=n_ckpt, bv_=block_v, tu=tuning: kda._chunk_kda_core(
            *a, n_ckpt=n, scale=d ** -0.5, block_v=bv_, interpret=kda._default_interpret(),
            tuning=tuple(sorted(tu.items())) if tu else None)
        core_ms = common.time_pipelined(core, *args, iters=iters, warmup=min(3, iters))[0]
        row = dict(case=f"B{b} T{t} H{h} D{d} bf16", export=name, n_states=b * len(pos or []), block_v=block_v,
                   ms=ms, host_ms=host_ms, core_ms=core_ms)
        print(row, flush=True)
        out.append(row)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="1x32768x32,1x8192x32,8x4096x32")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--iters", type=int, default=10, help="calls back to back per timing (warm-up: up to 3)")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = ap.parse_args()
    rows = []
    for shape in args.shapes.split(","):
        b, t, h = (int(x) for x in shape.split("x"))
        rows += rows_for(b, t, h, args.head_dim, args.iters)
        common.write_results(args.out, "kda_export_probe", rows)


if __name__ == "__main__":
    main()
