"""Fault injection for tests and drills: forged entries in a shared Mooncake store.

What any process on the host can do to the store without the deployment's secret: open a plain
Mooncake client (the library the tiers use, no secret) and replace the entries under live keys.
`forge_entries` does exactly that, so a test can check that forged pages are never served (the
tiers count them in `stats.auth_failures` and answer misses, cache/store_auth.py).

Each forgery is as convincing as a writer without the secret can make it: the stored entry's
framing (version, dtype, shape, hence its exact size) with a random payload, tagged under a
random secret (`how="force"`: remove with force, then put, the overwrite a plain client can
always do; `how="upsert"`: Mooncake's replace-in-place).  A stored object that is not a tier
entry is replaced by random bytes of its size.
"""

from __future__ import annotations

import logging
import secrets
import urllib.request
from typing import Sequence

import numpy as np

from cache.host_tier import _HEADER, _PREFIX, MAGIC, TierError, _dtype, encode_entry
from cache.store_auth import StoreAuth

log = logging.getLogger(__name__)


def list_store_keys(master_http_url: str, timeout_s: float = 5.0) -> list[str]:
    """Every key the store holds, from its master's HTTP server (`MooncakeServices.master_http_url`)."""
    with urllib.request.urlopen(f"{master_http_url.rstrip('/')}/get_all_keys", timeout=timeout_s) as r:
        return [k for k in r.read().decode().splitlines() if k]


def _forgery(key: str, genuine: bytes, auth: StoreAuth, rng: np.random.Generator) -> bytes:
    """A well-framed entry shaped like `genuine` with a random payload, tagged under `auth`."""
    try:
        magic, _, meta_len, n = _HEADER.unpack_from(genuine, 0)
        dtype_str, shape_str = bytes(genuine[_PREFIX : _PREFIX + meta_len]).decode().rsplit("|", 1)
        shape = tuple(int(s) for s in shape_str.split(",") if s)
        dtype = _dtype(dtype_str)
        if magic != MAGIC or int(np.prod(shape, dtype=np.int64)) * dtype.itemsize != n:
            raise ValueError("not a tier entry")
    except Exception:  # noqa: BLE001 - not a tier entry: random bytes of its size
        return rng.bytes(len(genuine))
    payload = np.frombuffer(rng.bytes(n), np.uint8).view(dtype).reshape(shape)
    return encode_entry(payload, key, auth)


def forge_entries(
    target,
    keys: Sequence[str] | None = None,
    *,
    master_http_url: str | None = None,
    how: str = "force",
    seed: int | None = None,
) -> list[str]:
    """Replace the entry under each of `keys` with a forgery written by a plain Mooncake client
    without the secret; returns the keys whose forgery was stored.

    `target`: a `MooncakeHostKVTier` (or a tier wrapping one as `.inner`, like
    `GuardedHostKVTier`) or a `MooncakeServices`: where the store's master and metadata server
    are.  `keys` None: every key the store holds, listed from `master_http_url` (default: the
    target's own, which a `MooncakeServices` has).  `how`: "force" (remove with force, then put)
    or "upsert".  Keys that are absent are skipped."""
    if how not in ("force", "upsert"):
        raise ValueError(f"how is 'force' or 'upsert'; got {how!r}")
    target = getattr(target, "inner", target)
    master_http_url = master_http_url or getattr(target, "master_http_url", None)
    if keys is None:
        if master_http_url is None:
            raise ValueError("no keys given and no master_http_url to list them from")
        keys = list_store_keys(master_http_url)
    from mooncake.store import MooncakeDistributedStore  # optional: mooncake (the store extra)

    plain = MooncakeDistributedStore()
    if plain.setup("127.0.0.1", target.metadata_url, 0, 16 << 20, "tcp", "", target.master_addr) != 0:
        raise TierError(f"a plain Mooncake client could not set up against {target.master_addr}")
    attacker = StoreAuth(secrets.token_bytes(32))  # a secret that is not the deployment's
    rng = np.random.default_rng(seed)
    forged = []
    try:
        for key in keys:
            genuine = plain.get(key)
            if not genuine:
                continue
            blob = _forgery(key, genuine, attacker, rng)
            if how == "force":
                plain.remove(key, True)
                rc = plain.put(key, blob)
            else:
                rc = plain.upsert(key, blob)
            if rc == 0:
                forged.append(key)
            else:
                log.warning("forging %s failed (rc=%d)", key, rc)
    finally:
        plain.close()
    return forged
