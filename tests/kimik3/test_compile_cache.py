"""The CLI's persistent compilation cache: a second run loads its programs from disk and
prints the same tokens; "off" and an unusable directory compile as usual."""

import os
import subprocess
import sys

import pytest

from kimik3 import compile_cache

ARGS = [sys.executable, "-m", "serving.cli", "generate", "--config", "tiny", "--prompt", "Hi", "--max-new-tokens", "3"]


def _run(cache: str):
    env = dict(os.environ, KIMIK3_COMPILE_CACHE=cache)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # the run's cache (tests/conftest.py): not this test's
    out = subprocess.run(ARGS, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    return [line for line in out.stdout.splitlines() if line.startswith("tokens:")]


@pytest.mark.slow  # KIMIK3_SLOW=1: three CLI processes, 36-64 s (the suite must stay under 20 min on 2 cores)
def test_a_second_run_reads_the_cache_and_an_unusable_directory_compiles_as_usual(tmp_path):
    """One test, three CLI runs (each compiles or loads tiny's programs: the suite's time)."""
    cache = tmp_path / "xla"
    first = _run(str(cache))
    entries = set(os.listdir(cache))
    assert any(name.startswith("jit__forward") for name in entries)
    assert _run(str(cache)) == first and first
    assert set(os.listdir(cache)) == entries  # nothing new to compile the second time
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    assert _run(str(blocker / "xla")) == first  # a cache that cannot be made: compiled as usual


def test_off_names_no_directory_and_a_user_path_expands(monkeypatch):
    assert compile_cache.cache_dir("off") is None and compile_cache.cache_dir("~/x").endswith("/x")
    monkeypatch.setenv(compile_cache.ENV, "somewhere")
    assert compile_cache.enable("off") is None  # nothing enabled; children inherit "off"
    assert os.environ[compile_cache.ENV] == "off"
