"""Every notebook under notebooks/ executes top to bottom without error, and is committed as it
ran: with the outputs of every code cell (`python -m tests.notebooks.execute notebooks/X.ipynb`
saves them), its figures left to the notebook's display (no notebook picks a file-only
matplotlib backend, so a figure shows inline in Jupyter).

The EAGLE-3 A/B notebook trains a target and its draft with the configurations of the suite's
`trained_tiny` and `trained_draft` fixtures (tests/conftest.py), which train once a run: here it
is handed that pair (KIMIK3_TRAINED_TINY / KIMIK3_TRAINED_DRAFT) and runs only the A/B.  The
Kimi-Linear notebook needs the `reference` extra (transformers and CPU torch) and the serving one
the `openai` client, both in the dev install (`./run.sh test`)."""

import os
import pathlib
import re

import nbformat
import pytest

from tests.notebooks.execute import execute

NOTEBOOK_DIR = pathlib.Path(__file__).parents[2] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
ids = lambda p: p.name
# matplotlib.use(...), pyplot.switch_backend(...) or %matplotlib naming a backend that draws to files only
FILE_BACKEND = re.compile(
    r"""((\.use|switch_backend)\(\s*["']|%matplotlib\s+)(agg|pdf|svg|ps|cairo|template)\b""", re.I
)


def test_the_notebooks_are_the_ones_this_suite_runs():
    names = {p.name for p in NOTEBOOKS}
    assert {"quickstart.ipynb", "kernels.ipynb", "caching.ipynb", "serving.ipynb"} <= names, names
    assert {"eagle_ab.ipynb", "media_cache_ablation.ipynb", "kimi_linear.ipynb"} <= names, names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=ids)
def test_notebook_is_committed_with_its_outputs(path):
    """Each code cell ran (an execution count) and left outputs; none of them an error."""
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code, f"{path.name} has no code cells"
    unexecuted = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and c.execution_count is None]
    assert not unexecuted, f"{path.name}: cells {unexecuted} were never executed (run tests/notebooks/execute.py)"
    silent = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and not c.outputs]
    assert not silent, f"{path.name}: code cells {silent} have no outputs"
    errors = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors, f"{path.name}: cells {errors} hold an error"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=ids)
def test_notebook_figures_display_inline(path):
    """No notebook switches matplotlib to a file-only backend (its figures would never show in
    Jupyter); a notebook that draws shows its figures (PNG outputs, small enough to commit)."""
    nb = nbformat.read(path, as_version=4)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert not FILE_BACKEND.search(cell.source), f"{path.name} cell {i}: a file-only matplotlib backend"
    draws = any("plt." in c.source for c in nb.cells if c.cell_type == "code")
    pngs = [
        o.data["image/png"]
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.outputs
        if "image/png" in o.get("data", {})
    ]
    if draws:
        assert pngs, f"{path.name} draws a figure but holds none"
    assert all(len(p) * 3 // 4 < 100_000 for p in pngs), f"{path.name}: a figure over 100 KB"


@pytest.mark.parametrize("path", [p for p in NOTEBOOKS if p.name != "eagle_ab.ipynb"], ids=ids)
def test_notebook_runs(path):
    if path.name == "kimi_linear.ipynb" and not os.environ.get("KIMIK3_REQUIRE_REFERENCE"):
        pytest.importorskip("transformers")
        pytest.importorskip("torch")
    if path.name == "serving.ipynb":
        try:
            import openai  # noqa: F401
        except ImportError:
            pytest.fail("serving.ipynb needs the openai client: pip install openai")
    execute(path)


def test_eagle_ab_notebook_runs_on_the_suites_trained_pair(trained_tiny, trained_draft, monkeypatch):
    """The A/B notebook on the pair the suite trained (the notebook's own configurations)."""
    monkeypatch.setenv("KIMIK3_TRAINED_TINY", trained_tiny[0].out)
    monkeypatch.setenv("KIMIK3_TRAINED_DRAFT", trained_draft[3])
    execute(NOTEBOOK_DIR / "eagle_ab.ipynb")
