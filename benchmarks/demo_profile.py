"""The demo's colocated setup under cProfile: where the engine's host time goes, by function.

The demo's warm-up (`Engine.warmup`, then one short run, as `serving.demo.main` does), then one
measured `run_mode` with the profiler on.  Prints the engine's step profile
(`metrics.StepProfile`) and the functions with the most own time (tottime: a jitted call's
enqueue counts in its caller's) and the most cumulative time; writes the stats file with --out.

    PYTHONPATH=$PWD python3 benchmarks/demo_profile.py --config small --out /tmp/demo.prof
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import logging
import pstats

from kimik3 import stacked
from serving import demo, metrics


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="small")
    parser.add_argument("--mode", default="colocated", choices=demo.MODES)
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--out", default=None, help="cProfile stats file")
    args = parser.parse_args(argv)
    spec = demo.DemoSpec(config=args.config)
    params, cfg = demo._params(spec)
    params = stacked.serving_layout(params, cfg, scan=False)
    max_pages = demo._max_pages(spec)
    demo._engines(params, cfg, spec, "colocated", max_pages).warmup()
    demo.run_mode(params, cfg, dataclasses.replace(spec, sessions=1, turns=(2, 2)), args.mode, max_pages=max_pages)
    prof = cProfile.Profile()
    prof.enable()
    summary, _, compiles, steps = demo.run_mode(params, cfg, spec, args.mode)
    prof.disable()
    if args.out:
        prof.dump_stats(args.out)
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("tottime").print_stats(args.top)
    stats.sort_stats("cumulative").print_stats(args.top)
    report = f"{metrics.format_table([summary])}\nnew compiles: {compiles}\nsteps: {steps}\n{text.getvalue()}"
    print(report)
    return report


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    main()
