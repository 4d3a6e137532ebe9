"""`kimik3 bench serve`: a load generator against an OpenAI-compatible server (`kimik3 serve`,
`kimik3 launch`, a router), streaming over HTTP, that reports what `vllm bench serve` reports.

    kimik3 bench serve --base-url http://127.0.0.1:8000 --dataset-name random \\
        --random-input-len 128 --random-output-len 64 --num-prompts 200 --request-rate 4
    kimik3 bench serve --dataset-name multiturn --multiturn-sessions 8 --max-concurrency 8
    kimik3 bench serve --dataset-name mt-bench --num-prompts 80 --result-file out/mt_bench.json

Requests stream (SSE) from /v1/completions or /v1/chat/completions (`--endpoint`; default per
dataset: `serving.bench_data`) with ``stream_options.include_usage``, so the output tokens are the
server's count; without a usage chunk they are the chunks' ``token_ids`` (kimik3's extension),
else one per output chunk.  Arrivals: a Poisson process (`--request-rate`, seeded; gamma
intervals with `--burstiness` other than 1, as vLLM's) or all at once (`inf`, the default), with
at most `--max-concurrency` requests in flight.  A multiturn session's turns go one after the
other: the schedule times the sessions' first turns.  `--num-warmups` requests (the first
request's prompt) go before the measured ones and are not counted; all of them failing ends the
run before it starts.  The API key: `--api-key @FILE`, else $KIMIK3_API_KEY, else $OPENAI_API_KEY
(a key on the command line shows in the process list, so it is refused, as `kimik3 serve` does).

Metrics (`serving.bench_metrics`): request, output and total token throughput; TTFT, TPOT, ITL and
E2E latency mean, median, std and percentiles (`--metric-percentiles`, default 90,99), printed as
vLLM's text block and, with `--result-file`, written as vLLM's JSON keys plus the run's settings
and per-request lists.  Where the server's /metrics exports the engine's step counters
(`bench_metrics.STEP_SERIES`) the report adds the measured steps' host and device-wait ms by step
kind; otherwise it says the server exports none.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import math
import os
import sys
import time

import httpx
import numpy as np

from serving import bench_data
from serving import flags
from serving.bench_metrics import RequestResult, calculate_metrics, format_report, read_step_counters, step_profile

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Target:
    """Where and how requests go.  `base_url`: the server's root (no /v1); `temperature` None: the
    server's default; `extra_body`: more request fields, sent as given."""

    base_url: str
    endpoint: str = bench_data.COMPLETIONS
    model: str = ""
    api_key: str | None = None
    ignore_eos: bool = False
    temperature: float | None = None
    timeout_s: float = 600.0
    extra_body: dict = dataclasses.field(default_factory=dict)

    def headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclasses.dataclass(frozen=True)
class LoadConfig:
    """How requests arrive: `request_rate` per second (inf: all at once), gamma-distributed gaps of
    shape `burstiness` (1: Poisson), at most `max_concurrency` in flight (None: no limit),
    `num_warmups` uncounted requests first."""

    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    num_warmups: int = 1
    seed: int = 0
    percentiles: tuple[float, ...] = (90.0, 99.0)


def arrival_times(n: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send offsets (s from the benchmark's start) of `n` arrivals, vLLM's schedule: gaps drawn
    from a gamma distribution of shape `burstiness` and mean 1 / `request_rate` (exponential, a
    Poisson process, at burstiness 1; constant at infinite burstiness), summed, then scaled so
    the last arrival is at n / request_rate; all 0 at an infinite rate.  Deterministic in `seed`."""
    if n <= 0:
        return []
    if not request_rate > 0 or not burstiness > 0:
        raise ValueError(f"--request-rate and --burstiness must be > 0 (got {request_rate}, {burstiness})")
    if math.isinf(request_rate):
        return [0.0] * n
    if math.isinf(burstiness):
        gaps = np.full(n, 1.0 / request_rate)
    else:
        gaps = np.random.default_rng(seed).gamma(burstiness, 1.0 / (request_rate * burstiness), n)
    times = np.cumsum(gaps)
    return (times * (n / request_rate) / times[-1]).tolist()


def request_body(target: Target, sample: bench_data.SampleRequest) -> dict:
    """The streaming request body of `sample` to `target.endpoint`."""
    body = {"model": target.model, "stream": True, "stream_options": {"include_usage": True}}
    if target.endpoint == bench_data.CHAT:
        body.update(messages=sample.prompt, max_completion_tokens=sample.output_len)
    else:
        body.update(prompt=sample.prompt, max_tokens=sample.output_len)
    if target.ignore_eos:
        body["ignore_eos"] = True
    if target.temperature is not None:
        body["temperature"] = target.temperature
    return {**body, **target.extra_body}


def _output_of(choice: dict) -> tuple[int, bool]:
    """(token ids, whether it is an output chunk) of a streamed choice."""
    ids = choice.get("token_ids") or []
    text = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
    return len(ids), bool(ids or text)


async def send(client: httpx.AsyncClient, target: Target, sample: bench_data.SampleRequest, t0: float) -> RequestResult:
    """Stream one request; its `RequestResult` (times from `time.perf_counter`, `start_time`
    relative to `t0`).  A non-200 answer, an error event in the stream, a transport error or a
    stream that ends before [DONE] is a failure naming why."""
    res = RequestResult(prompt_len=sample.prompt_len, session=sample.session, turn=sample.turn)
    usage, chunk_tokens, done = None, 0, False
    first = last_token = last_choice = None
    st = time.perf_counter()
    res.start_time = st - t0
    try:
        url = target.base_url + target.endpoint
        async with client.stream("POST", url, json=request_body(target, sample), headers=target.headers()) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:300]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                now = time.perf_counter()
                event = json.loads(data)
                if "error" in event:
                    res.error = f"stream error: {json.dumps(event['error'])[:300]}"
                    return res
                usage = event.get("usage") or usage
                if not event.get("choices"):
                    continue
                last_choice = now
                n_ids, is_output = _output_of(event["choices"][0])
                if not is_output:
                    continue
                if first is None:
                    first = now
                else:
                    res.itl.append(now - last_token)
                last_token = now
                chunk_tokens += n_ids or 1
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    if not done or last_choice is None:
        res.error = "the stream ended before [DONE]" if not done else "no chunk with a choice"
        return res
    res.success = True
    res.ttft = (first if first is not None else last_choice) - st
    res.latency = last_choice - st
    res.output_tokens = (usage or {}).get("completion_tokens", chunk_tokens)
    if usage and usage.get("prompt_tokens") is not None:
        res.prompt_len = usage["prompt_tokens"]
    res.cached_tokens = ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return res


def _client(max_concurrency: int | None, timeout_s: float) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency)
    return httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0), limits=limits)


async def server_info(target: Target) -> dict:
    """/v1/models' first model ({"id", "max_model_len", ...}); ValueError naming what went wrong."""
    try:
        async with _client(None, 30.0) as client:
            r = await client.get(target.base_url + "/v1/models", headers=target.headers())
    except httpx.HTTPError as e:
        raise ValueError(f"{target.base_url}/v1/models: {type(e).__name__}: {e}") from None
    if r.status_code in (401, 403):
        raise ValueError(f"{target.base_url} refused the API key (HTTP {r.status_code}): pass --api-key @FILE")
    if r.status_code != 200 or not r.json().get("data"):
        raise ValueError(f"{target.base_url}/v1/models answered HTTP {r.status_code}: {r.text[:200]}")
    return r.json()["data"][0]


async def _step_counters(client: httpx.AsyncClient, target: Target) -> dict | None:
    """`read_step_counters` of the server's /metrics; None where it has none (or no /metrics)."""
    try:
        r = await client.get(target.base_url + "/metrics", headers=target.headers())
        return read_step_counters(r.text) if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError, ImportError) as e:  # unreachable, not Prometheus, no parser
        log.debug("no step counters from %s/metrics: %s", target.base_url, e)
        return None


async def benchmark(target: Target, samples: list[bench_data.SampleRequest], load: LoadConfig) -> dict:
    """Warm up, send `samples` on `load`'s schedule, and return the result: vLLM's metrics
    (`bench_metrics.calculate_metrics`), the run's settings, per-request lists (input_lens,
    output_lens, ttfts, itls, latencies, start_times, errors) and `engine_step_profile`
    (`bench_metrics.step_profile`; None where the server exports no step counters)."""
    if not samples:
        raise ValueError("no requests to send")
    chains: dict[int, list[int]] = {}  # session -> indices of its requests, in order
    for i, s in enumerate(samples):
        chains.setdefault(s.session, []).append(i)
    offsets = arrival_times(len(chains), load.request_rate, load.burstiness, load.seed)
    gate = asyncio.Semaphore(load.max_concurrency or len(samples))
    results: list[RequestResult | None] = [None] * len(samples)
    async with _client(load.max_concurrency, target.timeout_s) as client:
        if load.num_warmups:
            t = time.perf_counter()

            async def warm():
                async with gate:
                    return await send(client, target, samples[0], t)

            warm_results = await asyncio.gather(*(warm() for _ in range(load.num_warmups)))
            if not any(r.success for r in warm_results):
                raise ValueError(f"every warm-up request failed: {warm_results[0].error}")
            log.info("%d warm-up requests in %.2f s", load.num_warmups, time.perf_counter() - t)
        before = await _step_counters(client, target)
        t0 = time.perf_counter()

        async def chain(indices: list[int], offset: float) -> None:
            await asyncio.sleep(max(0.0, t0 + offset - time.perf_counter()))
            for i in indices:
                async with gate:
                    results[i] = await send(client, target, samples[i], t0)

        await asyncio.gather(*(chain(ix, off) for ix, off in zip(chains.values(), offsets)))
        duration = time.perf_counter() - t0
        after = await _step_counters(client, target) if before is not None else None
    done = [r for r in results if r is not None]
    for r in done:
        if not r.success:
            log.warning("request %d/%d failed: %s", r.session, r.turn, r.error)
    return {
        "date": time.strftime("%Y%m%d-%H%M%S"),
        "base_url": target.base_url,
        "endpoint": target.endpoint,
        "model_id": target.model,
        "num_prompts": len(samples),
        "request_rate": "inf" if math.isinf(load.request_rate) else load.request_rate,
        "burstiness": load.burstiness,
        "max_concurrency": load.max_concurrency,
        "num_warmups": load.num_warmups,
        "seed": load.seed,
        **calculate_metrics(done, duration, load.percentiles),
        "input_lens": [r.prompt_len for r in done],
        "cached_lens": [r.cached_tokens for r in done],
        "output_lens": [r.output_tokens if r.success else 0 for r in done],
        "ttfts": [r.ttft for r in done],
        "itls": [r.itl for r in done],
        "latencies": [r.latency for r in done],
        "start_times": [r.start_time for r in done],
        "errors": [r.error for r in done],
        "engine_step_profile": step_profile(before, after),
    }


# ---- command line --------------------------------------------------------------------------------------
def api_key(value: str | None) -> str | None:
    """`--api-key @FILE`'s key (`serving.flags.read_api_key`), else $KIMIK3_API_KEY, else $OPENAI_API_KEY."""
    if value:
        return flags.read_api_key(value)
    return os.environ.get("KIMIK3_API_KEY") or os.environ.get("OPENAI_API_KEY") or None


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """`kimik3 bench serve`'s flags (vLLM's names where vLLM has the flag)."""
    p.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="debug logging")
    p.add_argument(
        "--base-url", default="http://127.0.0.1:8000", help="the server's root URL (a trailing /v1 is dropped)"
    )
    p.add_argument("--endpoint", default=None, choices=bench_data.ENDPOINTS, help="default: per dataset")
    p.add_argument("--model", default=None, help="the model name sent (default: /v1/models' first)")
    p.add_argument("--api-key", default=None, metavar="@FILE", help="the key in FILE (default $KIMIK3_API_KEY)")
    p.add_argument("--dataset-name", default="random", choices=bench_data.DATASETS, help="the request set")
    p.add_argument(
        "--dataset-path",
        default=None,
        help=f"mt-bench's questions (default: ../shared/data/{bench_data.MT_BENCH_FILE} next to the checkout "
        "when present, else serving/data's copy)",
    )
    p.add_argument("--num-prompts", type=int, default=100, help="requests measured (multiturn: at most)")
    p.add_argument("--random-input-len", type=int, default=1024, help="random: prompt tokens")
    p.add_argument("--random-output-len", type=int, default=128, help="random: tokens to generate")
    p.add_argument("--random-range-ratio", type=float, default=0.0, help="random: lengths in len * [1-r, 1+r]")
    p.add_argument("--mt-bench-output-len", type=int, default=256, help="mt-bench: tokens to generate")
    p.add_argument("--multiturn-sessions", type=int, default=8, help="multiturn: sessions")
    p.add_argument("--multiturn-min-turns", type=int, default=2, help="multiturn: turns per session, at least")
    p.add_argument("--multiturn-max-turns", type=int, default=4, help="multiturn: turns per session, at most")
    p.add_argument("--multiturn-scale", type=float, default=16.0, help="multiturn: docs/design.md's tokens / this")
    p.add_argument("--request-rate", type=float, default=math.inf, help="arrivals per second (inf: all at once)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps (1: Poisson)")
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight, at most")
    p.add_argument("--num-warmups", type=int, default=1, help="uncounted requests before the measured ones")
    p.add_argument("--seed", type=int, default=0, help="dataset and arrival seed")
    p.add_argument("--ignore-eos", action="store_true", help="generate every requested token (ignore_eos)")
    p.add_argument("--temperature", type=float, default=None, help="default: the server's")
    p.add_argument("--metric-percentiles", default="90,99", help="comma-separated percentiles reported")
    p.add_argument("--request-timeout-s", type=float, default=600.0, help="per request")
    p.add_argument("--result-file", default=None, metavar="PATH", help="write the JSON result here")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`kimik3 bench`: its one benchmark, `serve`."""
    sub = parser.add_subparsers(dest="bench_command", required=True, metavar="{serve}")
    s = sub.add_parser(
        "serve", help="load an OpenAI server", description=__doc__, formatter_class=parser.formatter_class
    )
    add_serve_arguments(s)


def build_requests(args, max_model_len: int | None) -> list[bench_data.SampleRequest]:
    """The request set the arguments name (`serving.bench_data`)."""
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1 (got {args.num_prompts})")
    if args.dataset_name == "random":
        return bench_data.random_requests(
            args.num_prompts,
            args.random_input_len,
            args.random_output_len,
            endpoint=args.endpoint,
            range_ratio=args.random_range_ratio,
            seed=args.seed,
        )
    if args.dataset_name == "multiturn":
        return bench_data.multiturn_requests(
            args.num_prompts,
            sessions=args.multiturn_sessions,
            turns=(args.multiturn_min_turns, args.multiturn_max_turns),
            scale=args.multiturn_scale,
            endpoint=args.endpoint,
            max_model_len=max_model_len,
            seed=args.seed,
        )
    path = args.dataset_path or bench_data.default_mt_bench_path()
    return bench_data.mt_bench_requests(
        args.num_prompts, path, args.mt_bench_output_len, endpoint=args.endpoint, seed=args.seed
    )


def run(args) -> int:
    """The command: benchmark, print the report, write --result-file."""
    if getattr(args, "bench_command", "serve") != "serve":
        raise ValueError(f"unknown benchmark {args.bench_command!r}")
    args.endpoint = args.endpoint or bench_data.DEFAULT_ENDPOINT[args.dataset_name]
    try:
        percentiles = tuple(float(p) for p in args.metric_percentiles.split(","))
    except ValueError:
        raise ValueError(f"--metric-percentiles {args.metric_percentiles!r}: numbers, comma-separated") from None
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1 (got {args.max_concurrency})")
    base = args.base_url.rstrip("/").removesuffix("/v1")
    target = Target(
        base,
        args.endpoint,
        args.model or "",
        api_key(args.api_key),
        args.ignore_eos,
        args.temperature,
        args.request_timeout_s,
    )
    info = asyncio.run(server_info(target))
    target = dataclasses.replace(target, model=args.model or info["id"])
    samples = build_requests(args, info.get("max_model_len"))
    load = LoadConfig(
        args.request_rate, args.burstiness, args.max_concurrency, args.num_warmups, args.seed, percentiles
    )
    print(
        f"{args.dataset_name}: {len(samples)} requests to {base}{args.endpoint} ({target.model}); request rate "
        f"{args.request_rate:g}, burstiness {args.burstiness:g}, max concurrency {args.max_concurrency}",
        flush=True,
    )
    result = asyncio.run(benchmark(target, samples, load))
    result["dataset_name"] = args.dataset_name
    print(format_report(result, percentiles))
    if args.result_file:
        os.makedirs(os.path.dirname(os.path.abspath(args.result_file)), exist_ok=True)
        with open(args.result_file, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.result_file}")
    return 0 if result["completed"] else 1


def main(argv=None) -> int:
    """`python -m serving.bench_serve serve ...`."""
    parser = argparse.ArgumentParser(prog="kimik3 bench", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if getattr(args, "verbose", False) else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
    try:
        return run(args)
    except ValueError as e:
        print(f"kimik3 bench: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
