"""Chained block hashes: the identity of a prefix at cache-block granularity.

    h_i = H(h_{i-1} | tokens of block i | extras of block i)

Extras: the namespace (model, quantization, dtype) in the seed h_{-1}, the
tenant salt on block 0, and every image overlapping block i as (image hash,
its first token's offset relative to the block, its length).  H is BLAKE2b
with a fixed 16-byte digest and no per-process randomness, so every process
and host computes the same hashes.  Only full blocks are hashed: a partial
last block is never shared.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
from typing import Sequence

import numpy as np

DIGEST_BYTES = 16
_PERSON = b"kimik3-blk-v1"  # domain separation from any other BLAKE2b use


@dataclasses.dataclass(frozen=True)
class MMItem:
    """An image in the prompt: its content hash and the token span of its placeholders."""

    content_hash: bytes
    offset: int  # index of its first placeholder token in the prompt
    length: int  # number of placeholder tokens

    def __post_init__(self):
        if self.offset < 0 or self.length <= 0:
            raise ValueError(f"MMItem needs offset >= 0 and length > 0; got {self.offset}, {self.length}")


def image_content_hash(image) -> bytes:
    """One image's content hash, as every process computes it from the array the engine is given
    (the router from the uint8 pixels it sends, the worker's engine from what it receives): its
    dtype, shape and bytes, so uint8 and float copies of a picture never collide."""
    a = np.ascontiguousarray(image)
    return hashlib.blake2b(
        a.dtype.str.encode() + repr(a.shape).encode() + a.tobytes(), digest_size=DIGEST_BYTES, person=b"kimik3-img-v1"
    ).digest()


def image_items(token_ids: Sequence[int], images, tokens_per_image: int, image_id: int) -> tuple[MMItem, ...]:
    """One MMItem per image: the k-th image spans the k-th run of `tokens_per_image` placeholders."""
    where = [i for i, t in enumerate(token_ids) if t == image_id]
    return tuple(
        MMItem(image_content_hash(img), where[k * tokens_per_image], tokens_per_image) for k, img in enumerate(images)
    )


def _h(*parts: bytes) -> bytes:
    m = hashlib.blake2b(digest_size=DIGEST_BYTES, person=_PERSON)
    for p in parts:
        m.update(struct.pack("<Q", len(p)))  # length-prefix: no two part lists collide
        m.update(p)
    return m.digest()


def namespace_seed(namespace: str) -> bytes:
    """h_{-1}: hashes from different models, quantizations or dtypes never meet."""
    if not namespace:
        raise ValueError("namespace must name the model, quantization and dtype (e.g. 'tiny/bf16')")
    return _h(b"ns", namespace.encode())


def block_hashes(
    token_ids: Sequence[int],
    *,
    block_size: int = 128,
    mm_items: Sequence[MMItem] = (),
    salt: str | None = None,
    namespace: str,
) -> list[bytes]:
    """Hashes of the full blocks of `token_ids` (len(token_ids) // block_size of them)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive; got {block_size}")
    n_full = len(token_ids) // block_size
    for item in mm_items:
        if item.offset + item.length > len(token_ids):
            raise ValueError(
                f"image span [{item.offset}, {item.offset + item.length}) exceeds the {len(token_ids)} prompt tokens"
            )
    prev = namespace_seed(namespace)
    out = []
    for i in range(n_full):
        lo, hi = i * block_size, (i + 1) * block_size
        tokens = struct.pack(f"<{block_size}I", *(int(t) for t in token_ids[lo:hi]))
        extras = [b"salt" + salt.encode()] if (i == 0 and salt) else []
        for item in mm_items:
            if item.offset < hi and item.offset + item.length > lo:
                extras.append(b"mm" + item.content_hash + struct.pack("<qI", item.offset - lo, item.length))
        prev = _h(prev, tokens, *extras)
        out.append(prev)
    return out
