"""Where a `small` serving process's host memory goes: RSS after each start-up stage.

    PYTHONPATH=$PWD python3 benchmarks/host_rss.py [--config small] [--trim]

Prints one JSON line per stage (current and peak RSS, GiB): jax imported, the backend up,
a first tiny program, the params drawn, the serving layout, one engine warmed up.  --trim calls
glibc's malloc_trim(0) after each stage and reports what that gave back (memory the compiler
freed but the allocator kept).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import time


def _rss():  # not serving.demo's reader: importing it would bring jax in before the first stage
    with open("/proc/self/statm") as f:
        current = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30
    return current, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="small")
    ap.add_argument("--trim", action="store_true")
    ap.add_argument("--no-engine", action="store_true")
    args = ap.parse_args()
    os.environ.setdefault("KIMIK3_COMPILE_CACHE", "off")
    libc = ctypes.CDLL("libc.so.6") if args.trim else None
    t0 = time.perf_counter()

    def stage(name):
        cur, peak = _rss()
        row = {"stage": name, "rss_gib": round(cur, 3), "peak_gib": round(peak, 3), "s": round(time.perf_counter() - t0, 2)}
        if libc is not None:
            libc.malloc_trim(0)
            row["after_trim_gib"] = round(_rss()[0], 3)
        print(json.dumps(row), flush=True)

    stage("start")
    import jax
    import jax.numpy as jnp
    stage("jax imported")
    jax.devices()
    stage("backend up")
    jax.block_until_ready(jnp.ones(4) + 1)
    stage("first program")
    from kimik3 import config as configs, model, stacked
    stage("kimik3 imported")
    cfg = configs.get_config(args.config)
    params = jax.block_until_ready(model.init_params(cfg, jax.random.PRNGKey(0)))
    stage("params drawn")
    params = jax.block_until_ready(stacked.serving_layout(params, cfg, scan=False))
    stage("serving layout")
    if args.no_engine:
        return
    from serving.engine import Engine, EngineConfig
    eng = Engine(params, cfg, EngineConfig(num_pages=96, page_tokens=32))
    stage("engine built")
    eng.warmup()
    stage("engine warmed up")


if __name__ == "__main__":
    main()
