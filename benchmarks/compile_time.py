"""Compile time of one decode step on this machine (issue 15's CPU yardstick).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/compile_time.py [--config small] [--batch 8] [--repeats 3]
        [--fused] [--stacked] [--programs auto|whole|layerwise]

`kimik3.model.forward` with a contiguous cache, B rows of one token: the first call (trace,
lower, compile, run) minus the second (run), in a fresh process per repeat so no cache is warm
(the persistent compilation cache is off here).  Prints one line per repeat and the median.
`--programs` is `forward`'s: "auto" (what a user's call gets: layer by layer on the CPU,
`kimik3.layerwise`), "whole" (one program for the model, what the engine's steps compile).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def one(config: str, batch: int, fused_layout: bool = False, stacked_layout: bool = False,
        programs: str = "auto") -> float:
    os.environ["KIMIK3_COMPILE_CACHE"] = "off"  # it times compiles: no persistent cache of any kind
    os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
    import jax
    import jax.numpy as jnp

    from kimik3 import config as configs, fused, model, stacked

    cfg = configs.get_config(config)
    params = model.init_params(cfg, jax.random.PRNGKey(0))
    if fused_layout:  # the serving layout the engine's programs read
        params = fused.fuse_projections(params, cfg)
    if stacked_layout:  # the repeated periods as one scan step (kimik3.stacked)
        params = stacked.stack_periods(params, cfg)
    cache = model.init_cache(cfg, batch, 256)
    tokens = jnp.zeros((batch, 1), jnp.int32)
    jax.block_until_ready(params)
    t0 = time.perf_counter()
    jax.block_until_ready(model.forward(params, cfg, tokens, cache=cache, programs=programs))
    t1 = time.perf_counter()
    jax.block_until_ready(model.forward(params, cfg, tokens, cache=cache, programs=programs))
    t2 = time.perf_counter()
    return (t1 - t0) - (t2 - t1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="small")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--fused", action="store_true", help="params in the serving layout (kimik3.fused)")
    ap.add_argument("--stacked", action="store_true", help="params in the scanned layout (kimik3.stacked)")
    ap.add_argument("--programs", default="auto", choices=("auto", "whole", "layerwise"),
                    help="model.forward's programs (default: %(default)s)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(one(args.config, args.batch, args.fused, args.stacked, args.programs)))
        return
    seconds = []
    for i in range(args.repeats):
        out = subprocess.run([sys.executable, __file__, "--child", "--config", args.config, "--batch", str(args.batch)]
                             + (["--fused"] if args.fused else []) + (["--stacked"] if args.stacked else [])
                             + ["--programs", args.programs],
                             capture_output=True, text=True, check=True, env=dict(os.environ))
        seconds.append(float(out.stdout.strip().splitlines()[-1]))
        print(f"repeat {i}: compile {seconds[-1]:.2f} s", flush=True)
    print(f"{args.config}{' (fused layout)' if args.fused else ''} decode step B{args.batch} T1, programs "
          f"{args.programs}, compile "
          f"(first call - second): median "
          f"{statistics.median(seconds):.2f} s over {args.repeats} fresh processes")


if __name__ == "__main__":
    main()
