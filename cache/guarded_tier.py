"""A host tier behind a deadline and a circuit breaker: a dead store costs the serving path nothing.

A remote tier (Mooncake) whose master died does not fail fast: every get or put waits out the
client's reconnect (~4 s each on loopback), and the engine calls the tier from its step, so
every request on the worker stalls behind it (TTFT < 1 s -> 7-47 s).
`GuardedHostKVTier` wraps any `HostKVTier`:

* every call runs on one I/O thread and the caller waits at most `timeout_s`; a call that
  overruns, raises or makes the inner tier count an error is a *failure*, and what it was
  asked for is a miss (gets fill private buffers, copied out only when the call finished in
  time, so a late reply can never write into a buffer the caller has reused);
* `failures_to_open` consecutive failures open the breaker: calls return misses (gets,
  exists) or False (puts) at once, touching nothing, for `cooldown_s`; then one call goes
  through as a probe (half-open): success closes the breaker, failure reopens it;
* `health()` reports "ok", or "degraded" (breaker open or half-open, with the last error), for
  the worker's /health, with the inner tier's count of entries that failed authentication
  (`auth_failures`: forged store entries, cache/store_auth.py).  A forged entry is a miss, not a
  failure: it never opens the breaker.

Misses are what a tier fault must be anyway (cache/host_tier.py): correctness never depends
on the tier, only the cache rate does.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from typing import Callable, Sequence

import numpy as np

from cache.host_tier import HostKVTier

log = logging.getLogger(__name__)

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half-open"


class GuardedHostKVTier(HostKVTier):
    """`inner` behind a per-call deadline and a circuit breaker (module docstring)."""

    def __init__(
        self,
        inner: HostKVTier,
        *,
        timeout_s: float = 1.0,
        failures_to_open: int = 1,
        cooldown_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        super().__init__(getattr(inner, "auth", None))  # the inner tier's secret: it tags and checks entries
        if timeout_s <= 0 or cooldown_s < 0 or failures_to_open < 1:
            raise ValueError(
                f"need timeout_s > 0, cooldown_s >= 0, failures_to_open >= 1; got {timeout_s}, "
                f"{cooldown_s}, {failures_to_open}"
            )
        self.inner, self.timeout_s, self.failures_to_open, self.cooldown_s = (
            inner,
            timeout_s,
            failures_to_open,
            cooldown_s,
        )
        self.stats = inner.stats  # hits, misses, errors, auth_failures: the inner tier's own counts
        self._clock = clock
        self._io = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="host-tier-io")
        self._busy: concurrent.futures.Future | None = None  # a call still running past its deadline
        self._state_lock = threading.Lock()
        self.state = CLOSED
        self.consecutive_failures = 0
        self.opened_at: float | None = None
        self.last_error: str | None = None
        self.skipped = 0  # calls answered without touching the tier (breaker open)
        self.timeouts = 0
        self.trips = 0  # times the breaker opened from closed (failed probes reopen it without counting)

    # ---- the breaker ----------------------------------------------------------------------------
    def _admit(self) -> bool:
        """Whether a call may reach the inner tier now (a half-open probe counts as admitted)."""
        with self._state_lock:
            if self.state == OPEN:
                if self._clock() - self.opened_at < self.cooldown_s:
                    return False
                self.state = HALF_OPEN
                log.info("host tier: cooldown over, probing")
            return True

    def _record(self, ok: bool, error: str | None = None) -> None:
        with self._state_lock:
            if ok:
                if self.state != CLOSED:
                    log.warning("host tier recovered; breaker closed")
                self.state, self.consecutive_failures, self.opened_at = CLOSED, 0, None
                return
            self.consecutive_failures += 1
            self.last_error = error
            if self.state == HALF_OPEN or self.consecutive_failures >= self.failures_to_open:
                if self.state == CLOSED:
                    self.trips += 1
                    log.warning(
                        "host tier failing (%s); breaker open for %.1f s: its gets and puts are misses",
                        error,
                        self.cooldown_s,
                    )
                else:
                    log.info("host tier probe failed (%s); breaker open again", error)
                self.state, self.opened_at = OPEN, self._clock()

    def _call(self, fn, fallback):
        """fn() on the I/O thread within the deadline, or `fallback` (a failure unless skipped)."""
        if not self._admit():
            self.skipped += 1
            return fallback
        if self._busy is not None and not self._busy.done():  # the last call is still stuck in the tier
            self._record(False, "the previous call has not returned")
            return fallback
        errors = self.inner.stats.errors
        future = self._io.submit(fn)
        try:
            result = future.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            self._busy = future
            self.timeouts += 1
            self._record(False, f"no reply within {self.timeout_s:g} s")
            return fallback
        except Exception as e:  # noqa: BLE001 - a tier fault is a miss, never an exception on the serving path
            self._record(False, repr(e))
            return fallback
        if self.inner.stats.errors > errors:
            self._record(False, "the store reported errors")
        else:
            self._record(True)
        return result

    def health(self) -> dict:
        """{"status": "ok" | "degraded", "breaker": state, ...} for /health."""
        with self._state_lock:
            return {
                "status": "ok" if self.state == CLOSED else "degraded",
                "breaker": self.state,
                "last_error": self.last_error,
                "trips": self.trips,
                "timeouts": self.timeouts,
                "skipped": self.skipped,
                "auth_failures": self.inner.stats.auth_failures,
            }

    # ---- HostKVTier -----------------------------------------------------------------------------
    def batch_put(self, keys: Sequence[str], arrays: Sequence[np.ndarray]) -> list[bool]:
        if len(keys) != len(arrays):
            raise ValueError(f"{len(keys)} keys for {len(arrays)} arrays")
        keys, arrays = list(keys), [np.array(a, copy=True) for a in arrays]  # the caller may reuse its buffers
        return self._call(lambda: self.inner.batch_put(keys, arrays), [False] * len(keys))

    def batch_get_into(self, keys: Sequence[str], outs: Sequence[np.ndarray]) -> list[bool]:
        if len(keys) != len(outs):
            raise ValueError(f"{len(keys)} keys for {len(outs)} buffers")
        private = [np.empty_like(o) for o in outs]
        found = self._call(lambda: self.inner.batch_get_into(list(keys), private), [False] * len(keys))
        for ok, mine, out in zip(found, private, outs):
            if ok:
                out[...] = mine
        return found

    def exists(self, keys: Sequence[str]) -> list[bool]:
        return self._call(lambda: self.inner.exists(list(keys)), [False] * len(keys))

    def remove(self, keys: Sequence[str]) -> None:
        self._call(lambda: self.inner.remove(list(keys)), None)

    def _put_blob(self, key, blob):  # the batched methods above cover every use
        raise NotImplementedError

    def _get_blob(self, key):
        raise NotImplementedError

    def close(self) -> None:
        self._io.shutdown(wait=False, cancel_futures=True)
        close = getattr(self.inner, "close", None)
        if close is not None and (self._busy is None or self._busy.done()):
            close()  # a call stuck in the tier keeps it; the process exit reclaims it
