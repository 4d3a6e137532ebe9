"""Run a notebook top to bottom as the test suite runs it (nbclient, a python3 kernel started in the
notebook's folder) and, from the command line, save it with its outputs:

    .venv/bin/python -m tests.notebooks.execute notebooks/caching.ipynb [...]

The saved file keeps what a reader needs (each cell's outputs and execution count) and drops what
changes from run to run without meaning anything: nbclient's per-cell timing and the kernel's
version details in the notebook's metadata."""

from __future__ import annotations

import os
import pathlib
import sys
import time

import nbformat
from nbclient import NotebookClient

# the notebook's own metadata, as committed (the kernel's language_info details are dropped)
METADATA = {
    "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
    "language_info": {"name": "python"},
}


def execute(path: pathlib.Path, timeout: int = 600) -> nbformat.NotebookNode:
    """The notebook at `path`, executed (a cell that raises raises here: `CellExecutionError`)."""
    nb = nbformat.read(path, as_version=4)
    NotebookClient(
        nb,
        timeout=timeout,
        kernel_name="python3",
        record_timing=False,
        resources={"metadata": {"path": str(path.parent)}},
    ).execute()
    return nb


def clean(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """Drop the volatile metadata an execution leaves (timings, the kernel's version details)."""
    nb.metadata = nbformat.from_dict(METADATA)
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
    return nb


def main(paths: list[str]) -> int:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    for p in map(pathlib.Path, paths):
        t0 = time.perf_counter()
        nb = clean(execute(p.resolve()))
        nbformat.write(nb, p)
        print(f"{p}: executed in {time.perf_counter() - t0:.1f} s, saved with its outputs", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
