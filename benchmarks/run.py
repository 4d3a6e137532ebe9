"""Run registered benchmarks in one process and write one JSON of their rows.

    python -m benchmarks.run --suite kernels --shapes full [--only mla_decode,kda_chunk] [--variants all]
    python benchmarks/run.py --suite all --shapes ci --json /tmp/ci.json
    python -m benchmarks.run --suite kernels --shapes full --base HEAD~1     # this tree vs another commit
    python -m benchmarks.run --list [--suite model --shapes full]          # the registry [and those cases]

Writes {date, device, host_cpu, versions, commit, ceilings, rows} to --json (default
benchmarks/results/<suite>_<device>.json) after every row, so a run cut short keeps what it
measured (a benchmark may yield a row again, completed, when its peer is measured later); logs
progress to stderr and prints a markdown table of the rows at the end.  Exits 1 when any row
failed its check or raised.  `--base REF` runs the same suite on REF's library code
(REF's tree from `git archive`, with this tree's benchmarks/ copied over it) in a subprocess,
then here, and adds each row's base_ms and vs_base (this / base) beside it.
"""

from __future__ import annotations

import argparse
import datetime
import io
import json
import logging
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __name__ == "__main__" and not __package__:  # `python benchmarks/run.py`: the package from the repo root
    sys.path[0] = ROOT

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# a donated pool the CPU backend cannot reuse is copied instead: the figures of a CPU run mean nothing anyway
warnings.filterwarnings("ignore", message="Some donated buffers were not usable")

from benchmarks import common, registry  # noqa: E402

log = logging.getLogger("benchmarks")
COLUMNS = [
    "benchmark",
    "case",
    "variant",
    "ours_ms",
    "peer",
    "peer_ms",
    "ratio",
    "ceiling_kind",
    "fraction_of_ceiling",
    "check_err",
    "status",
]


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n")[0])
    ap.add_argument("--suite", default="all", choices=registry.SUITES + ("all",))
    ap.add_argument("--only", default=None, help="comma-separated benchmark names (overrides --suite)")
    ap.add_argument("--shapes", default="ci", choices=("ci", "full"), help="the registry's shape preset")
    ap.add_argument(
        "--cases",
        default=None,
        metavar="I[,J]",
        help="indices of each benchmark's preset cases to run (default all; e.g. 0: a quick pass)",
    )
    ap.add_argument("--variants", default="", help="named variants to run beside each default: NAME[,NAME] or all")
    ap.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="BENCH.KEY=VALUE",
        help="a benchmark's option (e.g. spec_decode.target=DIR); repeatable",
    )
    ap.add_argument("--json", default=None, help="output path (default benchmarks/results/<suite>_<device>.json)")
    ap.add_argument("--budget-s", type=float, default=None, help="skip the benchmarks that start after this long")
    ap.add_argument("--base", default=None, metavar="REF", help="also run REF's library code and report this / base")
    ap.add_argument("--keep-base", action="store_true", help="keep --base's extracted tree (its path is logged)")
    ap.add_argument("--commit", default=None, help="the commit measured (default: git rev-parse HEAD of this tree)")
    ap.add_argument(
        "--compile-cache",
        default=None,
        help="persistent XLA cache dir (default $KIMIK3_COMPILE_CACHE or ~/.cache/kimik3/xla; 'off')",
    )
    ap.add_argument(
        "--list",
        action="store_true",
        help="print the registry and exit (with --suite or --only, also their cases at --shapes, by index)",
    )
    return ap.parse_args(argv)


def parse_options(items: list[str]) -> dict[str, dict[str, str]]:
    """{benchmark: {key: value}} from BENCH.KEY=VALUE items."""
    out: dict[str, dict[str, str]] = {}
    for item in items:
        name, _, value = item.partition("=")
        bench, _, key = name.partition(".")
        if not (bench and key and _):
            raise SystemExit(f"--option wants BENCH.KEY=VALUE; got {item!r}")
        out.setdefault(bench, {})[key] = value
    return out


def parse_variants(text: str, benches: list[registry.Benchmark]):
    if text.strip() == "all":
        return "all"
    names = tuple(v for v in text.split(",") if v)
    known = {v for b in benches for v in b.variants}
    unknown = [v for v in names if v not in known]
    if unknown:
        raise SystemExit(f"unknown variants {unknown} for {[b.name for b in benches]}; known: {sorted(known)}")
    return names


def default_json(args, device: str) -> str:
    stem = args.only.replace(",", "-") if args.only else args.suite
    return os.path.join(ROOT, "benchmarks", "results", f"{stem}_{common.device_slug(device)}.json")


def write_json(path: str, result: dict) -> None:
    """Write result to path whole or not at all (a reader never sees half a file)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1, default=str)
    os.replace(tmp, path)


def table(rows: list[dict], base: bool = False) -> str:
    flat = [dict(r, check_err=(r.get("check") or {}).get("max_err")) for r in rows]
    cols = COLUMNS + (["base_ms", "vs_base"] if base else [])
    return common.markdown_table(flat, cols)


def run_suite(args, benches: list[registry.Benchmark], budget_s: float | None) -> dict:
    """Run `benches` here; returns the result written to args.json (rows appended as they come)."""
    from kimik3 import compile_cache

    compile_cache.enable(args.compile_cache)
    device = common.device_name()
    args.json = args.json or default_json(args, device)
    result = dict(
        date=datetime.datetime.now().isoformat(timespec="seconds"),
        device=device,
        host_cpu=common.host_cpu(),
        versions=common.versions(),
        commit={"sha": args.commit, "dirty": None} if args.commit else common.commit(),
        shapes=args.shapes,
        cases=args.cases,
        suite=args.suite,
        only=args.only,
        variants=args.variants,
        command=" ".join(["python -m benchmarks.run", *map(shlex.quote, sys.argv[1:])]),
        ceilings={},
        rows=[],
    )
    log.info("device %s, host %s, versions %s", device, result["host_cpu"], result["versions"])
    start = time.monotonic()
    deadline = start + budget_s if budget_s else float("inf")
    try:
        result["ceilings"] = common.measure_ceilings()
    except Exception as e:  # noqa: BLE001 - the rows are still worth having without their fractions
        log.exception("measuring the ceilings failed: fractions of ceiling stay empty")
        result["ceilings"] = {"memory_gbs": None, "compute_tflops": None, "error": repr(e)[:300]}
    log.info("ceilings %s", result["ceilings"])
    write_json(args.json, result)
    options = parse_options(args.option)
    variants = parse_variants(args.variants, benches)
    for bench in benches:
        if time.monotonic() > deadline:
            log.warning("budget spent: skipping %s", bench.name)
            result["rows"].append(
                registry.error_row(bench, "-", f"skipped: the {budget_s:.0f} s budget was spent", status="skipped")
            )
            continue
        ctx = registry.Context(
            bench,
            shapes=args.shapes,
            variants=variants,
            ceilings=result["ceilings"],
            options=options.get(bench.name, {}),
            deadline=deadline,
            pick=tuple(int(i) for i in args.cases.split(",")) if args.cases else None,
        )
        t0 = time.monotonic()
        log.info("%s (%s): %d cases", bench.name, bench.suite, len(ctx.cases()))
        try:
            for row in bench.load()(ctx):
                # a row yielded again (the same dict, completed: a peer measured later) is kept once
                if not any(row is r for r in result["rows"]):
                    result["rows"].append(row)
                log.info(
                    "  %s [%s]: ours %s ms, peer %s ms, %s",
                    row["case"],
                    row["variant"],
                    common.fmt(row["ours_ms"]),
                    common.fmt(row["peer_ms"]),
                    row["status"],
                )
                write_json(args.json, result)  # every row: a run cut short keeps what it measured
        except Exception as e:  # noqa: BLE001 - one benchmark that breaks ends neither the run nor the file
            log.exception("%s raised", bench.name)
            result["rows"].append(registry.error_row(bench, "-", e))
        log.info("%s done in %.1f s", bench.name, time.monotonic() - t0)
        write_json(args.json, result)
    result["seconds"] = time.monotonic() - start
    write_json(args.json, result)
    return result


def extract_base(ref: str) -> tuple[str, str]:
    """(sha, dir): REF's tree from `git archive` in a temp dir, its benchmarks/ replaced by this tree's."""
    sha = subprocess.run(
        ["git", "rev-parse", f"{ref}^{{commit}}"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    tar = subprocess.run(["git", "archive", "--format=tar", sha], cwd=ROOT, capture_output=True, check=True).stdout
    tmp = tempfile.mkdtemp(prefix="kimik3-base-")
    with tarfile.open(fileobj=io.BytesIO(tar)) as t:
        t.extractall(tmp, filter="data")
    shutil.rmtree(os.path.join(tmp, "benchmarks"), ignore_errors=True)
    shutil.copytree(
        os.path.join(ROOT, "benchmarks"),
        os.path.join(tmp, "benchmarks"),
        ignore=shutil.ignore_patterns("__pycache__", "results", "RESULTS.md", "*.tmp"),
    )
    return sha, tmp


def run_base(args, benches: list[registry.Benchmark]) -> tuple[dict, int]:
    """Run the same selection on --base's library code in a subprocess, then here; rows of this
    run get base_ms and vs_base = ours_ms / base's ours_ms (below 1: this tree is faster)."""
    half = args.budget_s / 2 if args.budget_s else None
    sha, tmp = extract_base(args.base)
    log.info("base %s (%s) extracted to %s", args.base, sha[:12], tmp)
    json_path = args.json or default_json(args, common.device_name())
    base_json = json_path[:-5] + ".base.json" if json_path.endswith(".json") else json_path + ".base"
    child = (
        [
            "--suite",
            args.suite,
            "--shapes",
            args.shapes,
            "--variants",
            args.variants,
            "--json",
            base_json,
            "--commit",
            sha,
        ]
        + (["--only", args.only] if args.only else [])
        + (["--cases", args.cases] if args.cases else [])
        + (["--budget-s", str(half)] if half else [])
        + [a for o in args.option for a in ("--option", o)]
        + (["--compile-cache", args.compile_cache] if args.compile_cache else [])
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([tmp] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", *child], cwd=tmp, env=env, stdout=subprocess.PIPE, text=True
    )
    log.info("base run exited %d after %.1f s", proc.returncode, time.monotonic() - t0)
    try:
        with open(base_json) as f:
            base = json.load(f)
    except (OSError, ValueError) as e:
        base = {"rows": [], "error": repr(e)}
    if not args.keep_base:
        shutil.rmtree(tmp, ignore_errors=True)
    args.json = json_path
    left = args.budget_s - (time.monotonic() - t0) if args.budget_s else None
    result = run_suite(args, benches, max(left, 1.0) if left is not None else None)
    by_key = {(r["benchmark"], r["case"], r["variant"]): r for r in base["rows"]}
    for row in result["rows"]:
        other = by_key.get((row["benchmark"], row["case"], row["variant"]))
        row["base_ms"] = other["ours_ms"] if other else None
        row["vs_base"] = row["ours_ms"] / row["base_ms"] if row["ours_ms"] and row["base_ms"] else None
    result["base"] = dict(
        ref=args.base,
        commit=sha,
        json=base_json,
        exit=proc.returncode,
        device=base.get("device"),
        ceilings=base.get("ceilings"),
    )
    write_json(args.json, result)
    return result, proc.returncode


def list_registry(selected: list[registry.Benchmark] | None = None, shapes: str = "ci") -> str:
    """The registry as a markdown table; with `selected` (a --suite or --only selection) also each of
    their cases at `shapes`, by index (what --cases picks)."""
    rows = [
        dict(
            benchmark=b.name,
            suite=b.suite,
            peer=b.peer,
            ceiling=b.ceiling,
            ci=len(b.shapes["ci"]),
            full=len(b.shapes["full"]),
            variants=", ".join(b.variants) or None,
        )
        for b in registry.BENCHMARKS
    ]
    out = common.markdown_table(rows, ["benchmark", "suite", "peer", "ceiling", "ci", "full", "variants"])
    for b in selected or ():
        out += f"\n\n{b.name} ({shapes} cases; fields {' '.join(b.fields)})"
        out += "".join(f"\n  {i:>2}  {b.label(case)}" for i, case in enumerate(b.shapes[shapes]))
    return out


MEM_FRACTION_ENV = "XLA_PYTHON_CLIENT_MEM_FRACTION"
MODEL_MEM_FRACTION = "0.95"  # the model suite's default share of the GPU for JAX's allocator

# The ci preset on the CPU: XLA:CPU compiles thousands of small programs that then run a few times
# (its figures mean nothing), where LLVM's optimizations cost more than they save.
CPU_CI_XLA_FLAGS = {"xla_backend_optimization_level": "0", "xla_llvm_disable_expensive_passes": "true"}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.shapes == "ci" and os.environ.get("JAX_PLATFORMS") == "cpu" and "jax" not in sys.modules:
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = " ".join(
            [flags] + [f"--{k}={v}" for k, v in CPU_CI_XLA_FLAGS.items() if f"--{k}=" not in flags]
        ).strip()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    try:
        benches = registry.select(args.suite, args.only.split(",") if args.only else None)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    if args.list:
        print(list_registry(benches if args.only or args.suite != "all" else None, args.shapes))
        return 0
    if benches and all(b.suite == "model" for b in benches) and MEM_FRACTION_ENV not in os.environ:
        # two full-size models, one at a time, beside a 1M-token cache: JAX's allocator may have the
        # GPU (its default stops at 75%); set before the backend starts
        os.environ[MEM_FRACTION_ENV] = MODEL_MEM_FRACTION
        log.info("model suite: %s=%s", MEM_FRACTION_ENV, MODEL_MEM_FRACTION)
    if args.base:
        result, _ = run_base(args, benches)
    else:
        result = run_suite(args, benches, args.budget_s)
    print(table(result["rows"], base=bool(args.base)))
    if args.base:
        ratios = [r["vs_base"] for r in result["rows"] if r.get("vs_base")]
        print(
            f"\nthis tree / base {args.base} ({result['base']['commit'][:12]}): "
            + (f"{len(ratios)} rows, geometric mean {_geomean(ratios):.3f}" if ratios else "no row timed on both")
        )
    print(f"\nwritten to {args.json} in {result.get('seconds', 0):.1f} s")
    bad = [r for r in result["rows"] if r["status"] in ("failed", "error")]
    return 1 if bad else 0


def _geomean(xs: list[float]) -> float:
    import math

    return math.exp(sum(math.log(x) for x in xs) / len(xs))


if __name__ == "__main__":
    raise SystemExit(main())
