"""The router's Prometheus metrics, and the federation of its workers' behind its /metrics.

`RouterMetrics` holds kimik3_router_* and, under vLLM's names with the served model's name
(`serving.vllm_metrics`), the request-level figures.  `/metrics` (`RouterMetrics.exposition`)
adds every worker's engine series (KV use, the prefix cache, preemptions, kimik3_worker_*)
labelled worker=URL, scraped when it is read; a worker that does not answer within
`WORKER_SCRAPE_TIMEOUT_S` is kimik3_router_worker_metrics_up 0, never a stalled scrape.
"""

from __future__ import annotations

import asyncio
import logging

import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from serving.router.registry import Worker
from serving.vllm_metrics import VLLMMetrics, WithWorkers, federate

log = logging.getLogger(__name__)

# the longest a router's /metrics waits for its workers' (read when a scrape starts)
WORKER_SCRAPE_TIMEOUT_S = 2.0


class RouterMetrics:
    """kimik3_router_* and, under vLLM's names with model_name (`serving.vllm_metrics`), the
    request-level figures: queue, latencies, tokens, finish reasons."""

    def __init__(self, model_name: str):
        r = self.registry = CollectorRegistry()
        self.vllm = VLLMMetrics(r, model_name)
        self.requests = Counter(
            "kimik3_router_requests", "HTTP API requests by endpoint and status", ["endpoint", "status"], registry=r
        )
        self.latency = Histogram(
            "kimik3_router_request_seconds",
            "request wall time",
            ["endpoint"],
            registry=r,
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
        )
        self.ttft = Histogram(
            "kimik3_router_ttft_seconds",
            "arrival to first token",
            registry=r,
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        )
        self.tpot = Histogram(
            "kimik3_router_tpot_seconds",
            "mean gap between output tokens",
            registry=r,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1),
        )
        self.abandoned = Counter(
            "kimik3_router_abandoned",
            "non-streamed requests whose client left before the answer (their worker requests were cancelled)",
            registry=r,
        )
        self.prompt_tokens = Counter("kimik3_router_prompt_tokens", "prompt tokens", registry=r)
        self.completion_tokens = Counter("kimik3_router_completion_tokens", "completion tokens", registry=r)
        self.cached_tokens = Counter(
            "kimik3_router_cached_prompt_tokens", "prompt tokens served from cache", ["tier"], registry=r
        )
        self.handoff_cached = Counter(
            "kimik3_router_handoff_cached_tokens", "tokens a decode worker found in cache when taking over", registry=r
        )
        self.inflight = Gauge("kimik3_router_inflight", "admitted requests", registry=r)
        self.queued = Gauge("kimik3_router_queued", "requests waiting for admission", registry=r)
        self.rejected = Counter("kimik3_router_rejected", "requests refused before any worker", ["reason"], registry=r)
        self.worker_requests = Counter(
            "kimik3_router_worker_requests", "attempts sent to workers", ["worker", "role", "outcome"], registry=r
        )
        self.retries = Counter("kimik3_router_retries", "attempts retried on another worker", ["role"], registry=r)
        self.failovers = Counter("kimik3_router_failovers", "streams continued on another decode worker", registry=r)
        self.handoffs = Counter(
            "kimik3_router_handoffs", "prefill -> decode handoffs by how the KV moved", ["mode"], registry=r
        )
        self.handoff_bytes = Counter(
            "kimik3_router_direct_handoff_bytes",
            "KV bytes direct handoffs moved worker to worker (never through the router)",
            registry=r,
        )
        self.affinity = Counter(
            "kimik3_router_prefill_choice", "how the prefill worker was chosen", ["decision"], registry=r
        )
        self.circuit = Gauge(
            "kimik3_router_circuit_open", "1 when the worker's circuit is open", ["worker"], registry=r
        )
        self.healthy = Gauge(
            "kimik3_router_worker_healthy", "1 when the last health check passed", ["worker"], registry=r
        )
        self.worker_load = Gauge("kimik3_router_worker_score", "load score", ["worker"], registry=r)
        self.media = Gauge(
            "kimik3_router_media",
            "remote images: fetches, seconds fetching, and the L1 fetch "
            "cache's hits / misses / puts / corrupt / errors / bytes_hit",
            ["stat"],
            registry=r,
        )
        self.worker_metrics_up = Gauge(
            "kimik3_router_worker_metrics_up",
            "1 when the worker answered the scrape of its /metrics behind this one, 0 when it did not in time",
            ["worker"],
            registry=r,
        )
        self.scrape: asyncio.Future | None = None  # the workers' scrape in flight (`scrape_workers`)

    async def scrape_workers(self, client: httpx.AsyncClient | None, workers: list[Worker]) -> dict[str, str | None]:
        """Every worker's /metrics text by URL (None: no answer within `WORKER_SCRAPE_TIMEOUT_S`, or
        not a 200), fetched together; a /metrics that arrives while a scrape is in flight shares it,
        so clients never multiply the workers' scrapes."""
        if self.scrape is None or self.scrape.done():
            self.scrape = asyncio.ensure_future(_scrape_all(client, workers))
        return await asyncio.shield(self.scrape)

    def exposition(self, scraped: dict[str, str | None], media_stats: dict, running: int, waiting: int) -> bytes:
        """The /metrics text: this router's series (the media fetcher's `media_stats`, admission's
        `running` and `waiting` set now) and the workers' `scraped` series, labelled worker=URL."""
        for stat, value in media_stats.items():
            self.media.labels(stat).set(value)
        self.vllm.load(running, waiting)
        families, answered = federate(scraped)
        for url, up in answered.items():
            self.worker_metrics_up.labels(url).set(1 if up else 0)
        return generate_latest(WithWorkers(self.registry, families))


async def _scrape_all(client: httpx.AsyncClient | None, workers: list[Worker]) -> dict[str, str | None]:
    timeout = WORKER_SCRAPE_TIMEOUT_S  # the module's value now: an operator (or a test) may set it

    async def one(w: Worker) -> str | None:
        if client is None:
            return None
        try:
            r = await asyncio.wait_for(client.get(w.url + "/metrics", timeout=timeout), timeout)
        except (httpx.HTTPError, asyncio.TimeoutError) as e:
            log.debug("metrics of %s: %r", w.url, e)
            return None
        return r.text if r.status_code == 200 else None

    texts = await asyncio.gather(*(one(w) for w in workers))
    return {w.url: text for w, text in zip(workers, texts)}
