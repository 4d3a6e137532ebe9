"""L1 of the media cache (`cache.media.l1`): bytes by (tenant, URL), content-addressed,
embedded or in a real redis-server on 127.0.0.1; corruption and a Redis outage are misses."""

import os
import time

import pytest

from cache.media import FetchPolicy, MediaFetcher
from cache.media.l1 import EmbeddedFetchCache, RedisFetchCache, content_hash, normalize_url
from cache.media.redis_server import RedisServer, RedisUnavailable

from .test_media_fetch import ImageServer, png_bytes

URL = "https://images.example/cat.png"


@pytest.fixture(scope="module")
def redis_server():
    try:
        srv = RedisServer(max_memory_mb=64).start()
    except RedisUnavailable as e:
        if os.environ.get("KIMIK3_REQUIRE_MOONCAKE"):  # CI: every real service must run
            raise
        pytest.skip(str(e))
    yield srv
    srv.stop()


@pytest.fixture(params=["embedded", "redis"])
def cache(request):
    if request.param == "embedded":
        yield EmbeddedFetchCache(budget_bytes=1 << 20)
        return
    srv = request.getfixturevalue("redis_server")
    c = RedisFetchCache(srv.url, prefix=f"test:{request.node.name}")
    yield c
    c.close()


def test_normalized_urls_share_an_entry():
    assert normalize_url("HTTPS://Images.Example:443/a.png#frag") == "https://images.example/a.png"
    assert normalize_url("http://h:8080/A?b=1") == "http://h:8080/A?b=1"


def test_a_put_is_a_hit_for_its_tenant_only(cache):
    data = png_bytes(0)
    assert cache.get(URL, "tenant-a") is None
    cache.put(URL, data, "tenant-a")
    assert cache.get(URL, "tenant-a") == data
    assert cache.get(URL.replace("https://images.example", "HTTPS://IMAGES.EXAMPLE:443"), "tenant-a") == data
    assert cache.get(URL, "tenant-b") is None  # another tenant learns nothing from A's fetch
    assert cache.get(URL, None) is None
    assert cache.stats.hits == 2 and cache.stats.misses == 3


def test_tenants_with_the_same_image_share_one_copy():
    c = EmbeddedFetchCache(budget_bytes=1 << 20)
    data = png_bytes(1)
    c.put(URL, data, "a")
    c.put("https://mirror.example/cat.png", data, "b")
    assert c.bytes_held == len(data) and c.get(URL, "a") == c.get("https://mirror.example/cat.png", "b") == data


def test_entries_expire_and_the_budget_evicts_least_recent_first():
    now = [0.0]
    c = EmbeddedFetchCache(budget_bytes=3000, ttl_s=10, clock=lambda: now[0])
    blobs = [bytes([i]) * 1000 for i in range(4)]
    for i, b in enumerate(blobs[:3]):
        c.put(f"https://h/{i}", b)
    assert c.get("https://h/0") == blobs[0]  # 0 is now the most recent
    c.put("https://h/3", blobs[3])  # over budget: 1 (least recent) goes
    assert c.get("https://h/1") is None and c.get("https://h/0") == blobs[0] and c.bytes_held == 3000
    now[0] = 11.0
    assert c.get("https://h/0") is None  # expired


def test_a_corrupt_blob_is_a_counted_miss(cache):
    data = png_bytes(2)
    cache.put(URL, data, "t")
    digest = content_hash(data)
    if isinstance(cache, EmbeddedFetchCache):
        cache._blobs[digest] = data[:-1] + bytes([data[-1] ^ 1])
    else:
        cache._redis.set(f"{cache.prefix}:blob:{digest}", data[:-1] + bytes([data[-1] ^ 1]))
    assert cache.get(URL, "t") is None and cache.stats.corrupt == 1


def test_two_redis_clients_share_the_cache(redis_server):
    a, b = (RedisFetchCache(redis_server.url, prefix="test:shared") for _ in range(2))
    data = png_bytes(3)
    a.put(URL, data, "t")
    assert b.get(URL, "t") == data
    a.close()
    b.close()


def test_a_redis_outage_is_a_fast_miss_and_puts_are_dropped():
    srv = RedisServer(max_memory_mb=16)
    try:
        srv.start()
    except RedisUnavailable as e:
        if os.environ.get("KIMIK3_REQUIRE_MOONCAKE"):
            raise
        pytest.skip(str(e))
    c = RedisFetchCache(srv.url, prefix="test:outage", timeout_s=0.2)
    data = png_bytes(4)
    c.put(URL, data, "t")
    assert c.get(URL, "t") == data
    srv.stop()
    t0 = time.monotonic()
    assert c.get(URL, "t") is None
    c.put(URL, data, "t")  # no exception
    assert time.monotonic() - t0 < 2.0 and c.stats.errors == 2
    srv.start()  # restarted (empty, same port and password): the same client's puts and hits resume
    try:
        assert c.get(URL, "t") is None
        c.put(URL, data, "t")
        assert c.get(URL, "t") == data  # (a stale connection may count one more error first)
    finally:
        srv.stop()
        c.close()


def test_the_fetcher_reads_through_l1_and_refetches_for_another_tenant():
    server = ImageServer()
    try:
        body = png_bytes(5)
        server.routes["/i.png"] = (200, {"Content-Type": "image/png"}, body)
        fetcher = MediaFetcher(FetchPolicy(allow_networks=("127.0.0.1/32",)), EmbeddedFetchCache())
        url = server.url("/i.png")
        assert fetcher.get(url, "a") == body and fetcher.get(url, "a") == body
        assert server.requests == 1
        assert fetcher.get(url, "b") == body and server.requests == 2  # b's first fetch is its own
        stats = fetcher.stats()
        assert stats["fetches"] == 2 and stats["l1_hits"] == 1 and stats["l1_misses"] == 2
        uncached = MediaFetcher(FetchPolicy(allow_networks=("127.0.0.1/32",)))
        uncached.get(url)
        uncached.get(url)
        assert server.requests == 4 and uncached.stats()["fetches"] == 2
    finally:
        server.close()
