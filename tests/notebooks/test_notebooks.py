"""Every notebook under notebooks/ executes top to bottom without error."""

import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

# The EAGLE-3 A/B notebook trains a target and a draft first (~100 s on 2 cores) and the media
# cache's runs its ablation (~40 s): each re-runs a CLI's path that a test covers
# (tests/serving/test_eagle_ab.py, tests/serving/test_media_bench.py), so they run with the slow
# tests only (KIMIK3_SLOW=1); so does the Kimi-Linear notebook, whose comparison with transformers
# tests/kimik3/test_hf_reference.py makes in every run.
SLOW = {"eagle_ab.ipynb", "media_cache_ablation.ipynb", "kimi_linear.ipynb"}
NOTEBOOKS = [
    pytest.param(p, marks=pytest.mark.slow) if p.name in SLOW else p
    for p in sorted((pathlib.Path(__file__).parents[2] / "notebooks").glob("*.ipynb"))
]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: getattr(p, "name", None))
def test_notebook_runs(path):
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
