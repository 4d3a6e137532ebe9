"""The host-memory KV tier: one interface, two backends.

Entries are numpy arrays (MLA latent pages, KDA state snapshots) stored under
namespaced string keys (``"<namespace>/<kind>/<hash hex>"``).  Every stored
entry is framed and authenticated (format version 3):

    header  magic "KK3T" | version u16 | meta length u16 | payload length u64   (16 bytes, little-endian)
    tag     HMAC-SHA256(secret, "kv-entry/3" | store key | header | meta | payload)   (32 bytes)
    meta    "<dtype>|<comma-separated shape>"   (utf-8; numpy's dtype str, or an ml_dtypes name: bfloat16)
    payload the array's bytes, C order

(`cache.store_auth` says how the secret is found and how the MAC input is framed.)  On load the
lengths are checked against the blob, then the tag, and only then is the meta parsed and the
payload viewed as an array.  An entry that is not authentic -- forged by a writer without the
secret, written under another key, truncated, or damaged -- is a *miss*, counted in
`stats.auth_failures` (and `stats.corrupt`), never a wrong array and never an exception on the
serving path.  A tier remembers the keys whose entry failed: `exists` reports them absent and
the next put of one replaces what is stored, so a publisher's next write heals a poisoned key.

* `EmbeddedHostKVTier`: in-process host memory, LRU under a byte budget
  (`cache.byte_lru.ByteBudgetLRU`: cachetools' LRUCache sized in bytes).
  The single-machine default.
* `MooncakeHostKVTier` (cache/mooncake_tier.py): Mooncake Store, shared by
  many engines and hosts.
"""

from __future__ import annotations

import abc
import dataclasses
import logging
import struct
import threading
import time
from typing import Sequence

import cachetools
import numpy as np

from cache.byte_lru import ByteBudgetLRU
from cache.store_auth import TAG_BYTES, StoreAuth

log = logging.getLogger(__name__)

MAGIC = b"KK3T"
VERSION = 3  # 3: an HMAC-SHA256 tag over key, framing and payload (2: an XXH3-128 checksum)
KINDS = ("mla", "kda", "preempt", "vit")  # key kinds a tier accepts (preempt: a preempted request's KV; vit: ViT rows)
_HEADER = struct.Struct("<4sHHQ")  # magic, version, meta length, payload length
_PREFIX = _HEADER.size + TAG_BYTES  # header and tag: what precedes the meta
_LABEL = b"kv-entry/3"
_FORGED_KEYS = 65536  # keys remembered as failing authentication (the least recently failed are forgotten past this)


class TierError(RuntimeError):
    """A tier backend is unreachable or misconfigured (raised on setup, never on the serving path)."""


def make_key(namespace: str, kind: str, block_hash: bytes) -> str:
    if kind not in KINDS:
        raise ValueError(f"unknown key kind {kind!r}; kinds are {KINDS}")
    if not namespace or any(c.isspace() for c in namespace):
        raise ValueError(f"namespace must be non-empty without whitespace; got {namespace!r}")
    return f"{namespace}/{kind}/{block_hash.hex()}"


def _meta(shape, dtype) -> bytes:
    dtype = np.dtype(dtype)
    token = dtype.name if dtype.kind == "V" else dtype.str  # bfloat16 and friends (ml_dtypes): by name
    return f"{token}|{','.join(map(str, shape))}".encode()


def _dtype(token: str) -> np.dtype:
    """The dtype a meta names (`_meta`): numpy's own by their str, ml_dtypes' by their name."""
    try:
        return np.dtype(token)
    except TypeError:
        import ml_dtypes  # only entries of its dtypes need it

        return np.dtype(getattr(ml_dtypes, token))


def entry_size(shape, dtype) -> int:
    """Bytes of the framed entry of an array of this shape and dtype."""
    return _PREFIX + len(_meta(shape, dtype)) + int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize


def _payload(array: np.ndarray) -> np.ndarray:
    """The array's bytes as a flat uint8 view (a copy only if it is not C-contiguous)."""
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8)


def encode_entry_into(buf, array: np.ndarray, key: str, auth: StoreAuth) -> int:
    """Frame `array` as the entry under `key` into the writable buffer `buf` (at least
    `entry_size` bytes); returns the bytes written.  The payload is copied once, into `buf`."""
    array = np.asarray(array)
    meta, payload = _meta(array.shape, array.dtype), _payload(array)
    header = _HEADER.pack(MAGIC, VERSION, len(meta), payload.nbytes)
    out = np.frombuffer(buf, np.uint8) if not isinstance(buf, np.ndarray) else buf
    n = _PREFIX + len(meta) + payload.nbytes
    if out.nbytes < n:
        raise ValueError(f"a {out.nbytes}-byte buffer for a {n}-byte entry")
    out[: _HEADER.size] = np.frombuffer(header, np.uint8)
    out[_HEADER.size : _PREFIX] = np.frombuffer(auth.tag(_LABEL, key, header, meta, payload), np.uint8)
    out[_PREFIX : _PREFIX + len(meta)] = np.frombuffer(meta, np.uint8)
    out[_PREFIX + len(meta) : n] = payload
    return n


def encode_entry(array: np.ndarray, key: str, auth: StoreAuth) -> bytes:
    """The framed, tagged bytes of `array` as the entry under `key`."""
    array = np.asarray(array)
    meta, payload = _meta(array.shape, array.dtype), _payload(array)
    header = _HEADER.pack(MAGIC, VERSION, len(meta), payload.nbytes)
    return b"".join((header, auth.tag(_LABEL, key, header, meta, payload), meta, payload))


def _open(blob, key: str, auth: StoreAuth) -> tuple[np.ndarray | None, bool]:
    """(the array in `blob`, whether `blob` is an authentic entry under `key`).  The array is a
    view of `blob`, None when the entry is not authentic or (authentic) names a dtype this
    process cannot make.  Nothing of the meta or payload is interpreted before the tag verifies."""
    try:
        blob = memoryview(blob).cast("B")
        if len(blob) < _PREFIX:
            return None, False
        magic, version, meta_len, n = _HEADER.unpack_from(blob, 0)
        if magic != MAGIC or version != VERSION or len(blob) != _PREFIX + meta_len + n:
            return None, False
        header, tag = blob[: _HEADER.size], blob[_HEADER.size : _PREFIX]
        meta, payload = blob[_PREFIX : _PREFIX + meta_len], blob[_PREFIX + meta_len :]
        if not auth.verify(tag, _LABEL, key, header, meta, payload):
            return None, False
    except (struct.error, ValueError, TypeError):
        return None, False
    try:
        dtype_str, shape_str = bytes(meta).decode().rsplit("|", 1)  # a dtype str may hold "|" ("|i1")
        shape = tuple(int(s) for s in shape_str.split(",") if s)
        return np.frombuffer(payload, dtype=_dtype(dtype_str)).reshape(shape), True
    except (ValueError, TypeError, UnicodeDecodeError, AttributeError, ImportError):
        return None, True


def open_entry(blob, key: str, auth: StoreAuth) -> np.ndarray | None:
    """The array in `blob` (a view of it, no copy), or None when `blob` is not an authentic entry
    under `key` -- malformed, truncated, another version, another key's entry, or a tag that does
    not verify -- or names a dtype this process cannot make."""
    return _open(blob, key, auth)[0]


def decode_entry(blob, key: str, auth: StoreAuth, expect_shape=None, expect_dtype=None) -> np.ndarray | None:
    """The array in `blob`, or None when it is not authentic (`open_entry`) or not of the
    expected shape and dtype."""
    arr = open_entry(blob, key, auth)
    if arr is None or _mismatched(arr, expect_shape, expect_dtype):
        return None
    return arr


def _mismatched(arr: np.ndarray, shape, dtype) -> bool:
    return (shape is not None and tuple(shape) != arr.shape) or (dtype is not None and np.dtype(dtype) != arr.dtype)


UNREADABLE = object()  # a backend's answer for "an entry is stored, but not one this read can hold"


@dataclasses.dataclass
class TierStats:
    """A tier's counts.  `corrupt` counts every stored entry a get rejected; `auth_failures` the
    part of those that were not authentic (forged, another key's, truncated or damaged: see the
    module docstring), the rest being authentic entries of another shape or dtype.  Every
    rejected entry is also a miss."""

    puts: int = 0
    put_bytes: int = 0
    hits: int = 0
    get_bytes: int = 0
    misses: int = 0
    corrupt: int = 0
    auth_failures: int = 0
    errors: int = 0
    evictions: int = 0

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


class HostKVTier(abc.ABC):
    """Batched put / get-into / exists / remove by key.  Faults become misses.

    `secret` (bytes, a hex string, or a `StoreAuth`) authenticates entries; None: the
    `KIMIK3_STORE_SECRET` of the environment, else a secret of this process (`cache.store_auth`)."""

    def __init__(self, secret: bytes | str | StoreAuth | None = None):
        self.stats = TierStats()
        self.auth = secret if isinstance(secret, StoreAuth) else StoreAuth(secret)
        self._lock = threading.Lock()
        self._forged: cachetools.LRUCache = cachetools.LRUCache(maxsize=_FORGED_KEYS)
        self._forged_lock = threading.Lock()
        self._auth_logged_at = float("-inf")

    @abc.abstractmethod
    def _put_blob(self, key: str, blob: bytes) -> bool: ...

    @abc.abstractmethod
    def _get_blob(self, key: str) -> bytes | memoryview | None: ...

    @abc.abstractmethod
    def exists(self, keys: Sequence[str]) -> list[bool]: ...

    @abc.abstractmethod
    def remove(self, keys: Sequence[str]) -> None: ...

    # ---- keys whose entry failed authentication ------------------------------------------------
    def _mark_forged(self, key: str) -> None:
        with self._forged_lock:
            self._forged[key] = None  # the most recent; past _FORGED_KEYS the least recent goes

    def _is_forged(self, key: str) -> bool:
        return key in self._forged

    def _healed(self, key: str) -> None:
        """An authentic entry now stands under `key` (this tier wrote it)."""
        if self._forged:
            with self._forged_lock:
                self._forged.pop(key, None)

    def _present(self, keys: Sequence[str], stored: Sequence[bool]) -> list[bool]:
        """`stored`, except keys known to hold an entry that failed authentication (absent, so
        that their publisher writes them again)."""
        if not self._forged:
            return list(stored)
        return [s and k not in self._forged for k, s in zip(keys, stored)]

    def _accept(self, key: str, blob, out: np.ndarray) -> bool:
        """Verify a fetched entry and copy it into `out`: True (a hit) only for an authentic
        entry of `out`'s shape and dtype.  `blob`: the entry's bytes, None (absent) or
        `UNREADABLE` (stored, but not of the size this read expected)."""
        if blob is None:
            self.stats.misses += 1
            return False
        arr, authentic = (None, False) if blob is UNREADABLE else _open(blob, key, self.auth)
        if not authentic:
            self._auth_failure(key)
            return False
        if arr is None or _mismatched(arr, out.shape, out.dtype):
            what = "an unknown dtype" if arr is None else f"{arr.dtype} {arr.shape}"
            log.warning("host tier entry %s holds %s, not %s %s; a miss", key, what, out.dtype, out.shape)
            self.stats.corrupt += 1
            self.stats.misses += 1
            return False
        out[...] = arr
        self.stats.hits += 1
        self.stats.get_bytes += arr.nbytes
        return True

    def _auth_failure(self, key: str) -> None:
        self.stats.auth_failures += 1
        self.stats.corrupt += 1
        self.stats.misses += 1
        self._mark_forged(key)
        now = time.monotonic()
        if now - self._auth_logged_at >= 10.0:  # a flood of forgeries must not flood the log
            self._auth_logged_at = now
            log.warning(
                "host tier entry %s failed authentication (forged, written without this deployment's store "
                "secret, or damaged); a miss (%d so far)",
                key,
                self.stats.auth_failures,
            )

    def batch_put(self, keys: Sequence[str], arrays: Sequence[np.ndarray]) -> list[bool]:
        """Store each array; False where the backend refused or failed (logged, counted)."""
        if len(keys) != len(arrays):
            raise ValueError(f"{len(keys)} keys for {len(arrays)} arrays")
        out = []
        for key, arr in zip(keys, arrays):
            blob = encode_entry(np.asarray(arr), key, self.auth)
            try:
                ok = self._put_blob(key, blob)
            except Exception as e:  # noqa: BLE001 - a tier fault must not reach the serving path
                log.warning("host tier put %s failed: %r", key, e)
                self.stats.errors += 1
                ok = False
            if ok:
                self.stats.puts += 1
                self.stats.put_bytes += len(blob)
                self._healed(key)
            out.append(ok)
        return out

    def batch_get_into(self, keys: Sequence[str], outs: Sequence[np.ndarray]) -> list[bool]:
        """Fill each out buffer from its key; False (a miss) if missing, not authentic or mismatched.
        An out buffer is written only on a hit."""
        if len(keys) != len(outs):
            raise ValueError(f"{len(keys)} keys for {len(outs)} buffers")
        found = []
        for key, out in zip(keys, outs):
            try:
                blob = self._get_blob(key)
            except Exception as e:  # noqa: BLE001
                log.warning("host tier get %s failed: %r", key, e)
                self.stats.errors += 1
                blob = None
            found.append(self._accept(key, blob, out))
        return found


class EmbeddedHostKVTier(HostKVTier):
    """In-process host memory: entries (framed blobs) under `capacity_bytes`, least recently
    read or written out first (`stats.evictions` counts them); `used_bytes` is what they hold.
    An entry larger than the capacity is refused (its put returns False)."""

    def __init__(self, capacity_bytes: int, *, secret: bytes | str | StoreAuth | None = None):
        super().__init__(secret)
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive; got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._data = ByteBudgetLRU(capacity_bytes, len)

    @property
    def used_bytes(self) -> int:
        return self._data.currsize

    def _put_blob(self, key, blob):
        if not self._data.fits(blob):
            return False
        with self._lock:
            self._data.pop(key, None)  # a replaced entry is not an eviction
            evicted = self._data.evictions
            self._data[key] = blob
            self.stats.evictions += self._data.evictions - evicted
        return True

    def _get_blob(self, key):
        with self._lock:
            return self._data.get(key)  # now the most recent

    def exists(self, keys):
        with self._lock:
            stored = [k in self._data for k in keys]
        return self._present(keys, stored)

    def remove(self, keys):
        with self._lock:
            for k in keys:
                self._data.pop(k, None)
