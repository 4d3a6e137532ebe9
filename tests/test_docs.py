"""The documentation site builds strictly: every guide link, every API reference and every
docstring mkdocstrings renders resolves (mkdocs.yml), and a broken one fails the build."""

import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).parents[1]
pytest.importorskip("mkdocstrings_handlers.python", reason="the docs extra (mkdocs, mkdocstrings-python)")


def _build(root: pathlib.Path, site: pathlib.Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(root / "mkdocs.yml"), "-d", str(site)],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_site_and_its_api_reference_build_strictly(tmp_path):
    proc = _build(ROOT, tmp_path / "site")
    assert proc.returncode == 0, proc.stderr[-3000:]
    engine = (tmp_path / "site" / "api" / "engine" / "index.html").read_text()
    assert "EngineConfig" in engine and "submit" in engine  # rendered from the docstrings
    assert (tmp_path / "site" / "repo" / "benchmarks" / "RESULTS" / "index.html").exists()


@pytest.mark.parametrize(
    "page, broken",
    [
        ("api/index.md", "[a name that is not there][kimik3.model.no_such_function]"),
        ("model.md", "[a guide that is not there](no_such_guide.md)"),
        ("kernels.md", "[a file beside the docs that is not there](../benchmarks/NO_SUCH.md)"),
    ],
)
def test_a_broken_reference_or_link_fails_the_build(tmp_path, page, broken):
    copy = tmp_path / "repo"
    copy.mkdir()
    shutil.copy(ROOT / "mkdocs.yml", copy)
    shutil.copytree(ROOT / "docs", copy / "docs")
    for name in ("kimik3", "serving", "cache", "pallas_kernels", "benchmarks", "notebooks"):
        (copy / name).symlink_to(ROOT / name)
    with open(copy / "docs" / page, "a") as f:
        f.write(f"\n\n{broken}\n")
    proc = _build(copy, tmp_path / "site")
    assert proc.returncode != 0
    assert "WARNING" in proc.stderr or "Aborted" in proc.stderr
