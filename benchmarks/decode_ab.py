"""A/B the decode step under XLA flag and layout variants, one subprocess each, in one device call.

    PYTHONPATH=$PWD python3 benchmarks/decode_ab.py --out $OUT [--variants base,cublas,...] [--budget-s 540]

Each variant runs `benchmarks/serving_bench.py --config small --modes '' --decode-batches 1,32`
in a fresh process (XLA flags are read once per process) with its own environment and bench
arguments, under a time limit, and writes into its own folder under --out as it goes; the
driver prints and saves (`decode_ab.md` / `.json`) one row per variant with the engine's async
step, the program back to back, host dispatch and launches at B1 and B32, and the roofline
share.  A variant that runs out of time or fails says so in its row; the rest still run.
Variants (the `VARIANTS` table): base; cublas (XLA's Triton GEMMs off: the decode step's M = 32
projections were split-K Triton GEMMs at a third to a half of the copy rate); scan_all and
scan_all_dsf (every program scans the periods, without and with XLA's dynamic-slice fusion,
which may let GEMMs read a period's weights in place of copying them).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

VARIANTS = {
    "base": ({}, []),
    "cublas": ({"XLA_FLAGS": "--xla_gpu_enable_triton_gemm=false"}, []),
    "scan_all": ({}, ["--scan", "all"]),
    "scan_all_dsf": ({"XLA_FLAGS": "--xla_gpu_enable_dynamic_slice_fusion=true"}, ["--scan", "all"]),
}
COLUMNS = ("async_step_ms", "replay_ms", "replay_host_ms", "launches", "roofline_ms", "of_roofline", "experts_read")


def run_variant(name: str, out: str, budget_s: float, batches: str, config: str = "small", quick: bool = False) -> dict:
    env_extra, args = VARIANTS[name]
    env = dict(os.environ, PYTHONUNBUFFERED="1", **env_extra)
    if "XLA_FLAGS" in env_extra and os.environ.get("XLA_FLAGS"):
        env["XLA_FLAGS"] = os.environ["XLA_FLAGS"] + " " + env_extra["XLA_FLAGS"]
    folder = os.path.join(out, name)
    os.makedirs(folder, exist_ok=True)
    cmd = [sys.executable, os.path.join(HERE, "serving_bench.py"), "--config", config, "--modes", "",
           "--decode-batches", batches, "--compile-cache", "off", "--out", folder] + args + (["--quick"] if quick else [])
    t0 = time.monotonic()
    with open(os.path.join(folder, "log.txt"), "w") as log:
        try:
            proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, timeout=budget_s)
            status = "ok" if proc.returncode == 0 else f"exit {proc.returncode}"
        except subprocess.TimeoutExpired:
            status = f"timed out at {budget_s:.0f} s"
    row = {"variant": name, "status": status, "seconds": round(time.monotonic() - t0, 1),
           "flags": env_extra.get("XLA_FLAGS", ""), "args": " ".join(args)}
    try:
        rows = json.load(open(os.path.join(folder, "serving_bench.json")))
    except (OSError, ValueError):
        return row
    for r in rows:
        if r.get("section") == "decode step vs roofline":
            b = r["case"].split()[0]
            for c in COLUMNS:
                if c in r:
                    row[f"{b} {c}"] = round(r[c], 3) if isinstance(r[c], float) else r[c]
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--variants", default="base,cublas", help=f"comma-separated, of {', '.join(VARIANTS)}")
    ap.add_argument("--budget-s", type=float, default=540.0, help="for all variants together")
    ap.add_argument("--decode-batches", default="1,32")
    ap.add_argument("--config", default="small")
    ap.add_argument("--quick", action="store_true", help="serving_bench --quick (a CPU smoke run)")
    args = ap.parse_args()
    names = [v for v in args.variants.split(",") if v]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; known: {list(VARIANTS)}")
    sys.path.insert(0, ROOT)
    from benchmarks import common

    os.makedirs(args.out, exist_ok=True)
    deadline = time.monotonic() + args.budget_s
    rows = []
    for i, name in enumerate(names):
        left = deadline - time.monotonic()
        share = left / (len(names) - i)  # what is left, split over the variants still to run
        if share < 30:
            rows.append({"variant": name, "status": "skipped: no time left"})
            continue
        rows.append(run_variant(name, args.out, share, args.decode_batches, args.config, args.quick))
        common.write_results(args.out, "decode_ab", [dict(r, section="decode A/B") for r in rows])


if __name__ == "__main__":
    main()
