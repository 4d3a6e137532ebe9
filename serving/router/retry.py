"""The one retry loop: an attempt on one worker of a pool after another, with failover, backoff
and each worker's circuit breaker, until one attempt succeeds or the request must fail.

Every path a request takes through the workers runs in `Failover.run`: a colocated or decode
stream (`/generate`, `/adopt`), the prefill stage of a store handoff, and the prefill of a direct
handoff (`/prefill` with ``hold_kv``).  The rules, the same for all:

* An attempt that fails with a `WorkerFailure` goes to the next worker the policy picks (workers
  already tried come last), after a backoff of ``min(backoff_max_s, backoff_base_s * 2**(n-1))``
  with full jitter (n: the failures counted so far); a failure the worker is to blame for counts
  against its breaker and against `retries`: past it, the client gets a 503 with `Retry-After`.
  A refusal another worker may not make (full, draining, a handoff it could not pull) counts
  against neither, and is retried.
* A `RequestFailed` (the request's own fault) and a failure marked `engine_fault` (the poison-pill
  rule: the request may be what broke the worker) reach no second worker.
* With no worker of the role available at all, the request waits up to `no_worker_wait_s` for
  one to come back (a worker restart takes 10-20 s), then gets a 503 with `Retry-After`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
from collections.abc import AsyncIterator, Callable
from typing import NamedTuple

from serving.openai_api import APIError
from serving.router.config import RETRY_AFTER
from serving.router.registry import Worker

log = logging.getLogger(__name__)


class WorkerFailure(Exception):
    """One attempt on one worker failed in a way another worker may not.  `engine_fault`: the
    worker's engine failed while it held this request (its step, not the request, faulted): the
    poison-pill rule carries such a request to no second worker, since it may be what broke the first."""

    def __init__(self, message: str, *, count_failure: bool = True, engine_fault: bool = False):
        super().__init__(message)
        self.count_failure = count_failure
        self.engine_fault = engine_fault


class RequestFailed(APIError):
    """A worker failed or refused the request for a reason of the request's own (a 4xx, or an error
    the worker marked ``"retriable": false``): the client gets it as it is, and no other worker
    gets the request."""

    retriable = False

    def body(self) -> dict:
        body = super().body()
        body["error"]["retriable"] = False
        return body


def _worker_error(text: str) -> tuple[str, bool | None, str | None]:
    """(message, retriable, param) of a worker's error answer ({"error": msg, "retriable": bool,
    "param": field}); the text itself and None, None for anything else."""
    try:
        obj = json.loads(text)
    except ValueError:
        return text, None, None
    if not isinstance(obj, dict):
        return text, None, None
    retriable, param = obj.get("retriable"), obj.get("param")
    return (
        str(obj.get("error", text)),
        retriable if isinstance(retriable, bool) else None,
        param if isinstance(param, str) else None,
    )


def classify_worker_error(url: str, status: int, text: str, *, adopt: bool = False) -> Exception:
    """What a worker's non-200 answer means for the request: a `WorkerFailure` (try another
    worker; `count_failure` when the worker itself is at fault) or a `RequestFailed` (the
    request's own fault: to the client as it is, never retried, nothing counted).

    429 (full), 503 while draining and, for /adopt, 502 (the KV's source failed) are refusals
    another worker may not make; 401 / 403 say this router's internal token is wrong (a
    deployment fault, counted); any other 4xx, and any answer marked ``"retriable": false``, is
    the request's; a remaining 5xx is the worker's."""
    message, retriable, param = _worker_error(text)
    if status == 429:
        return WorkerFailure(f"{url} is full", count_failure=False)
    if status == 503 and "draining" in message:
        return WorkerFailure(f"{url} is draining", count_failure=False)
    if status in (401, 403):
        return WorkerFailure(f"{url} refused this router's internal token ({status}): {message[:200]}")
    if retriable is False or 400 <= status < 500:
        code = status if 400 <= status < 600 else 500
        kind = "invalid_request_error" if code < 500 else "server_error"
        return RequestFailed(
            code, f"the worker refused the request: {message[:500]}", type=kind, param=param, code="worker_refused"
        )
    if status == 502 and adopt:
        return WorkerFailure(f"{url} could not pull the handoff: {message[:500]}", count_failure=False)
    return WorkerFailure(f"{url} answered {status}: {message[:500]}", engine_fault=_code(text) == "engine_fault")


def _code(text: str) -> str | None:
    """The `code` of a worker's JSON error answer, if it has one."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    return obj.get("code") if isinstance(obj, dict) else None


# an attempt: (worker, first) -> that worker's events, the last one holding "done"
Attempt = Callable[[Worker, bool], AsyncIterator[dict]]


class Route(NamedTuple):
    """What a first stage is placed by (prefix affinity) and remembered under: its prompt, the
    tenant's salt (`router_auth.cache_salt`) and its images (base64 RGB bytes, or None)."""

    prompt: list[int]
    salt: str | None
    images_b64: list[str] | None


class Failover:
    """The retry loop (module docstring) over a router's pools.  `pick` and `remember` are the
    placement policy's (`serving.router.policy.PrefixAffinity`); `sleep` is the wait between
    attempts, a coroutine function of seconds: `asyncio.sleep` unless a caller (a test) records
    the waits instead of sleeping them."""

    def __init__(self, cfg, metrics, pick, remember):
        self.cfg, self.metrics, self.pick, self.remember = cfg, metrics, pick, remember
        self.sleep = asyncio.sleep

    async def run(
        self, pool: list[Worker], attempt: Attempt, *, rid: str, out: list[int], route: Route | None = None
    ) -> AsyncIterator[dict]:
        """Yield the events of `attempt` on one worker of `pool` after another until an attempt
        yields its done event (yielded last).  `attempt(worker, first)`: `first` while no attempt
        of this run has failed (a direct handoff's KV may be adopted only then: a failed adoption
        may have half taken it).  `out`: the request's tokens so far (stream attempts append to
        it), which tells a failover mid-stream from a retry and words the errors.  With `route`,
        prefix affinity places the attempt and the worker that serves it is remembered; without,
        load alone places it.  Raises APIError 503 (`retries` exhausted, an engine fault, no
        worker for `no_worker_wait_s`) or the attempt's RequestFailed."""
        role = pool[0].role
        tried: set[str] = set()
        failures, waiting_since = 0, None
        while True:
            if route is None:
                w = await self.pick(pool, tried, None)
            else:
                w = await self.pick(pool, tried, route.prompt, route.salt, route.images_b64)
            if w is None:
                waiting_since = await self._await_worker(role, waiting_since)
                continue
            waiting_since = None
            first, before = not tried, len(out)
            tried.add(w.url)
            w.inflight += 1
            try:
                # closed on the way out: a worker's stream ends with the attempt, not when collected
                async with contextlib.aclosing(attempt(w, first)) as events:
                    async for ev in events:
                        if "done" in ev:
                            self._succeeded(w, role, route)
                            yield ev
                            return
                        yield ev
                failure = WorkerFailure(f"{w.url} ended the attempt without an answer")
            except WorkerFailure as e:
                failure = e
            finally:
                w.inflight -= 1
            failures = self._failed(w, role, failure, failures, rid, out, before)
            await self.backoff(failures)

    async def backoff(self, failures: int) -> None:
        """The wait before the next attempt: doubling with `failures`, capped, full jitter."""
        delay = min(self.cfg.backoff_max_s, self.cfg.backoff_base_s * 2 ** max(0, failures - 1))
        await self.sleep(random.uniform(0, delay))  # full jitter: retries of many requests spread out

    async def _await_worker(self, role: str, since: float | None) -> float:
        """Every worker of the role is down, drained or tripped: wait a health interval for one to
        come back (a restart takes 10-20 s) rather than fail within a few backoffs; a 503 once
        `no_worker_wait_s` have passed since `since`.  Returns when the wait began."""
        now = time.monotonic()
        since = since or now
        if now - since >= self.cfg.no_worker_wait_s:
            raise APIError(
                503,
                f"no healthy {role} worker was available for {self.cfg.no_worker_wait_s:g} s; retry later",
                type="service_unavailable",
                code="no_worker",
                headers=RETRY_AFTER,
            )
        await asyncio.sleep(min(self.cfg.health_interval_s, self.cfg.no_worker_wait_s))
        return since

    def _succeeded(self, w: Worker, role: str, route: Route | None) -> None:
        w.breaker.success()
        self.metrics.worker_requests.labels(w.url, role, "ok").inc()
        if route is not None:
            self.remember(route.prompt, w.url, route.salt, route.images_b64)

    def _failed(
        self, w: Worker, role: str, e: WorkerFailure, failures: int, rid: str, out: list[int], before: int
    ) -> int:
        """Count `e` against `w` (its breaker, when it is to blame) and return the failures so far;
        raises the APIError that ends the request when it may go to no other worker."""
        w.last_error = str(e)
        self.metrics.worker_requests.labels(w.url, role, "failed" if e.count_failure else "refused").inc()
        if e.count_failure:
            w.breaker.failure()
            failures += 1
        log.warning("%s attempt for %s failed (%d tokens so far): %s", role, rid, len(out), e)
        if e.engine_fault:  # the poison-pill rule: a request that failed a worker reaches no other
            raise APIError(
                503,
                f"the {role} worker serving this request failed with it after {len(out)} tokens; "
                f"the request is not carried to another worker ({e})",
                type="service_unavailable",
                code="worker_failed",
            ) from e
        if len(out) > before or (role == "decode" and out):
            self.metrics.failovers.inc()
        if failures > self.cfg.retries:
            raise APIError(
                503,
                f"the request failed on {failures} {role} workers after {len(out)} "
                f"tokens; retry later (last error: {e})",
                type="service_unavailable",
                code="worker_failure",
                headers=RETRY_AFTER,
            ) from e
        self.metrics.retries.labels(role).inc()
        return failures
