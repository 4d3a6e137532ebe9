"""The code's structure as contracts: the import layers and acyclic packages that pyproject.toml
declares (import-linter), imports at the module's top unless a comment says why not, and the
model's math written once: the residual block, the head's fp32 dot, the MoE's tail and MLA's two
forms each have one home that every mesh and every reference calls.

``python tests/test_structure.py`` lists every function-level import of the product code by file."""

import ast
import collections
import io
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tokenize

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


# Imports sit at the module's top.  One inside a function says why in a comment on its line, or
# on a comment line directly above it or above the imports it follows: a heavy or optional
# dependency (`# optional: the serve extra`), or a module that must stay light (`# JAX: loads on
# use`, `# loads only where a mesh is given`).  A lint pragma alone (noqa) says nothing.
# PENDING_FILES: files whose function-level imports are still to be moved or explained.
PENDING_FILES: frozenset[str] = frozenset()
_PRAGMA = re.compile(r"#\s*(noqa(:\s*[A-Z]+[0-9]+(\s*,\s*[A-Z]+[0-9]+)*)?|type:\s*ignore(\[[^]]*\])?|fmt:\s*\w+)\s*")


def _comments(text: str) -> tuple[set[int], set[int]]:
    """(lines holding a comment that is more than a lint pragma, those of them holding nothing else)."""
    said, alone = set(), set()
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT and not _PRAGMA.fullmatch(tok.string):
            said.add(tok.start[0])
            if not tok.line[: tok.start[1]].strip():
                alone.add(tok.start[0])
    return said, alone


def function_level_imports(text: str) -> list[tuple[int, str, bool]]:
    """(line, statement, whether a comment says why) of every import inside a function of `text`: a
    comment on the statement's lines, or a comment line directly above it or above an import of
    the run of imports that leads to it."""
    lines, found = text.splitlines(), []
    said_on, comment_lines = _comments(text)

    def visit(node, in_function: bool) -> None:
        for field in ("body", "orelse", "finalbody", "handlers", "cases"):
            body = getattr(node, field, None)
            if not isinstance(body, list):
                continue
            under = False  # the imports before this one (blank lines between them) sit under a comment line
            for child in body:
                if not isinstance(child, (ast.Import, ast.ImportFrom)):
                    under = False
                else:
                    under = under or child.lineno - 1 in comment_lines
                    if in_function:
                        said = under or any(n in said_on for n in range(child.lineno, child.end_lineno + 1))
                        found.append((child.lineno, lines[child.lineno - 1].strip(), said))
                visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(text), False)
    return found


def _function_level_imports_by_file() -> dict[str, list[tuple[int, str, bool]]]:
    by_file = {name: function_level_imports(text) for name, text in _sources()}
    return {name: found for name, found in by_file.items() if found}


def test_function_level_imports_say_why_they_are_not_at_the_top():
    unsaid = collections.defaultdict(list)
    for name, found in _function_level_imports_by_file().items():
        if name not in PENDING_FILES:
            unsaid[name] += [f"  {line}: {stmt}" for line, stmt, said in found if not said]
    unsaid = {name: rows for name, rows in unsaid.items() if rows}
    listing = "\n".join(f"{name}\n" + "\n".join(rows) for name, rows in sorted(unsaid.items()))
    assert not unsaid, f"move these imports to the module's top, or say why they stay (a comment):\n{listing}"


def test_pending_files_still_have_imports_to_sort_out():
    """A file leaves PENDING_FILES once its function-level imports are all moved or explained."""
    by_file = _function_level_imports_by_file()
    done = sorted(name for name in PENDING_FILES if all(said for _, _, said in by_file.get(name, [])))
    assert not done, f"no import left to sort out in {done}: take them off PENDING_FILES"


def test_the_function_level_import_check_sees_a_new_unexplained_one():
    text = """import os


def f(x):
    import json

    # optional: a heavy dependency
    import numpy

    import jax
    x += 1
    import torch  # optional: the reference extra
    import yaml  # noqa: F401
    if x:  # a comment about the condition
        import zlib
    return [json, numpy, jax, torch, zlib]
"""
    found = {stmt: said for _, stmt, said in function_level_imports(text)}
    assert found == {
        "import json": False,
        "import numpy": True,
        "import jax": True,  # under the comment above its run of imports
        "import torch  # optional: the reference extra": True,
        "import yaml  # noqa: F401": False,  # a lint pragma is no reason
        "import zlib": False,  # the comment above is the condition's
    }


if __name__ == "__main__":
    for name, found in _function_level_imports_by_file().items():
        print(f"{name} ({len(found)})")
        for line, stmt, said in found:
            print(f"  {line:5d} {'  ' if said else '! '}{stmt}")
    print(sum(map(len, _function_level_imports_by_file().values())), "function-level imports")
