"""What `kimik3 bench serve` (`serving.bench_serve`) measures, with `vllm bench serve`'s names and
definitions (vllm/benchmarks/serve.py, `calculate_metrics`), over the successful requests:

* TTFT: from sending the request to its first output chunk;
* ITL: every gap between two consecutive output chunks, all requests' pooled;
* TPOT: per request with more than one output token, (E2EL - TTFT) / (output tokens - 1);
* E2EL: from sending the request to its last chunk that carries a choice;
* request throughput: completed requests / benchmark duration; output token throughput: their
  output tokens / duration; total token throughput: (input + output tokens) / duration.

Each latency has its mean, median, standard deviation and percentiles (numpy's linear
interpolation), in ms; a latency with no value reads 0, as vLLM writes it.  An output chunk is a
streamed chunk whose choice carries a token (``token_ids``, kimik3's extension) or text: a chat
stream's opening role chunk and a finish-only closing chunk are not tokens.  Beyond vLLM's: the
prompt tokens the server reports as prefix-cache hits (the usage's
``prompt_tokens_details.cached_tokens``), which the multiturn dataset is built to produce.

The engine's step profile (`serving.metrics.StepProfile`) comes from the server's Prometheus
/metrics where it exports the counters named in `STEP_SERIES` (labelled by step ``kind``; a router
federates its workers' series, labelled by ``worker``): `step_profile` is what happened between
two readings.
"""

from __future__ import annotations

import dataclasses

import numpy as np

# a step-kind-labelled counter per quantity; the workers' /metrics would export these
STEP_SERIES = {
    "steps": "kimik3_worker_engine_steps_total",
    "host_s": "kimik3_worker_engine_step_host_seconds_total",
    "wait_s": "kimik3_worker_engine_step_wait_seconds_total",
}
LATENCIES = (
    ("ttft", "TTFT", "Time to First Token"),
    ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
    ("itl", "ITL", "Inter-token Latency"),
    ("e2el", "E2EL", "End-to-end Latency"),
)


@dataclasses.dataclass
class RequestResult:
    """One request's client-side record; times in seconds, `start_time` from the benchmark's start."""

    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = dataclasses.field(default_factory=list)
    latency: float = 0.0
    start_time: float = 0.0
    cached_tokens: int = 0  # of the prompt, a prefix-cache hit (the usage's prompt_tokens_details)
    session: int = 0
    turn: int = 0


def _word(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def latency_stats(name: str, values: list[float], percentiles=(90.0, 99.0)) -> dict[str, float]:
    """{mean_NAME_ms, median_NAME_ms, std_NAME_ms, pP_NAME_ms...} of `values` (seconds)."""
    v = np.asarray(values or [0.0], np.float64) * 1e3
    out = {
        f"mean_{name}_ms": float(v.mean()),
        f"median_{name}_ms": float(np.median(v)),
        f"std_{name}_ms": float(v.std()),
    }
    out.update({f"p{_word(p)}_{name}_ms": float(np.percentile(v, p)) for p in percentiles})
    return out


def calculate_metrics(results: list[RequestResult], duration_s: float, percentiles=(90.0, 99.0)) -> dict:
    """vLLM's metrics of `results` over a benchmark of `duration_s` (the module docstring)."""
    ok = [r for r in results if r.success]
    total_in, total_out = sum(r.prompt_len for r in ok), sum(r.output_tokens for r in ok)
    out = {
        "duration": duration_s,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "total_cached_tokens": sum(r.cached_tokens for r in ok),
        "request_throughput": len(ok) / duration_s,
        "output_throughput": total_out / duration_s,
        "total_token_throughput": (total_in + total_out) / duration_s,
    }
    values = {
        "ttft": [r.ttft for r in ok],
        "tpot": [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1],
        "itl": [x for r in ok for x in r.itl],
        "e2el": [r.latency for r in ok],
    }
    for name, _, _ in LATENCIES:
        out.update(latency_stats(name, values[name], percentiles))
    return out


def read_step_counters(metrics_text: str) -> dict[str, dict[str, float]] | None:
    """{kind: {"steps", "host_s", "wait_s"}} of a Prometheus text, summed over workers; None when
    it holds none of `STEP_SERIES`."""
    from prometheus_client.parser import text_string_to_metric_families  # optional: the serve extra

    by_name = {v: k for k, v in STEP_SERIES.items()}
    out: dict[str, dict[str, float]] = {}
    for fam in text_string_to_metric_families(metrics_text):
        for s in fam.samples:
            if s.name in by_name:
                kind = out.setdefault(s.labels.get("kind", "?"), dict.fromkeys(STEP_SERIES, 0.0))
                kind[by_name[s.name]] += s.value
    return out or None


def step_profile(before: dict | None, after: dict | None) -> dict[str, dict[str, float]] | None:
    """{kind: {"steps", "host_ms", "wait_ms"}}: the steps taken between two `read_step_counters`
    readings and their mean host and device-wait ms a step (`StepProfile.as_dict`'s shape); None
    without both readings."""
    if before is None or after is None:
        return None
    out = {}
    for kind, a in after.items():
        b = before.get(kind, dict.fromkeys(STEP_SERIES, 0.0))
        n = a["steps"] - b["steps"]
        if n > 0:
            host, wait = a["host_s"] - b["host_s"], a["wait_s"] - b["wait_s"]
            out[kind] = {"steps": int(n), "host_ms": 1e3 * host / n, "wait_ms": 1e3 * wait / n}
    return out


def format_report(result: dict, percentiles=(90.0, 99.0)) -> str:
    """vLLM's "Serving Benchmark Result" block of a `serving.bench_serve.benchmark` result, and the
    engine's step profile after it where the server exports one."""
    row = lambda label, value, fmt="": f"{label:<40} {value:<10{fmt}}".rstrip()
    lines = ["{:=^50}".format(" Serving Benchmark Result ")]
    lines += [row("Successful requests:", result["completed"]), row("Failed requests:", result["failed"])]
    if result.get("max_concurrency") is not None:
        lines.append(row("Maximum request concurrency:", result["max_concurrency"]))
    if result.get("request_rate", "inf") != "inf":
        lines.append(row("Request rate configured (RPS):", result["request_rate"], ".2f"))
    lines += [
        row("Benchmark duration (s):", result["duration"], ".2f"),
        row("Total input tokens:", result["total_input_tokens"]),
        row("Total generated tokens:", result["total_output_tokens"]),
        row("Cached input tokens (prefix hits):", result["total_cached_tokens"]),
        row("Request throughput (req/s):", result["request_throughput"], ".2f"),
        row("Output token throughput (tok/s):", result["output_throughput"], ".2f"),
        row("Total token throughput (tok/s):", result["total_token_throughput"], ".2f"),
    ]
    for name, short, header in LATENCIES:
        lines.append("{:-^50}".format(header))
        lines.append(row(f"Mean {short} (ms):", result[f"mean_{name}_ms"], ".2f"))
        lines.append(row(f"Median {short} (ms):", result[f"median_{name}_ms"], ".2f"))
        lines += [row(f"P{_word(p)} {short} (ms):", result[f"p{_word(p)}_{name}_ms"], ".2f") for p in percentiles]
    lines.append("{:-^50}".format("Engine Steps (host + device wait)"))
    profile = result.get("engine_step_profile")
    if profile is None:
        lines.append("not exported by this server (/metrics has no " + STEP_SERIES["steps"] + ")")
    elif not profile:
        lines.append("no engine step between the readings")
    for kind, v in sorted((profile or {}).items(), key=lambda kv: -kv[1]["steps"]):
        lines.append(row(f"{kind} ({v['steps']} steps), ms a step:", f"{v['host_ms']:.2f} + {v['wait_ms']:.2f}"))
    lines.append("=" * 50)
    return "\n".join(lines)
