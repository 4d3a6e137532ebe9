"""The persistent XLA compilation cache of the command-line entry points.

A serving engine compiles one whole-model program per step shape (~30 s each for
`small` on an H200 host, ~20 shapes); a restarted worker or a second `kimik3
demo` finds them on disk instead.  The library never turns this on by itself
(JAX's config is process-global); `kimik3 ...` and `python -m serving.<module>`
do, at `$KIMIK3_COMPILE_CACHE` (default ~/.cache/kimik3/xla; "off" disables),
and children they start inherit the variable.
"""

from __future__ import annotations

import logging
import os

ENV = "KIMIK3_COMPILE_CACHE"
DEFAULT_DIR = os.path.join(os.path.expanduser("~"), ".cache", "kimik3", "xla")
OFF = ("", "off", "none", "0")

log = logging.getLogger(__name__)


def cache_dir(value: str | None = None) -> str | None:
    """The cache directory for `value` (else $KIMIK3_COMPILE_CACHE, else the default); None if off."""
    value = os.environ.get(ENV, DEFAULT_DIR) if value is None else value
    return None if value.strip().lower() in OFF else os.path.abspath(os.path.expanduser(value))


def enable(value: str | None = None) -> str | None:
    """Point JAX's persistent compilation cache at `cache_dir(value)` and export it to child
    processes.  Returns the directory, or None when off or when it cannot be created (then
    every program compiles as usual: a cache is an optimisation, never a requirement)."""
    import jax  # on use: serving.cli imports this module, and --help stays JAX-free

    directory = cache_dir(value)
    os.environ[ENV] = directory or "off"
    if directory is None:
        return None
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        log.warning("compilation cache %s unusable (%s): compiling without it", directory, e)
        return None
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    _autotune_cache(os.path.join(directory, "autotune"))
    log.info("persistent compilation cache: %s", directory)
    return directory


def _autotune_cache(directory: str) -> None:
    """XLA's GPU autotuning results beside the programs (a cache hit skips the compile, but a
    program evicted or compiled for a new shape still re-autotunes its GEMMs without this).
    Only effective before the GPU backend starts; XLA_FLAGS set by the user win."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_gpu_per_fusion_autotune_cache_dir" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_gpu_per_fusion_autotune_cache_dir={directory}".strip()
