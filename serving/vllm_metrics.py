"""Prometheus metrics under vLLM's names, beside our `kimik3_*` ones.

Dashboards and KV-aware routers built for vLLM scrape ``vllm:*`` series with a ``model_name``
label (vLLM V1's names, ``vllm/v1/metrics/loggers.py``).  The same figures kimik3 already keeps are
exported again under those names, so such a dashboard or router works unchanged against a kimik3
worker (engine-level: queue, KV use, preemptions, the prefix cache: `load`, `prefix_cache`) or
router (request-level: latencies, tokens, finish reasons: `load`, `finished`).  Each figure comes
from one place only (a P/D pair sees every request twice; the router once), so sums over every
scrape target do not double count.  Units are vLLM's: seconds, and KV use as a fraction in [0, 1].
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

# vLLM's histogram buckets (seconds)
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
TPOT_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
FINISHED_REASONS = ("stop", "length", "abort")


class VLLMMetrics:
    """The ``vllm:*`` series of one model on `registry`; every series carries model_name."""

    def __init__(self, registry, model_name: str):
        self.model_name = model_name
        m = ["model_name"]
        kw = dict(labelnames=m, registry=registry)
        self.running = Gauge("vllm:num_requests_running", "Number of requests in model execution batches.", **kw)
        self.waiting = Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", **kw)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", **kw)
        self.preemptions = Counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", **kw)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", **kw)
        self.generation_tokens = Counter("vllm:generation_tokens", "Number of generation tokens processed.", **kw)
        self.prefix_queries = Counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.", **kw
        )
        self.prefix_hits = Counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", **kw
        )
        self.success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labelnames=m + ["finished_reason"],
            registry=registry,
        )
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            buckets=TTFT_BUCKETS,
            **kw,
        )
        self.tpot = Histogram(
            "vllm:time_per_output_token_seconds",
            "Histogram of time per output token in seconds.",
            buckets=TPOT_BUCKETS,
            **kw,
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            buckets=E2E_BUCKETS,
            **kw,
        )
        self.prompt_hist = Histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", buckets=_token_buckets(), **kw
        )
        self.generation_hist = Histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", buckets=_token_buckets(), **kw
        )
        for metric in (
            self.running,
            self.waiting,
            self.kv_usage,
            self.preemptions,
            self.prompt_tokens,
            self.generation_tokens,
            self.prefix_queries,
            self.prefix_hits,
            self.ttft,
            self.tpot,
            self.e2e,
            self.prompt_hist,
            self.generation_hist,
        ):  # every series present from the start, as vLLM's
            metric.labels(model_name)
        for reason in FINISHED_REASONS:
            self.success.labels(model_name, reason)
        self._preemptions_seen = 0

    def load(self, running: int, waiting: int, kv_use: float | None = None, preemptions: int | None = None) -> None:
        """The engine's (or the router's) current queue; `preemptions`: the engine's running total."""
        self.running.labels(self.model_name).set(running)
        self.waiting.labels(self.model_name).set(waiting)
        if kv_use is not None:
            self.kv_usage.labels(self.model_name).set(kv_use)
        if preemptions is not None and preemptions > self._preemptions_seen:
            self.preemptions.labels(self.model_name).inc(preemptions - self._preemptions_seen)
            self._preemptions_seen = preemptions

    def finished(
        self,
        *,
        prompt_tokens: int,
        generation_tokens: int,
        finished_reason: str,
        ttft_s: float | None = None,
        tpot_s: float | None = None,
        e2e_s: float | None = None,
    ) -> None:
        """One request done at the API (`finished_reason`: stop, length or abort); the prefix
        cache's series are the engines' (`prefix_cache`)."""
        name = self.model_name
        self.prompt_tokens.labels(name).inc(prompt_tokens)
        self.generation_tokens.labels(name).inc(generation_tokens)
        self.prompt_hist.labels(name).observe(prompt_tokens)
        self.generation_hist.labels(name).observe(generation_tokens)
        self.success.labels(name, finished_reason if finished_reason in FINISHED_REASONS else "abort").inc()
        for hist, value in ((self.ttft, ttft_s), (self.tpot, tpot_s), (self.e2e, e2e_s)):
            if value is not None:
                hist.labels(name).observe(value)

    def prefix_cache(self, queried_tokens: int, hit_tokens: int) -> None:
        """An engine's prefix-cache lookup for one request: prompt tokens asked, tokens found."""
        self.prefix_queries.labels(self.model_name).inc(queried_tokens)
        self.prefix_hits.labels(self.model_name).inc(hit_tokens)


def _token_buckets(limit: int = 1 << 20) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to limit (vLLM's build_1_2_5_buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


# The series only an engine knows (its pool, its prefix cache, its preemptions): a router's own
# copies never move, so its /metrics carries each worker's instead, labelled by worker.
ENGINE_SERIES = (
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:num_preemptions",
)
# and the workers' own kimik3 series
WORKER_PREFIXES = ("kimik3_worker_", "kimik3_store_")


def federated_name(name: str) -> bool:
    """Whether a worker's metric family (a parsed family's name: a counter's without ``_total``)
    belongs on the router's /metrics: `ENGINE_SERIES` and `WORKER_PREFIXES`, less the
    ``_created`` timestamps."""
    return not name.endswith("_created") and (name in ENGINE_SERIES or name.startswith(WORKER_PREFIXES))


def federate(worker_texts: dict[str, str | None], label: str = "worker") -> tuple[list, dict[str, bool]]:
    """The families of several workers' Prometheus texts that belong on the router
    (`federated_name`), one family per name with every worker's samples, each sample labelled
    `label` = its worker's key; and which workers answered (a worker whose text is None or does
    not parse contributes nothing and is False)."""
    families: dict[str, Metric] = {}
    answered = {}
    for worker, text in worker_texts.items():
        if text is None:
            answered[worker] = False
            continue
        try:
            parsed = list(text_string_to_metric_families(text))
        except ValueError:
            answered[worker] = False
            continue
        answered[worker] = True
        for fam in parsed:
            if not federated_name(fam.name):
                continue
            out = families.get(fam.name)
            if out is None:
                out = families[fam.name] = Metric(fam.name, fam.documentation, fam.type)
            for s in fam.samples:
                out.add_sample(s.name, {**s.labels, label: worker}, s.value, s.timestamp)
    return list(families.values()), answered


class WithWorkers:
    """What `prometheus_client.generate_latest` reads for a router's /metrics: the router's own
    registry less its `ENGINE_SERIES` (which only the workers fill), then the workers' families
    (`federate`)."""

    def __init__(self, registry, families: list):
        self.registry, self.families = registry, families

    def collect(self):
        for metric in self.registry.collect():
            if metric.name not in ENGINE_SERIES:
                yield metric
        yield from self.families
