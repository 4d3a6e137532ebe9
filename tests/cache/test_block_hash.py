"""Block hashes: chained, deterministic across processes, sensitive to every extra."""

import subprocess
import sys

import pytest

from cache.block_hash import MMItem, block_hashes

TOKENS = list(range(300))
NS = "tiny/float32"


def test_only_full_blocks_and_chained():
    hs = block_hashes(TOKENS, block_size=128, namespace=NS)
    assert len(hs) == 2 and len(set(hs)) == 2
    # a change in block 0 changes every later hash; a change in block 1 leaves block 0
    changed = block_hashes([999] + TOKENS[1:], block_size=128, namespace=NS)
    assert changed[0] != hs[0] and changed[1] != hs[1]
    tail = block_hashes(TOKENS[:200] + [7] * 100, block_size=128, namespace=NS)
    assert tail[0] == hs[0] and tail[1] != hs[1]


def test_extras_change_the_hash():
    base = block_hashes(TOKENS, namespace=NS)
    assert block_hashes(TOKENS, namespace="tiny/bf16") != base
    salted = block_hashes(TOKENS, namespace=NS, salt="tenant-a")
    assert salted[0] != base[0] and salted != block_hashes(TOKENS, namespace=NS, salt="tenant-b")
    img = [MMItem(b"\x01" * 16, offset=130, length=4)]
    with_img = block_hashes(TOKENS, namespace=NS, mm_items=img)
    assert with_img[0] == base[0] and with_img[1] != base[1]
    other_img = block_hashes(TOKENS, namespace=NS, mm_items=[MMItem(b"\x02" * 16, offset=130, length=4)])
    assert other_img[1] != with_img[1]
    moved = block_hashes(TOKENS, namespace=NS, mm_items=[MMItem(b"\x01" * 16, offset=131, length=4)])
    assert moved[1] != with_img[1]


def test_identical_in_a_fresh_process():
    code = (
        "from cache.block_hash import block_hashes, MMItem;"
        "print([h.hex() for h in block_hashes(list(range(300)), namespace='tiny/float32', salt='t',"
        " mm_items=[MMItem(bytes(16), 5, 3)])])"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": seed, "PYTHONPATH": "."},
        ).stdout
        for seed in ("1", "2")
    }
    here = str([h.hex() for h in block_hashes(TOKENS, namespace=NS, salt="t", mm_items=[MMItem(bytes(16), 5, 3)])])
    assert outs == {here + "\n"}


def test_bad_arguments():
    with pytest.raises(ValueError, match="namespace"):
        block_hashes(TOKENS, namespace="")
    with pytest.raises(ValueError, match="exceeds"):
        block_hashes(TOKENS, namespace=NS, mm_items=[MMItem(b"x", 298, 5)])
