"""The host-memory KV tier: one interface, two backends.

Entries are numpy arrays (MLA latent pages, KDA state snapshots) stored under
namespaced string keys (``"<namespace>/<kind>/<hash hex>"``).  Every stored
entry is framed with a header (magic, format version, dtype, shape, payload
length, XXH3-128 checksum of the payload) that is verified on load: a corrupt,
truncated or missing entry is a *miss*, counted in `stats`, never a wrong
array and never an exception on the serving path.

* `EmbeddedHostKVTier`: in-process host memory, LRU under a byte budget.
  The single-machine default.
* `MooncakeHostKVTier` (cache/mooncake_tier.py): Mooncake Store, shared by
  many engines and hosts.
"""

from __future__ import annotations

import abc
import collections
import dataclasses
import logging
import struct
import threading
from typing import Sequence

import numpy as np
import xxhash

log = logging.getLogger(__name__)

MAGIC = b"KK3T"
VERSION = 2  # 2: XXH3-128 checksums
KINDS = ("mla", "kda", "preempt", "vit")  # key kinds a tier accepts (preempt: a preempted request's KV; vit: ViT rows)
_HEADER = struct.Struct("<4sHH16sQ")  # magic, version, header json length, checksum, payload length


class TierError(RuntimeError):
    """A tier backend is unreachable or misconfigured (raised on setup, never on the serving path)."""


def make_key(namespace: str, kind: str, block_hash: bytes) -> str:
    if kind not in KINDS:
        raise ValueError(f"unknown key kind {kind!r}; kinds are {KINDS}")
    if not namespace or any(c.isspace() for c in namespace):
        raise ValueError(f"namespace must be non-empty without whitespace; got {namespace!r}")
    return f"{namespace}/{kind}/{block_hash.hex()}"


def _meta(shape, dtype) -> bytes:
    return f"{np.dtype(dtype).str}|{','.join(map(str, shape))}".encode()


def entry_size(shape, dtype) -> int:
    """Bytes of the framed entry of an array of this shape and dtype."""
    return _HEADER.size + len(_meta(shape, dtype)) + int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize


def encode_entry(array: np.ndarray) -> bytes:
    """Header + payload bytes of one array."""
    array = np.ascontiguousarray(array)
    meta = _meta(array.shape, array.dtype)
    payload = array.tobytes()
    digest = xxhash.xxh3_128_digest(payload)
    return _HEADER.pack(MAGIC, VERSION, len(meta), digest, len(payload)) + meta + payload


def decode_entry(blob: bytes | memoryview, expect_shape=None, expect_dtype=None) -> np.ndarray | None:
    """The array in `blob`, or None when the blob is corrupt or not what was expected."""
    try:
        blob = memoryview(blob)
        magic, version, meta_len, digest, n = _HEADER.unpack_from(blob, 0)
        if magic != MAGIC or version != VERSION:
            return None
        meta = bytes(blob[_HEADER.size : _HEADER.size + meta_len]).decode()
        dtype_str, shape_str = meta.split("|")
        shape = tuple(int(s) for s in shape_str.split(",") if s)
        payload = blob[_HEADER.size + meta_len :]
        if len(payload) != n or xxhash.xxh3_128_digest(payload) != digest:
            return None
        arr = np.frombuffer(payload, dtype=np.dtype(dtype_str)).reshape(shape)
    except (struct.error, ValueError, TypeError, UnicodeDecodeError):
        return None
    if (expect_shape is not None and tuple(expect_shape) != arr.shape) or (
        expect_dtype is not None and np.dtype(expect_dtype) != arr.dtype
    ):
        return None
    return arr


@dataclasses.dataclass
class TierStats:
    puts: int = 0
    put_bytes: int = 0
    hits: int = 0
    get_bytes: int = 0
    misses: int = 0
    corrupt: int = 0
    errors: int = 0
    evictions: int = 0


class HostKVTier(abc.ABC):
    """Batched put / get-into / exists / remove by key.  Faults become misses."""

    def __init__(self):
        self.stats = TierStats()
        self._lock = threading.Lock()

    @abc.abstractmethod
    def _put_blob(self, key: str, blob: bytes) -> bool: ...

    @abc.abstractmethod
    def _get_blob(self, key: str) -> bytes | memoryview | None: ...

    @abc.abstractmethod
    def exists(self, keys: Sequence[str]) -> list[bool]: ...

    @abc.abstractmethod
    def remove(self, keys: Sequence[str]) -> None: ...

    def _accept(self, key: str, stored: bool, arr: np.ndarray | None, out: np.ndarray) -> bool:
        """Count a get and copy a verified entry into `out`; `stored` says whether bytes came back."""
        if arr is None:
            if stored:
                log.warning("host tier entry %s is corrupt or mismatched; treated as a miss", key)
                self.stats.corrupt += 1
            self.stats.misses += 1
            return False
        out[...] = arr
        self.stats.hits += 1
        self.stats.get_bytes += arr.nbytes
        return True

    def batch_put(self, keys: Sequence[str], arrays: Sequence[np.ndarray]) -> list[bool]:
        """Store each array; False where the backend refused or failed (logged, counted)."""
        if len(keys) != len(arrays):
            raise ValueError(f"{len(keys)} keys for {len(arrays)} arrays")
        out = []
        for key, arr in zip(keys, arrays):
            blob = encode_entry(np.asarray(arr))
            try:
                ok = self._put_blob(key, blob)
            except Exception as e:  # noqa: BLE001 - a tier fault must not reach the serving path
                log.warning("host tier put %s failed: %r", key, e)
                self.stats.errors += 1
                ok = False
            if ok:
                self.stats.puts += 1
                self.stats.put_bytes += len(blob)
            out.append(ok)
        return out

    def batch_get_into(self, keys: Sequence[str], outs: Sequence[np.ndarray]) -> list[bool]:
        """Fill each out buffer from its key; False (a miss) if missing, corrupt or mismatched."""
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
            arr = None if blob is None else decode_entry(blob, out.shape, out.dtype)
            found.append(self._accept(key, blob is not None, arr, out))
        return found


class EmbeddedHostKVTier(HostKVTier):
    """In-process host memory with an LRU byte budget."""

    def __init__(self, capacity_bytes: int):
        super().__init__()
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive; got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._data: collections.OrderedDict[str, bytes] = collections.OrderedDict()

    def _put_blob(self, key, blob):
        if len(blob) > self.capacity_bytes:
            return False
        with self._lock:
            if key in self._data:
                self.used_bytes -= len(self._data.pop(key))
            while self.used_bytes + len(blob) > self.capacity_bytes:
                _, old = self._data.popitem(last=False)
                self.used_bytes -= len(old)
                self.stats.evictions += 1
            self._data[key] = blob
            self.used_bytes += len(blob)
        return True

    def _get_blob(self, key):
        with self._lock:
            blob = self._data.get(key)
            if blob is not None:
                self._data.move_to_end(key)
            return blob

    def exists(self, keys):
        with self._lock:
            return [k in self._data for k in keys]

    def remove(self, keys):
        with self._lock:
            for k in keys:
                blob = self._data.pop(k, None)
                if blob is not None:
                    self.used_bytes -= len(blob)

    def corrupt_for_test(self, key: str, byte_index: int = -1) -> None:
        """Flip one stored byte (fault injection for tests and drills)."""
        with self._lock:
            blob = bytearray(self._data[key])
            blob[byte_index] ^= 0xFF
            self._data[key] = bytes(blob)
