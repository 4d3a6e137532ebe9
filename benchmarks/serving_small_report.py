"""Issue 15's figures for `small` on one GPU, in one run: writes benchmarks/results/serving_small.json.

    PYTHONPATH=$PWD python3 benchmarks/serving_small_report.py --out $OUT [--skip-demo]

1. `benchmarks/serving_bench.py --config small --modes '' --decode-batches 1,32`: the decode
   step at B1 and B32 (2048 cached tokens) against the byte roofline at torch's `copy_` rate,
   synchronized, back to back, and in the engine's async loop;
2. `kimik3 demo --config small` twice on a fresh compilation cache: cold, then warm (the
   restart the cache is for): warm-up seconds, colocated TPOT p50 (and its decode-only / mixed
   split), peak host RSS.
Each step's output lands under --out as it finishes, so a run cut short keeps what it made.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def run(cmd: list[str], log_path: str, env: dict) -> str:
    """Run cmd with its output going straight to log_path (a run cut short keeps what it printed);
    returns that output."""
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
    if proc.returncode:
        print(f"{' '.join(cmd)} exited {proc.returncode}; see {log_path}", flush=True)
    with open(log_path) as log:
        return log.read()


def demo_figures(text: str) -> dict:
    """warm-up s, peak RSS GiB and the colocated row's TPOT figures from `kimik3 demo`'s output."""
    out = {}
    m = re.search(r"warm-up \(compiles\) ([\d.]+) s", text)
    out["warmup_s"] = float(m.group(1)) if m else None
    m = re.search(r"peak RSS of this process ([\d.]+) GiB", text)
    out["peak_rss_gib"] = float(m.group(1)) if m else None
    m = re.search(r"after each phase: ([^)]*)\)", text)
    out["rss_phases_gib"] = m.group(1) if m else None
    row = next((line for line in text.splitlines() if line.startswith("| colocated |")), None)
    if row:
        cells = [c.strip() for c in row.strip("|").split("|")]
        out["tpot_p50_ms"] = float(cells[4].split("/")[0])
        split = cells[5].split("/")
        out["tpot_decode_only_p50_ms"], out["tpot_mixed_p50_ms"] = (float(x) for x in split)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--skip-demo", action="store_true")
    ap.add_argument("--cold-only", action="store_true", help="the demo once, from a cold compilation cache")
    ap.add_argument("--dump-step-hlo", action="store_true", help="keep the decode steps' optimized HLO (bench/)")
    ap.add_argument("--commit", default=None,
                    help="the commit measured (default: git rev-parse HEAD here; a device machine's copy of the "
                         "tree may carry a stale .git, so pass it from the machine that sent the tree)")
    ap.add_argument("--config", default="small", help="small (the issue's figures); tiny smoke-tests this script")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1")
    report = {"date": datetime.date.today().isoformat(),
              "commit": args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                       cwd=ROOT).stdout.strip() or None}
    path = os.path.join(args.out, "serving_small.json")

    def save():
        with open(path, "w") as f:
            json.dump(report, f, indent=1)

    bench_out = os.path.join(args.out, "bench")
    quick = ["--quick"] if args.config == "tiny" else []
    run([sys.executable, os.path.join(HERE, "serving_bench.py"), "--config", args.config, "--modes", "",
         "--loads", "32", "--decode-batches", "1,32", *quick, "--out", bench_out, "--compile-cache", "off",
         *(["--dump-step-hlo"] if args.dump_step_hlo else [])],
        os.path.join(args.out, "bench.log"), env)
    try:
        rows = json.load(open(os.path.join(bench_out, "serving_bench.json")))
    except OSError:
        rows = []
    for r in rows:
        if r.get("section") == "roofline":
            report["copy_gbs_torch"] = r.get("torch_copy_gbs")
        if r.get("section") == "decode step vs roofline":
            b = r["case"].split()[0].lower()  # "b32"
            report[f"decode_step_ms_{b}"] = r["async_step_ms"]
            report[f"decode_step_sync_ms_{b}"] = r["runner_step_ms"]
            report[f"decode_program_back_to_back_ms_{b}"] = r["replay_ms"]
            report[f"host_dispatch_ms_{b}"] = r["replay_host_ms"]
            report[f"roofline_ms_{b}"] = r["roofline_ms"]
            report[f"launches_per_step_{b}"] = r["launches"]
    save()
    if not args.skip_demo:
        cache = tempfile.mkdtemp(prefix="kimik3-xla-")  # cold: nothing compiled yet
        denv = dict(env, KIMIK3_COMPILE_CACHE=cache)
        demo = [os.path.join(os.path.dirname(sys.executable), "kimik3")]
        if not os.path.exists(demo[0]):
            demo = [sys.executable, "-m", "serving.cli"]
        for label in ("cold",) if args.cold_only else ("cold", "warm"):
            text = run(demo + ["demo", "--config", args.config, "--out", os.path.join(args.out, f"demo_{label}")],
                       os.path.join(args.out, f"demo_{label}.log"), denv)
            fig = demo_figures(text)
            report[f"warmup_{label}_s"] = fig.get("warmup_s")
            if label == "cold":
                report["demo_tpot_p50_ms"] = fig.get("tpot_p50_ms")
                report["demo_tpot_decode_only_p50_ms"] = fig.get("tpot_decode_only_p50_ms")
                report["demo_tpot_mixed_p50_ms"] = fig.get("tpot_mixed_p50_ms")
            report[f"peak_rss_gib_{label}"] = fig.get("peak_rss_gib")
            report[f"rss_phases_gib_{label}"] = fig.get("rss_phases_gib")
            save()
        report["peak_rss_gib"] = max((v for k, v in report.items() if k.startswith("peak_rss_gib_") and isinstance(v, float)), default=None)
    save()
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
