"""`kimik3 router`: an OpenAI-compatible gateway over prefill and decode worker processes.

    python -m serving.router --port 8000 --prefill http://127.0.0.1:8101 --decode http://127.0.0.1:8201 \
        [--mooncake-master 127.0.0.1:50051 --mooncake-metadata http://127.0.0.1:8080/metadata]

A request is tokenized and validated here (nothing invalid reaches a worker), admitted under a
bound (`--max-inflight` running, `--max-queue` waiting at most `--queue-timeout-s`; beyond that
429), then:

1. prefill: a prefill worker runs the prompt and returns the first token; its engine publishes
   the prompt's pages and KDA snapshots to the shared store (serving/worker.py);
2. decode: a decode worker gets prompt + tokens so far, finds the prefix in the store (it
   recomputes at most the last partial page) and streams the remaining tokens.

With `--handoff direct` (the default when the workers have no store) the prefill worker keeps
the prompt's KV (page contents + KDA state, `/prefill` with `hold_kv`) under a one-time handle,
and the decode worker's `/adopt` pulls it from the prefill worker by that handle and continues
without computing the prompt: the KV moves worker to worker, the router carries the handle
(`serving.kv_handoff`).  With no prefill workers (`both` workers under `--decode`) the whole request goes
to one worker.

Choice of worker: the lowest load score, ``router in-flight + worker queue depth + KV use``,
among workers whose health check passes, that are not draining and whose circuit is closed
(or half-open).  Prefix affinity (prefill only): the router remembers which worker prefilled
each block hash; a prompt whose deepest known prefix is *not* in the shared store goes to the
worker that holds it in its GPU pool, unless that worker is busier than the best by more than
`--affinity-slack`.  A prefix that is in the store is served equally well by any worker, so
then load alone decides.

Faults: connection errors, timeouts (workers send a keepalive line every second, so
`--read-timeout-s` of silence means a hung worker), 5xx and broken streams are retried on
another worker with exponential backoff and full jitter, at most `--retries` times; each counts
against that worker's circuit breaker (`--breaker-threshold` consecutive failures open it for
`--breaker-cooldown-s`, doubling while it keeps failing; a passing health check or request
after the cooldown closes it).  A decode worker that dies mid-stream is replaced by another
that continues from prompt + the tokens already sent: nothing is sent twice.  When no worker
of a role is available at all (down, drained, circuit open), a request waits up to
`--no-worker-wait-s` for one to come back (a worker restart), then gets a 503.  When every
attempt fails, the client gets 503 (or, once streaming, a final SSE error event) marked
retriable, with `Retry-After`.

Poison pills: a request that failed on a worker for a reason of its own is never sent to another
worker.  A worker's 4xx answer (other than 429 full, and 401 / 403, which say the router's
internal token is wrong: a deployment fault), and an error the worker marks ``"retriable":
false`` (in its answer or its stream), go back to the client as they are, with the worker's
status, marked not retriable, and count nothing against the worker's circuit breaker.

Bodies: capped at `--max-body-bytes` (413: refused on the Content-Length before reading, and
while reading a body that states none) and due whole within `--body-timeout-s` (408).  Parsing,
validation and tokenization run on worker threads, never on the event loop (bodies over 1 MiB
`--large-body-parsers` at a time), so a flood of large bodies does not stall `/health`.  Two
checks spare the work a body that cannot fit would cost: one that holds more JSON values than 4
per context token is a 400 as it arrives, before it is read whole or parsed
(`serving.router_body.ValueCounter`), and a prompt whose text is longer than the context could
hold even at the tokenizer's longest token is a 400 before it is tokenized.  Malformed JSON,
including an integer literal over Python's 4,300-digit conversion limit (named by its field),
is a 400.

Authentication (`serving.router_auth`): with API keys (``$KIMIK3_API_KEY`` / ``--api-key``,
``$KIMIK3_API_KEY_FILE`` / ``--api-key-file``) every /v1/* request needs ``Authorization:
Bearer KEY`` (the scheme in any case), and the key's tenant salts every cache namespace the
request touches: the workers' prefix cache, KDA snapshots and encoder cache (``cache_salt``),
this router's affinity hashes and the media cache's L1 and L2.  A single key is one tenant for
all its clients; no key (loopback development) makes every client the anonymous tenant.  The
operator's routes (``/admin/workers``, ``/docs``, ``/openapi.json``, and the worker details in
``/health``) need an API key or the deployment's internal token when either is configured;
``/admin/drain`` and ``/admin/resume`` need the internal token (an API key where the deployment
has no internal token).  ``/health``'s status and ``/metrics`` stay open, as vLLM's do; ``/metrics``
carries the workers' engine series too (KV use, the prefix cache, preemptions), labelled by worker
and scraped when it is read (`Router.scrape_workers`).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import collections
import contextlib
import dataclasses
import json
import logging
import os
import random
import sys
import time
import uuid

import httpx
import numpy as np
from fastapi import Request  # at module level: FastAPI resolves handler annotations in module globals

from cache.media import build_fetcher
from kimik3.text import load_serving_tokenizer
from serving import internal_auth, router_auth, router_body
from serving.sampling import TokenLogprobs
from serving.stop import StopMatcher
from serving.openai_api import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    chat_logprobs,
    chat_prompt,
    check_common,
    completion_logprobs,
    completion_prompt,
    logprobs_count,
    resolve_max_tokens,
    sampling_options,
    stop_strings,
    validation_error,
)

log = logging.getLogger(__name__)

CLOSED, HALF_OPEN, OPEN = "closed", "half_open", "open"


class CircuitBreaker:
    """Consecutive-failure breaker: closed -> open (cooldown, doubling) -> half-open -> closed."""

    def __init__(self, threshold: int = 3, cooldown_s: float = 5.0, max_cooldown_s: float = 60.0, clock=time.monotonic):
        self.threshold, self.base_cooldown_s, self.max_cooldown_s = threshold, cooldown_s, max_cooldown_s
        self.cooldown_s = cooldown_s
        self.clock = clock
        self._state = CLOSED
        self.failures = 0
        self.opened_at = 0.0
        self.opens = 0

    @property
    def state(self) -> str:
        if self._state == OPEN and self.clock() - self.opened_at >= self.cooldown_s:
            return HALF_OPEN
        return self._state

    def available(self) -> bool:
        return self.state != OPEN

    def success(self) -> None:
        if self.state == OPEN:
            return  # a success still in flight from before the circuit opened does not close it
        self._state, self.failures, self.cooldown_s = CLOSED, 0, self.base_cooldown_s

    def failure(self) -> None:
        state = self.state
        self.failures += 1
        if state == HALF_OPEN:
            self.cooldown_s = min(self.max_cooldown_s, 2 * self.cooldown_s)
            self._open()
        elif state == CLOSED and self.failures >= self.threshold:
            self._open()

    def _open(self) -> None:
        self._state, self.opened_at = OPEN, self.clock()
        self.opens += 1


@dataclasses.dataclass
class Worker:
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


@dataclasses.dataclass
class RouterConfig:
    prefill: list[str] = dataclasses.field(default_factory=list)
    decode: list[str] = dataclasses.field(default_factory=list)
    config: str = "tiny"
    checkpoint: str | None = None  # the workers' checkpoint: its config.json names the model
    # `kimik3.text.load_tokenizer`'s spec: "byte", a tokenizer.json / tiktoken file or a directory
    # (None: the checkpoint's, if it holds one, else "byte"); the workers must use the same one
    tokenizer: str | None = None
    model_name: str | None = None
    max_inflight: int = 16
    max_queue: int = 32
    queue_timeout_s: float = 10.0
    retries: int = 3
    backoff_base_s: float = 0.05
    backoff_max_s: float = 1.0
    connect_timeout_s: float = 1.0
    read_timeout_s: float = 5.0
    request_timeout_s: float = 300.0
    health_interval_s: float = 0.5
    health_timeout_s: float = 2.0
    breaker_threshold: int = 3
    breaker_cooldown_s: float = 5.0
    breaker_max_cooldown_s: float = 30.0
    max_images: int = 16
    max_body_bytes: int = 32 << 20  # larger bodies are a 413 before they are read whole
    body_timeout_s: float = 30.0  # a body not received whole by then is a 408
    no_worker_wait_s: float = 20.0  # with no worker of a role available, wait this long (a restart) before a 503
    image_decoders: int = 4  # requests decoding (and fetching) images at once (off the event loop)
    large_body_parsers: int = 1  # bodies over LARGE_BODY_BYTES whose JSON is parsed at once (off the event loop)
    # Remote image URLs (`cache.media`): fetched under an SSRF-safe policy (public addresses only,
    # checked on the resolved address and on every redirect), through the L1 fetch cache.
    fetch_images: bool = True
    fetch_allow_hosts: tuple[str, ...] | None = None  # None: any public host
    fetch_allow_networks: tuple[str, ...] = ()  # non-public CIDRs let through (tests: 127.0.0.1/32)
    fetch_timeout_s: float = 10.0
    fetch_max_bytes: int = 16 << 20
    l1_bytes: int = 256 << 20  # the embedded L1's budget (0: no L1)
    l1_redis: str | None = None  # redis://127.0.0.1:PORT/0: an L1 shared by every router
    l2_bytes: int = 256 << 20  # decoded pixels by (tenant, content); 0: none
    default_max_tokens: int = 256
    affinity_slack: float = 2.0
    affinity_entries: int = 100_000
    mooncake_master: str | None = None
    mooncake_metadata: str | None = None
    handoff: str = "auto"  # store | direct | auto (store when the prefill workers have one)
    prefill_timeout_s: float = 30.0  # a direct-handoff prefill answers in one piece: no keepalives
    # clients of the OpenAI routes (/v1/*) send `Authorization: Bearer <key>`, a key of `api_key` or of the
    # key file `api_key_file` (`serving.router_auth`); neither: open, as on loopback
    api_key: str | None = dataclasses.field(default=None, repr=False)
    api_key_file: str | None = None


API_KEY_ENV = router_auth.API_KEY_ENV
API_KEY_FILE_ENV = router_auth.API_KEY_FILE_ENV
LARGE_BODY_BYTES = 1 << 20  # bodies past this parse under `large_body_parsers`
DISCONNECT_POLL_S = 0.25  # how often a non-streamed request checks that its client is still there

# A worker restart takes 10-20 s (a fresh process compiles its steps): clients retry after that.
RETRY_AFTER = {"Retry-After": "15"}


async def read_body(request, limit: int, timeout_s: float | None = None, max_values: int | None = None) -> bytearray:
    """The request's body (one buffer, never copied), or a 413 past `limit` bytes: refused on its
    Content-Length before reading, and while reading (a chunked body states none); a 408 when the
    whole body has not arrived within `timeout_s` (a client that sends half a body and waits holds
    a connection and a buffer forever otherwise); a 400 as soon as the JSON text holds more than
    `max_values` separators (`router_body.ValueCounter`), before it is read whole or parsed."""
    too_large = lambda: APIError(413, f"request body larger than {limit} bytes", code="request_too_large")
    counter = router_body.ValueCounter() if max_values is not None else None
    length = request.headers.get("content-length", "").strip()
    if length.isdigit() and (len(length) > 18 or int(length) > limit):  # 18 digits: int() never balks
        raise too_large()
    body, n = bytearray(), 0  # one buffer: no list of chunks joined into a second copy

    async def read():
        nonlocal n
        async for chunk in request.stream():
            n += len(chunk)
            if n > limit:
                raise too_large()
            if counter is not None and counter.feed(chunk) > max_values:
                raise APIError(
                    400,
                    f"the body holds more than {max_values} JSON values; no request that fits this model's "
                    "context needs that many",
                    code="too_many_values",
                )
            body.extend(chunk)

    try:
        await asyncio.wait_for(read(), timeout_s)
    except asyncio.TimeoutError:
        raise APIError(
            408, f"the request body did not arrive within {timeout_s:g} s ({n} bytes read)", code="request_timeout"
        ) from None
    return body


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


@dataclasses.dataclass
class Parsed:
    """A validated /v1 request: the pydantic request, its prompt ids, the completion budget, its
    images (base64 RGB bytes, or None) and its cache salt (`router_auth.cache_salt`)."""

    req: object
    prompt: list[int]
    max_tokens: int
    images_b64: list[str] | None
    salt: str | None


def max_token_bytes(tok) -> int | None:
    """The most bytes a regular token of `tok` stands for: text of n characters is then at least
    n / max_token_bytes tokens.  None where that bound does not hold (a tokenizer that normalizes
    text before encoding may drop characters)."""
    inner = getattr(tok, "_tok", None)  # a Hugging Face tokenizer's core
    if inner is not None and getattr(inner, "normalizer", None) is not None:
        return None
    try:
        return max(len(tok.token_bytes(i)) for i in range(tok.vocab_size) if not tok.is_special(i))
    except Exception as e:  # noqa: BLE001 - no bound: every prompt is tokenized before its length is known
        log.warning("no longest-token bound for %s (%r): long prompts are tokenized to be refused", tok.name, e)
        return None


class _Metrics:
    """kimik3_router_* and, under vLLM's names with model_name (`serving.vllm_metrics`), the
    request-level figures: queue, latencies, tokens, finish reasons."""

    def __init__(self, model_name: str):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        from serving.vllm_metrics import VLLMMetrics

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
        self.scrape: asyncio.Future | None = None  # the workers' scrape in flight (`Router.scrape_workers`)


# the longest a router's /metrics waits for its workers' (`Router.scrape_workers`)
WORKER_SCRAPE_TIMEOUT_S = 2.0


class Overloaded(Exception):
    pass


class Admission:
    """At most `max_inflight` requests run; `max_queue` more wait up to `timeout_s`; the rest: 429."""

    def __init__(self, max_inflight: int, max_queue: int, timeout_s: float):
        self.max_inflight, self.max_queue, self.timeout_s = max_inflight, max_queue, timeout_s
        self.running = 0
        self.waiting = 0
        self._cond: asyncio.Condition | None = None

    async def acquire(self) -> None:
        if self._cond is None:
            self._cond = asyncio.Condition()
        async with self._cond:
            if self.running < self.max_inflight and not self.waiting:
                self.running += 1
                return
            if self.waiting >= self.max_queue:
                raise Overloaded(f"{self.running} requests running and {self.waiting} queued")
            self.waiting += 1
            try:
                await asyncio.wait_for(self._cond.wait_for(lambda: self.running < self.max_inflight), self.timeout_s)
            except asyncio.TimeoutError:
                raise Overloaded(f"no capacity within {self.timeout_s:g} s") from None
            finally:
                self.waiting -= 1
            self.running += 1

    async def release(self) -> None:
        async with self._cond:
            self.running -= 1
            self._cond.notify_all()


class StoreProbe:
    """Whether a prefix's last page and KDA snapshot are in the shared Mooncake store."""

    def __init__(self, master: str, metadata: str):
        from cache.mooncake_tier import MooncakeHostKVTier

        from cache.guarded_tier import GuardedHostKVTier

        # a probe is a hint: a dead store answers "not there" at once, never stalls routing
        self.tier = GuardedHostKVTier(MooncakeHostKVTier(master, metadata, staging_bytes=1 << 20), timeout_s=0.5)

    def has(self, namespace: str, block_hash: bytes) -> bool:
        from cache.host_tier import make_key

        return all(self.tier.exists([make_key(namespace, "mla", block_hash), make_key(namespace, "kda", block_hash)]))

    def close(self) -> None:
        self.tier.close()


class Router:
    def __init__(self, cfg: RouterConfig):
        from kimik3 import config

        if not cfg.decode:
            raise ValueError("the router needs decode (or both-role) workers: --decode URL ...")
        if cfg.handoff not in ("auto", "store", "direct"):
            raise ValueError(f"handoff must be auto, store or direct; got {cfg.handoff!r}")
        self.cfg = cfg
        if cfg.checkpoint:  # the served weights' own config (a trained or quantized checkpoint)
            from kimik3 import checkpoint

            self.model_cfg = checkpoint.load_config(cfg.checkpoint)
        else:
            self.model_cfg = config.get_config(cfg.config)
        self.tok = load_serving_tokenizer(cfg.tokenizer, cfg.checkpoint, self.model_cfg.vocab_size)
        self.max_token_bytes = max_token_bytes(self.tok)
        self.keys = router_auth.KeyRing.from_config(cfg.api_key, cfg.api_key_file)
        # a Hugging Face directory is served under its own name (vLLM's habit); a config or our
        # own checkpoint as kimik3-<config>
        from kimik3 import hf

        hf_dir = bool(cfg.checkpoint) and hf.is_hf_dir(cfg.checkpoint)
        self.model_name = cfg.model_name or (self.model_cfg.name if hf_dir else f"kimik3-{self.model_cfg.name}")
        self.aliases = {self.model_name, self.model_cfg.name}
        mk = lambda: CircuitBreaker(cfg.breaker_threshold, cfg.breaker_cooldown_s, cfg.breaker_max_cooldown_s)
        self.prefill = [Worker(u.rstrip("/"), "prefill", mk()) for u in cfg.prefill]
        self.decode = [Worker(u.rstrip("/"), "decode", mk()) for u in cfg.decode]
        self.workers = self.prefill + self.decode
        self.metrics = _Metrics(self.model_name)
        self.admission = Admission(cfg.max_inflight, cfg.max_queue, cfg.queue_timeout_s)
        self.affinity: collections.OrderedDict[bytes, str] = collections.OrderedDict()
        self.store: StoreProbe | None = None
        self.media = build_fetcher(
            enabled=cfg.fetch_images,
            allow_hosts=cfg.fetch_allow_hosts,
            allow_networks=cfg.fetch_allow_networks,
            timeout_s=cfg.fetch_timeout_s,
            max_bytes=cfg.fetch_max_bytes,
            l1_bytes=cfg.l1_bytes,
            l1_redis=cfg.l1_redis,
            l2_bytes=cfg.l2_bytes,
        )
        self.client: httpx.AsyncClient | None = None
        # the wait between attempts (`_backoff`): a coroutine function of seconds, `asyncio.sleep`
        # unless a caller (a test) records the waits instead of sleeping them
        self.sleep = asyncio.sleep
        self._health_task: asyncio.Task | None = None
        self.created = int(time.time())

    # ---- lifecycle ------------------------------------------------------------------------------------
    async def start(self) -> None:
        limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
        self.client = httpx.AsyncClient(
            limits=limits,
            timeout=httpx.Timeout(self.cfg.read_timeout_s, connect=self.cfg.connect_timeout_s),
            headers=internal_auth.headers(internal_auth.token()),
        )
        if self.cfg.mooncake_master:
            try:
                self.store = await asyncio.to_thread(StoreProbe, self.cfg.mooncake_master, self.cfg.mooncake_metadata)
            except Exception as e:  # noqa: BLE001 - without the probe, affinity applies to every known prefix
                log.warning("shared store probe unavailable: %r", e)
        await self.check_health()
        self._health_task = asyncio.create_task(self._health_loop())

    async def stop(self) -> None:
        if self._health_task:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        if self.client:
            await self.client.aclose()
        if self.store:
            self.store.close()

    # ---- metrics ------------------------------------------------------------------------------------
    async def scrape_workers(self) -> dict[str, str | None]:
        """Every worker's /metrics text by URL (None: no answer within `WORKER_SCRAPE_TIMEOUT_S`, or
        not a 200), fetched together; a /metrics that arrives while a scrape is in flight shares it,
        so clients never multiply the workers' scrapes."""
        if self.metrics.scrape is None or self.metrics.scrape.done():
            self.metrics.scrape = asyncio.ensure_future(self._scrape_all())
        return await asyncio.shield(self.metrics.scrape)

    async def _scrape_all(self) -> dict[str, str | None]:
        async def one(w: Worker) -> str | None:
            if self.client is None:
                return None
            try:
                r = await asyncio.wait_for(
                    self.client.get(w.url + "/metrics", timeout=WORKER_SCRAPE_TIMEOUT_S), WORKER_SCRAPE_TIMEOUT_S
                )
            except (httpx.HTTPError, asyncio.TimeoutError) as e:
                log.debug("metrics of %s: %r", w.url, e)
                return None
            return r.text if r.status_code == 200 else None

        texts = await asyncio.gather(*(one(w) for w in self.workers))
        return {w.url: text for w, text in zip(self.workers, texts)}

    # ---- health -------------------------------------------------------------------------------------
    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.health_interval_s)
            try:
                await self.check_health()
            except Exception:  # noqa: BLE001
                log.exception("health check round failed")

    async def check_health(self) -> None:
        await asyncio.gather(*(self._check(w) for w in self.workers))

    async def _check(self, w: Worker) -> None:
        try:
            r = await self.client.get(w.url + "/health", timeout=self.cfg.health_timeout_s)
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

    @property
    def max_values(self) -> int:
        """The most JSON values (separators) a /v1 body may hold: a prompt of ids costs a token per
        value and a message at least one, so 4 per context token (plus room for the fields and
        their small lists) is past anything that fits the context."""
        return 4 * self.max_context + 4096

    def _fact(self, key: str, default=None):
        vals = [w.info[key] for w in self.workers if key in w.info]
        return vals[0] if vals else default

    @property
    def max_context(self) -> int:
        vals = [w.info["max_context"] for w in self.workers if "max_context" in w.info]
        return min(vals) if vals else self.model_cfg.max_seq_len

    # ---- choosing workers -----------------------------------------------------------------------------
    @staticmethod
    def _least_loaded(cands: list[Worker]) -> Worker:
        low = min(w.score() for w in cands)
        return random.choice([w for w in cands if w.score() == low])

    async def pick(
        self,
        pool: list[Worker],
        tried: set[str],
        prompt: list[int] | None,
        salt: str | None = None,
        images_b64: list[str] | None = None,
    ) -> Worker | None:
        cands = [w for w in pool if w.available()]
        cands = [w for w in cands if w.url not in tried] or cands
        if not cands:
            return None
        best = self._least_loaded(cands)
        if prompt is None:
            return best
        decision, chosen = "load", best
        holder, h = self._affinity_holder(prompt, salt, images_b64)
        if holder is not None:
            ns = self._fact("namespace")
            in_store = False
            if self.store is not None and ns:
                try:
                    in_store = await asyncio.to_thread(self.store.has, ns, h)
                except Exception as e:  # noqa: BLE001
                    log.debug("store probe failed: %r", e)
            if in_store:
                decision = "store"
            else:
                w = next((c for c in cands if c.url == holder), None)
                if w is not None and w.score() <= best.score() + self.cfg.affinity_slack:
                    decision, chosen = "affinity", w
        self.metrics.affinity.labels(decision).inc()
        return chosen

    def _hashes(self, prompt: list[int], salt: str | None = None, images_b64: list[str] | None = None) -> list[bytes]:
        """The workers' block hashes of `prompt` for a tenant's `salt` with its images (as their
        caches key them: a block holding an image's placeholders carries the image's hash, so
        image prompts match the workers' blocks and prompts that differ only in an image do not)."""
        from cache.block_hash import block_hashes, image_items
        from kimik3 import tokenizer

        ns, page = self._fact("namespace"), self._fact("page_tokens")
        if not ns or not page:
            return []
        items = ()
        if images_b64:
            vit = self.model_cfg.vit
            shape = (vit.image_size, vit.image_size, vit.channels)
            images = [np.frombuffer(base64.b64decode(b), np.uint8).reshape(shape) for b in images_b64]
            items = image_items(prompt, images, vit.tokens_per_image, tokenizer.IMAGE_ID)
            items = tuple(it for it in items if it.offset + it.length <= len(prompt))
        return block_hashes(prompt, block_size=page, namespace=ns, salt=salt, mm_items=items)

    def _affinity_holder(
        self, prompt: list[int], salt: str | None = None, images_b64: list[str] | None = None
    ) -> tuple[str | None, bytes | None]:
        hashes = self._hashes(prompt[:-1], salt, images_b64)  # hits are capped at n - 1 tokens
        for h in reversed(hashes):
            if h in self.affinity:
                self.affinity.move_to_end(h)
                return self.affinity[h], h
        return None, None

    def _remember(
        self, prompt: list[int], url: str, salt: str | None = None, images_b64: list[str] | None = None
    ) -> None:
        for h in self._hashes(prompt, salt, images_b64):
            self.affinity[h] = url
            self.affinity.move_to_end(h)
        while len(self.affinity) > self.cfg.affinity_entries:
            self.affinity.popitem(last=False)

    # ---- one request through the pools ----------------------------------------------------------------
    async def _attempt(
        self, w: Worker, context: list[int], want: int, opts: dict, rid: str, out: list[int], adopt: dict | None = None
    ):
        """Stream up to `want` tokens of `context`'s continuation from `w` into `out` (yielding each);
        with `adopt` ({"kv_from", "kv_handle"}: a direct handoff's KV, held by the prefill worker)
        the worker pulls and takes over the KV instead of computing it.  `opts`: stop_at_eos and the
        sampling parameters (temperature, top_p, seed: draws are seeded per position, so a failover
        continues the same sample).  Ends with the worker's done event.  Raises WorkerFailure (try
        another worker), or RequestFailed (`classify_worker_error`: the request's own fault)."""
        if adopt is not None:
            # the decode worker pulls the KV from the prefill worker by handle (`serving.kv_handoff`);
            # the images travel inside the handoff's KV file, not in the query string
            kw = {
                "params": {
                    "max_tokens": want + len(out),
                    "request_id": rid,
                    **adopt,
                    **{k: v for k, v in opts.items() if k != "images"},
                }
            }
        else:
            # out: what earlier workers generated, now the prompt's tail (the penalties count it)
            kw = {
                "json": {
                    "prompt": context,
                    "max_tokens": want,
                    "request_id": rid,
                    **opts,
                    **({"prior_output": len(out)} if out else {}),
                }
            }
        try:
            async with self.client.stream(
                "POST", w.url + ("/adopt" if adopt is not None else "/generate"), **kw
            ) as resp:
                if resp.status_code != 200:
                    text = (await resp.aread())[:4096].decode(errors="replace")
                    err = classify_worker_error(w.url, resp.status_code, text, adopt=adopt is not None)
                    if resp.status_code == 503 and "draining" in text:
                        w.draining = True
                    raise err
                async for line in resp.aiter_lines():
                    if not line.strip():
                        continue
                    ev = json.loads(line)
                    if "token" in ev:
                        out.append(int(ev["token"]))
                        yield ev
                    elif "done" in ev:
                        yield ev
                        return
                    elif "error" in ev:
                        if ev.get("retriable") is False:  # the request's own fault: no other worker gets it
                            status = ev.get("status")
                            status = status if isinstance(status, int) and 400 <= status < 600 else 500
                            raise RequestFailed(
                                status,
                                f"the worker failed the request: {str(ev['error'])[:500]}",
                                type="invalid_request_error" if status < 500 else "server_error",
                                param=ev["param"] if isinstance(ev.get("param"), str) else None,
                                code="worker_refused",
                            )
                        raise WorkerFailure(f"{w.url}: {ev['error']}", engine_fault=ev.get("code") == "engine_fault")
                raise WorkerFailure(f"{w.url} closed the stream early")
        except (httpx.TransportError, json.JSONDecodeError) as e:
            raise WorkerFailure(f"{w.url}: {type(e).__name__}: {e}") from e

    async def _run_pool(
        self,
        pool: list[Worker],
        prompt: list[int],
        out: list[int],
        total: int,
        opts: dict,
        rid: str,
        affinity: bool,
        adopt: dict | None = None,
    ):
        """Generate until `out` holds `total` tokens (or EOS), failing over between workers (the
        first attempt adopts `adopt`'s KV if given; later ones recompute).
        Yields ("token", t) and finally ("done", event)."""
        role = pool[0].role
        tried: set[str] = set()
        failures = 0
        no_worker_since = None
        while True:
            w = await self.pick(pool, tried, prompt if affinity else None, opts.get("cache_salt"), opts.get("images"))
            if w is None:
                # Every worker of the role is down, drained or tripped: wait for one to come back
                # (a restart takes 10-20 s) rather than fail within a few backoffs.
                now = time.monotonic()
                no_worker_since = no_worker_since or now
                if now - no_worker_since >= self.cfg.no_worker_wait_s:
                    raise APIError(
                        503,
                        f"no healthy {role} worker was available for {self.cfg.no_worker_wait_s:g} s; retry later",
                        type="service_unavailable",
                        code="no_worker",
                        headers=RETRY_AFTER,
                    )
                await asyncio.sleep(min(self.cfg.health_interval_s, self.cfg.no_worker_wait_s))
                continue
            no_worker_since = None
            tried.add(w.url)
            before = len(out)
            w.inflight += 1
            try:
                async for ev in self._attempt(w, prompt + out, total - len(out), opts, rid, out, adopt):
                    if "token" in ev:
                        if "cached_tokens" in ev:
                            yield "info", ev
                        if "logprob" in ev:  # the token's, just before it
                            yield "logprobs", TokenLogprobs.from_json(ev)
                        yield "token", ev["token"]
                    else:
                        w.breaker.success()
                        self.metrics.worker_requests.labels(w.url, role, "ok").inc()
                        if role == "decode" and before == 1:  # the handoff itself, not a failover
                            self.metrics.handoffs.labels("direct" if adopt is not None else "store").inc()
                        if affinity:
                            self._remember(prompt, w.url, opts.get("cache_salt"), opts.get("images"))
                        yield "done", ev
                        return
            except WorkerFailure as e:
                adopt = None  # the handed-over KV may be half taken: later attempts recompute
                w.last_error = str(e)
                outcome = "failed" if e.count_failure else "refused"
                self.metrics.worker_requests.labels(w.url, role, outcome).inc()
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
                await self._backoff(failures)
            finally:
                w.inflight -= 1

    def handoff_mode(self) -> str:
        if self.cfg.handoff != "auto":
            return self.cfg.handoff
        stores = [w.info.get("store") for w in self.prefill if "store" in w.info]
        return "store" if stores and all(stores) else "direct"

    async def _prefill_direct(self, prompt: list[int], rid: str, opts: dict) -> tuple[int, dict, dict]:
        """Direct handoff, prefill side: (first token, where a decode worker pulls the prompt's KV
        from {"kv_from", "kv_handle"}, cache counts and the first token's logprobs)."""
        tried: set[str] = set()
        failures = 0
        body = {"prompt": prompt, "max_tokens": 1, "request_id": rid, "hold_kv": True, **opts}
        while True:
            w = await self.pick(self.prefill, tried, prompt, opts.get("cache_salt"), opts.get("images"))
            err = None
            if w is None:
                err = WorkerFailure("no prefill worker available")
            else:
                tried.add(w.url)
                w.inflight += 1
                try:
                    r = await self.client.post(
                        w.url + "/prefill",
                        json=body,
                        timeout=httpx.Timeout(self.cfg.prefill_timeout_s, connect=self.cfg.connect_timeout_s),
                    )
                    if r.status_code == 200:
                        w.breaker.success()
                        self.metrics.worker_requests.labels(w.url, "prefill", "ok").inc()
                        self._remember(prompt, w.url, opts.get("cache_salt"), opts.get("images"))
                        a = r.json()
                        info = {
                            "cached_tokens": int(a["cached_tokens"]),
                            "cached_tokens_host": int(a["cached_tokens_host"]),
                        }
                        if "logprobs" in a:
                            info["logprobs"] = TokenLogprobs.from_json(a["logprobs"])
                        self.metrics.handoff_bytes.inc(int(a["kv_bytes"]))
                        return int(a["token"]), {"kv_from": w.url, "kv_handle": a["kv_handle"]}, info
                    err = classify_worker_error(w.url, r.status_code, r.text[:4096])
                    if isinstance(err, RequestFailed):
                        raise err
                except httpx.TransportError as e:
                    err = WorkerFailure(f"{w.url}: {type(e).__name__}: {e}")
                finally:
                    w.inflight -= 1
                w.last_error = str(err)
                self.metrics.worker_requests.labels(
                    w.url, "prefill", "failed" if err.count_failure else "refused"
                ).inc()
                if err.count_failure:
                    w.breaker.failure()
            failures += 1 if (w is None or err.count_failure) else 0
            if failures > self.cfg.retries:
                raise APIError(
                    503,
                    f"prefill failed on {failures} attempts; retry later (last error: {err})",
                    type="service_unavailable",
                    code="worker_failure",
                    headers=RETRY_AFTER,
                )
            self.metrics.retries.labels("prefill").inc()
            await self._backoff(max(1, failures))

    async def _backoff(self, attempt: int) -> None:
        delay = min(self.cfg.backoff_max_s, self.cfg.backoff_base_s * 2 ** max(0, attempt - 1))
        await self.sleep(random.uniform(0, delay))  # full jitter

    async def generate(
        self,
        prompt: list[int],
        max_tokens: int,
        stop_at_eos: bool,
        rid: str,
        sampling: dict | None = None,
        images_b64: list[str] | None = None,
        cache_salt: str | None = None,
    ):
        """Yields ("token", id) for every output token (after ("logprobs", `TokenLogprobs`) for it when
        `sampling` asks for logprobs), ("info", {"cached_tokens", "cached_tokens_host"})
        once the first stage's prefix-cache share is known (before its first token), and a final
        ("done", summary).
        `sampling`: `openai_api.sampling_options`'s {"temperature", "top_p", "seed", "top_k", "min_p",
        and where asked "presence_penalty", "frequency_penalty", "logprobs"} (default greedy); `images_b64`: the
        prompt's images as base64 RGB uint8 [S, S, 3] bytes (they travel with every attempt,
        and inside a direct handoff's KV); `cache_salt`: the tenant's (`router_auth.cache_salt`),
        sent to every worker and in the router's own affinity hashes."""
        opts = {"stop_at_eos": stop_at_eos, **(sampling or {}), "images": images_b64}
        if cache_salt is not None:
            opts["cache_salt"] = cache_salt
        out: list[int] = []
        summary = {"cached_tokens": 0, "cached_tokens_host": 0, "finish_reason": "length"}
        stopped = lambda: stop_at_eos and out and out[-1] == self.tok.eos_id
        adopt = None
        if self.prefill and self.handoff_mode() == "direct":
            token, adopt, first = await self._prefill_direct(prompt, rid, opts)
            out.append(token)
            lp = first.pop("logprobs", None)
            summary.update(first)
            yield "info", {k: summary[k] for k in ("cached_tokens", "cached_tokens_host")}
            if lp is not None:
                yield "logprobs", lp
            yield "token", token
            stages = [(self.decode, max_tokens, False)]
        elif self.prefill:
            stages = [(self.prefill, 1, True), (self.decode, max_tokens, False)]
        else:
            stages = [(self.decode, max_tokens, True)]
        for pool, upto, first_stage in stages:
            if len(out) >= max_tokens or stopped():
                break
            async for kind, ev in self._run_pool(pool, prompt, out, upto, opts, rid, affinity=first_stage, adopt=adopt):
                if kind in ("token", "logprobs"):
                    yield kind, ev
                elif first_stage:
                    summary["cached_tokens"] = ev.get("cached_tokens", 0)
                    summary["cached_tokens_host"] = ev.get("cached_tokens_host", 0)
                    if kind == "info":
                        yield "info", {k: summary[k] for k in ("cached_tokens", "cached_tokens_host")}
                elif kind == "info":
                    pass
                else:
                    self.metrics.handoff_cached.inc(ev.get("cached_tokens", 0))
        summary["finish_reason"] = "stop" if stopped() else "length"
        yield "done", summary

    # ---- the HTTP app ---------------------------------------------------------------------------------
    def parse(self, kind: str, raw, tenant: str = router_auth.ANONYMOUS) -> "Parsed":
        """A /v1 body of `tenant` (`router_auth`) validated and tokenized, or APIError: `validate`
        then `build`.  Blocking (CPU); the app runs the two on threads."""
        return self.build(kind, self.validate(kind, raw), tenant)

    def validate(self, kind: str, raw):
        """The body's validated request (JSON, the request's model, checks that need no tokenizer,
        a prompt too long for the context whatever it tokenizes to), or APIError."""
        from pydantic import ValidationError

        obj = router_body.loads(raw)
        if not isinstance(obj, dict):
            raise APIError(400, "the request body must be a JSON object", code="invalid_json")
        try:
            req = (ChatCompletionRequest if kind == "chat" else CompletionRequest).model_validate(obj)
        except ValidationError as e:
            raise validation_error(e) from None
        del obj
        if req.model not in self.aliases:
            raise APIError(
                404,
                f"The model '{req.model}' does not exist; this server serves '{self.model_name}'",
                param="model",
                code="model_not_found",
            )
        check_common(req, self.model_cfg.vocab_size)
        self._check_prompt_fits(req)
        return req

    def build(self, kind: str, req, tenant: str = router_auth.ANONYMOUS) -> "Parsed":
        """A validated request's prompt ids and images (fetched and decoded through the media cache
        as its tenant's salt) and completion budget, or APIError."""
        salt = router_auth.cache_salt(tenant, req.cache_salt)
        try:
            if kind == "chat":
                vit = self.model_cfg.vit
                prompt, images = chat_prompt(
                    req,
                    max_images=self.cfg.max_images,
                    tokens_per_image=vit.tokens_per_image if vit else 0,
                    image_size=vit.image_size if vit else 0,
                    fetcher=self.media,
                    tenant=salt,  # the media cache's L1 / L2 namespace
                    tok=self.tok,
                )
                requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
            else:
                prompt, images = completion_prompt(req, vocab_size=self.model_cfg.vocab_size, tok=self.tok), []
                requested = req.max_tokens
        except UnicodeEncodeError as e:  # a lone surrogate (valid JSON, not valid UTF-8)
            raise APIError(
                400, f"text that is not valid Unicode: {e.reason} at {e.start}", code="invalid_text"
            ) from None
        max_tokens = resolve_max_tokens(requested, len(prompt), self.max_context, self.cfg.default_max_tokens)
        images_b64 = [base64.b64encode(im.tobytes()).decode() for im in images] or None
        return Parsed(req, prompt, max_tokens, images_b64, salt)

    def _check_prompt_fits(self, req) -> None:
        """A 400 (as `resolve_max_tokens` gives) for a prompt that cannot fit the context whatever it
        tokenizes to: more token ids than the context, or more characters than the context's
        tokens could cover at the tokenizer's longest token (`max_token_bytes`; a UTF-8
        character is at least a byte).  Costs nothing like tokenizing a 30 MB text would."""
        if isinstance(req, ChatCompletionRequest):
            param = "messages"
            chars = sum(
                len(m.content) if isinstance(m.content, str) else sum(len(getattr(p, "text", "")) for p in m.content)
                for m in req.messages
                if m.content is not None
            )
            least = -(-chars // self.max_token_bytes) if self.max_token_bytes else 0
        else:
            param, p = "prompt", req.prompt
            if isinstance(p, str) or (len(p) == 1 and isinstance(p[0], str)):
                chars = len(p if isinstance(p, str) else p[0])
                least = -(-chars // self.max_token_bytes) if self.max_token_bytes else 0
            else:
                least = len(p) if p and isinstance(p[0], int) else 0
        if least >= self.max_context:
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_context} tokens; the prompt has at least "
                f"{least} tokens, leaving no room for a completion",
                param=param,
                code="context_length_exceeded",
            )

    def create_app(self):
        from contextlib import asynccontextmanager

        from fastapi import FastAPI
        from fastapi.exceptions import RequestValidationError
        from fastapi.responses import JSONResponse, Response

        from serving.http_util import ClosingStreamingResponse
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
        from starlette.exceptions import HTTPException as StarletteHTTPException

        router = self

        @asynccontextmanager
        async def lifespan(app):
            await router.start()
            yield
            await router.stop()

        # /docs and /openapi.json are served below, behind the operator's credentials; no /redoc
        app = FastAPI(
            title="kimik3 router",
            lifespan=lifespan,
            docs_url=None,
            redoc_url=None,
            openapi_url=None,
            swagger_ui_oauth2_redirect_url=None,
        )

        def error_response(e: APIError, endpoint: str) -> JSONResponse:
            self.metrics.requests.labels(endpoint, str(e.status)).inc()
            return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

        @app.exception_handler(StarletteHTTPException)
        async def http_error(request, exc):
            return JSONResponse(
                APIError(exc.status_code, str(exc.detail), type="invalid_request_error").body(),
                status_code=exc.status_code,
            )

        @app.exception_handler(RequestValidationError)
        async def validation(request, exc):
            return JSONResponse(APIError(400, f"invalid request: {exc.errors()}").body(), status_code=400)

        @app.exception_handler(Exception)
        async def internal(request, exc):  # a bug: an OpenAI-shaped 500, one log line, no traceback to the client
            log.error("internal error on %s: %r", request.url.path, exc)
            return JSONResponse(APIError(500, "internal server error", type="server_error").body(), status_code=500)

        decoders = asyncio.Semaphore(self.cfg.image_decoders)
        large = asyncio.Semaphore(self.cfg.large_body_parsers)

        def refusal(message: str, *, type: str = "invalid_request_error", code: str | None = None) -> JSONResponse:
            self.metrics.rejected.labels("unauthorized").inc()
            return JSONResponse(
                APIError(401, message, type=type, code=code).body(),
                status_code=401,
                headers={"WWW-Authenticate": "Bearer"},
            )

        def client_tenant(request: Request) -> str | JSONResponse:
            """The caller's tenant (`router_auth.KeyRing.tenant`), or a 401 in OpenAI's shape."""
            given = request.headers.get("authorization")
            tenant = self.keys.tenant(given)
            if tenant is not None:
                return tenant
            what = (
                "Incorrect API key provided" if given else "You didn't provide an API key (Authorization: Bearer KEY)"
            )
            return refusal(what, code="invalid_api_key")

        def is_operator(request: Request) -> bool:
            """Whether the caller may see the deployment's internals: it carries an API key or the
            internal token, or the deployment has neither (loopback development)."""
            token, given = internal_auth.token(), request.headers.get("authorization")
            if token is None and not self.keys:
                return True
            if token is not None and internal_auth.authorized(given, token):
                return True
            return bool(self.keys) and self.keys.tenant(given) is not None

        def operator_only(request: Request) -> JSONResponse | None:
            if is_operator(request):
                return None
            return refusal(
                "this route needs an API key or the deployment's internal token (Authorization: Bearer ...)",
                type="authentication_error",
            )

        def admin_only(request: Request) -> JSONResponse | None:
            """None when the caller may change the deployment: it carries the internal token (an API
            key where the deployment has no internal token; anyone where it has neither)."""
            token, given = internal_auth.token(), request.headers.get("authorization")
            if token is not None:
                allowed = internal_auth.authorized(given, token)
            else:
                allowed = self.keys.tenant(given) is not None
            if allowed:
                return None
            return refusal(
                "the admin routes need the deployment's internal token (`kimik3 launch --state-file`)",
                type="authentication_error",
            )

        async def parse_off_loop(kind: str, raw, tenant: str) -> Parsed:
            """`Router.validate` and `Router.build` on threads: the JSON of large bodies
            `large_body_parsers` at a time (a parse holds the interpreter: more threads would only
            take turns), prompts with images `image_decoders` at a time (decoding and fetching
            cost CPU and memory, and decoders let other threads run)."""
            async with large if len(raw) > LARGE_BODY_BYTES else contextlib.nullcontext():
                req = await asyncio.to_thread(self.validate, kind, raw)
            async with decoders if b"image_url" in raw else contextlib.nullcontext():
                return await asyncio.to_thread(self.build, kind, req, tenant)

        async def handle(request: Request, kind: str):
            endpoint = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
            t0 = time.monotonic()
            tenant = client_tenant(request)
            if isinstance(tenant, JSONResponse):
                self.metrics.requests.labels(endpoint, "401").inc()
                return tenant
            try:
                raw = await read_body(
                    request, self.cfg.max_body_bytes, self.cfg.body_timeout_s, max_values=self.max_values
                )
                parsed = await parse_off_loop(kind, raw, tenant)
            except APIError as e:
                self.metrics.rejected.labels("invalid").inc()
                return error_response(e, endpoint)
            finally:
                raw = None  # the body's buffer goes now, not when a long stream ends
            req = parsed.req
            try:
                self.metrics.queued.inc()
                await self.admission.acquire()
            except Overloaded as e:
                self.metrics.rejected.labels("overloaded").inc()
                return error_response(
                    APIError(
                        429,
                        f"the server is at capacity ({e}); retry later",
                        type="rate_limit_error",
                        code="rate_limit_exceeded",
                        headers={"Retry-After": "1"},
                    ),
                    endpoint,
                )
            finally:
                self.metrics.queued.dec()
            self.metrics.inflight.inc()
            rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
            stream = _Stream(
                self, kind, req, parsed.prompt, parsed.max_tokens, rid, t0, endpoint, parsed.images_b64, parsed.salt
            )
            parsed = None
            try:
                first = await stream.first()
            except BaseException:
                await stream.close()
                raise
            if isinstance(first, APIError):
                await stream.close()  # counted there, with the error's status
                return JSONResponse(first.body(), status_code=first.status, headers=first.headers)
            if req.stream:
                # Start the SSE generator here: once started, its `finally` (which releases the
                # admission place) runs even if the response never iterates it.
                events = stream.sse(first)
                head = await events.__anext__()

                async def body():
                    yield head
                    async for chunk in events:
                        yield chunk

                # closes the stream (and so the worker's request) even when the client leaves mid-way
                return ClosingStreamingResponse(
                    body(), stream.close, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
                )
            return await collect_unless_gone(request, stream, first)

        async def collect_unless_gone(request: Request, stream: "_Stream", first):
            """A non-streamed answer, or, once its client has gone, nothing: the stream closes, which
            closes the worker's connection and so cancels its request (no decoding for nobody)."""
            collect = asyncio.ensure_future(stream.collect(first))

            async def gone():
                while not await request.is_disconnected():
                    await asyncio.sleep(DISCONNECT_POLL_S)

            watch = asyncio.ensure_future(gone())
            await asyncio.wait({collect, watch}, return_when=asyncio.FIRST_COMPLETED)
            if collect.done():
                watch.cancel()
                return collect.result()
            collect.cancel()
            with contextlib.suppress(BaseException):
                await collect  # its `finally` closes the stream
            self.metrics.abandoned.inc()
            return Response(status_code=499)

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            return await handle(request, "chat")

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await handle(request, "completion")

        @app.get("/v1/models")
        async def models(request: Request):
            if isinstance(refused := client_tenant(request), JSONResponse):
                return refused
            return {
                "object": "list",
                "data": [
                    {
                        "id": self.model_name,
                        "object": "model",
                        "created": self.created,
                        "owned_by": "kimik3",
                        "max_model_len": self.max_context,
                    }
                ],
            }

        @app.get("/health")
        async def health(request: Request):
            """Open: the status and the model; the workers' details (URLs, pids, load) only for an
            operator (`is_operator`)."""
            ok = (any(w.available() for w in self.prefill) or not self.prefill) and (
                any(w.available() for w in self.decode) or not self.decode
            )
            degraded = any(w.info.get("status") == "degraded" for w in self.workers if w.available())
            l1 = getattr(self.media, "cache", None)
            l1_down = hasattr(l1, "ping") and not await asyncio.to_thread(l1.ping)  # the shared L1 (Redis)
            body = {
                "status": ("degraded" if degraded or l1_down else "ok") if ok else "unavailable",
                "model": self.model_name,
            }
            if hasattr(l1, "ping"):
                body["l1"] = "down" if l1_down else "ok"
            if is_operator(request):
                body["workers"] = [w.describe() for w in self.workers]
            return JSONResponse(body, status_code=200 if ok else 503)

        @app.get("/metrics")
        async def metrics():
            """Open, as vLLM's: the router's series, and its workers' engine series (KV use, the
            prefix cache, preemptions, kimik3_worker_*) labelled worker=URL, scraped now
            (`scrape_workers`; a worker that does not answer is kimik3_router_worker_metrics_up 0)."""
            from serving.vllm_metrics import WithWorkers, federate

            for stat, value in (self.media.stats() if self.media is not None else {}).items():
                self.metrics.media.labels(stat).set(value)
            self.metrics.vllm.load(self.admission.running, self.admission.waiting)
            families, answered = federate(await self.scrape_workers())
            for url, up in answered.items():
                self.metrics.worker_metrics_up.labels(url).set(1 if up else 0)
            text = generate_latest(WithWorkers(self.metrics.registry, families))
            return Response(text, media_type=CONTENT_TYPE_LATEST)

        @app.get("/admin/workers")
        async def workers(request: Request):
            if (refused := operator_only(request)) is not None:
                return refused
            return {
                "workers": [w.describe() for w in self.workers],
                "admission": {"running": self.admission.running, "waiting": self.admission.waiting},
            }

        async def set_drain(request: Request, drain: bool):
            if (refused := admin_only(request)) is not None:
                return refused
            try:
                raw = await read_body(request, 1 << 16, self.cfg.body_timeout_s)
                url = router_body.loads(raw)["url"].rstrip("/")
            except APIError as e:
                return JSONResponse(e.body(), status_code=e.status)
            except (KeyError, TypeError, AttributeError):
                return JSONResponse(APIError(400, 'body must be {"url": "<worker url>"}').body(), status_code=400)
            w = next((w for w in self.workers if w.url == url), None)
            if w is None:
                return JSONResponse(APIError(404, f"no worker {url}").body(), status_code=404)
            w.drained_by_router = drain
            try:  # the worker refuses new requests (from any router) and finishes the admitted ones
                await self.client.post(w.url + ("/drain" if drain else "/resume"), timeout=self.cfg.health_timeout_s)
            except httpx.HTTPError as e:
                log.warning("could not tell %s to %s: %r", w.url, "drain" if drain else "resume", e)
            if not drain:
                w.draining = False
            return w.describe()

        @app.post("/admin/drain")
        async def drain(request: Request):
            return await set_drain(request, True)

        @app.post("/admin/resume")
        async def resume(request: Request):
            return await set_drain(request, False)

        @app.get("/openapi.json", include_in_schema=False)
        async def openapi(request: Request):
            if (refused := operator_only(request)) is not None:
                return refused
            return JSONResponse(app.openapi())

        @app.get("/docs", include_in_schema=False)
        async def docs(request: Request):
            from fastapi.openapi.docs import get_swagger_ui_html

            if (refused := operator_only(request)) is not None:
                return refused
            return get_swagger_ui_html(openapi_url="/openapi.json", title="kimik3 router")

        app.openapi = lambda: _openapi_schema(app)
        return app


def _openapi_schema(app) -> dict:
    """The app's OpenAPI schema, with what FastAPI cannot see in handlers that read their own
    bodies: the /v1 request bodies (`serving.openai_api`'s models) and the bearer scheme."""
    if app.openapi_schema:
        return app.openapi_schema
    from fastapi.openapi.utils import get_openapi

    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    components = schema.setdefault("components", {})
    models = components.setdefault("schemas", {})
    components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    for path, model in (("/v1/chat/completions", ChatCompletionRequest), ("/v1/completions", CompletionRequest)):
        js = model.model_json_schema(ref_template="#/components/schemas/{model}")
        models.update(js.pop("$defs", {}))
        models[model.__name__] = js
        op = schema["paths"][path]["post"]
        op["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}},
        }
        op["security"] = [{"bearer": []}, {}]
    app.openapi_schema = schema
    return schema


class _Stream:
    """One admitted request: a task runs `Router.generate` into a queue (so the stream's
    upstream connections live in one task), and the handler renders OpenAI responses from it."""

    def __init__(
        self, router: Router, kind: str, req, prompt, max_tokens, rid, t0, endpoint, images_b64=None, salt=None
    ):
        self.r, self.kind, self.req, self.prompt, self.max_tokens = router, kind, req, prompt, max_tokens
        self.images_b64, self.salt = images_b64, salt  # salt: `router_auth.cache_salt` of the request's tenant
        self.rid, self.t0, self.endpoint = rid, t0, endpoint
        self.created = int(time.time())
        self.tokens: list[int] = []
        self.logprobs: list = []  # per token: its TokenLogprobs (None where not known), if asked for
        self.offsets: list[int] = []  # per token: where its text starts in `text`
        self._pending_lp = None
        self.times: list[float] = []
        self.summary: dict | None = None
        self._decoder = router.tok.detokenizer()
        self._stops = StopMatcher(stop_strings(req))
        self._stop_ids = frozenset(req.stop_token_ids or ())
        self._info = {"cached_tokens": 0, "cached_tokens_host": 0}
        self.text = ""  # what the client has been sent (the completion cut before a stop sequence)
        self._queue: asyncio.Queue = asyncio.Queue()
        self._task = asyncio.create_task(self._produce(not req.ignore_eos))
        self._closed = False
        self.status = "200"

    async def _produce(self, stop_at_eos: bool) -> None:
        try:
            async with asyncio.timeout(self.r.cfg.request_timeout_s):
                async for item in self.r.generate(
                    self.prompt,
                    self.max_tokens,
                    stop_at_eos,
                    self.rid,
                    sampling_options(self.req),
                    self.images_b64,
                    self.salt,
                ):
                    await self._queue.put(item)
        except APIError as e:
            await self._queue.put(("error", e))
        except TimeoutError:
            await self._queue.put(
                (
                    "error",
                    APIError(
                        504,
                        f"the request did not finish within {self.r.cfg.request_timeout_s:g} s",
                        type="timeout",
                        code="timeout",
                    ),
                )
            )
        except Exception:  # noqa: BLE001 - a bug must not leave the client waiting
            log.exception("request %s failed", self.rid)
            await self._queue.put(("error", APIError(500, "internal router error", type="server_error")))

    async def next(self):
        item = await self._queue.get()
        if item[0] == "error":
            self.status = str(item[1].status)
            raise item[1]
        return item

    async def first(self):
        """The first event, or an APIError when the request fails before any token."""
        try:
            return await self.next()
        except APIError as e:
            return e

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._task.cancel()
        with contextlib.suppress(BaseException):
            await self._task
        await self.r.admission.release()
        m = self.r.metrics
        m.inflight.dec()
        m.requests.labels(self.endpoint, self.status).inc()
        m.latency.labels(self.endpoint).observe(time.monotonic() - self.t0)
        if self.summary is not None:
            m.prompt_tokens.inc(len(self.prompt))
            m.completion_tokens.inc(len(self.tokens))
            m.cached_tokens.labels("gpu").inc(self.summary["cached_tokens"] - self.summary["cached_tokens_host"])
            m.cached_tokens.labels("host").inc(self.summary["cached_tokens_host"])
        ttft = self.times[0] - self.t0 if self.times else None
        tpot = (self.times[-1] - self.times[0]) / (len(self.times) - 1) if len(self.times) > 1 else None
        if self.summary is not None:
            if ttft is not None:
                m.ttft.observe(ttft)
            if tpot is not None:
                m.tpot.observe(tpot)
        if self.status == "200":  # vLLM counts the requests its engine ran: finished, stopped or aborted
            m.vllm.finished(
                prompt_tokens=len(self.prompt),
                generation_tokens=len(self.tokens),
                finished_reason=self.summary["finish_reason"] if self.summary else "abort",
                ttft_s=ttft,
                tpot_s=tpot,
                e2e_s=time.monotonic() - self.t0,
            )

    def _usage(self) -> dict:
        cached = self.summary["cached_tokens"] if self.summary else 0
        return {
            "prompt_tokens": len(self.prompt),
            "completion_tokens": len(self.tokens),
            "total_tokens": len(self.prompt) + len(self.tokens),
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    async def _events(self, first):
        """(text piece, token) per token, then (tail text, None) once done.  A stop sequence or a
        stop token ends the events early (finish_reason "stop") and cancels the generation; text
        that may begin a stop sequence is held back until the next token settles it."""
        item = first
        while True:
            kind, ev = item
            if kind == "logprobs":
                self._pending_lp = ev
            elif kind == "token":
                self.tokens.append(ev)
                self.logprobs.append(self._pending_lp)
                self._pending_lp = None
                self.offsets.append(len(self.text) + len(self._stops.held))
                self.times.append(time.monotonic())
                if ev in self._stop_ids:  # its text is left out, as vLLM does; held text was no stop string
                    yield self._emit(self._stops.flush() + self._decoder.flush()), ev
                    self._stop_early()
                    yield "", None
                    return
                piece, stopped = self._stops.feed(self._decoder.feed(ev))
                yield self._emit(piece), ev
                if stopped:
                    self._stop_early()
                    yield "", None
                    return
            elif kind == "info":
                self._info = ev
            else:
                self.summary = ev
                piece, stopped = self._stops.feed(self._decoder.flush())
                if stopped:
                    self.summary = {**ev, "finish_reason": "stop"}
                yield self._emit(piece + self._stops.flush()), None
                return
            item = await self.next()

    def _emit(self, piece: str) -> str:
        self.text += piece
        return piece

    def _stop_early(self) -> None:
        self.summary = {**self._info, "finish_reason": "stop"}
        self._task.cancel()  # closes the worker's stream: the worker cancels the request

    async def collect(self, first):
        from fastapi.responses import JSONResponse

        try:
            async for _ in self._events(first):
                pass
        except APIError as e:
            return JSONResponse(e.body(), status_code=e.status, headers=e.headers)
        finally:
            await self.close()
        text = self.text
        choice = {
            "index": 0,
            "finish_reason": self.summary["finish_reason"],
            "token_ids": self.tokens,
            "logprobs": self._logprobs(slice(None)),
        }
        if self.kind == "chat":
            choice["message"] = {"role": "assistant", "content": text}
            obj = "chat.completion"
        else:
            choice["text"] = text
            obj = "text_completion"
        return {
            "id": self.rid,
            "object": obj,
            "created": self.created,
            "model": self.r.model_name,
            "choices": [choice],
            "usage": self._usage(),
        }

    def _chunk(
        self, delta: dict | None = None, text: str | None = None, token: int | None = None, finish: str | None = None
    ) -> str:
        choice = {"index": 0, "finish_reason": finish, "logprobs": None}
        if token is not None:
            choice["token_ids"] = [token]
            choice["logprobs"] = self._logprobs(slice(len(self.tokens) - 1, len(self.tokens)))
        if self.kind == "chat":
            choice["delta"] = delta if delta is not None else ({"content": text} if text else {})
            obj = "chat.completion.chunk"
        else:
            choice["text"] = text or ""
            obj = "text_completion"
        return (
            "data: "
            + json.dumps(
                {
                    "id": self.rid,
                    "object": obj,
                    "created": self.created,
                    "model": self.r.model_name,
                    "choices": [choice],
                }
            )
            + "\n\n"
        )

    def _logprobs(self, tokens: slice) -> dict | None:
        """OpenAI's logprobs object for self.tokens[tokens], or None when the request asked for none."""
        if logprobs_count(self.req) is None:
            return None
        if self.kind == "chat":
            return chat_logprobs(self.r.tok, self.tokens[tokens], self.logprobs[tokens])
        return completion_logprobs(self.r.tok, self.tokens[tokens], self.logprobs[tokens], self.offsets[tokens])

    async def sse(self, first):
        try:
            if self.kind == "chat":
                yield self._chunk(delta={"role": "assistant", "content": ""})
            async for piece, token in self._events(first):
                if token is not None or piece:
                    yield self._chunk(text=piece, token=token)
            yield self._chunk(finish=self.summary["finish_reason"])
            opts = self.req.stream_options
            if opts is not None and opts.include_usage:
                yield (
                    "data: "
                    + json.dumps(
                        {
                            "id": self.rid,
                            "object": "chat.completion.chunk" if self.kind == "chat" else "text_completion",
                            "created": self.created,
                            "model": self.r.model_name,
                            "choices": [],
                            "usage": self._usage(),
                        }
                    )
                    + "\n\n"
                )
            yield "data: [DONE]\n\n"
        except APIError as e:
            body = e.body()
            body["error"]["retriable"] = getattr(e, "retriable", e.status in (429, 500, 503, 504))
            body["error"]["tokens_sent"] = len(self.tokens)
            yield "data: " + json.dumps(body) + "\n\n"
            yield "data: [DONE]\n\n"
        finally:
            await self.close()


# ---- command line --------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = RouterConfig()
    parser.add_argument("--host", default="127.0.0.1", help="bind address")
    parser.add_argument("--port", type=int, default=8000, help="the port to serve on")
    parser.add_argument("--prefill", nargs="*", default=[], metavar="URL", help="prefill worker URLs")
    parser.add_argument("--decode", nargs="*", default=[], metavar="URL", help="decode (or both) worker URLs")
    parser.add_argument(
        "--config-file",
        default=None,
        help="JSON file with any of these options (prefill, decode, max_inflight, ...); command-line values win",
    )
    parser.add_argument("--config", default=None, help=f"model config (default {d.config})")
    parser.add_argument(
        "--checkpoint",
        default=None,
        metavar="DIR",
        help="the workers' checkpoint: the model's config is read from it (overrides --config)",
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        metavar="SPEC",
        help="'byte', a tokenizer.json, a tiktoken file or a directory holding one (default: the "
        "checkpoint's tokenizer if it has one, else 'byte'); the workers' must match",
    )
    parser.add_argument(
        "--model-name",
        "--served-model-name",
        dest="model_name",
        default=None,
        help="the model id clients send and metrics carry (default kimik3-<config>)",
    )
    for name in (
        "max_inflight",
        "max_queue",
        "retries",
        "breaker_threshold",
        "max_images",
        "default_max_tokens",
        "max_body_bytes",
        "image_decoders",
        "large_body_parsers",
    ):
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=None, help=f"default {getattr(d, name)}")
    for name in (
        "queue_timeout_s",
        "backoff_base_s",
        "backoff_max_s",
        "connect_timeout_s",
        "read_timeout_s",
        "request_timeout_s",
        "health_interval_s",
        "health_timeout_s",
        "breaker_cooldown_s",
        "breaker_max_cooldown_s",
        "affinity_slack",
        "prefill_timeout_s",
        "body_timeout_s",
        "no_worker_wait_s",
    ):
        parser.add_argument("--" + name.replace("_", "-"), type=float, default=None, help=f"default {getattr(d, name)}")
    parser.add_argument(
        "--handoff",
        choices=("auto", "store", "direct"),
        default=None,
        help="how KV moves from prefill to decode workers: through the shared store, or "
        "directly (the router carries it); auto: store when the workers have one",
    )
    parser.add_argument(
        "--no-fetch-images",
        dest="fetch_images",
        action="store_false",
        default=None,
        help="refuse http(s) image URLs (only data: URLs)",
    )
    parser.add_argument(
        "--fetch-allow-hosts",
        nargs="*",
        default=None,
        metavar="HOST",
        help="fetch images only from these hosts (NAME or .SUFFIX); default any public host",
    )
    parser.add_argument(
        "--fetch-allow-networks",
        nargs="*",
        default=None,
        metavar="CIDR",
        help="non-public networks image fetches may reach (default none)",
    )
    parser.add_argument("--fetch-timeout-s", type=float, default=None, help=f"default {d.fetch_timeout_s}")
    parser.add_argument("--fetch-max-bytes", type=int, default=None, help=f"default {d.fetch_max_bytes}")
    parser.add_argument("--l1-bytes", type=int, default=None, help=f"embedded L1 fetch cache (default {d.l1_bytes})")
    parser.add_argument(
        "--l1-redis",
        default=None,
        help="redis://:PASSWORD@127.0.0.1:PORT/0: a shared L1 fetch cache (or $KIMIK3_L1_REDIS)",
    )
    parser.add_argument("--l2-bytes", type=int, default=None, help=f"decoded-pixel cache (default {d.l2_bytes})")
    parser.add_argument("--mooncake-master", default=None, help="shared store, for the prefix-affinity check")
    parser.add_argument("--mooncake-metadata", default=None, help="the store's HTTP metadata URL")
    parser.add_argument(
        "--api-key",
        default=None,
        help=f"clients of /v1/* must send 'Authorization: Bearer KEY' (or set ${API_KEY_ENV}, "
        f"which keeps the key out of the process list); default: no key (loopback)",
    )
    parser.add_argument(
        "--api-key-file",
        default=None,
        metavar="PATH",
        help=f"API keys, one 'KEY [TENANT]' a line ('#' comments; a key alone is a tenant of its own); "
        f"each key's tenant salts its caches (or set ${API_KEY_FILE_ENV})",
    )
    parser.add_argument("--log-level", default="warning", help="debug | info | warning | error")


def config_from_args(args) -> RouterConfig:
    values = {}
    if args.config_file:
        with open(args.config_file) as f:
            values = json.load(f)
        unknown = set(values) - {f.name for f in dataclasses.fields(RouterConfig)}
        if unknown:
            raise ValueError(f"unknown router options in {args.config_file}: {sorted(unknown)}")
    for f in dataclasses.fields(RouterConfig):
        v = getattr(args, f.name, None)
        if v is not None and v != []:
            values[f.name] = v
    if "l1_redis" not in values and os.environ.get("KIMIK3_L1_REDIS"):  # how `kimik3 launch` passes its password
        values["l1_redis"] = os.environ["KIMIK3_L1_REDIS"]
    if "api_key" not in values and os.environ.get(API_KEY_ENV):  # a key kept off the command line (ps)
        values["api_key"] = os.environ[API_KEY_ENV]
    if "api_key_file" not in values and os.environ.get(API_KEY_FILE_ENV):
        values["api_key_file"] = os.environ[API_KEY_FILE_ENV]
    return RouterConfig(**values)


def run(args) -> int:
    import uvicorn

    logging.getLogger("httpx").setLevel(logging.WARNING)
    router = Router(config_from_args(args))
    uvicorn.run(
        router.create_app(), host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5
    )
    return 0


def main(argv=None) -> int:
    from serving.cli import standalone_main

    return standalone_main("kimik3 router", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
