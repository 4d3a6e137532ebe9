"""The benchmark runner on the CPU: every registered benchmark's ci preset runs in one process (Pallas
in interpret mode, `tiny` configs) and writes rows whose checks pass; `--base` runs another commit's
library code and reports this / base; the registry covers every benchmark module.  Figures of a
CPU run mean nothing: only that each benchmark runs, checks and reports is tested here, so a GPU
run does not find a broken benchmark."""

import ast
import json
import os
import re
import subprocess
import sys

import pytest

from benchmarks import registry

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH_DIR = os.path.join(ROOT, "benchmarks")
SHARED = {"common", "profile", "registry", "run", "__init__"}  # the runner's own modules, no benchmark in them


def _run(args, timeout=600):
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return proc


@pytest.fixture(scope="module")
def ci_run(tmp_path_factory):
    """`--suite all --shapes ci`, once: (exit code, stdout, the JSON it wrote)."""
    out = tmp_path_factory.mktemp("ci") / "ci.json"
    proc = _run(["--suite", "all", "--shapes", "ci", "--json", str(out)])
    result = json.loads(out.read_text()) if out.exists() else None
    return proc, result


def test_the_ci_preset_runs_every_benchmark_and_every_check_passes(ci_run):
    proc, result = ci_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert result is not None
    for key in ("date", "device", "host_cpu", "versions", "commit", "ceilings", "rows"):
        assert key in result, key
    assert result["device"] == "cpu" and result["ceilings"]["memory_gbs"] is None
    assert set(result["versions"]) >= {"jax", "jaxlib", "torch", "triton", "fla"}
    assert re.fullmatch(r"[0-9a-f]{40}", result["commit"]["sha"] or "")
    rows = result["rows"]
    keys = [(r["benchmark"], r["case"], r["variant"]) for r in rows]
    assert len(keys) == len(set(keys)), "a row yielded again (completed) is kept once"
    for bench in registry.BENCHMARKS:
        mine = [r for r in rows if r["benchmark"] == bench.name]
        assert len(mine) >= len(bench.shapes["ci"]), (bench.name, mine)
        for r in mine:
            assert r["status"] == "ok" and r["check"]["ok"], r
            assert set(r) >= {"case", "ours_ms", "peer", "peer_ms", "ratio", "ceiling_kind", "fraction_of_ceiling"}
            if "accuracy benchmark" not in bench.peer_note:  # every other benchmark times ours
                assert r["ours_ms"] and r["ours_ms"] > 0, r
            if bench.ceiling is not None:
                assert r["ceiling_kind"] in ("memory", "compute"), r
    # the table at the end: a markdown row per result row
    table = [line for line in proc.stdout.splitlines() if line.startswith("| ") and not line.startswith("| --- ")]
    assert table[0].startswith("| benchmark | case | variant | ours_ms") and len(table) == len(rows) + 1


def test_base_runs_the_same_benchmarks_on_another_commit_and_reports_this_over_base(tmp_path):
    out = tmp_path / "ab.json"
    proc = _run(
        ["--only", "kda_decode,host_tier", "--shapes", "ci", "--cases", "0", "--base", "HEAD", "--json", str(out)]
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    result = json.loads(out.read_text())
    base = json.loads((tmp_path / "ab.base.json").read_text())
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    assert result["base"]["commit"] == head and base["commit"]["sha"] == head
    assert [r["benchmark"] for r in base["rows"]] == ["kda_decode", "host_tier"]  # --cases 0: the first of each
    assert all(r["base_ms"] and r["vs_base"] == pytest.approx(r["ours_ms"] / r["base_ms"]) for r in result["rows"])
    header = next(line for line in proc.stdout.splitlines() if line.startswith("| benchmark"))
    assert header.endswith("| base_ms | vs_base |")
    assert "this tree / base HEAD" in proc.stdout


def test_a_spent_budget_skips_the_remaining_benchmarks_and_still_writes_the_file(tmp_path):
    out = tmp_path / "budget.json"
    proc = _run(["--only", "host_tier,kda_decode", "--budget-s", "1e-9", "--json", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["benchmark"], r["status"]) for r in rows] == [("kda_decode", "skipped"), ("host_tier", "skipped")]


def test_a_row_whose_check_fails_is_marked_failed_and_not_timed():
    bench = registry.by_name()["kda_decode"]
    ctx = registry.Context(bench, shapes="ci")

    def never():
        raise AssertionError("a failed check's case must not be timed")

    row = ctx.row(bench.shapes["ci"][0], {"max_err": 1.0, "tol": 0.1, "ok": False}, never, peer_ms=never)
    assert row["status"] == "failed" and row["ours_ms"] is None and row["peer_ms"] is None
    ok = ctx.row("x", {"max_err": 0.0, "tol": 0.1, "ok": True}, 2.0, peer_ms=lambda: 4.0, work={"bytes": 1})
    assert ok["status"] == "ok" and ok["ratio"] == 0.5 and ok["ceiling_kind"] == "memory"
    assert ok["fraction_of_ceiling"] is None  # no ceiling measured (the CPU)


def test_the_registry_covers_every_benchmark_module_and_each_entry_is_complete():
    modules = {f[:-3] for f in os.listdir(BENCH_DIR) if f.endswith(".py")} - SHARED
    registered = {b.module for b in registry.BENCHMARKS}
    assert modules == registered, f"unregistered: {modules - registered}; missing: {registered - modules}"
    assert len([f for f in os.listdir(BENCH_DIR) if f.endswith(".py")]) <= 17
    names = [b.name for b in registry.BENCHMARKS]
    assert len(names) == len(set(names))
    for b in registry.BENCHMARKS:
        assert b.suite in registry.SUITES and b.ceiling in registry.CEILINGS + (None,), b.name
        assert callable(b.load()), b.name
        assert b.peer is not None or b.peer_note, f"{b.name}: no peer and no reason"
        assert b.check and b.doc, b.name
        for preset in ("ci", "full"):
            assert b.shapes[preset], (b.name, preset)
            assert all(len(case) == len(b.fields) for case in b.shapes[preset]), (b.name, preset)
    # every function a benchmark module defines at top level that the registry names exists there
    for b in registry.BENCHMARKS:
        tree = ast.parse(open(os.path.join(BENCH_DIR, f"{b.module}.py")).read())
        assert b.fn in {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}, b.name


def test_the_moe_tilings_stay_importable_for_the_gpu_tests():
    from benchmarks.moe import hopper_tilings

    assert [t.label for t in hopper_tilings(4096, 2048, False, quick=False)][0] == "m128 n128 k64 s4 w8 M"
