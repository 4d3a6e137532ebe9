"""Authenticated store entries: a keyed MAC with the deployment's secret on everything a tier stores.

A shared store (Mooncake, Redis) takes writes from any local process that speaks its protocol, so
a stored entry proves nothing about who wrote it.  Every entry a tier writes therefore carries a
tag, HMAC-SHA256 under the deployment's secret over a purpose label, the entry's store key and
its framing and payload (`StoreAuth.tag`); a reader recomputes it before it interprets a byte of
the entry, and an entry whose tag does not verify is a miss, never served.  Writers without the
secret cannot make a tag that verifies, under a live key or any other; an entry copied under
another key fails too (the key is in the MAC).

The secret, in the order `StoreAuth(secret)` looks for it:

1. `secret` passed explicitly (bytes, or a hex string);
2. `KIMIK3_STORE_SECRET` in the environment, hex (`kimik3 launch` gives every process of a
   deployment the same one: `new_secret()` makes one);
3. none: a random secret of this process, made once and logged once at INFO.  Entries then
   authenticate within this process only (an embedded tier still checks its entries), and two
   processes without a shared secret never accept each other's entries.

A secret is at least `MIN_SECRET_BYTES` bytes; a malformed one raises `StoreSecretError` when a
tier is built, never on the serving path.  The secret is never logged; `fingerprint` (a keyed
hash of a constant) tells processes that share a secret apart from those that do not.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import struct
import threading

log = logging.getLogger(__name__)

ENV = "KIMIK3_STORE_SECRET"
MIN_SECRET_BYTES = 16
TAG_BYTES = 32  # HMAC-SHA256

_process_secret: bytes | None = None
_process_lock = threading.Lock()


class StoreSecretError(ValueError):
    """The configured store secret is malformed (not hex, or shorter than `MIN_SECRET_BYTES`)."""


def new_secret() -> str:
    """A fresh deployment secret, hex: what a launcher puts in `KIMIK3_STORE_SECRET` for its children."""
    return secrets.token_hex(32)


def _parse(secret: bytes | str, where: str) -> bytes:
    if isinstance(secret, str):
        try:
            secret = bytes.fromhex(secret.strip())
        except ValueError:
            raise StoreSecretError(f"the store secret ({where}) is not hex") from None
    if len(secret) < MIN_SECRET_BYTES:
        raise StoreSecretError(f"the store secret ({where}) has {len(secret)} bytes; at least {MIN_SECRET_BYTES}")
    return bytes(secret)


def _reset_after_fork() -> None:
    global _process_secret
    _process_secret = None  # a forked child is another process: its own secret (tiers built before keep theirs)


os.register_at_fork(after_in_child=_reset_after_fork)


def _local_secret() -> bytes:
    global _process_secret
    with _process_lock:
        if _process_secret is None:
            _process_secret = secrets.token_bytes(32)
            log.info(
                "no %s in the environment: store entries are authenticated with a secret of this process "
                "(fingerprint %s); other processes' entries will be misses",
                ENV,
                _fingerprint(_process_secret),
            )
        return _process_secret


def _fingerprint(secret: bytes) -> str:
    return hmac.digest(secret, b"kimik3 store secret fingerprint", "sha256")[:6].hex()


class StoreAuth:
    """Tags and checks store entries under one secret (module docstring).  Thread-safe."""

    def __init__(self, secret: bytes | str | None = None):
        if secret is not None:
            self._secret, self.source = _parse(secret, "passed explicitly"), "explicit"
        elif os.environ.get(ENV):
            self._secret, self.source = _parse(os.environ[ENV], ENV), "env"
        else:
            self._secret, self.source = _local_secret(), "process"
        self.fingerprint = _fingerprint(self._secret)
        self._base = hmac.new(self._secret, digestmod=hashlib.sha256)  # keyed once; each tag copies it

    def __repr__(self) -> str:
        return f"StoreAuth(source={self.source!r}, fingerprint={self.fingerprint!r})"

    def tag(self, label: bytes, key: str | bytes, *parts) -> bytes:
        """HMAC-SHA256(secret, len(label) | label | len(key) | key | parts...), `TAG_BYTES` bytes.

        `label` names what the entry is (a KV entry, an L1 URL entry), so a tag of one kind never
        verifies as another.  `parts` are bytes-like (memoryviews and contiguous arrays are hashed
        in place, without a copy); the caller frames them so their boundaries are unambiguous
        (fixed sizes, or lengths in an earlier part)."""
        kb = key.encode() if isinstance(key, str) else bytes(key)
        h = self._base.copy()
        h.update(struct.pack("<H", len(label)) + label + struct.pack("<I", len(kb)) + kb)
        for p in parts:
            h.update(p)
        return h.digest()

    def verify(self, tag, label: bytes, key: str | bytes, *parts) -> bool:
        """Whether `tag` is this secret's tag of (label, key, parts); constant-time comparison."""
        return len(tag) == TAG_BYTES and hmac.compare_digest(bytes(tag), self.tag(label, key, *parts))
