"""What drawing the params costs: `model.init_params` against one whole-model init program.

    PYTHONPATH=$PWD python3 benchmarks/init_time.py [--config small] [--variants init_params,whole,whole_kernel]

Each variant runs in a fresh process (no compilation cache) and prints one JSON line:
seconds per stage and the process's peak host RSS.  Variants:

* ``init_params``: what the library does (one program per block kind, cheap threefry);
* ``whole``: flax's init of the whole model as one jitted program (threefry inlined per
  parameter; what `init_params` did before), trace / lower / compile / run apart;
* ``whole_kernel``: the same with ``jax_threefry_gpu_kernel_lowering`` (GPU only).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time


def _rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _whole(cfg, dtype):
    import jax

    from kimik3 import model

    @jax.jit
    def init(key):
        return model.cast_params(model.KimiK3(cfg).init(key, *model._example_inputs(cfg))["params"], dtype)

    return init


def one(config: str, variant: str) -> dict:
    os.environ["KIMIK3_COMPILE_CACHE"] = "off"  # it times compiles: no persistent cache of any kind
    os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
    import jax

    if variant == "whole_kernel":
        jax.config.update("jax_threefry_gpu_kernel_lowering", True)

    from kimik3 import config as configs, model, stacked

    cfg = configs.get_config(config)
    key = jax.random.PRNGKey(0)
    out = {"variant": variant, "config": config, "backend": jax.default_backend()}
    t = time.perf_counter()
    if variant == "init_params":
        params = jax.block_until_ready(model.init_params(cfg, key))
        out["init_s"] = time.perf_counter() - t
    else:
        traced = _whole(cfg, cfg.dtype).trace(key)
        out["trace_s"] = time.perf_counter() - t
        t = time.perf_counter()
        lowered = traced.lower()
        out["lower_s"] = time.perf_counter() - t
        t = time.perf_counter()
        compiled = lowered.compile()
        out["compile_s"] = time.perf_counter() - t
        t = time.perf_counter()
        params = jax.block_until_ready(compiled(key))
        out["run_s"] = time.perf_counter() - t
        out["init_s"] = sum(out[k] for k in ("trace_s", "lower_s", "compile_s", "run_s"))
    out["rss_after_init_gib"] = _rss_gib()
    t = time.perf_counter()
    jax.block_until_ready(stacked.serving_layout(params, cfg, scan=False))
    out["serving_layout_s"] = time.perf_counter() - t
    out["peak_rss_gib"] = _rss_gib()
    out["param_gib"] = sum(x.nbytes for x in jax.tree.leaves(params)) / 2**30
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="small")
    ap.add_argument("--variants", default="init_params,whole_kernel,whole")
    ap.add_argument("--out", default=None, help="append each variant's JSON line to this file")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(one(args.config, args.child)), flush=True)
        return
    failed = False
    for v in args.variants.split(","):
        proc = subprocess.run([sys.executable, __file__, "--config", args.config, "--child", v],
                              capture_output=True, text=True)
        line = proc.stdout.strip().splitlines()[-1] if proc.returncode == 0 else json.dumps(
            {"variant": v, "error": proc.stderr[-2000:]})
        print(line, flush=True)
        failed |= proc.returncode != 0
        if args.out:
            with open(args.out, "a") as f:
                f.write(line + "\n")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
