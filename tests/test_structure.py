"""The code's structure as contracts: the import layers and acyclic packages that pyproject.toml
declares (import-linter), and the model's math written once: the residual block, the head's
fp32 dot, the MoE's tail and MLA's two forms each have one home that every mesh and every
reference calls."""

import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PRODUCT = ("kimik3", "sharding", "serving", "pallas_kernels", "cache", "harness")

# concept: (what a second definition would contain, the one file that may)
ONE_HOME = {
    "the residual block's additions": (re.compile(r"\bx_btd \+ "), "kimik3/block.py"),
    "the head's fp32 dot": (re.compile(r"lm_head\w*\.astype\(jnp\.float32\)"), "kimik3/block.py"),
    "the MoE's routed tail": (re.compile(r"\* cfg\.routed_scaling_factor"), "kimik3/layers/moe.py"),
    "MLA's expansion and absorption": (re.compile(r'"(bsr|nsr|bthn|bthr),rh[nvd]->'), "pallas_kernels/mla_forms.py"),
}


def _sources():
    for package in PRODUCT:
        for path in sorted((ROOT / package).rglob("*.py")):
            yield path.relative_to(ROOT).as_posix(), path.read_text(encoding="utf-8")


@pytest.mark.parametrize("concept", list(ONE_HOME))
def test_each_piece_of_model_math_is_written_in_one_place(concept):
    pattern, home = ONE_HOME[concept]
    found = {name for name, text in _sources() if pattern.search(text)}
    assert found == {home}, f"{concept}: written in {sorted(found)}, its one home is {home}"


def test_every_mesh_builds_its_blocks_from_the_one_residual_block():
    for name in ("sharding/prefill.py", "sharding/decode.py"):
        assert "residual_block(" in (ROOT / name).read_text(), name
    block = (ROOT / "kimik3/block.py").read_text()
    assert "mixer_half(" in block and "ffn_half(" in block


def test_the_import_layers_and_acyclic_packages_hold():
    exe = shutil.which("lint-imports", path=os.path.dirname(sys.executable)) or shutil.which("lint-imports")
    if exe is None:
        pytest.skip("import-linter is not installed (the dev extra installs it)")
    proc = subprocess.run([exe], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:]
