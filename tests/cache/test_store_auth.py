"""Store entries are authenticated (cache/store_auth.py): a writer without the deployment's secret
-- a plain Mooncake or Redis client on the same host -- cannot get a page served, under a live key
or any other.  Forged, damaged, truncated and misplaced entries are counted misses
(`stats.auth_failures`), never served and never a fault; real services on 127.0.0.1."""

import logging
import os
import subprocess
import sys

import numpy as np
import pytest

from cache import store_auth
from cache.guarded_tier import CLOSED, GuardedHostKVTier
from cache.host_tier import EmbeddedHostKVTier, decode_entry, encode_entry, make_key, open_entry
from cache.mooncake_tier import MooncakeHostKVTier
from cache.store_auth import ENV, StoreAuth, StoreSecretError, new_secret
from cache.store_forgery import forge_entries
from tests.conftest import start_mooncake

SECRET = bytes(range(32))


def _keys(tag, n):
    return [make_key(f"auth/{tag}", "mla", bytes([i]) * 16) for i in range(n)]


def _pages(rng, n, shape=(64, 32)):
    return [rng.standard_normal(shape).astype(np.float32) for _ in range(n)]


def _tier(services, secret=SECRET, **kw):
    return MooncakeHostKVTier(services.master_addr, services.metadata_url, staging_bytes=1 << 20, secret=secret, **kw)


# ---- the entry format and the secret -------------------------------------------------------------
def test_an_entry_verifies_only_under_its_key_secret_and_bytes(rng):
    auth, key = StoreAuth(SECRET), _keys("codec", 1)[0]
    page = _pages(rng, 1)[0]
    blob = encode_entry(page, key, auth)
    np.testing.assert_array_equal(open_entry(blob, key, auth), page)
    flipped = bytearray(blob)
    flipped[-7] ^= 0x01  # one payload bit
    bad_meta = bytearray(blob)
    bad_meta[blob.index(b"|") - 1] ^= 0x01  # the dtype in the meta
    forged = encode_entry(page, key, StoreAuth(os.urandom(32)))  # well framed, another secret
    for b, k in [
        (bytes(flipped), key),
        (bytes(bad_meta), key),
        (blob[:-1], key),  # truncated
        (blob + b"\0", key),  # extended
        (blob, _keys("codec", 2)[1]),  # copied under another key
        (forged, key),
        (b"", key),
    ]:
        assert open_entry(b, k, auth) is None
    assert decode_entry(blob, key, auth, (64, 32), np.float32) is not None
    assert decode_entry(blob, key, auth, (32, 64), np.float32) is None


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn", "int8", "bool", "float16"])
def test_every_kv_dtype_round_trips(dtype):
    """The meta names ml_dtypes' types by name and keeps numpy's "|i1"-style strs whole."""
    import ml_dtypes

    dt = np.dtype(getattr(ml_dtypes, dtype, None) or dtype)
    tier, key = EmbeddedHostKVTier(1 << 20, secret=SECRET), _keys("dtype", 1)[0]
    page = (np.arange(96).reshape(8, 12) % 7).astype(dt)
    out = np.zeros_like(page)
    assert tier.batch_put([key], [page]) == [True] and tier.batch_get_into([key], [out]) == [True]
    np.testing.assert_array_equal(out.astype(np.float32), page.astype(np.float32))


def test_the_secret_comes_from_the_argument_then_the_environment_then_the_process(monkeypatch, caplog):
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setattr(store_auth, "_process_secret", None)
    with caplog.at_level(logging.INFO, logger="cache.store_auth"):
        a, b = StoreAuth(), StoreAuth()
    assert a.source == b.source == "process" and a.fingerprint == b.fingerprint
    assert sum("secret of this process" in r.getMessage() for r in caplog.records) == 1  # logged once
    assert store_auth._process_secret.hex() not in caplog.text  # the secret itself is never logged

    hex_secret = new_secret()
    monkeypatch.setenv(ENV, hex_secret)
    env = StoreAuth()
    assert env.source == "env" and env.fingerprint == StoreAuth(bytes.fromhex(hex_secret)).fingerprint
    assert env.fingerprint != a.fingerprint
    assert (
        StoreAuth(SECRET).source == "explicit" and StoreAuth(SECRET.hex()).fingerprint == StoreAuth(SECRET).fingerprint
    )
    for bad in ("not hex", "abcd"):  # malformed, too short: refused when the tier is built
        with pytest.raises(StoreSecretError):
            StoreAuth(bad)
        monkeypatch.setenv(ENV, bad)
        with pytest.raises(StoreSecretError):
            EmbeddedHostKVTier(1 << 20)


def test_the_embedded_tier_counts_unauthentic_entries_as_misses(rng):
    tier = EmbeddedHostKVTier(1 << 20, secret=SECRET)
    keys, pages = _keys("embedded", 2), _pages(rng, 2)
    assert tier.batch_put(keys, pages) == [True, True]
    tier._data[keys[1]] = tier._data[keys[0]]  # key 0's genuine entry copied under key 1
    outs = [np.full_like(p, 5.0) for p in pages]
    assert tier.batch_get_into(keys, outs) == [True, False]
    np.testing.assert_array_equal(outs[0], pages[0])
    assert (outs[1] == 5.0).all() and tier.stats.auth_failures == 1 and tier.stats.misses == 1
    assert tier.exists(keys) == [True, False]  # reported absent until written again
    assert tier.batch_put(keys[1:], pages[1:]) == [True]
    assert tier.exists(keys) == [True, True] and tier.batch_get_into(keys[1:], outs[1:]) == [True]
    other = EmbeddedHostKVTier(1 << 20, secret=os.urandom(32))  # the same bytes, another secret
    other._data[keys[0]] = tier._data[keys[0]]
    assert other.batch_get_into(keys[:1], outs[:1]) == [False] and other.stats.auth_failures == 1


# ---- the shared Mooncake store, forged by a plain client -----------------------------------------
@pytest.mark.parametrize("how", ["force", "upsert"])
def test_forged_pages_under_live_keys_are_never_served(mooncake_services, rng, how):
    """The attack: a plain client (no secret) replaces published pages; a worker with the
    secret -- running, or restarted -- misses, counts them, and its next publish heals them."""
    keys, pages = _keys(f"forged-{how}", 4), _pages(rng, 4)
    writer, reader, restarted = (_tier(mooncake_services) for _ in range(3))
    try:
        assert writer.batch_put(keys, pages) == [True] * 4
        assert sorted(forge_entries(writer, keys, how=how, seed=1)) == sorted(keys)
        for t in (reader, restarted):
            outs = [np.full_like(p, 9.0) for p in pages]
            assert t.batch_get_into(keys, outs) == [False] * 4
            assert all((o == 9.0).all() for o in outs)  # nothing of a forgery reaches a buffer
            assert t.stats.auth_failures == 4 and t.stats.hits == 0 and t.stats.errors == 0
        assert reader.exists(keys) == [False] * 4  # so the engine publishes these pages again
        assert reader.batch_put(keys, pages) == [True] * 4  # upserted over the forgeries
        outs = [np.empty_like(p) for p in pages]
        assert restarted.batch_get_into(keys, outs) == [True] * 4
        for o, p in zip(outs, pages):
            np.testing.assert_array_equal(o, p)
    finally:
        for t in (writer, reader, restarted):
            t.close()


def test_a_forgery_stored_before_the_genuine_page_is_a_miss_until_republished(mooncake_services, rng):
    """A poisoned first page put before any worker publishes it (a plain put does not replace
    an existing object): every reader misses it until one of them writes it again."""
    key, page = _keys("first", 1)[0], _pages(rng, 1)[0]
    victim, attacker = _tier(mooncake_services), _tier(mooncake_services, secret=os.urandom(32))
    try:
        assert attacker.batch_put([key], [np.zeros_like(page)]) == [True]  # well framed, wrong secret
        assert victim.batch_put([key], [page]) == [True]  # Mooncake keeps the first object
        out = np.empty_like(page)
        assert victim.batch_get_into([key], [out]) == [False] and victim.stats.auth_failures == 1
        assert victim.batch_put([key], [page]) == [True]
        assert victim.batch_get_into([key], [out]) == [True]
        np.testing.assert_array_equal(out, page)
    finally:
        victim.close()
        attacker.close()


def test_damaged_truncated_extended_and_moved_entries_are_misses_not_faults(mooncake_services, rng):
    keys, pages = _keys("damage", 5), _pages(rng, 5)
    tier = _tier(mooncake_services)
    guarded = GuardedHostKVTier(_tier(mooncake_services), timeout_s=5.0)
    try:
        assert tier.batch_put(keys, pages) == [True] * 5
        blob = [bytes(tier._store.get(k)) for k in keys]
        flipped = bytearray(blob[0])
        flipped[len(flipped) // 2] ^= 0x10
        store = tier._store  # the same client API a plain process has
        assert store.upsert(keys[0], bytes(flipped)) == 0
        assert store.upsert(keys[1], blob[1][:-100]) == 0  # truncated
        assert store.upsert(keys[2], blob[2] + b"\0" * 64) == 0  # larger than the reader's buffer
        assert store.upsert(keys[3], blob[4]) == 0  # a genuine entry copied under another key
        outs = [np.full_like(p, 3.0) for p in pages]
        assert guarded.batch_get_into(keys, outs) == [False] * 4 + [True]
        assert all((o == 3.0).all() for o in outs[:4])
        np.testing.assert_array_equal(outs[4], pages[4])
        assert guarded.stats.auth_failures == 4 and guarded.stats.errors == 0
        assert guarded.state == CLOSED and guarded.health()["auth_failures"] == 4  # a forgery is no outage
    finally:
        tier.close()
        guarded.close()


def test_tiers_read_each_others_entries_only_with_the_same_secret(mooncake_services, rng, monkeypatch):
    keys, pages = _keys("peers", 2), _pages(rng, 2)
    a, same, other = _tier(mooncake_services), _tier(mooncake_services), _tier(mooncake_services, secret=os.urandom(32))
    try:
        assert a.batch_put(keys, pages) == [True, True]
        outs = [np.empty_like(p) for p in pages]
        assert same.batch_get_into(keys, outs) == [True, True] and same.stats.auth_failures == 0
        np.testing.assert_array_equal(outs[1], pages[1])
        assert other.batch_get_into(keys, outs) == [False, False] and other.stats.auth_failures == 2
    finally:
        for t in (a, same, other):
            t.close()
    # Another process without KIMIK3_STORE_SECRET: its own secret, so its entries are misses here.
    monkeypatch.delenv(ENV, raising=False)
    key, page = _keys("child", 1)[0], pages[0]
    child = (
        "import sys, numpy as np; from cache.mooncake_tier import MooncakeHostKVTier as T;"
        f"t = T('{mooncake_services.master_addr}', '{mooncake_services.metadata_url}', staging_bytes=1 << 20);"
        f"sys.exit(0 if t.batch_put(['{key}'], [np.zeros((64, 32), np.float32)]) == [True] else 1)"
    )
    subprocess.run([sys.executable, "-c", child], check=True, timeout=120, env=dict(os.environ, PYTHONPATH="."))
    reader = MooncakeHostKVTier(mooncake_services.master_addr, mooncake_services.metadata_url, staging_bytes=1 << 20)
    try:
        assert reader.auth.source == "process"
        assert reader.batch_get_into([key], [np.empty_like(page)]) == [False] and reader.stats.auth_failures == 1
    finally:
        reader.close()


def test_forge_entries_forges_every_stored_key():
    """The drill helper the end-to-end check uses: every key the master lists, forged."""
    svc = start_mooncake(32 << 20)  # its own store: the helper forges everything in it
    try:
        rng = np.random.default_rng(0)
        keys, pages = _keys("all", 3), _pages(rng, 3)
        tier = _tier(svc)
        guarded = GuardedHostKVTier(tier, timeout_s=10.0)
        assert guarded.batch_put(keys, pages) == [True] * 3
        assert tier._store.put("not-a-tier-entry", b"x" * 10) == 0
        assert sorted(forge_entries(svc)) == sorted(keys + ["not-a-tier-entry"])
        assert guarded.batch_get_into(keys, [np.empty_like(p) for p in pages]) == [False] * 3
        assert guarded.stats.auth_failures == 3
        guarded.close()
    finally:
        svc.stop()


# ---- the media L1 in Redis -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def redis_url():
    from cache.media.redis_server import RedisServer, RedisUnavailable

    try:
        srv = RedisServer(max_memory_mb=16).start()
    except RedisUnavailable as e:
        if os.environ.get("KIMIK3_REQUIRE_MOONCAKE"):  # CI: every real service must run
            raise
        pytest.skip(str(e))
    yield srv.url
    srv.stop()


def test_a_forged_l1_url_entry_is_a_counted_miss(redis_url):
    from cache.media.l1 import RedisFetchCache, _url_key, content_hash

    url, real, evil = "https://images.example/cat.png", b"\x89PNG real", b"\x89PNG forged"
    a, b = (
        RedisFetchCache(redis_url, prefix="auth", secret=SECRET),
        RedisFetchCache(redis_url, prefix="auth", secret=SECRET),
    )
    other = RedisFetchCache(redis_url, prefix="auth", secret=os.urandom(32))
    try:
        a.put(url, real, "t")
        assert b.get(url, "t") == real  # the same secret: shared
        assert other.get(url, "t") is None and other.stats.auth_failures == 1
        plain = a._redis  # a plain Redis client (with the password, no secret)
        plain.set(f"auth:blob:{content_hash(evil)}", evil)
        url_key = f"auth:url:{_url_key('t', url)}"
        for value in (content_hash(evil).encode(), a._redis.get(url_key)[:64] + os.urandom(32)):
            plain.set(url_key, value)  # an untagged pointer to forged bytes, then a guessed tag
            assert b.get(url, "t") is None
        a._redis.set(url_key, a._pointer(url_key, content_hash(real)))  # authentic pointer, bytes replaced:
        plain.set(f"auth:blob:{content_hash(real)}", evil)
        assert b.get(url, "t") is None and b.stats.auth_failures == 3 and b.stats.hits == 1
    finally:
        for c in (a, b, other):
            c.close()
