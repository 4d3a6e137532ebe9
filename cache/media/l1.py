"""L1 of the media cache: fetched image bytes by URL.

Two maps, as a content-addressed store keeps them:

    (tenant, normalized URL) -> content hash        who fetched what, per tenant, with a TTL
    content hash             -> bytes               shared, checked against its hash on read

A tenant reaches bytes only through its own URL entries, so a hit never tells one tenant what
another fetched; two tenants (or two URLs) with the same image share one copy of its bytes.
A blob whose bytes no longer match its hash is a miss (counted `corrupt`), never returned.

`EmbeddedFetchCache` is an in-process LRU under a byte budget (the default: one router), built
on cachetools.
`RedisFetchCache` is shared by every router that points at the same Redis (started on loopback,
with a password, by the tests and `kimik3 launch --redis`); every Redis call has a short socket
timeout, and an outage or a timeout is a miss (counted `errors`), never an error or a stall.

Whoever can reach that Redis can write it, so its URL entries are authenticated: the value under
a URL key is the content hash followed by HMAC-SHA256 under the deployment's store secret over
the Redis key and that hash (`cache.store_auth`: `KIMIK3_STORE_SECRET`, or the `secret` given).
The bytes are bound to the tag through their SHA-256 (the content hash), which every read checks,
so a forged URL entry, or bytes that do not match the authenticated hash, are misses counted in
`auth_failures` (and `corrupt`).  Routers share entries only when they share the secret.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import threading
import time
import urllib.parse

import cachetools

from cache.byte_lru import ByteBudgetLRU
from cache.store_auth import TAG_BYTES, StoreAuth

log = logging.getLogger(__name__)


def normalize_url(url: str) -> str:
    """Scheme and host lower-cased, the default port and the fragment dropped; path and query
    kept as sent (servers may treat them case-sensitively)."""
    p = urllib.parse.urlsplit(url)
    scheme, host = p.scheme.lower(), (p.hostname or "").lower()
    default = {"http": 80, "https": 443}.get(scheme)
    port = p.port
    netloc = (f"[{host}]" if ":" in host else host) + (f":{port}" if port and port != default else "")
    return urllib.parse.urlunsplit((scheme, netloc, p.path or "/", p.query, ""))


def content_hash(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _url_key(tenant: str | None, url: str) -> str:
    return hashlib.sha256(f"{tenant or ''}\x00{normalize_url(url)}".encode()).hexdigest()


_URL_LABEL = b"media-l1-url/1"
_DIGEST_HEX = 64  # a content hash: SHA-256, hex


@dataclasses.dataclass
class CacheStats:
    """`corrupt`: stored entries a get rejected; `auth_failures`: those that were not authentic
    (a shared cache's forged entries; always 0 for in-process caches).  Each is also a miss."""

    hits: int = 0
    misses: int = 0
    puts: int = 0
    corrupt: int = 0
    auth_failures: int = 0
    errors: int = 0
    bytes_hit: int = 0

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


class EmbeddedFetchCache:
    """In-process L1: blobs under `budget_bytes`, least recently read or written out first
    (`cache.byte_lru.ByteBudgetLRU`); URL entries in a `cachetools.TTLCache` of `max_urls`,
    each valid for `ttl_s` after its put (`clock` seconds), least recently used out first past
    `max_urls` (their blobs stay in the LRU).  A blob larger than the budget is not kept."""

    def __init__(
        self, budget_bytes: int = 256 << 20, ttl_s: float = 3600.0, clock=time.monotonic, max_urls: int = 100_000
    ):
        if max_urls < 1:
            raise ValueError(f"max_urls must be >= 1; got {max_urls}")
        self.budget_bytes, self.ttl_s, self.clock, self.max_urls = budget_bytes, ttl_s, clock, max_urls
        self._urls: cachetools.TTLCache = cachetools.TTLCache(maxsize=max_urls, ttl=ttl_s, timer=clock)
        self._blobs = ByteBudgetLRU(budget_bytes, len)
        self._lock = threading.Lock()
        self.stats = CacheStats()

    def get(self, url: str, tenant: str | None = None) -> bytes | None:
        key = _url_key(tenant, url)
        with self._lock:
            digest = self._urls.get(key)  # None: never put, or expired
            data = self._blobs.get(digest) if digest is not None else None  # now the most recent
            if data is not None and content_hash(data) != digest:
                del self._blobs[digest]
                self.stats.corrupt += 1
                data = None
            if data is None:
                self.stats.misses += 1
                return None
            self.stats.hits += 1
            self.stats.bytes_hit += len(data)
            return data

    def put(self, url: str, data: bytes, tenant: str | None = None) -> None:
        if not self._blobs.fits(data):
            return
        digest = content_hash(data)
        with self._lock:
            self._urls[_url_key(tenant, url)] = digest
            if digest in self._blobs:
                self._blobs.touch(digest)
            else:
                self._blobs[digest] = bytes(data)
            self.stats.puts += 1

    @property
    def bytes_held(self) -> int:
        return self._blobs.currsize


class RedisFetchCache:
    """L1 in Redis (`redis_url`, e.g. redis://127.0.0.1:6379/0), shared across processes.
    Keys live under `prefix`; both maps expire after `ttl_s`.  URL entries are tagged with
    `secret` (see `cache.store_auth`; None: `KIMIK3_STORE_SECRET`, else this process's own)."""

    def __init__(
        self,
        redis_url: str,
        ttl_s: float = 3600.0,
        timeout_s: float = 0.25,
        prefix: str = "kimik3:l1",
        max_entry_bytes: int = 64 << 20,
        secret: bytes | str | StoreAuth | None = None,
    ):
        import redis  # optional dependency: only a deployment with a shared L1 needs it

        self._errors = (redis.exceptions.RedisError, OSError)
        self._redis = redis.Redis.from_url(
            redis_url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry_on_timeout=False
        )
        self.ttl_s, self.prefix, self.max_entry_bytes = ttl_s, prefix, max_entry_bytes
        self.auth = secret if isinstance(secret, StoreAuth) else StoreAuth(secret)
        self.stats = CacheStats()

    def ping(self) -> bool:
        """Whether Redis answers a PING within the socket timeout (a health probe; never raises)."""
        try:
            return bool(self._redis.ping())
        except self._errors:
            return False

    def _pointer(self, url_key: str, digest: str) -> bytes:
        """The value stored under `url_key`: the content hash and its tag."""
        return digest.encode() + self.auth.tag(_URL_LABEL, url_key, digest.encode())

    def _digest(self, url_key: str, value: bytes) -> str | None:
        """The content hash in a URL entry's value, or None when the entry is not authentic."""
        digest, tag = value[:_DIGEST_HEX], value[_DIGEST_HEX:]
        if len(value) != _DIGEST_HEX + TAG_BYTES or not self.auth.verify(tag, _URL_LABEL, url_key, digest):
            return None
        try:
            return digest.decode("ascii")
        except UnicodeDecodeError:
            return None

    def _rejected(self, what: str) -> None:
        self.stats.auth_failures += 1
        self.stats.corrupt += 1
        log.warning("L1 Redis %s failed authentication (forged, or another secret's); a miss", what)

    def get(self, url: str, tenant: str | None = None) -> bytes | None:
        url_key = f"{self.prefix}:url:{_url_key(tenant, url)}"
        data = None
        try:
            value = self._redis.get(url_key)
            digest = self._digest(url_key, value) if value is not None else None
            if value is not None and digest is None:
                self._rejected("URL entry")
            elif digest is not None:
                data = self._redis.get(f"{self.prefix}:blob:{digest}")
        except self._errors as e:
            self.stats.errors += 1
            log.warning("L1 Redis lookup failed (a miss): %s", e)
            return None
        if data is not None and content_hash(data) != digest:
            self._rejected("blob (bytes not those of the authenticated hash)")
            data = None
        if data is None:
            self.stats.misses += 1
            return None
        self.stats.hits += 1
        self.stats.bytes_hit += len(data)
        return data

    def put(self, url: str, data: bytes, tenant: str | None = None) -> None:
        if len(data) > self.max_entry_bytes:
            return
        digest, ttl = content_hash(data), max(1, int(self.ttl_s))
        try:
            pipe = self._redis.pipeline()
            pipe.set(f"{self.prefix}:blob:{digest}", data, ex=ttl)
            url_key = f"{self.prefix}:url:{_url_key(tenant, url)}"
            pipe.set(url_key, self._pointer(url_key, digest), ex=ttl)
            pipe.execute()
            self.stats.puts += 1
        except self._errors as e:
            self.stats.errors += 1
            log.warning("L1 Redis store failed (not cached): %s", e)

    def close(self) -> None:
        self._redis.close()
