"""mkdocs hooks: the guides link to files beside docs/ (benchmarks/RESULTS.md, the notebooks);
those files, and the files they link to in turn, join the site under `repo/` and the links are
rewritten to them, so a link to a file that does not exist still fails the strict build."""

from __future__ import annotations

import os
import posixpath
import re

from mkdocs.structure.files import File, InclusionLevel

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
UP = re.compile(r"\]\(\.\./([^)#\s]+)")  # ](../path) in a page at the docs root
RELATIVE = re.compile(r"\]\((?![a-z]+:|#|/)([^)#\s]+)")  # ](path) relative to its page


def _links_of(path: str) -> set[str]:
    """Repository paths a Markdown file under the repository links to (relative links only)."""
    with open(os.path.join(REPO, path), encoding="utf-8") as f:
        text = f.read()
    base = posixpath.dirname(path)
    return {posixpath.normpath(posixpath.join(base, link)) for link in RELATIVE.findall(text)}


def on_files(files, config):
    todo = set()
    for f in files.documentation_pages():
        with open(f.abs_src_path, encoding="utf-8") as fh:
            todo.update(UP.findall(fh.read()))
    seen: set[str] = set()
    while todo:
        path = todo.pop()
        if path in seen or not os.path.isfile(os.path.join(REPO, path)):
            continue  # a missing target stays unresolved: the strict build reports it
        seen.add(path)
        files.append(
            File.generated(
                config, f"repo/{path}", abs_src_path=os.path.join(REPO, path), inclusion=InclusionLevel.NOT_IN_NAV
            )
        )
        if path.endswith(".md"):
            todo |= _links_of(path)
    return files


def on_page_markdown(markdown, page, config, files):
    if page.file.src_uri.startswith("repo/"):
        return markdown
    return UP.sub(lambda m: f"](repo/{m.group(1)}", markdown)
