"""The router's workers: one `Worker` each, grouped by role into `WorkerPools`, and their health.

A worker's health check (``GET /health``) reports its status, load (queue depth, KV use) and the
facts the router needs of the deployment (namespace, page size, context, handoff store); it also
moves the worker's circuit breaker: a failed check counts a failure, a passing one closes the
circuit.  A worker whose tokenizer ends sequences on another id than the router's is kept out
of the pools: it would never end a request where the router expects.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import httpx

from serving.router.breaker import OPEN, CircuitBreaker

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Worker:
    """One worker as this router sees it: its role, its breaker, what its last health check said and
    how many of this router's requests it holds.  `score` orders the candidates (lower is less busy)."""

    url: str
    role: str  # the pool it serves in: "prefill" or "decode"
    breaker: CircuitBreaker
    healthy: bool | None = None  # None until the first health check
    draining: bool = False  # the worker says so (its /health)
    drained_by_router: bool = False
    inflight: int = 0  # requests this router has on it now
    info: dict = dataclasses.field(default_factory=dict)
    load: dict = dataclasses.field(default_factory=dict)
    last_error: str | None = None

    def available(self) -> bool:
        return (
            self.healthy is not False and not self.draining and not self.drained_by_router and self.breaker.available()
        )

    def score(self) -> float:
        return self.inflight + self.load.get("waiting", 0) + self.load.get("kv_use", 0.0)

    def describe(self) -> dict:
        return {
            "url": self.url,
            "role": self.role,
            "healthy": self.healthy,
            "draining": self.draining or self.drained_by_router,
            "circuit": self.breaker.state,
            "inflight": self.inflight,
            "score": self.score(),
            "load": self.load,
            "last_error": self.last_error,
            "worker_id": self.info.get("worker_id"),
            "pid": self.info.get("pid"),
            "status": self.info.get("status"),
            "store_health": self.info.get("store_health"),
        }


class WorkerPools:
    """The prefill and decode workers of `cfg` (a worker of role "both" serves under decode), each
    with its own breaker; `all` is prefill + decode (in that order, the order of the health
    report).  `tok` is the router's tokenizer (its `eos_id` and `name`), `metrics` the router's
    (`serving.router.metrics.RouterMetrics`: the per-worker gauges the checks set)."""

    def __init__(self, cfg, tok, metrics):
        self.cfg, self.tok, self.metrics = cfg, tok, metrics
        mk = lambda: CircuitBreaker(cfg.breaker_threshold, cfg.breaker_cooldown_s, cfg.breaker_max_cooldown_s)
        self.prefill = [Worker(u.rstrip("/"), "prefill", mk()) for u in cfg.prefill]
        self.decode = [Worker(u.rstrip("/"), "decode", mk()) for u in cfg.decode]
        self.all = self.prefill + self.decode

    def fact(self, key: str, default=None):
        """A deployment fact the workers report on /health (the first worker that reports it)."""
        vals = [w.info[key] for w in self.all if key in w.info]
        return vals[0] if vals else default

    def max_context(self, default: int) -> int:
        """The smallest context any worker reports (a request must fit every worker it may reach)."""
        vals = [w.info["max_context"] for w in self.all if "max_context" in w.info]
        return min(vals) if vals else default

    def find(self, url: str) -> Worker | None:
        return next((w for w in self.all if w.url == url), None)

    def serving(self) -> bool:
        """Whether every role that has workers has one available (the router can serve a request)."""
        return (any(w.available() for w in self.prefill) or not self.prefill) and (
            any(w.available() for w in self.decode) or not self.decode
        )

    def describe(self) -> list[dict]:
        return [w.describe() for w in self.all]

    async def check_all(self, client: httpx.AsyncClient) -> None:
        await asyncio.gather(*(self.check(client, w) for w in self.all))

    async def check(self, client: httpx.AsyncClient, w: Worker) -> None:
        """One health check of `w`: its status, load and facts, its breaker, and its gauges."""
        try:
            r = await client.get(w.url + "/health", timeout=self.cfg.health_timeout_s)
            body = r.json()
        except (httpx.HTTPError, ValueError) as e:
            w.healthy, w.last_error = False, f"health: {e!r}"
            w.breaker.failure()
        else:
            status = body.get("status")
            w.info = {k: v for k, v in body.items() if k != "load"}
            w.load = body.get("load", {})
            w.draining = status == "draining"
            theirs = (body.get("tokenizer") or {}).get("eos_id", self.tok.eos_id)
            if theirs != self.tok.eos_id:  # its EOS would not end our requests: keep it out of the pools
                w.healthy = False
                w.last_error = (
                    f"tokenizer mismatch: the worker's end of sequence is id {theirs}, this router's "
                    f"({self.tok.name}) {self.tok.eos_id}"
                )
                log.error("%s: %s", w.url, w.last_error)
            elif r.status_code == 200 or status == "draining":
                w.healthy = True
                w.breaker.success()
            else:
                w.healthy, w.last_error = False, f"health: status {status}"
                w.breaker.failure()
        self.metrics.circuit.labels(w.url).set(1 if w.breaker.state == OPEN else 0)
        self.metrics.healthy.labels(w.url).set(1 if w.healthy else 0)
        self.metrics.worker_load.labels(w.url).set(w.score())
