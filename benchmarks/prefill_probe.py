"""Where a mixed step's time goes on `small`: one prefill chunk per compiled length (device vs
host), and the KDA snapshot moves around it (eager pool ops).

    PYTHONPATH=$PWD python3 benchmarks/prefill_probe.py [--config small]
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import numpy as np

from kimik3 import compile_cache, config, model
from serving.engine import Engine, EngineConfig


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="small")
    ap.add_argument("--compile-cache", default=None,
                    help="persistent XLA cache dir (default $KIMIK3_COMPILE_CACHE or ~/.cache/kimik3/xla; 'off')")
    args = ap.parse_args()
    compile_cache.enable(args.compile_cache)
    cfg = config.get_config(args.config)
    params = model.init_params(cfg, jax.random.PRNGKey(0))
    ec = EngineConfig(num_pages=96, num_slots=4, num_snapshots=16, page_tokens=32, kda_block_tokens=128,
                      max_pages_per_request=40, prefill_chunk_tokens=256)
    eng = Engine(params, cfg, ec)
    t0 = time.perf_counter()
    eng.warmup()
    print(f"warmup {time.perf_counter() - t0:.1f} s", flush=True)
    table = [list(range(1, 41))]
    for n in (5, 64, 200, 256):
        tokens = np.zeros((1, n), np.int32)
        run = lambda: np.asarray(eng.runner.forward(eng.kv, tokens, table, [0], [0], export_offsets=[])[0])  # [1, 1, V]
        run()
        t = time.perf_counter()
        for _ in range(5):
            run()
        print(f"prefill chunk {n} tokens (bucket {eng.runner.prefill_bucket(n)}): {(time.perf_counter() - t) / 5 * 1e3:.2f} ms "
              "per call incl. logits read", flush=True)
    for name, fn in (("restore_state", lambda: eng.kv.restore_state(0, 1)),
                     ("save_state", lambda: eng.kv.save_state(0, 1))):
        fn()
        jax.block_until_ready(eng.kv.pools)
        t = time.perf_counter()
        for _ in range(5):
            fn()
        jax.block_until_ready((eng.kv.pools, eng.kv.snapshots.data))
        print(f"{name}: {(time.perf_counter() - t) / 5 * 1e3:.2f} ms", flush=True)


if __name__ == "__main__":
    main()
