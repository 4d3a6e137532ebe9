"""Host-tier bandwidth: put / get of MLA pages and KDA snapshots, embedded and Mooncake
(loopback TCP), against plain memcpy of the same bytes measured in the same run.  CPU only.

    PYTHONPATH=$PWD python3 benchmarks/host_tier.py [--out DIR]

Entry shapes come from the model configs: an MLA page is 128 tokens of every
MLA layer's latent (bf16); a KDA snapshot is every KDA layer's fp32 state.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import numpy as np

from benchmarks import common
from cache.host_tier import EmbeddedHostKVTier, make_key
from cache.mooncake_tier import MooncakeHostKVTier, MooncakeServices
from kimik3 import config


def entry_shapes(cfg):
    n_mla, n_kda = cfg.mixer_kinds.count("mla"), cfg.mixer_kinds.count("kda")
    return {"mla_page": ((n_mla, 128, cfg.mla_latent_dim), np.float16),  # bf16-sized
            "kda_snapshot": ((n_kda, cfg.kda_heads, cfg.kda_head_dim, cfg.kda_head_dim), np.float32)}


def timed(fn, reps=3):
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench(tier, arrays, tag):
    keys = [make_key(f"bench/{tag}", "mla", i.to_bytes(16, "little")) for i in range(len(arrays))]
    outs = [np.empty_like(a) for a in arrays]
    put_s = timed(lambda: tier.batch_put(keys, arrays))
    found = []
    get_s = timed(lambda: found.append(all(tier.batch_get_into(keys, outs))))
    assert all(found), f"{tag}: some gets missed"
    assert all(np.array_equal(a, b) for a, b in zip(arrays, outs)), "round trip mismatch"
    nbytes = sum(a.nbytes for a in arrays)
    return nbytes / put_s / 1e9, nbytes / get_s / 1e9


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--budget-mb", type=int, default=1536, help="bytes moved per case")
    args = ap.parse_args()
    rows = []
    services = MooncakeServices(segment_bytes=4 << 30).start()
    try:
        mooncake = MooncakeHostKVTier(services.master_addr, services.metadata_url, staging_bytes=512 << 20)
        for cfg_name in ("small", "kimi_k3"):
            for kind, (shape, dtype) in entry_shapes(config.get_config(cfg_name)).items():
                one = int(np.prod(shape)) * np.dtype(dtype).itemsize
                n = max(1, min(64, (args.budget_mb << 20) // one))
                if one > (480 << 20):
                    rows.append(dict(config=cfg_name, entry=kind, entry_mb=one / 2**20, note="exceeds staging buffer"))
                    continue
                rng = np.random.default_rng(0)
                arrays = [rng.integers(0, 255, shape).astype(dtype) for _ in range(n)]
                dst = [np.empty_like(a) for a in arrays]
                memcpy = sum(a.nbytes for a in arrays) / timed(lambda: [np.copyto(d, a) for d, a in zip(dst, arrays)]) / 1e9
                emb_put, emb_get = bench(EmbeddedHostKVTier(4 << 30), arrays, f"{cfg_name}-{kind}-e")
                mc_put, mc_get = bench(mooncake, arrays, f"{cfg_name}-{kind}-m")
                rows.append(dict(config=cfg_name, entry=kind, entry_mb=one / 2**20, entries=n, memcpy_gbs=memcpy,
                                 embedded_put_gbs=emb_put, embedded_get_gbs=emb_get,
                                 mooncake_put_gbs=mc_put, mooncake_get_gbs=mc_get))
                print(rows[-1], flush=True)
        mooncake.close()
    finally:
        services.stop()
    print(f"\nhost: {platform.processor() or platform.machine()}, {os.cpu_count()} cores")
    common.write_results(args.out, "host_tier", rows)

if __name__ == "__main__":
    main()
