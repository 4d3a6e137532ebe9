"""Real English text to train on, from files a Debian package ships.

Sources (`find_sources`, the first one present wins under ``auto``):

* ``python-doc``: Debian's Python documentation (``apt-get install python3.11-doc``), the reST
  sources of its HTML pages, ``/usr/share/doc/python3*/html/_sources/**/*.txt`` (3.11: 497 files,
  11 MB of prose and examples);
* ``licenses``: the licence texts every Debian system carries (``base-files``),
  ``/usr/share/common-licenses/*`` (~0.3 MB: enough for a short CPU run, not to train a model).

Text becomes byte-level token ids (`kimik3.tokenizer`), documents joined by EOS.  The split is
by 4 KiB block: each block of each document goes to the held-out set when a hash of (the file's
path under the corpus's root, block) says so, so the split depends neither on file order nor on
how many documents there are (a copy of the directory splits the same), and a corpus of a few
long files still has a held-out part.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import logging
import os

import numpy as np

from kimik3 import tokenizer

log = logging.getLogger(__name__)

SOURCES = {
    "python-doc": "/usr/share/doc/python3*/html/_sources/**/*.txt",
    "licenses": "/usr/share/common-licenses/*",
}
BLOCK_BYTES = 4096


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Token ids of one source, split.  train / held_out: int32 [N] (blocks joined by EOS)."""

    name: str
    train: np.ndarray
    held_out: np.ndarray
    documents: int
    nbytes: int

    def describe(self) -> str:
        return (
            f"{self.name}: {self.documents} documents, {self.nbytes / 1e6:.2f} MB, "
            f"{self.train.size:,} train / {self.held_out.size:,} held-out tokens"
        )


def find_sources(name: str = "auto", root: str = "/") -> tuple[str, list[str]]:
    """(source name, its files sorted) for `name` (a SOURCES key, "auto", or a directory of text
    files).  Raises FileNotFoundError naming what to install when nothing is there."""
    if name not in SOURCES and name != "auto":
        files = sorted(p for p in glob.glob(os.path.join(name, "**", "*"), recursive=True) if os.path.isfile(p))
        if not files:
            raise FileNotFoundError(f"corpus directory {name!r} has no files")
        return os.path.basename(os.path.normpath(name)), files
    for key in [name] if name != "auto" else list(SOURCES):
        pattern = os.path.join(root, SOURCES[key].lstrip("/"))
        # one file once: Debian links python3.11-dev's doc directory to python3.11's
        files = sorted({os.path.realpath(p) for p in glob.glob(pattern, recursive=True) if os.path.isfile(p)})
        if files:
            return key, files
    raise FileNotFoundError(
        f"no corpus {name!r} on this machine: install Debian's python3.11-doc "
        f"(apt-get install python3.11-doc) or pass a directory of text files"
    )


def _held_out(rel_path: str, block: int, fraction: float) -> bool:
    h = hashlib.blake2b(f"{rel_path}:{block}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") / 2**64 < fraction


def load(
    name: str = "auto", *, held_out_fraction: float = 0.05, max_bytes: int | None = None, root: str = "/"
) -> Corpus:
    """The corpus `name` (see `find_sources`) as token ids, split by block.  max_bytes: read
    documents in order until this many bytes (a quick run's corpus)."""
    if not 0 < held_out_fraction < 1:
        raise ValueError(f"held_out_fraction must be in (0, 1); got {held_out_fraction}")
    source, files = find_sources(name, root)
    base = os.path.dirname(files[0]) if len(files) == 1 else os.path.commonpath(files)
    parts = {False: [], True: []}
    nbytes = docs = 0
    for path in files:
        with open(path, "rb") as f:
            data = f.read()
        text = data.decode("utf-8", errors="replace")
        data = text.encode("utf-8")
        docs += 1
        nbytes += len(data)
        for i in range(0, len(data), BLOCK_BYTES):
            ids = np.frombuffer(data[i : i + BLOCK_BYTES], np.uint8).astype(np.int32)  # = tokenizer.encode
            parts[_held_out(os.path.relpath(path, base), i // BLOCK_BYTES, held_out_fraction)].append(
                np.append(ids, np.int32(tokenizer.EOS_ID))
            )
        if max_bytes is not None and nbytes >= max_bytes:
            break
    if not parts[True] or not parts[False]:
        raise ValueError(f"corpus {source!r} ({nbytes} bytes) is too small to split at {held_out_fraction}")
    corpus = Corpus(source, np.concatenate(parts[False]), np.concatenate(parts[True]), docs, nbytes)
    log.info("corpus %s", corpus.describe())
    return corpus
