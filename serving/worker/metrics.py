"""What a worker reports about itself: its Prometheus series behind /metrics (`WorkerMetrics`) and
the periodic stats line in vLLM's words (`StatsLogger`)."""

from __future__ import annotations

import logging
import threading

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily

from serving.metrics import RequestRecord
from serving.vllm_metrics import VLLMMetrics

STATS_LOGGER = "serving.stats"


class WorkerMetrics:
    """kimik3_worker_* and, under vLLM's names with model_name (`serving.vllm_metrics`), the same,
    in `registry`.  Fed by the engine thread (`observe` per finished request, `gauges` per step)
    and by /metrics as it is read (`refresh`)."""

    def __init__(self, registry, model_name: str, profile=None):
        """profile: callable -> the engine's `serving.metrics.StepProfile` (read at scrape time as
        kimik3_worker_engine_step*_total{kind}), or None for no step series."""
        self.vllm = VLLMMetrics(registry, model_name)
        if profile is not None:
            registry.register(StepProfileCollector(profile))
        self.ttft = Histogram(
            "kimik3_worker_ttft_seconds",
            "arrival to first token",
            registry=registry,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        )
        self.tpot = Histogram(
            "kimik3_worker_tpot_seconds",
            "mean gap between output tokens",
            registry=registry,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1),
        )
        self.tokens = Counter("kimik3_worker_output_tokens", "output tokens", registry=registry)
        self.cached = Counter(
            "kimik3_worker_cached_prompt_tokens", "prompt tokens served from cache", ["tier"], registry=registry
        )
        self.prompt = Counter("kimik3_worker_prompt_tokens", "prompt tokens", registry=registry)
        self.waiting = Gauge("kimik3_worker_waiting", "requests waiting for admission", registry=registry)
        self.running = Gauge("kimik3_worker_running", "admitted requests", registry=registry)
        self.kv_use = Gauge("kimik3_worker_kv_use", "fraction of KV pages in use", registry=registry)
        self.compiles = Gauge(
            "kimik3_worker_compiles",
            "XLA programs this worker built since its warm-up (each stalled the step that needed it)",
            registry=registry,
        )
        self.store_auth_failures = Gauge(
            "kimik3_store_auth_failures",
            "store entries this worker refused for failing their MAC (forged, damaged or another secret's)",
            registry=registry,
        )

    def observe(self, req) -> None:
        """A finished request (the engine's `Request`): its latencies and token counts."""
        rec = RequestRecord(req.arrival_s, req.token_times_s, len(req.prompt), 0, 0)
        self.vllm.prefix_cache(len(req.prompt), req.cached_tokens)  # engine-level only: the router counts requests
        if rec.ttft_s is not None:
            self.ttft.observe(rec.ttft_s)
        if rec.tpot_s is not None:
            self.tpot.observe(rec.tpot_s)
        self.tokens.inc(len(req.output))
        self.prompt.inc(len(req.prompt))
        self.cached.labels("gpu").inc(req.cached_tokens - req.cached_tokens_host)
        self.cached.labels("host").inc(req.cached_tokens_host)

    def gauges(self, load: dict) -> None:
        """The queue and KV use of an `EngineLoop.load`-shaped snapshot."""
        self.waiting.set(load["waiting"])
        self.running.set(load["running"])
        self.kv_use.set(load["kv_use"])
        self.vllm.load(load["running"], load["waiting"], load["kv_use"], load.get("preemptions"))

    def refresh(self, store_stats, compile_watch) -> None:
        """The series read at scrape time: the store client's refused entries (`store_stats`, its
        tier's stats, when it counts them) and the programs built since warm-up (`compile_watch`,
        a started `metrics.CompileWatch`, or None)."""
        if store_stats is not None and hasattr(store_stats, "auth_failures"):
            self.store_auth_failures.set(store_stats.auth_failures)
        if compile_watch is not None:
            self.compiles.set(compile_watch.count)


class StepProfileCollector:
    """The engine's step profile (`serving.metrics.StepProfile`) as three counters by step kind,
    read when /metrics is scraped: kimik3_worker_engine_steps_total, and the seconds of host work
    and of waiting on the device, kimik3_worker_engine_step_{host,wait}_seconds_total (what
    `kimik3 bench serve` reads between its start and end, `serving.bench_metrics.step_profile`)."""

    def __init__(self, profile):
        self.profile = profile

    def collect(self):
        prof = self.profile()
        series = (
            ("kimik3_worker_engine_steps", "engine steps taken, by kind", prof.steps),
            ("kimik3_worker_engine_step_host_seconds", "host time of the engine's steps, by kind", prof.host_s),
            (
                "kimik3_worker_engine_step_wait_seconds",
                "time the engine's steps waited on the device, by kind",
                prof.wait_s,
            ),
        )
        for name, doc, counts in series:
            fam = CounterMetricFamily(name, doc, labels=["kind"])
            for kind, value in list(counts.items()):  # a copy: the engine thread adds to it
                fam.add_metric([kind], float(value))
            yield fam


class StatsLogger:
    """Every `interval_s`, one line on the logger `STATS_LOGGER` in vLLM's words: ``decode-0: Avg
    prompt throughput: X tokens/s, Avg generation throughput: Y tokens/s, Running: N reqs,
    Waiting: M reqs, GPU KV cache usage: P%, Prefix cache hit rate: Q%`` (`IntervalStats`).  At
    INFO while the worker has work or had throughput in the interval before, at DEBUG while it
    idles (as vLLM).  The logger is set to INFO when the thread starts, so the line shows under
    the worker's default --log-level (warning); --log-stats-interval-s 0 turns it off.  `loop`:
    the worker's `serving.worker.loop.EngineLoop`."""

    def __init__(self, loop, interval_s: float):
        self.loop, self.interval_s = loop, interval_s
        self.log = logging.getLogger(STATS_LOGGER)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stats-logger", daemon=True)

    def tick(self) -> str:
        """Log the interval's line now (and start the next interval); returns it."""
        load = self.loop.load()
        text, active = self.loop.stats.line(load["running"], load["waiting"], load["kv_use"])
        text = f"{self.loop.worker_id}: {text}"
        self.log.log(logging.INFO if active else logging.DEBUG, "%s", text)
        return text

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - a line that cannot be made never stops the worker
                self.log.exception("stats line failed")

    def start(self) -> "StatsLogger":
        if self.log.getEffectiveLevel() > logging.INFO:
            self.log.setLevel(logging.INFO)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
