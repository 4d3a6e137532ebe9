"""Mooncake Store tier against a real mooncake_master + memory server on 127.0.0.1."""

import os
import subprocess
import sys
import time

import numpy as np
import pytest

from cache.host_tier import make_key
from cache.mooncake_tier import MooncakeHostKVTier
from cache.store_auth import ENV, new_secret
from tests.conftest import start_mooncake


@pytest.fixture
def services(mooncake_services):
    return mooncake_services


@pytest.fixture
def tier(services):
    t = MooncakeHostKVTier(services.master_addr, services.metadata_url, staging_bytes=4 << 20)
    yield t
    t.close()


def _keys(tag, n):
    return [make_key(f"test/{tag}", "mla", bytes([i]) * 16) for i in range(n)]


def test_batched_round_trip_is_bit_exact(tier, rng):
    pages = [rng.standard_normal((128, 48)).astype(np.float32) for _ in range(5)]
    keys = _keys("rt", 5)
    assert tier.batch_put(keys, pages) == [True] * 5
    outs = [np.empty_like(p) for p in pages]
    assert tier.batch_get_into(keys + _keys("absent", 1), outs + [np.empty((128, 48), np.float32)]) == [True] * 5 + [
        False
    ]
    for a, b in zip(outs, pages):
        np.testing.assert_array_equal(a, b)
    assert tier.exists(keys[:1] + _keys("absent", 1)) == [True, False]


def test_batches_larger_than_the_staging_buffer_are_split(tier, rng):
    pages = [rng.standard_normal((256, 1024)).astype(np.float32) for _ in range(5)]  # 1 MiB each, 4 MiB staging
    keys = _keys("big", 5)
    assert all(tier.batch_put(keys, pages))
    outs = [np.empty_like(p) for p in pages]
    assert all(tier.batch_get_into(keys, outs))
    np.testing.assert_array_equal(outs[4], pages[4])


def test_a_corrupt_entry_is_a_counted_miss(tier, rng):
    key = _keys("corrupt", 1)[0]
    page = rng.standard_normal((128, 48)).astype(np.float32)
    tier.batch_put([key], [page])
    blob = bytearray(tier._store.get(key))
    blob[-3] ^= 0xFF
    assert tier._store.upsert(key, bytes(blob)) == 0  # overwrite in place with a flipped byte
    out = np.zeros_like(page)
    assert tier.batch_get_into([key], [out]) == [False]
    assert tier.stats.corrupt == 1 and (out == 0).all()


def test_kv_written_by_one_process_is_found_by_a_new_one(services, rng, monkeypatch):
    monkeypatch.setenv(ENV, new_secret())  # the deployment's store secret, shared by its processes
    page = rng.standard_normal((64, 32)).astype(np.float32)
    key = _keys("xproc", 1)[0]
    writer = (
        "import numpy as np, sys; from cache.mooncake_tier import MooncakeHostKVTier as T;"
        f"t = T('{services.master_addr}', '{services.metadata_url}', staging_bytes=1 << 20);"
        f"sys.exit(0 if t.batch_put(['{key}'], [np.frombuffer(bytes.fromhex('{page.tobytes().hex()}'),"
        " np.float32).reshape(64, 32)]) == [True] else 1)"
    )
    subprocess.run([sys.executable, "-c", writer], check=True, timeout=120, env=dict(os.environ, PYTHONPATH="."))
    reader = MooncakeHostKVTier(services.master_addr, services.metadata_url, staging_bytes=1 << 20)
    out = np.empty_like(page)
    assert reader.batch_get_into([key], [out]) == [True]
    np.testing.assert_array_equal(out, page)
    reader.close()


def test_a_killed_master_turns_into_misses_not_crashes(rng):
    svc = start_mooncake(64 << 20)  # its own (the test kills its master); a skip only outside CI
    try:
        tier = MooncakeHostKVTier(svc.master_addr, svc.metadata_url, staging_bytes=1 << 20)
        key = _keys("dead", 1)[0]
        page = rng.standard_normal((32, 32)).astype(np.float32)
        assert tier.batch_put([key], [page]) == [True]
        svc.kill_master()
        t0 = time.monotonic()
        assert tier.batch_get_into([key], [np.empty_like(page)]) in ([False], [True])
        assert tier.batch_put(_keys("dead2", 1), [page]) == [False]
        assert tier.exists([key]) in ([False], [True])
        assert time.monotonic() - t0 < 60
    finally:
        svc.stop()


def _listening(pid: int) -> set[str]:
    import psutil

    return {c.laddr.ip for c in psutil.Process(pid).net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}


def test_the_master_and_the_metadata_server_listen_on_loopback_only(services):
    """The master's own metadata server binds 0.0.0.0 whatever its host flag, so it is off and
    the wheel's `mooncake_http_metadata_server --host 127.0.0.1` serves the protocol instead."""
    assert _listening(services.master.pid) == {"127.0.0.1"}
    assert _listening(services.metadata.pid) == {"127.0.0.1"}


LOOPBACK = {"127.0.0.1", "::ffff:127.0.0.1", "::1"}


def test_the_memory_servers_transfer_engine_listens_on_loopback_only(services):
    """The transfer engine binds every interface (no option upstream); the memory
    server runs with the loopback shim (`cache.loopback`) and still serves the store (the other
    tests here read and write through it)."""
    assert services.loopback_only
    listening = _listening(services.memory_server.pid)
    assert len(listening) > 0 and listening <= LOOPBACK, listening


def test_a_store_client_started_with_the_loopback_env_listens_on_loopback_and_round_trips(services, rng, monkeypatch):
    """What `kimik3 launch` does for a worker or the router: a process whose MooncakeHostKVTier
    (its own transfer engine) listens on loopback only, and whose pages another process reads."""
    from cache.loopback import loopback_env

    monkeypatch.setenv(ENV, new_secret())

    key = _keys("loopback", 1)[0]
    page = rng.standard_normal((64, 32)).astype(np.float32)
    child = (
        "import os, sys, time, numpy as np, psutil; from cache.mooncake_tier import MooncakeHostKVTier as T;"
        f"t = T('{services.master_addr}', '{services.metadata_url}', staging_bytes=1 << 20);"
        f"ok = t.batch_put(['{key}'], [np.frombuffer(bytes.fromhex('{page.tobytes().hex()}'), np.float32)"
        ".reshape(64, 32)]) == [True];"
        "ips = {c.laddr.ip for c in psutil.Process().net_connections(kind='inet') if c.status == 'LISTEN'};"
        "print(sorted(ips)); sys.exit(0 if ok and ips else 1)"
    )
    out = subprocess.run(
        [sys.executable, "-c", child],
        capture_output=True,
        text=True,
        timeout=120,
        env=loopback_env(dict(os.environ, PYTHONPATH=".")),
    )
    assert out.returncode == 0, out.stderr[-2000:]
    listening = set(eval(out.stdout.strip().splitlines()[-1]))
    assert listening <= LOOPBACK, listening
    reader = MooncakeHostKVTier(services.master_addr, services.metadata_url, staging_bytes=1 << 20)
    got = np.empty_like(page)
    assert reader.batch_get_into([key], [got]) == [True]
    np.testing.assert_array_equal(got, page)
    reader.close()


def test_the_metadata_server_speaks_mooncakes_protocol(services):
    """GET / PUT / DELETE /metadata?key=..., an ``rpc_meta`` key written once (no takeover of a
    live segment's RPC address), on the server the store's processes use."""
    import httpx

    url = services.metadata_url
    key, rpc = f"kimik3-test/{os.getpid()}/a", f"kimik3-test/rpc_meta/{os.getpid()}"
    try:
        assert httpx.get(url, params={"key": key}).status_code == 404
        assert httpx.put(url, params={"key": key}, content=b'{"x": 1}').status_code == 200
        assert httpx.get(url, params={"key": key}).content == b'{"x": 1}'
        assert httpx.put(url, params={"key": rpc}, content=b"1").status_code == 200
        assert httpx.put(url, params={"key": rpc}, content=b"2").status_code == 400  # no takeover
        assert httpx.get(url, params={"key": rpc}).content == b"1"
        assert httpx.delete(url, params={"key": key}).status_code == 200
        assert httpx.delete(url, params={"key": key}).status_code == 404
        assert httpx.get(url.replace("/metadata", "/other"), params={"key": key}).status_code == 404
    finally:
        httpx.delete(url, params={"key": key})
        httpx.delete(url, params={"key": rpc})


def test_a_metadata_server_whose_port_is_taken_is_an_error_not_a_stray_process(tmp_path):
    """Mooncake's metadata server keeps running after its bind fails; `MooncakeServices` checks
    that the process it started is the one listening, and stops it otherwise (a connect alone
    would reach whoever holds the port)."""
    import socket

    from cache import mooncake_tier
    from cache.mooncake_tier import MooncakeServices, TierError

    try:
        mooncake_tier._binary("mooncake_http_metadata_server")
    except TierError as e:
        if os.environ.get("KIMIK3_REQUIRE_MOONCAKE"):
            raise
        pytest.skip(f"Mooncake unavailable: {e}")
    svc = MooncakeServices(log_dir=str(tmp_path))
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", svc.http_port))
        holder.listen()
        t0 = time.monotonic()
        with pytest.raises(TierError, match="address already in use"):
            svc._start_metadata()
        assert time.monotonic() - t0 < 10  # the failure is read from its log, not waited out
    assert svc.metadata.poll() is not None  # stopped


def test_a_master_that_fails_to_start_leaves_no_service_behind(monkeypatch, tmp_path):
    """`MooncakeServices.start` stops the metadata server it started when the master cannot
    start (a missing libibverbs, a bad binary): a caller that skips leaks no process."""
    from cache import mooncake_tier
    from cache.mooncake_tier import MooncakeServices, TierError

    real = mooncake_tier._binary
    monkeypatch.setattr(
        mooncake_tier, "_binary", lambda name: "/bin/false" if name == "mooncake_master" else real(name)
    )
    svc = MooncakeServices(log_dir=str(tmp_path))
    with pytest.raises(TierError, match="exited"):
        svc.start()
    assert svc.metadata is not None and svc.metadata.poll() is not None  # started, then stopped
