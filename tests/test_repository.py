"""The tree describes the product, not its making: lint and format clean (ruff, as configured in
pyproject.toml), a README a newcomer reads (under 10,000 characters), every relative link in the
README, docs and results resolving, no project-history words, benchmarks as one registry with a
results table of current figures."""

import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# the words spelled in pieces, so that this file passes the same search
HISTORY = re.compile(
    "|".join(
        [r"session [0-9]", r"issues? [0-9]", r"(twenty|thirty)[a-z]+ round", "must" + "-show", "nvidia-h[12]00" + "-x"]
    ),
    re.I,
)


def _ruff():
    exe = shutil.which("ruff", path=os.path.dirname(sys.executable)) or shutil.which("ruff")
    if exe is None:
        pytest.skip("ruff is not installed (the dev extra installs it)")
    return exe


@pytest.mark.parametrize("args", [["check", "."], ["format", "--check", "."]], ids=["lint", "format"])
def test_ruff_is_clean(args):
    proc = subprocess.run([_ruff(), *args], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def _tracked():
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip("not a git checkout")
    return [ROOT / p for p in out.stdout.splitlines() if (ROOT / p).is_file()]


def test_no_file_tells_the_story_of_its_making():
    hits = []
    for path in _tracked():
        if path.suffix in (".png", ".whl", ".npy"):
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        hits += [
            f"{path.relative_to(ROOT)}:{text[: m.start()].count(chr(10)) + 1}: {m.group(0)}"
            for m in HISTORY.finditer(text)
        ]
    assert not hits, "\n".join(hits[:20])


def test_the_readme_is_short_and_every_relative_link_resolves():
    assert len((ROOT / "README.md").read_text(encoding="utf-8")) < 10_000
    broken = []
    pages = [
        ROOT / "README.md",
        *sorted((ROOT / "docs").glob("*.md")),
        ROOT / "benchmarks" / "README.md",
        ROOT / "benchmarks" / "RESULTS.md",
    ]
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            if not (page.parent / target.split("#")[0]).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, broken


def test_benchmarks_are_one_registry_and_results_hold_current_tables():
    scripts = [p.name for p in (ROOT / "benchmarks").glob("*.py") if p.name not in ("registry.py", "run.py")]
    assert len(scripts) <= 15, sorted(scripts)
    assert not (ROOT / "benchmarks" / "gpu_round.sh").exists()
    assert len((ROOT / "benchmarks" / "RESULTS.md").read_text(encoding="utf-8").splitlines()) < 400
