"""The CLI's persistent compilation cache: a second run loads its programs from disk and
prints the same tokens; "off" and an unusable directory compile as usual."""

import os
import subprocess
import sys

from kimik3 import compile_cache

ARGS = [sys.executable, "-m", "serving.cli", "generate", "--config", "tiny", "--prompt", "Hi", "--max-new-tokens", "3"]


def _run(cache: str):
    env = dict(os.environ, KIMIK3_COMPILE_CACHE=cache)
    out = subprocess.run(ARGS, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    return [line for line in out.stdout.splitlines() if line.startswith("tokens:")]


def test_a_second_run_reads_the_cache_and_gives_the_same_tokens(tmp_path):
    cache = tmp_path / "xla"
    first = _run(str(cache))
    entries = set(os.listdir(cache))
    assert any(name.startswith("jit__forward") for name in entries)
    assert _run(str(cache)) == first and first
    assert set(os.listdir(cache)) == entries  # nothing new to compile the second time


def test_off_and_unusable_directories_compile_as_usual(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    assert _run("off") == _run(str(blocker / "xla"))
    assert compile_cache.cache_dir("off") is None and compile_cache.cache_dir("~/x").endswith("/x")
