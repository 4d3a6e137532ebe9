"""Mutants the suite must catch: each a one-place edit of the source -- a bug that named tests
exist to find -- applied to a scratch copy of the working tree, where those tests then run.  A
mutant is caught when the tests pass on the unedited copy and fail on the edited one; one that
survives is a hole in the suite, one whose snippet no longer matches exactly one place is a table
to update.

    .venv/bin/python -m tests.mutants                # every mutant, a line each
    .venv/bin/python -m tests.mutants NAME ...       # only these
    .venv/bin/python -m tests.mutants --list         # the table

tests/test_mutants.py runs every mutant in the slow tier (``KIMIK3_SLOW=1`` or ``-m slow``) and,
in the default tier, checks that each still applies to exactly one place.  To add one, append a
`Mutant` to `MUTANTS`: the file, a snippet that occurs exactly once in it, its replacement, the
tests (pytest node ids or files) that must fail, and any environment they need (a mutant whose
tests all skip on this machine, a GPU's on a CPU, is reported "skipped", not "survived").
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class Mutant:
    name: str
    path: str  # relative to the repository root
    old: str  # occurs exactly once in `path`
    new: str
    tests: tuple[str, ...]  # pytest node ids or files, relative to the root
    bug: str  # what the edit breaks, in words
    env: tuple[tuple[str, str], ...] = ()  # for the test runs, e.g. (("JAX_PLATFORMS", "cuda"),) for a GPU's tests


MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        "mla_softmax_scale_nope_only",
        "kimik3/layers/mla.py",
        "scale=cfg.mla_qk_dim**-0.5,",
        "scale=cfg.qk_nope_dim**-0.5,",
        ("tests/kimik3/test_formulas.py",),
        "MLA's softmax scale 1/sqrt(nope) instead of 1/sqrt(nope + rope), prefill and decode alike",
    ),
    Mutant(
        "mla_decode_softmax_scale_25_percent",
        "kimik3/layers/mla.py",
        "scale=cfg.mla_qk_dim**-0.5,",
        "scale=cfg.mla_qk_dim**-0.5 * (1.25 if cache is not None and t == 1 else 1.0),",
        ("tests/kimik3/test_generate.py::test_bf16_cached_path_agrees_with_the_bf16_forward_at_every_step",),
        "MLA's softmax scale 25% too large in single-token decode steps only (the bf16 bound)",
    ),
    Mutant(
        "mxfp8_scale_emax_7",
        "kimik3/quant/formats.py",
        '_EMAX = {"mxfp8": 8, "mxfp4": 2}',
        '_EMAX = {"mxfp8": 7, "mxfp4": 2}',
        ("tests/kimik3/test_quant_spec.py",),
        "MXFP8 block scales X = floor(log2 amax) - 7 (OCP MX: - 8 for e4m3)",
    ),
    Mutant(
        "cancel_mid_prefill_keeps_its_pages",
        "serving/scheduler.py",
        "        if req.request_id in manager.requests:\n",
        "        if req.request_id in manager.requests and req.planned_len >= len(req.context):\n",
        (
            "tests/serving/test_engine.py::test_a_request_cancelled_at_any_step_returns_every_page_snapshot_and_slot",
            "tests/serving/test_worker.py::test_a_closed_stream_cancels_the_request_and_frees_every_page",
        ),
        "a request released before its prefill completes (cancelled, failed) never frees its blocks",
    ),
    Mutant(
        "cancel_while_preempted_keeps_its_offload",
        "serving/scheduler.py",
        "            self.manager.host.remove(req.offload_keys)\n",
        "            pass\n",
        ("tests/serving/test_engine.py::test_a_request_cancelled_while_preempted_leaves_nothing_held",),
        "a request cancelled while preempted leaves its offloaded KV in the host tier",
    ),
    Mutant(
        "ep_dense_capacity_halved",
        "sharding/layers.py",
        "cap = n * k  # every row could go to one rank",
        "cap = n * k // 2  # every row could go to one rank",
        ("tests/sharding/test_expert_dispatch.py",),
        "the dense EP dispatch's capacity too small for a skewed routing (rows dropped)",
    ),
    Mutant(
        "ep_ragged_rows_land_at_the_senders_offsets",
        "sharding/layers.py",
        "out_offsets = (jnp.cumsum(sizes_sd, axis=0) - sizes_sd)[me]",
        "out_offsets = send_offsets",
        ("tests/sharding/test_expert_dispatch.py",),
        "the ragged EP dispatch writes each source's rows at the sender's own offsets (sources overwrite each other)",
    ),
    Mutant(
        "router_failover_reuses_the_handoff_handle",
        "serving/router/core.py",
        "            handed = adopt if first else None  # the handed-over KV may be half taken: later attempts recompute",
        "            handed = adopt  # the handed-over KV may be half taken: later attempts recompute",
        ("tests/serving/test_router_failures.py",),
        "a decode failover after a direct P/D handoff offers the spent one-time handle again",
    ),
    Mutant(
        "router_retries_a_4xx",
        "serving/router/retry.py",
        "    if retriable is False or 400 <= status < 500:",
        "    if retriable is False:",
        ("tests/serving/test_router_failures.py",),
        "a worker's 400 refusal (no retriable flag) is retried on another worker",
    ),
    Mutant(
        "hopper_decode_releases_p_before_reading_it",
        "pallas_kernels/mla_decode_hopper.py",
        "            acc = value_half(acc, i, slot, 1)\n            plgpu.barrier_arrive(p_free.at[pslot])\n",
        "            plgpu.barrier_arrive(p_free.at[pslot])\n            acc = value_half(acc, i, slot, 1)\n",
        ("tests/pallas_kernels/test_ring_order.py",),
        "the MLA decode's second warpgroup releases its P slot before its P @ V wgmma reads it",
    ),
)


@dataclasses.dataclass
class Outcome:
    mutant: Mutant
    # "caught", "survived", "skipped" (every named test skipped here: the machine lacks what they
    # need) or "error" (the tests fail without the mutant, or did not run)
    verdict: str
    seconds: float
    detail: str  # the failing tests' summary lines, or why it is an error


def by_name(names) -> list[Mutant]:
    table = {m.name: m for m in MUTANTS}
    unknown = [n for n in names if n not in table]
    if unknown:
        raise KeyError(f"no mutant named {unknown}; the mutants are {sorted(table)}")
    return [table[n] for n in names]


def places(mutant: Mutant, root: pathlib.Path = ROOT) -> int:
    """How often the mutant's snippet occurs in its file under `root` (0 when the file is gone)."""
    path = root / mutant.path
    return path.read_text(encoding="utf-8").count(mutant.old) if path.is_file() else 0


def copy_tree(dest: pathlib.Path, root: pathlib.Path = ROOT) -> None:
    """The working tree as git sees it -- tracked files (with their uncommitted edits) and untracked
    files it does not ignore -- copied to `dest` (no .git, no .venv, no build outputs)."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root,
        capture_output=True,
        check=True,
    )
    for rel in sorted(set(out.stdout.decode().split("\0")) - {""}):
        src = root / rel
        if src.is_file():  # a tracked file deleted in the working tree is skipped
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def apply(mutant: Mutant, root: pathlib.Path) -> None:
    """Edit the copy under `root`; ValueError unless the snippet occurs exactly once."""
    n = places(mutant, root)
    if n != 1:
        raise ValueError(f"mutant {mutant.name}: its snippet occurs {n} times in {mutant.path} (must be once)")
    path = root / mutant.path
    path.write_text(path.read_text(encoding="utf-8").replace(mutant.old, mutant.new), encoding="utf-8")


def run_tests(tests, root: pathlib.Path, timeout_s: float, extra_env=()) -> subprocess.CompletedProcess:
    """pytest on `tests` in the tree at `root` (stopping at the first failure), importing that
    tree's packages (and so do the processes the tests start)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}  # not the outer run's worker
    env["PYTHONPATH"] = os.pathsep.join([str(root)] + [p for p in [env.get("PYTHONPATH")] if p])
    env.update(extra_env)
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests]
    return subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout_s)


def _ran(proc: subprocess.CompletedProcess) -> bool:
    """Whether any test ran to a pass or a failure (not all skipped or deselected)."""
    return re.search(r"\b\d+ (passed|failed)", proc.stdout) is not None


def _summary(proc: subprocess.CompletedProcess) -> str:
    lines = (proc.stdout + proc.stderr).splitlines()
    keep = [ln for ln in lines if ln.startswith(("FAILED", "ERROR"))] or lines[-3:]
    return "\n".join(keep[-6:])


def run(mutant: Mutant, *, baseline: bool = True, timeout_s: float = 900.0) -> Outcome:
    """Copy the working tree, run the mutant's tests there unedited (`baseline`: they must pass),
    apply the mutant and run them again: "caught" when they fail (pytest exit status 1)."""
    t0 = time.monotonic()
    scratch = pathlib.Path(tempfile.mkdtemp(prefix=f"kimik3-mutant-{mutant.name}-"))
    try:
        copy_tree(scratch)
        if baseline:
            proc = run_tests(mutant.tests, scratch, timeout_s, mutant.env)
            if proc.returncode == 0 and not _ran(proc):
                return Outcome(mutant, "skipped", time.monotonic() - t0, _summary(proc))
            if proc.returncode != 0:
                return Outcome(
                    mutant, "error", time.monotonic() - t0, "the tests fail without the mutant:\n" + _summary(proc)
                )
        try:
            apply(mutant, scratch)
        except ValueError as e:
            return Outcome(mutant, "error", time.monotonic() - t0, str(e))
        proc = run_tests(mutant.tests, scratch, timeout_s, mutant.env)
        verdict = {0: "survived" if _ran(proc) else "skipped", 1: "caught"}.get(proc.returncode, "error")
        return Outcome(mutant, verdict, time.monotonic() - t0, f"pytest exit {proc.returncode}\n" + _summary(proc))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("names", nargs="*", help="mutants to run (default: all)")
    ap.add_argument("--list", action="store_true", help="print the table and exit")
    ap.add_argument("--no-baseline", action="store_true", help="skip the run of the unedited copy")
    args = ap.parse_args(argv)
    mutants = by_name(args.names) if args.names else list(MUTANTS)
    w = max(len(m.name) for m in mutants)
    if args.list:
        for m in mutants:
            print(f"{m.name:{w}s} {m.path}: {m.bug}\n{'':{w}s} tests: {' '.join(m.tests)}")
        return 0
    failed = 0
    for m in mutants:
        out = run(m, baseline=not args.no_baseline)
        failed += out.verdict not in ("caught", "skipped")
        print(f"{m.name:{w}s} {out.verdict:8s} {out.seconds:6.1f} s", flush=True)
        if out.verdict != "caught":
            print("    " + out.detail.replace("\n", "\n    "), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
