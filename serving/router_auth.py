"""Who a router's client is: the deployment's API keys, the tenant each key authenticates as, and
the cache salt that keeps one tenant's cached state from answering another's requests.

Keys come from any of (their union is the deployment's key set):

* one key: ``$KIMIK3_API_KEY`` or ``--api-key``;
* a key file: ``$KIMIK3_API_KEY_FILE`` or ``--api-key-file``.

Key file format, one key a line::

    # a field that starts with '#' starts a comment (to the line's end); blank lines are skipped
    sk-3f9c...  acme          # KEY TENANT: this key authenticates as tenant "acme"
    sk-77ab...  acme          # several keys may name one tenant (rotation): they share its caches
    sk-d041...                # KEY alone: its tenant is the key's hash (a tenant of its own)

A key or tenant holds no whitespace; a line of more than two fields, an empty file or a key
listed twice under two tenants is an error (the router does not start).  The single key
(``$KIMIK3_API_KEY``) is a one-field line: a single-key deployment has one tenant, all its
clients together.  With no key at all (a loopback development setup) every client is the
anonymous tenant.

The tenant enters every cache namespace the router controls through one salt,
``cache_salt(tenant, request.cache_salt)``: the prefix-cache salt sent to the workers (their
engines key prefix pages and KDA snapshots by it, and the encoder cache, L3, by it too), the
router's own affinity hashes, and the media cache's L1 (fetched bytes by URL) and L2 (decoded
pixels) namespaces.  A request's ``cache_salt`` only narrows within its tenant (two tenants that
send the same ``cache_salt`` still share nothing); a request's ``user`` does not narrow at all:
the same key with two ``user`` values shares its cache, unless the requests' ``cache_salt``
differ.  The anonymous tenant without a ``cache_salt`` has no salt (None): the workers' shared,
unsalted cache, as before tenants existed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat

log = logging.getLogger(__name__)

API_KEY_ENV = "KIMIK3_API_KEY"  # one key (as vLLM reads VLLM_API_KEY)
API_KEY_FILE_ENV = "KIMIK3_API_KEY_FILE"  # a key file's path
ANONYMOUS = ""  # every client's tenant when the deployment has no key


def bearer(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header value, or None.  The scheme is
    matched case-insensitively ("Bearer", "bearer", "BEARER": RFC 6750 section 2.1 and RFC 9110
    section 11.1), surrounding blanks are ignored."""
    scheme, _, token = (authorization or "").strip().partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def key_tenant(key: str) -> str:
    """The tenant of a key whose line names none: derived from the key's hash (never the key)."""
    return "key-sha256:" + hashlib.sha256(key.encode()).hexdigest()[:32]


def parse_key_file(text: str, source: str = "key file") -> dict[str, str]:
    """{key: tenant} from a key file's text (format: the module docstring); ValueError naming the
    line for a malformed one, a key listed under two tenants, or no key at all."""
    keys: dict[str, str] = {}
    for n, line in enumerate(text.splitlines(), 1):
        fields = []
        for field in line.split():
            if field.startswith("#"):
                break
            fields.append(field)
        if not fields:
            continue
        if len(fields) > 2:
            raise ValueError(f"{source}:{n}: expected 'KEY [TENANT]', got {len(fields)} fields")
        key = fields[0]
        tenant = fields[1] if len(fields) == 2 else key_tenant(key)
        if keys.get(key, tenant) != tenant:
            raise ValueError(f"{source}:{n}: a key already listed under another tenant")
        keys[key] = tenant
    if not keys:
        raise ValueError(f"{source}: no keys (every client would be refused)")
    return keys


def load_key_file(path: str) -> dict[str, str]:
    """`parse_key_file` of the file at `path`; logs a warning when others than its owner may read it."""
    with open(path) as f:
        mode = os.fstat(f.fileno()).st_mode
        text = f.read()
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("API key file %s is readable by other users (mode %o): chmod 600 it", path, mode & 0o777)
    return parse_key_file(text, path)


class KeyRing:
    """The deployment's keys.  `tenant(authorization)` is the caller's tenant: ANONYMOUS when the
    deployment has no key, the key's tenant for a known bearer key, else None (refused).  A key
    is looked up by its SHA-256 digest, so the lookup's timing depends on the digest of what the
    caller sent, never on how much of a real key it matched."""

    def __init__(self, keys: dict[str, str] | None = None):
        self._tenants = {hashlib.sha256(k.encode()).digest(): t for k, t in (keys or {}).items()}

    @classmethod
    def from_config(cls, api_key: str | None, api_key_file: str | None) -> "KeyRing":
        """The single key (its tenant: `key_tenant`) and a key file's keys; a key in both keeps
        the file's tenant."""
        keys = {api_key: key_tenant(api_key)} if api_key else {}
        if api_key_file:
            keys.update(load_key_file(api_key_file))
        return cls(keys)

    def __bool__(self) -> bool:
        return bool(self._tenants)

    def __len__(self) -> int:
        return len(self._tenants)

    def __repr__(self) -> str:  # never the keys
        return f"KeyRing({len(self)} keys, {len(set(self._tenants.values()))} tenants)"

    def tenant(self, authorization: str | None) -> str | None:
        if not self._tenants:
            return ANONYMOUS
        token = bearer(authorization)
        if token is None:
            return None
        return self._tenants.get(hashlib.sha256(token.encode()).digest())


def cache_salt(tenant: str, request_salt: str | None) -> str | None:
    """The salt of every cache namespace a request of `tenant` with its own `cache_salt` uses:
    H(tenant, cache_salt), 32 hex characters; None for the anonymous tenant without a
    `cache_salt` (the shared cache).  Distinct (tenant, cache_salt) pairs give distinct salts."""
    if tenant == ANONYMOUS and request_salt is None:
        return None
    return hashlib.sha256(json.dumps(["kimik3-tenant", tenant, request_salt]).encode()).hexdigest()[:32]
