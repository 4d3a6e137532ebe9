"""A dead store costs nothing: the guarded tier's deadline and circuit breaker, on a
real Mooncake store whose master is killed and restarted, and on an in-process tier that stalls."""

import threading

import numpy as np
import pytest

from cache.guarded_tier import CLOSED, OPEN, GuardedHostKVTier
from cache.host_tier import EmbeddedHostKVTier, make_key
from cache.mooncake_tier import MooncakeHostKVTier
from tests.conftest import start_mooncake


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _keys(tag, n):
    return [make_key("guard", "mla", f"{tag}{i}".encode().ljust(16, b".")) for i in range(n)]


@pytest.fixture
def services():  # its own: these tests kill its master
    svc = start_mooncake(64 << 20)
    yield svc
    svc.stop()


def test_a_killed_master_opens_the_breaker_and_a_restarted_one_serves_again(services, rng):
    clock = Clock()
    inner = MooncakeHostKVTier(services.master_addr, services.metadata_url, staging_bytes=1 << 20)
    tier = GuardedHostKVTier(inner, timeout_s=2.0, cooldown_s=30.0, clock=clock)
    try:
        page = rng.standard_normal((16, 32)).astype(np.float32)
        before = _keys("before", 1)
        assert tier.batch_put(before, [page]) == [True]
        assert tier.health()["status"] == "ok"

        services.kill_master()
        out = np.full_like(page, 7.0)
        assert tier.batch_get_into(before, [out]) == [False]  # a miss: the master is gone
        assert (out == 7.0).all()  # and the caller's buffer untouched
        assert tier.state == OPEN and tier.health()["status"] == "degraded"
        assert tier.health()["last_error"]

        # While open, calls never reach the store: answered at once, counted as skipped.
        errors, skipped = inner.stats.errors, tier.skipped
        assert tier.batch_put(_keys("open", 2), [page, page]) == [False, False]
        assert tier.exists(before) == [False]
        assert tier.batch_get_into(before, [out]) == [False]
        assert tier.skipped == skipped + 3 and inner.stats.errors == errors

        assert services.supervise() == ["mooncake_master", "memory_server"]  # the launcher's restart
        clock.now += 31.0  # cooldown over: the next call probes
        after = _keys("after", 1)
        assert tier.batch_put(after, [page]) == [True]  # the probe succeeds: closed again
        assert tier.state == CLOSED and tier.health()["status"] == "ok"
        got = np.empty_like(page)
        assert tier.batch_get_into(after, [got]) == [True]  # hits resume
        np.testing.assert_array_equal(got, page)
        assert tier.batch_get_into(before, [got]) == [False]  # the old master's entries are gone: misses
        assert tier.state == CLOSED  # a plain miss is not a fault
    finally:
        tier.close()


def test_a_failed_probe_reopens_the_breaker(services, rng):
    clock = Clock()
    tier = GuardedHostKVTier(
        MooncakeHostKVTier(services.master_addr, services.metadata_url, staging_bytes=1 << 20),
        timeout_s=2.0,
        cooldown_s=5.0,
        clock=clock,
    )
    try:
        services.kill_master()
        page = rng.standard_normal((4, 8)).astype(np.float32)
        assert tier.batch_put(_keys("x", 1), [page]) == [False] and tier.state == OPEN
        clock.now += 6.0
        assert tier.exists(_keys("x", 1)) == [False]  # the probe fails
        assert tier.state == OPEN and tier.trips == 1 and tier.opened_at == 6.0
    finally:
        tier.close()


class StallingTier(EmbeddedHostKVTier):
    """An in-process tier whose gets block until released: a store that stops answering."""

    def __init__(self):
        super().__init__(1 << 20)
        self.release = threading.Event()

    def _get_blob(self, key):
        self.release.wait(30)
        return super()._get_blob(key)


def test_a_stalled_call_is_abandoned_at_the_deadline_and_its_late_reply_is_dropped():
    inner = StallingTier()
    key = _keys("late", 1)
    value = np.arange(12, dtype=np.float32).reshape(3, 4)
    inner.batch_put(key, [value])
    clock = Clock()
    tier = GuardedHostKVTier(inner, timeout_s=0.2, cooldown_s=10.0, clock=clock)
    out = np.zeros_like(value)
    assert tier.batch_get_into(key, [out]) == [False]
    assert tier.state == OPEN and tier.timeouts == 1
    inner.release.set()  # the store answers after the caller gave up
    tier._busy.result(timeout=10)
    assert (out == 0).all()  # the late reply went to the tier's own buffer, not the caller's
    clock.now += 11.0
    assert tier.batch_get_into(key, [out]) == [True]  # the next probe is answered: closed
    np.testing.assert_array_equal(out, value)
    assert tier.state == CLOSED


def test_a_call_still_stuck_in_the_tier_fails_the_probe_without_waiting():
    inner = StallingTier()
    key = _keys("stuck", 1)
    inner.batch_put(key, [np.ones(4, np.float32)])
    clock = Clock()
    tier = GuardedHostKVTier(inner, timeout_s=0.2, cooldown_s=1.0, clock=clock)
    try:
        assert tier.batch_get_into(key, [np.zeros(4, np.float32)]) == [False]
        clock.now += 2.0
        assert tier.state == OPEN
        assert tier.exists(key) == [False]  # probe: the I/O thread is still busy, so it fails at once
        assert tier.state == OPEN and tier.timeouts == 1
    finally:
        inner.release.set()
        tier.close()


def test_settings_are_checked():
    with pytest.raises(ValueError, match="timeout_s"):
        GuardedHostKVTier(EmbeddedHostKVTier(1 << 10), timeout_s=0)
