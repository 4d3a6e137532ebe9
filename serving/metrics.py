"""Serving metrics, defined once (docs/design.md) and used everywhere.

* TTFT: arrival to first output token.
* TPOT: mean gap between a request's consecutive output tokens; split by the step that produced
  the later token: decode-only steps, and steps that also ran prefill chunks ("mixed": what
  prompts arriving cost the running requests).
* queue time: arrival to admission (first KV allocated).
* throughput: output tokens / wall time of the run.
* token cache rate: prompt tokens served from cache / prompt tokens, per tier.
Every latency is reported at p50 / p90 / p99.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from typing import Sequence

import numpy as np


@dataclasses.dataclass
class RequestRecord:
    arrival_s: float
    token_times_s: Sequence[float]
    prompt_tokens: int
    cached_tokens_gpu: int
    cached_tokens_host: int
    admitted_s: float | None = None
    token_mixed: Sequence[bool] = ()  # per output token: its step also ran prefill (empty: unknown)

    @property
    def ttft_s(self) -> float | None:
        return self.token_times_s[0] - self.arrival_s if self.token_times_s else None

    @property
    def tpot_s(self) -> float | None:
        t = self.token_times_s
        return (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else None

    def _gaps(self, mixed: bool) -> float | None:
        t, m = self.token_times_s, self.token_mixed
        gaps = [t[i] - t[i - 1] for i in range(1, len(t)) if i < len(m) and bool(m[i]) == mixed]
        return sum(gaps) / len(gaps) if gaps else None

    @property
    def tpot_decode_only_s(self) -> float | None:
        """Mean gap before tokens from decode-only steps."""
        return self._gaps(False)

    @property
    def tpot_mixed_s(self) -> float | None:
        """Mean gap before tokens from steps that also ran prefill chunks."""
        return self._gaps(True)

    @property
    def queue_s(self) -> float | None:
        return None if self.admitted_s is None else self.admitted_s - self.arrival_s


# jax's event for each XLA program it builds (compiled, or loaded from the persistent cache):
# `jax._src.dispatch.BACKEND_COMPILE_EVENT`, emitted with the program's name (`fun_name`)
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class CompileWatch:
    """Every XLA program this process builds inside the `with` block (compiled, or loaded from the
    persistent compile cache), by name, and the seconds spent: a serving run that builds one stalls
    for it.  An engine's `compiles` counts its step programs; this also sees the helpers (a page or
    snapshot move, an eager op) that a warm-up may have missed.  Listens to jax's monitoring events,
    so it counts other threads' compiles in the same window too."""

    def __init__(self):
        self.names: collections.Counter = collections.Counter()
        self.seconds = 0.0

    @property
    def count(self) -> int:
        return sum(self.names.values())

    def _on_duration(self, event: str, duration_s: float, **kwargs) -> None:
        if event == BACKEND_COMPILE_EVENT:
            self.names[kwargs.get("fun_name", "?")] += 1
            self.seconds += duration_s

    def __enter__(self) -> "CompileWatch":
        import jax.monitoring  # the worker's metrics read this module without JAX

        jax.monitoring.register_event_duration_secs_listener(self._on_duration)
        return self

    def __exit__(self, *exc) -> None:
        import jax.monitoring  # the worker's metrics read this module without JAX

        jax.monitoring.unregister_event_duration_listener(self._on_duration)


@dataclasses.dataclass
class StepProfile:
    """Where an engine's steps go, by kind (`Engine.step`): "chained" (a decode step dispatched on
    the device tokens of the one in flight, then that one's tokens read), "decode" (decode rows
    only, dispatched after every token was read), "mixed" (decode rows and prefill chunks),
    "prefill" (chunks only), "idle".  wait_s: what the step blocked on the device
    (`jax.block_until_ready`) for a decode step's tokens or a prompt's last chunk's logits;
    host_s: the rest of its wall time (scheduling, the dispatches, sampling, bookkeeping; a
    decode mesh's step, which reads its tokens inside its call, counts there too).  A chained
    step whose wait is ~0 is host-bound: the device finished before the host asked."""

    steps: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    host_s: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    wait_s: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    def add(self, kind: str, host_s: float, wait_s: float) -> None:
        self.steps[kind] += 1
        self.host_s[kind] += host_s
        self.wait_s[kind] += wait_s

    def as_dict(self) -> dict[str, dict[str, float]]:
        """{kind: {"steps": n, "host_ms": mean host ms a step, "wait_ms": mean wait ms a step}}."""
        return {
            k: {"steps": n, "host_ms": 1e3 * self.host_s[k] / n, "wait_ms": 1e3 * self.wait_s[k] / n}
            for k, n in self.steps.items()
        }

    def summary(self) -> str:
        """One line: each kind's steps and mean host / wait ms a step, the most frequent first."""
        return "; ".join(
            f"{k} {v['steps']} steps (host {v['host_ms']:.2f} + wait {v['wait_ms']:.2f} ms a step)"
            for k, v in sorted(self.as_dict().items(), key=lambda kv: -kv[1]["steps"])
        )


def percentiles(values: Sequence[float | None]) -> dict[str, float]:
    v = np.asarray([x for x in values if x is not None], np.float64)
    if v.size == 0:
        return {"p50": float("nan"), "p90": float("nan"), "p99": float("nan")}
    return {f"p{q}": float(np.percentile(v, q)) for q in (50, 90, 99)}


@dataclasses.dataclass
class Summary:
    name: str
    requests: int
    output_tokens: int
    wall_s: float
    ttft_s: dict
    tpot_s: dict
    queue_s: dict
    cache_rate: float
    cache_rate_gpu: float
    cache_rate_host: float
    tpot_decode_only_s: dict = dataclasses.field(default_factory=lambda: percentiles([]))
    tpot_mixed_s: dict = dataclasses.field(default_factory=lambda: percentiles([]))

    @property
    def throughput_tok_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else float("nan")


def summarize(name: str, records: Sequence[RequestRecord], wall_s: float) -> Summary:
    prompt = max(1, sum(r.prompt_tokens for r in records))
    gpu = sum(r.cached_tokens_gpu for r in records)
    host = sum(r.cached_tokens_host for r in records)
    return Summary(
        name,
        len(records),
        sum(len(r.token_times_s) for r in records),
        wall_s,
        percentiles([r.ttft_s for r in records]),
        percentiles([r.tpot_s for r in records]),
        percentiles([r.queue_s for r in records]),
        (gpu + host) / prompt,
        gpu / prompt,
        host / prompt,
        percentiles([r.tpot_decode_only_s for r in records]),
        percentiles([r.tpot_mixed_s for r in records]),
    )


def format_table(summaries: Sequence[Summary]) -> str:
    ms = lambda d, q: f"{1e3 * d[q]:.1f}"
    lines = [
        "| mode | requests | throughput tok/s | TTFT p50 / p90 / p99 ms | TPOT p50 / p90 / p99 ms | "
        "TPOT p50 decode-only / mixed ms | queue p50 / p99 ms | cache rate (GPU + host) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for s in summaries:
        lines.append(
            f"| {s.name} | {s.requests} | {s.throughput_tok_s:.1f} | "
            f"{ms(s.ttft_s, 'p50')} / {ms(s.ttft_s, 'p90')} / {ms(s.ttft_s, 'p99')} | "
            f"{ms(s.tpot_s, 'p50')} / {ms(s.tpot_s, 'p90')} / {ms(s.tpot_s, 'p99')} | "
            f"{ms(s.tpot_decode_only_s, 'p50')} / {ms(s.tpot_mixed_s, 'p50')} | "
            f"{ms(s.queue_s, 'p50')} / {ms(s.queue_s, 'p99')} | "
            f"{s.cache_rate:.1%} ({s.cache_rate_gpu:.1%} + {s.cache_rate_host:.1%}) |"
        )
    return "\n".join(lines)


def plot(summaries_records: dict[str, Sequence[RequestRecord]], path: str) -> None:
    """TTFT and TPOT distributions per mode (empirical CDFs)."""
    from matplotlib.figure import Figure  # no pyplot: the caller's backend stays

    fig = Figure(figsize=(9, 3.5))
    axes = fig.subplots(1, 2)
    for name, records in summaries_records.items():
        for ax, attr in zip(axes, ("ttft_s", "tpot_s")):
            v = np.sort([getattr(r, attr) * 1e3 for r in records if getattr(r, attr) is not None])
            if v.size:
                ax.plot(v, np.arange(1, v.size + 1) / v.size, label=name)
    for ax, title in zip(axes, ("TTFT (ms)", "TPOT (ms)")):
        ax.set_xlabel(title)
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


class IntervalStats:
    """The figures of vLLM's periodic stats line (`vllm/v1/metrics/loggers.py`, LoggingStatLogger)
    for one engine: prompt and generation throughput since the previous line, the queue, KV use,
    and the prefix cache's hit rate over the most recent `recent_requests` prompts (vLLM's window).

    `prefilled` (a prompt's first token went out) and `generated` (tokens went out) are called by
    the thread that runs the engine, `line` by the one that logs: a lock keeps them apart."""

    def __init__(self, recent_requests: int = 1000, clock=None):
        self.clock = clock or time.monotonic
        self._lock = threading.Lock()
        self._prompt = 0  # prompt tokens prefilled since the last line
        self._generated = 0  # tokens generated since the last line
        self._recent: collections.deque[tuple[int, int]] = collections.deque(maxlen=recent_requests)
        self._since = self.clock()
        self.last_active = False  # whether the previous line had any throughput

    def prefilled(self, prompt_tokens: int, cached_tokens: int) -> None:
        """A prompt was prefilled: its tokens, and how many of them the prefix cache held."""
        with self._lock:
            self._prompt += prompt_tokens
            self._recent.append((prompt_tokens, cached_tokens))

    def generated(self, tokens: int) -> None:
        with self._lock:
            self._generated += tokens

    def line(self, running: int, waiting: int, kv_use: float) -> tuple[str, bool]:
        """(the line, whether anything happened: throughput now or in the previous interval, or
        requests running or waiting), and the interval starts again."""
        with self._lock:
            now = self.clock()
            dt = max(now - self._since, 1e-9)
            prompt_tps, gen_tps = self._prompt / dt, self._generated / dt
            queried = sum(q for q, _ in self._recent)
            hits = sum(h for _, h in self._recent)
            self._prompt = self._generated = 0
            self._since = now
        active = bool(prompt_tps or gen_tps or running or waiting or self.last_active)
        self.last_active = bool(prompt_tps or gen_tps)
        text = (
            f"Avg prompt throughput: {prompt_tps:.1f} tokens/s, Avg generation throughput: {gen_tps:.1f} tokens/s, "
            f"Running: {running} reqs, Waiting: {waiting} reqs, GPU KV cache usage: {100 * kv_use:.1f}%, "
            f"Prefix cache hit rate: {100 * hits / queried if queried else 0.0:.1f}%"
        )
        return text, active


def record_of(req) -> "RequestRecord":
    """The metrics record of a finished `serving.request.Request`."""
    return RequestRecord(
        req.arrival_s,
        req.token_times_s,
        len(req.prompt),
        req.cached_tokens - req.cached_tokens_host,
        req.cached_tokens_host,
        req.admitted_s,
        req.token_mixed,
    )
