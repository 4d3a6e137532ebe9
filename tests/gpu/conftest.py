"""The GPU suite: what only a GPU can check: the Hopper kernels' real bodies (the
Mosaic GPU interpreter runs a different one), the model's sm_90 dispatch, bf16 serving.

    JAX_PLATFORMS=cuda PYTHONPATH=$PWD python3 -m pytest -q tests/gpu

Every test here skips cleanly where no GPU backend runs (the CPU CI, the dev machine)."""

import jax
import pytest


def _gpu() -> bool:
    try:
        return jax.default_backend() == "gpu"
    except RuntimeError:
        return False


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a GPU backend (JAX_PLATFORMS=cuda)")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/") and not _gpu():
            item.add_marker(skip)


def sm90() -> bool:
    return _gpu() and str(getattr(jax.devices()[0], "compute_capability", "")).startswith("9")
