"""`kimik3 worker`: one `Engine` in its own process behind a small HTTP API.

    python -m serving.worker --role prefill --port 8101 --config tiny \
        --mooncake-master 127.0.0.1:50051 --mooncake-metadata http://127.0.0.1:8080/metadata

The engine is not thread-safe, so exactly one background thread owns it (`EngineLoop`):
HTTP handlers (asyncio, uvicorn) hand it commands through a queue and get their tokens
back through per-request asyncio queues.  Endpoints:

* ``POST /generate`` ``{"prompt": [ids], "max_tokens": n, "stop_at_eos": bool, "request_id": str,
  "cache_salt": str}``: NDJSON stream (``cache_salt``, the tenant's: prefix hits only among requests
  with the same salt; `serving.engine_config.check_cache_salt`).  First line ``{"accepted": true, ...}``
  once the engine took the request, then
  one ``{"token": id, "index": i}`` line per token (with ``"logprob"`` and ``"top_logprobs":
  [[id, logprob], ...]`` when the request asked for ``logprobs``: `serving.sampling.TokenLogprobs`),
  ``{"keepalive": true}`` lines while nothing else happens (a live worker is never silent for
  more than `keepalive_s`), and a last line ``{"done": true, "finish_reason": ..., "cached_tokens":
  ..., "cached_tokens_host": ...}`` or ``{"error": msg, "status": int, "retriable": bool, "code": str}``
  (see "Failures" below).  Closing the connection cancels the request.
* ``POST /prefill``: the same request with one token, answered as one JSON object; with
  ``"hold_kv": true`` (a prefill worker) the prompt's KV is kept under a one-time handle for a
  decode worker to pull (``GET /kv/<handle>``, internal token; `serving.kv_handoff`), and
  ``POST /adopt?kv_from=URL&kv_handle=H`` makes this worker pull it and decode: direct P/D
  with the KV moving worker to worker.  With a
  shared store (`--mooncake-master`) every finished request's pages and KDA snapshots are
  published there (`Engine(publish_to_host=True)`), so a decode worker (or this worker after a
  restart) finds the prompt's prefix in the store.
* ``GET /health`` (200 ok or degraded: the shared store is not answering and its lookups are
  misses, `cache.guarded_tier`; 503 draining or failed; plus the model facts a router needs),
  ``GET /load`` (queue depth, running, free pages and sessions, KV use), ``POST /drain``
  (refuse new requests, finish the admitted ones), ``POST /resume``, ``GET /metrics``.

Start-up: before /health answers, the engine compiles every step shape (`Engine.warmup`) and
every sampling variant a request may ask for (`warm_sampling_variants`: sampled, penalties,
logprobs), so no request waits for a compile (`--no-warmup`: compile on first use).  Every
`--log-stats-interval-s` (default 10 s) the worker logs vLLM's stats line (`StatsLogger`).  Every
`serving.engine_config.EngineConfig` field is a flag (`serving.flags`).

Status codes: 400 for a request the engine can never serve (every field is bounded where it
enters: the error names it, as ``"param"``), 429 when the waiting queue is full (try another
worker), 503 while draining or after an engine fault.

Failures.  A request's failure is that request's: when its own work inside the engine raises
(`serving.engine.Engine.fail_request`), it alone ends with ``{"error": ..., "status": 400 (a value
it carries could not be used) or 500, "retriable": false, "code": "request_failed"}`` -- another
worker would fail it the same way, so a router must not carry it there -- and the engine goes on
serving the others.  Only a fault of a step itself (a device program) is an engine fault: every
request here then ends with ``{"error": ..., "status": 500, "retriable": true, "code":
"engine_fault"}``, /health says "failed", and the process exits with `EXIT_ENGINE_FAULT` so that
its supervisor (`kimik3 launch`) restarts it.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import binascii
import dataclasses
import itertools
import json
import logging
import os
import queue
import resource
import sys
import threading
import time
from typing import Annotated, Any, Callable

import numpy as np
from fastapi import Query, Request  # at module level: FastAPI resolves handler annotations in module globals

from serving import flags, internal_auth, kv_handoff, router_body
from serving.cli import SERVING_MANIFESTS
from serving.engine_config import MAX_CACHE_SALT_CHARS, check_cache_salt, check_handoff
from serving.http_util import ClosingStreamingResponse
from serving.metrics import IntervalStats
from serving.openai_api import INT32_LIMIT, APIError
from serving.sampling import GREEDY, MAX_LOGPROBS, MAX_TOP_K, SEED_LIMIT, SamplingParams

log = logging.getLogger(__name__)

KEEPALIVE_S = 1.0
EXIT_ENGINE_FAULT = 3  # the worker's exit code after an engine fault (its supervisor restarts it)
# exceptions of a request's own values (its failure is a 400): the rest of its own failures are 500s
_VALUE_ERRORS = (ValueError, TypeError, OverflowError, ArithmeticError)


# /adopt's query parameters, bounded as a /generate body's fields (at module level: see above)
_QueryTokens = Annotated[int, Query(ge=1, lt=INT32_LIMIT)]
_QueryId = Annotated[str, Query(max_length=256)]
_QueryTemperature = Annotated[float, Query(ge=0.0, le=2.0, allow_inf_nan=False)]
_QueryUnit = Annotated[float, Query(ge=0.0, le=1.0, allow_inf_nan=False)]
_QueryTopP = Annotated[float, Query(gt=0.0, le=1.0, allow_inf_nan=False)]
_QuerySeed = Annotated[int, Query(ge=0, lt=SEED_LIMIT)]
_QueryTopK = Annotated[int, Query(ge=-1, le=MAX_TOP_K)]
_QueryPenalty = Annotated[float, Query(ge=-2.0, le=2.0, allow_inf_nan=False)]
_QueryLogprobs = Annotated[int | None, Query(ge=0, le=MAX_LOGPROBS)]


def request_failure(message: str, invalid: bool) -> dict:
    """The event (and error body) of a request that failed on its own: not retriable."""
    return {"error": message, "status": 400 if invalid else 500, "retriable": False, "code": "request_failed"}


def engine_failure(message: str) -> dict:
    """The event of a request that failed with its engine: retriable on another worker."""
    return {"error": message, "status": 500, "retriable": True, "code": "engine_fault"}


@dataclasses.dataclass
class _Sub:
    """One request as the HTTP side sees it."""

    internal_id: str
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    req: Any = None  # the engine's Request, set by the engine thread
    sent: int = 0
    export: bool = False  # direct handoff: send the prompt's KV back with the first token
    kv: tuple | None = None  # (pages, packed KDA state) once exported


class EngineLoop:
    """The single thread that owns an `Engine`.  Thread-safe `submit` / `cancel` / `load`."""

    def __init__(
        self,
        engine,
        *,
        max_waiting: int = 32,
        step_delay_s: float = 0.0,
        worker_id: str = "worker",
        registry=None,
        model_name: str = "kimik3",
        on_fault: Callable[[], None] | None = None,
    ):
        """on_fault(): called once, on the engine thread, after an engine fault has failed every
        request (the worker process passes one that exits it, for its supervisor to restart)."""
        self.engine = engine
        self.on_fault = on_fault
        self.max_waiting = max_waiting
        self.step_delay_s = step_delay_s
        self.worker_id = worker_id
        self.draining = False
        self.failed: str | None = None
        self._cmds: queue.Queue = queue.Queue()
        self._subs: dict[str, _Sub] = {}  # engine thread only
        self._lock = threading.Lock()
        self._pending = 0  # submitted by handlers, not yet finished (guarded by _lock)
        self._ids = itertools.count()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"engine-{worker_id}", daemon=True)
        self.counters = {
            "submitted": 0,
            "finished": 0,
            "cancelled": 0,
            "errors": 0,
            "rejected": 0,
            "output_tokens": 0,
            "prompt_tokens": 0,
            "cached_tokens": 0,
            "cached_tokens_host": 0,
        }
        self._adopts: list = []  # direct handoffs waiting for a slot and pages (engine thread only)
        self.stats = IntervalStats()  # the periodic stats line's figures (`StatsLogger`)
        self.compile_watch = None  # a `metrics.CompileWatch` started after warm-up (kimik3_worker_compiles)
        self._load = self._snapshot()
        self._metrics = _WorkerMetrics(registry, model_name) if registry is not None else None
        if engine.role == "prefill":  # a prefill engine stops after the first token; export on request
            engine.on_prefilled = self._on_prefilled

    # ---- called from HTTP handlers (any thread) ------------------------------------------------
    def start(self) -> "EngineLoop":
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._cmds.put(("wake", None))
        self._thread.join(timeout)

    def try_reserve(self) -> str | None:
        """Take a place in the queue: None if admitted, else why not (for 429 / 503)."""
        with self._lock:
            if self.failed:
                return "failed"
            if self.draining:
                return "draining"
            load = self._load
            if self._pending - load["running"] >= self.max_waiting:
                self.counters["rejected"] += 1
                return "full"
            self._pending += 1
            self.counters["submitted"] += 1
            return None

    def submit(
        self,
        prompt: list[int],
        max_new_tokens: int,
        *,
        stop_at_eos: bool,
        request_id: str,
        export: bool = False,
        sampling: SamplingParams = GREEDY,
        images=None,
        cache_salt=None,
        prior_output: int = 0,
    ) -> _Sub:
        """Queue a request (after `try_reserve`).  Its events arrive on the returned queue."""
        sub = _Sub(f"{request_id}#{next(self._ids)}", asyncio.get_running_loop(), asyncio.Queue(), export=export)
        self._cmds.put(
            ("submit", (sub, prompt, max_new_tokens, stop_at_eos, sampling, images, cache_salt, prior_output))
        )
        return sub

    def adopt(
        self,
        prompt: list[int],
        first_token: int,
        max_new_tokens: int,
        pages,
        state,
        *,
        stop_at_eos: bool,
        request_id: str,
        sampling: SamplingParams = GREEDY,
        images=None,
        cache_salt=None,
    ) -> _Sub:
        """Take over a request another worker prefilled (direct handoff), after `try_reserve`."""
        sub = _Sub(f"{request_id}#{next(self._ids)}", asyncio.get_running_loop(), asyncio.Queue())
        self._cmds.put(
            (
                "adopt",
                (sub, prompt, first_token, max_new_tokens, pages, state, stop_at_eos, sampling, images, cache_salt),
            )
        )
        return sub

    def cancel(self, sub: _Sub) -> None:
        self._cmds.put(("cancel", sub.internal_id))

    def load(self) -> dict:
        with self._lock:
            out = dict(self._load)
            out.update(
                inflight=self._pending,
                draining=self.draining,
                failed=self.failed,
                max_waiting=self.max_waiting,
                **self.counters,
            )
        out["waiting"] = max(out["waiting"], out["inflight"] - out["running"])
        return out

    # ---- the engine thread ----------------------------------------------------------------------
    def _snapshot(self) -> dict:
        out = self.engine.load()
        out["waiting"] += len(self._adopts)
        out["max_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        ec = self.engine.encoder_cache  # L3 of the media cache
        if ec is not None:
            out.update(l3_hits=ec.stats.hits, l3_misses=ec.stats.misses, l3_bytes_held=ec.bytes_held)
        return out

    def _push(self, sub: _Sub, event: dict) -> None:
        try:
            sub.loop.call_soon_threadsafe(sub.events.put_nowait, event)
        except RuntimeError:  # the HTTP loop is gone (shutdown)
            pass

    def _finish(self, sub: _Sub, counter: str) -> None:
        """`sub` leaves the worker (done, cancelled or failed): counted, with `load`'s engine figures
        refreshed under the same lock, so a client that hears of its end and then reads /load sees
        its slot and pages back (not the figures of the step before)."""
        self._subs.pop(sub.internal_id, None)
        snapshot = self._snapshot()
        with self._lock:
            self._pending -= 1
            self.counters[counter] += 1
            self._load = snapshot

    def _handle(self, kind: str, payload) -> None:
        e = self.engine
        if kind == "submit":
            sub, prompt, n, stop_at_eos, sampling, images, cache_salt, prior_output = payload
            try:
                sub.req = e.submit(
                    prompt,
                    n,
                    request_id=sub.internal_id,
                    stop_at_eos=stop_at_eos,
                    sampling=sampling,
                    images=images,
                    cache_salt=cache_salt,
                    prior_output=prior_output,
                )
            except Exception as err:  # noqa: BLE001 - whatever a request brings fails that request alone
                if not isinstance(err, ValueError):
                    log.warning("request %s refused: %r", sub.internal_id, err, exc_info=err)
                self._push(sub, request_failure(str(err), isinstance(err, _VALUE_ERRORS)))
                self._finish(sub, "errors")
                return
            self._subs[sub.internal_id] = sub
            self._push(sub, {"accepted": True, "worker": self.worker_id})
        elif kind == "adopt":
            self._adopts.append(payload)
            self._push(payload[0], {"accepted": True, "worker": self.worker_id, "adopt": True})
        elif kind == "cancel":
            sub = self._subs.get(payload)
            if sub is not None:
                e.cancel(payload)
                self._finish(sub, "cancelled")
            for item in self._adopts:
                if item[0].internal_id == payload:
                    self._adopts.remove(item)
                    self._finish(item[0], "cancelled")
                    break

    def _try_adopts(self) -> None:
        still = []
        for item in self._adopts:
            sub, prompt, first, n, pages, state, stop_at_eos, sampling, images, cache_salt = item
            try:
                req = self.engine.adopt(
                    prompt,
                    first,
                    n,
                    pages,
                    state,
                    request_id=sub.internal_id,
                    arrival_s=time.monotonic(),
                    stop_at_eos=stop_at_eos,
                    sampling=sampling,
                    images=images,
                    cache_salt=cache_salt,
                )
            except _VALUE_ERRORS as err:  # values the handoff brings (images that do not match the prompt, ...)
                self._push(sub, request_failure(str(err), True))
                self._finish(sub, "errors")
                continue
            if req is None:
                still.append(item)  # no slot or pages yet
                continue
            sub.req, sub.sent = req, 1  # the first token came from the prefill worker
            self._subs[sub.internal_id] = sub
        self._adopts = still

    def _on_prefilled(self, engine, req) -> None:
        sub = self._subs.get(req.request_id)
        if sub is not None and sub.export:
            pages, state = engine.export_kv(req)
            sub.kv = (np.stack(pages) if pages else np.zeros((0,)), np.asarray(state))

    def _publish(self) -> None:
        for sub in list(self._subs.values()):
            try:
                self._publish_one(sub)
            except Exception as err:  # noqa: BLE001 - one request's events failing fails that request alone
                log.exception("request %s: its events could not be built", sub.internal_id)
                if not sub.req.done:
                    self.engine.cancel(sub.internal_id)
                if sub.internal_id in self._subs:  # not finished before it raised
                    self._push(sub, request_failure(f"the request failed: {type(err).__name__}: {err}", False))
                    self._finish(sub, "errors")
        self.engine.pop_finished()  # results went out above; do not grow without bound

    def _publish_one(self, sub: _Sub) -> None:
        """Push the tokens of `sub` not sent yet, and its end once it is done."""
        req = sub.req
        sent = sub.sent
        while sub.sent < len(req.output):
            ev = {"token": int(req.output[sub.sent]), "index": sub.sent}
            if sub.sent < len(req.logprobs) and req.logprobs[sub.sent] is not None:
                ev.update(req.logprobs[sub.sent].as_json())
            if sub.sent == 0:  # the prefix cache's share is known once the prompt is in: a client
                # that stops early (a stop string) still reports it
                ev.update(cached_tokens=req.cached_tokens, cached_tokens_host=req.cached_tokens_host)
                self.stats.prefilled(len(req.prompt), req.cached_tokens)
            self._push(sub, ev)
            sub.sent += 1
        if sub.sent > sent:
            self.stats.generated(sub.sent - sent)
        if req.done:
            if req.error:
                self._finish(sub, "errors")  # counted before the client hears of it, as "done" below
                if req.fault is not None:  # its own failure: another worker would fail it too
                    self._push(sub, request_failure(req.error, req.fault == "invalid"))
                else:  # out of KV capacity here: another worker may serve it
                    self._push(sub, engine_failure(req.error) | {"code": "request_dropped"})
                return
            eos = self.engine.config.eos_id
            reason = "stop" if req.stop_at_eos and req.output and req.output[-1] == eos else "length"
            done = {
                "done": True,
                "finish_reason": reason,
                "prompt_tokens": len(req.prompt),
                "completion_tokens": len(req.output),
                "cached_tokens": req.cached_tokens,
                "cached_tokens_host": req.cached_tokens_host,
                "worker": self.worker_id,
            }
            if sub.export:
                done["kv"] = sub.kv
            with self._lock:  # counted before the client hears "done" (it may read /load next)
                self.counters["output_tokens"] += len(req.output)
                self.counters["prompt_tokens"] += len(req.prompt)
                self.counters["cached_tokens"] += req.cached_tokens
                self.counters["cached_tokens_host"] += req.cached_tokens_host
            if self._metrics is not None:
                self._metrics.observe(req)
            self._finish(sub, "finished")
            self._push(sub, done)

    def _fail_all(self, why: str) -> None:
        for sub in list(self._subs.values()) + [item[0] for item in self._adopts]:
            self._push(sub, engine_failure(why))
            self._finish(sub, "errors")
        self._adopts = []

    def _engine_fault(self, why: str) -> None:
        """The engine cannot step: fail every request (retriable), report "failed", and call
        `on_fault` (once)."""
        first = self.failed is None
        self.failed = why
        self._fail_all(why)
        if first and self.on_fault is not None:
            self.on_fault()

    def _group_fault(self, err: Exception) -> None:
        """A process group's step failed (a member died, or this engine faulted): the group cannot
        step without every member, so its requests here fail (retriable: a router fails them over)
        and the process exits for `kimik3 launch` to restart the group."""
        log.error("process group step failed (%r): failing this worker's requests and exiting", err)
        self.failed = f"process group fault: {err!r}"
        self._fail_all(self.failed)
        time.sleep(0.5)  # let the HTTP loop send the errors
        os._exit(1)

    def _run(self) -> None:
        try:
            self._serve()
        except Exception as err:  # noqa: BLE001 - a bug of this loop: as an engine fault, never a silent hang
            log.exception("the engine thread failed")
            self._engine_fault(f"engine thread fault: {err!r}")

    def _serve(self) -> None:
        e = self.engine
        while not self._stop.is_set():
            try:
                block = not e.has_work()
                while True:
                    kind, payload = self._cmds.get(block=block, timeout=0.1 if block else None)
                    block = False
                    self._handle(kind, payload)
            except queue.Empty:
                pass
            if self._adopts and not self.failed:
                try:
                    self._try_adopts()
                except Exception as err:  # noqa: BLE001 - writing a handoff into the pools failed
                    log.exception("adopt failed")
                    self._engine_fault(f"engine fault: {err!r}")
            try:
                idle = self.failed or not (e.group_has_work() if e.group else e.has_work())
            except Exception as err:  # noqa: BLE001 - only a group's collective can fail here
                self._group_fault(err)
            if idle:
                with self._lock:
                    self._load = self._snapshot()
                if self._metrics is not None:  # a request that left between steps frees its pages
                    self._metrics.gauges(self._load)
                continue
            try:
                e.step()
            except Exception as err:  # noqa: BLE001 - an engine fault fails its requests (retriable) here
                if e.group:
                    self._group_fault(err)
                log.exception("engine step failed; the worker reports itself failed")
                self._engine_fault(f"engine fault: {err!r}")
                continue
            self._publish()
            with self._lock:
                self._load = self._snapshot()
            if self._metrics is not None:
                self._metrics.gauges(self._load)
            if self.step_delay_s:
                time.sleep(self.step_delay_s)


class _WorkerMetrics:
    """kimik3_worker_* and, under vLLM's names with model_name (`serving.vllm_metrics`), the same."""

    def __init__(self, registry, model_name: str):
        from prometheus_client import Counter, Gauge, Histogram

        from serving.vllm_metrics import VLLMMetrics

        self.vllm = VLLMMetrics(registry, model_name)
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
        from serving.metrics import RequestRecord

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
        self.waiting.set(load["waiting"])
        self.running.set(load["running"])
        self.kv_use.set(load["kv_use"])
        self.vllm.load(load["running"], load["waiting"], load["kv_use"], load.get("preemptions"))


# ---- the periodic stats line and the sampling warm-up --------------------------------------------------
STATS_LOGGER = "serving.stats"


class StatsLogger:
    """Every `interval_s`, one line on the logger `STATS_LOGGER` in vLLM's words: ``decode-0: Avg
    prompt throughput: X tokens/s, Avg generation throughput: Y tokens/s, Running: N reqs,
    Waiting: M reqs, GPU KV cache usage: P%, Prefix cache hit rate: Q%`` (`IntervalStats`).  At
    INFO while the worker has work or had throughput in the interval before, at DEBUG while it
    idles (as vLLM).  The logger is set to INFO when the thread starts, so the line shows under
    the worker's default --log-level (warning); --log-stats-interval-s 0 turns it off."""

    def __init__(self, loop: EngineLoop, interval_s: float):
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


def warm_sampling_variants(engine) -> int:
    """Build, before the first request, every program a request's sampling options can need that
    `Engine.warmup(sampled=True)` leaves to first use: the decode program's variant for
    presence / frequency penalties and logprobs (`serving.model_runner.decode_program_ext`) in
    every decode bucket, greedy and sampled, with the write of a slot's penalty counts; and the
    one-row programs that choose a prefilled request's first token (sampled, penalized, both)
    and its logprobs (`serving.sampling.choose_token`, `logprobs_of`).  Without it a client's
    first request with logprobs or a penalty waits for a whole-model compile.

    The decode steps run rows of padding only (the scratch slot and null pages: nothing a
    request holds); the engine must be idle.  A speculative engine takes no penalties or
    logprobs, and a decode mesh samples on the host: they build only the one-row programs; a
    prefill engine samples first tokens only.  Returns the XLA programs built."""
    import jax

    from cache.block_pool import NULL_BLOCK
    from serving.metrics import CompileWatch
    from serving.model_runner import DecodeRows
    from serving.sampling import choose_token, logprobs_of

    runner = engine.runner
    with CompileWatch() as watch:
        logits = np.zeros(engine.cfg.vocab_size, np.float32)
        for sp in (
            SamplingParams(temperature=1.0),
            SamplingParams(temperature=0.0, presence_penalty=0.5),
            SamplingParams(temperature=1.0, frequency_penalty=0.5),
        ):
            choose_token(logits, sp, 1, [0])
        logprobs_of(logits, 0, 1)
        if engine.spec is None and runner.decode_step is None and engine.role != "prefill":
            scratch = engine.scratch_slot
            for b in sorted({runner.decode_bucket(n) for n in range(1, scratch + 1)}):
                for temperature in (0.0, 1.0):
                    rows = DecodeRows.build(
                        b, [], [], [], [], [], max_pages=engine.max_pages, null_page=NULL_BLOCK, scratch_slot=scratch
                    )
                    # row 0 (padding, inactive) asks for logprobs and holds penalty counts: the
                    # variant runs, and so does the write of its slot's counts
                    rows = dataclasses.replace(rows, temperature=np.full(b, temperature, np.float32), logprobs=(0,))
                    engine.pools, tokens, _, lp = runner.decode.dispatch(
                        engine.params, engine.pools, rows, histories=[(rows, 0, lambda: [])]
                    )
                    jax.block_until_ready((tokens, lp))
    return watch.count


# ---- the HTTP app ------------------------------------------------------------------------------------
def create_app(
    loop: EngineLoop,
    info: dict,
    *,
    keepalive_s: float = KEEPALIVE_S,
    registry=None,
    held_kv_bytes: int = 1 << 30,
    held_kv_ttl_s: float = 60.0,
    pull_timeout_s: float = 30.0,
):
    """FastAPI app around a started or startable `EngineLoop`.  `info` goes out on /health.
    held_kv_bytes / held_kv_ttl_s: the KV a prefill worker keeps for decode workers to pull
    (`serving.kv_handoff.HeldKV`); pull_timeout_s: a decode worker's pull of one handoff."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from fastapi.exceptions import RequestValidationError
    from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

    def decode_images(images_b64: list[str] | None):
        """base64 RGB uint8 [S, S, C] per image -> [N, S, S, C] (None for none), or ValueError."""
        if not images_b64:
            return None
        vit = loop.engine.cfg.vit
        if vit is None:
            raise ValueError("this model has no vision encoder: images are not accepted")
        shape = (vit.image_size, vit.image_size, vit.channels)
        try:
            arrays = [np.frombuffer(base64.b64decode(b, validate=True), np.uint8) for b in images_b64]
        except (binascii.Error, ValueError) as err:
            raise ValueError(f"images must be base64: {err}") from None
        if any(a.size != int(np.prod(shape)) for a in arrays):
            raise ValueError(f"each image must be {shape} uint8 values")
        return np.stack([a.reshape(shape) for a in arrays])

    class GenerateBody(BaseModel):
        """A /generate or /prefill body: every number bounded (a value out of range, NaN or
        Infinity is a 400 naming its field)."""

        model_config = ConfigDict(extra="forbid")
        prompt: list[Annotated[StrictInt, Field(ge=0, lt=INT32_LIMIT)]] = Field(min_length=1)
        max_tokens: StrictInt = Field(ge=1, lt=INT32_LIMIT)
        stop_at_eos: StrictBool = False
        request_id: StrictStr = Field("req", max_length=256)
        export_kv: StrictBool = False  # answer with the KV itself (npz)
        hold_kv: StrictBool = False  # keep the KV for a decode worker to pull; answer with its handle
        temperature: float = Field(0.0, ge=0.0, le=2.0, allow_inf_nan=False)
        top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
        seed: StrictInt = Field(0, ge=0, lt=SEED_LIMIT)
        top_k: StrictInt = Field(0, ge=-1, le=MAX_TOP_K)
        min_p: float = Field(0.0, ge=0.0, le=1.0, allow_inf_nan=False)
        presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
        frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
        logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
        # the prompt's tail that is the request's own output (penalties)
        prior_output: StrictInt = Field(0, ge=0, lt=INT32_LIMIT)
        images: list[StrictStr] | None = None  # base64 RGB uint8 [S, S, 3] each, S = the ViT's input size
        cache_salt: StrictStr | None = Field(None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)  # the tenant's

        def sampling(self) -> SamplingParams:
            return SamplingParams(
                self.temperature,
                self.top_p,
                self.seed,
                self.top_k,
                self.min_p,
                self.presence_penalty,
                self.frequency_penalty,
                self.logprobs,
            )

    held = kv_handoff.HeldKV(held_kv_bytes, held_kv_ttl_s)
    clients = []

    def puller():
        """The HTTP client a decode worker pulls handoffs with (one per app, made on first use)."""
        import httpx

        if not clients:
            clients.append(httpx.AsyncClient(limits=httpx.Limits(max_connections=64)))
        return clients[0]

    @asynccontextmanager
    async def lifespan(app):
        if not loop._thread.is_alive() and not loop._stop.is_set():
            loop.start()
        yield
        for c in clients:
            await c.aclose()
        loop.stop()

    app = FastAPI(title="kimik3 worker", lifespan=lifespan)

    def error(status: int, message: str, **extra) -> JSONResponse:
        return JSONResponse({"error": message, **extra}, status_code=status)

    tok = internal_auth.token()
    if tok is None:
        log.warning("no %s: this worker's endpoints take requests from anyone who reaches its port", internal_auth.ENV)

    @app.middleware("http")
    async def require_token(request: Request, call_next):
        # every POST changes state (runs, adopts KV, drains): only the deployment's router may
        if request.method == "POST" and not internal_auth.authorized(request.headers.get("authorization"), tok):
            return error(401, "missing or wrong internal token (the router's)")
        return await call_next(request)

    def invalid(errors: list[dict]) -> JSONResponse:
        """400 naming the fields of pydantic's `errors` (the first as "param")."""
        where = lambda e: ".".join(str(p) for p in e["loc"] if p not in ("body", "query")) or "body"  # noqa: E731
        msg = "; ".join(f"{where(e)}: {e['msg']}" for e in errors[:5])
        return error(400, msg, param=where(errors[0]) if errors else None, retriable=False)

    @app.exception_handler(RequestValidationError)
    async def bad_query(request, exc):  # /adopt's query parameters: a 400 naming the field, as a body's
        return invalid(exc.errors())

    async def parse(request: Request) -> GenerateBody | JSONResponse:
        """The body as a `GenerateBody`, or a 400 naming what is wrong (`check_body` is the rest)."""
        try:
            return GenerateBody.model_validate(router_body.loads(await request.body()))
        except APIError as err:  # malformed JSON, or an integer literal too long to convert (named)
            return error(400, err.message, param=err.param, retriable=False)
        except ValidationError as err:
            return invalid(err.errors())

    def check_body(body: GenerateBody) -> JSONResponse | None:
        """A 400 naming the field if the body's prompt holds an id past the vocabulary or asks for
        more tokens than the context holds; None if it does not."""
        vocab = loop.engine.cfg.vocab_size
        bad = next((i for i, t in enumerate(body.prompt) if t >= vocab), None)
        if bad is not None:
            return error(
                400, f"prompt.{bad}: token ids must lie in [0, {vocab})", param=f"prompt.{bad}", retriable=False
            )
        limit = info.get("max_context")
        if limit is not None and len(body.prompt) + body.max_tokens > limit:
            return error(
                400,
                f"max_tokens: prompt ({len(body.prompt)}) + max_tokens ({body.max_tokens}) exceeds the "
                f"context limit of {limit} tokens",
                param="max_tokens",
                retriable=False,
            )
        return None

    def refuse(why: str) -> JSONResponse:
        if why == "full":
            return error(429, "worker queue is full", retriable=True)
        return error(503, f"worker is {why}", retriable=True)

    async def start(body: GenerateBody | None, adopt: tuple | None = None):
        """(sub, first event) or (None, an error response)."""
        why = loop.try_reserve()
        if why:
            return None, refuse(why)
        if adopt is not None:
            sub = loop.adopt(
                *adopt[:5],
                stop_at_eos=adopt[5],
                request_id=adopt[6],
                sampling=adopt[7],
                images=adopt[8],
                cache_salt=adopt[9],
            )
        else:
            try:
                images = decode_images(body.images)
            except ValueError as err:
                return None, error(400, str(err))
            sub = loop.submit(
                body.prompt,
                body.max_tokens,
                stop_at_eos=body.stop_at_eos,
                request_id=body.request_id,
                sampling=body.sampling(),
                images=images,
                cache_salt=body.cache_salt,
                prior_output=body.prior_output,
                export=(body.export_kv or body.hold_kv) and loop.engine.role == "prefill",
            )
        first = await sub.events.get()
        if "error" in first:
            extra = {"code": first["code"]} if "code" in first else {}
            return None, error(
                first.get("status", 500), first["error"], retriable=first.get("retriable", False), **extra
            )
        return sub, first

    def ndjson(sub, first) -> StreamingResponse:
        finished = False

        async def lines():
            nonlocal finished
            yield json.dumps(first) + "\n"
            while True:
                try:
                    ev = await asyncio.wait_for(sub.events.get(), keepalive_s)
                except asyncio.TimeoutError:
                    yield '{"keepalive": true}\n'
                    continue
                yield json.dumps(ev) + "\n"
                if "done" in ev or "error" in ev:
                    finished = True
                    return

        def close():
            if not finished:  # the client went away: stop decoding and free the KV now
                loop.cancel(sub)

        return ClosingStreamingResponse(lines(), close, media_type="application/x-ndjson")

    @app.post("/generate")
    async def generate(request: Request):
        body = await parse(request)
        if isinstance(body, JSONResponse):
            return body
        if (refused := check_body(body)) is not None:
            return refused
        sub, first = await start(body)
        return ndjson(sub, first) if sub is not None else first

    @app.post("/adopt")
    async def adopt(
        request: Request,
        max_tokens: _QueryTokens,
        stop_at_eos: bool = False,
        request_id: _QueryId = "req",
        temperature: _QueryTemperature = 0.0,
        top_p: _QueryTopP = 1.0,
        seed: _QuerySeed = 0,
        top_k: _QueryTopK = 0,
        min_p: _QueryUnit = 0.0,
        presence_penalty: _QueryPenalty = 0.0,
        frequency_penalty: _QueryPenalty = 0.0,
        logprobs: _QueryLogprobs = None,
        cache_salt: str | None = None,
        kv_from: str | None = None,
        kv_handle: str | None = None,
    ):
        """Direct handoff: the KV of a prefill worker's `/prefill` (npz: prompt, token, pages,
        state), pulled from `kv_from` by `kv_handle` (`hold_kv`), or the body itself (`export_kv`);
        streams like /generate from the second token.  A pull that fails is a 502 (retriable: the
        router recomputes the prompt)."""
        if (kv_from is None) != (kv_handle is None):
            return error(400, "kv_from and kv_handle go together")
        if kv_from is not None:
            try:
                raw = await kv_handoff.pull(
                    puller(),
                    kv_from,
                    kv_handle,
                    headers=internal_auth.headers(tok),
                    timeout_s=pull_timeout_s,
                    max_bytes=held.max_bytes,
                )
            except kv_handoff.HandoffError as err:
                return error(502, f"could not pull the KV: {err}", retriable=True)
        else:
            raw = await request.body()
        try:
            prompt, token, pages, state, images = kv_handoff.unpack(raw)
        except ValueError as err:
            return error(400, str(err))
        limit = info.get("max_context", 1 << 30)
        if not prompt or max_tokens < 2 or len(prompt) + max_tokens > limit:
            return error(400, f"adopt needs a prompt and 2 <= max_tokens with prompt + max_tokens <= {limit}")
        if state.shape != (loop.engine.snapshot_size,) or (pages and pages[0].shape != loop.engine.pages.block_shape):
            return error(400, "the KV handoff does not match this worker's model or page size")
        try:
            # what /adopt commits becomes the cached KV of the prompt's prefix: check it as /generate
            # checks a prompt, and that every value is finite (NaN pages would poison every later hit)
            check_handoff(
                prompt,
                token,
                pages,
                state,
                vocab_size=info.get("vocab_size", 1 << 31),
                page_tokens=loop.engine.page_tokens,
            )
            sampling = SamplingParams(
                temperature, top_p, seed, top_k, min_p, presence_penalty, frequency_penalty, logprobs
            )
            check_cache_salt(cache_salt)
        except ValueError as err:
            return error(400, str(err))
        sub, first = await start(
            None, (prompt, token, max_tokens, pages, state, stop_at_eos, request_id, sampling, images, cache_salt)
        )
        return ndjson(sub, first) if sub is not None else first

    @app.post("/prefill")
    async def prefill(request: Request):
        body = await parse(request)
        if isinstance(body, JSONResponse):
            return body
        body.max_tokens = 1
        if (refused := check_body(body)) is not None:
            return refused
        sub, first = await start(body)
        if sub is None:
            return first
        tokens, first_lp = [], None
        while True:
            ev = await sub.events.get()
            if "token" in ev:
                tokens.append(ev["token"])
                if "logprob" in ev and first_lp is None:
                    first_lp = {"logprob": ev["logprob"], "top_logprobs": ev["top_logprobs"]}
            elif "error" in ev:
                extra = {"code": ev["code"]} if "code" in ev else {}
                return error(ev.get("status", 500), ev["error"], retriable=ev.get("retriable", True), **extra)
            elif "done" in ev:
                kv = ev.pop("kv", None)
                answer = {"token": tokens[0], "tokens": tokens, **ev, **({"logprobs": first_lp} if first_lp else {})}
                if not (body.export_kv or body.hold_kv):
                    return answer
                if kv is None:
                    return error(400, "this worker cannot export KV (only prefill workers do)")
                packed = kv_handoff.pack(
                    body.prompt, tokens[0], kv[0], kv[1], decode_images(body.images) if body.images else None
                )
                if body.hold_kv:  # the decode worker pulls it (GET /kv/<handle>): the router sees the handle
                    try:
                        return {**answer, "kv_handle": held.put(packed), "kv_bytes": len(packed)}
                    except ValueError as err:
                        return error(503, str(err), retriable=True)
                headers = {
                    "x-kimik3-token": str(tokens[0]),
                    "x-kimik3-cached-tokens": str(ev["cached_tokens"]),
                    "x-kimik3-cached-tokens-host": str(ev["cached_tokens_host"]),
                }
                if first_lp is not None:  # the first token's logprobs: the router sends them (the adopter starts after)
                    headers["x-kimik3-logprobs"] = json.dumps(first_lp)
                return Response(packed, media_type="application/octet-stream", headers=headers)

    @app.get("/kv/{handle}")
    async def kv(handle: str, request: Request):
        """A held handoff, once (`hold_kv`): another tenant's prompt, so only the deployment's own
        processes (the internal token) may read it."""
        if not internal_auth.authorized(request.headers.get("authorization"), tok):
            return error(401, "missing or wrong internal token")
        data = held.take(handle)
        if data is None:
            return error(404, "no KV held under this handle (taken, expired or dropped)")
        return Response(data, media_type="application/octet-stream")

    @app.get("/health")
    async def health():
        tier = getattr(loop.engine.manager, "host", None)
        store = tier.health() if hasattr(tier, "health") else None
        status = (
            "failed"
            if loop.failed
            else "draining"
            if loop.draining
            else "degraded"
            if store and store["status"] != "ok"
            else "ok"
        )
        extra = {"store_health": store} if store else {}
        # degraded: serving, with store lookups answered as misses until the store is back
        return JSONResponse(
            {"status": status, "pid": os.getpid(), **info, **extra, "load": loop.load()},
            status_code=200 if status in ("ok", "degraded") else 503,
        )

    @app.get("/load")
    async def load():
        return {**loop.load(), **held.stats()}

    @app.post("/drain")
    async def drain():
        loop.draining = True
        return loop.load()

    @app.post("/resume")
    async def resume():
        loop.draining = False
        return loop.load()

    @app.get("/metrics")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        stats = getattr(getattr(loop.engine.manager, "host", None), "stats", None)
        if loop._metrics is not None and stats is not None and hasattr(stats, "auth_failures"):
            loop._metrics.store_auth_failures.set(stats.auth_failures)
        if loop._metrics is not None and loop.compile_watch is not None:
            loop._metrics.compiles.set(loop.compile_watch.count)
        return Response(generate_latest(registry) if registry is not None else b"", media_type=CONTENT_TYPE_LATEST)

    return app


# ---- building the engine --------------------------------------------------------------------------
def default_cache_geometry(config_name: str) -> tuple[int, int]:
    """(page_tokens, kda_block_tokens): the demo's small blocks on tiny, docs/design.md's elsewhere."""
    return (32, 128) if config_name == "tiny" else (128, 1536)


def build_engine(args):
    """(engine, host tier or None, info dict) from parsed worker arguments."""
    import jax

    from kimik3 import config, model
    from serving.engine import Engine, EngineConfig

    draft = None
    if getattr(args, "manifest", None) and not getattr(args, "checkpoint", None):
        raise ValueError("--manifest names the quantized weights of a checkpoint: pass --checkpoint DIR")
    if getattr(args, "checkpoint", None):
        from kimik3.quant import store

        params, cfg = store.load_params(args.checkpoint, getattr(args, "manifest", None))
        dtype = args.dtype or str(params["embed_vd"].dtype)
        params = model.cast_params(params, jax.numpy.dtype(dtype))
    else:
        cfg = config.get_config(args.config)
        dtype = args.dtype or cfg.dtype
        params = model.init_params(cfg, jax.random.PRNGKey(args.seed), dtype)
    spec = getattr(args, "speculative", None)
    if spec is None and getattr(args, "draft_checkpoint", None):
        raise ValueError("--draft-checkpoint is for speculative decoding: add --speculative eagle3")
    if spec is not None:
        if not args.draft_checkpoint:
            raise ValueError("--speculative eagle3 needs the draft: --draft-checkpoint DIR (`kimik3 train-eagle`)")
        if not args.checkpoint:
            raise ValueError("--speculative eagle3 needs the target the draft was trained for: --checkpoint DIR")
        if args.role != "both":  # the HTTP handoff carries no draft feature yet (in-process P/D: serving.disagg)
            raise ValueError("--speculative eagle3 workers serve colocated (--role both)")
        from kimik3 import eagle_train

        draft = eagle_train.load_draft(args.draft_checkpoint, cfg, params)
        if args.eagle_no_drop and args.eagle_tail not in ("drop", "no_drop"):
            raise ValueError(f"--eagle-no-drop contradicts --eagle-tail {args.eagle_tail}")
    page, block = default_cache_geometry(cfg.name)
    page = args.page_tokens or page
    block = args.kda_block_tokens or block
    max_len = getattr(args, "max_model_len", None) or cfg.max_seq_len
    if max_len > cfg.max_seq_len:
        raise ValueError(f"--max-model-len {max_len} is past {cfg.name}'s {cfg.max_seq_len} positions")
    num_pages = pool_pages(args, cfg, params, page)
    max_pages = min(args.max_pages_per_request or -(-max_len // page), num_pages - 1)
    # the weights name the cache: random ones by their seed, a checkpoint's by a fingerprint (of its
    # embedding and LM head: `eagle_train.fingerprint`), so workers of other weights never share KV
    weights = f"seed{args.seed}"
    if getattr(args, "checkpoint", None):
        from kimik3 import eagle_train

        weights = f"ckpt-{eagle_train.fingerprint(params)}"
        if getattr(args, "manifest", None):  # other projections, other KV: the manifest names it too
            weights += f"-{args.manifest}"
    namespace = args.namespace or f"{cfg.name}/{dtype}/{weights}"
    host = None
    if args.mooncake_master:
        from cache.mooncake_tier import MooncakeHostKVTier

        from cache.guarded_tier import GuardedHostKVTier

        # behind a deadline and a breaker: a dead store turns into misses, not stalled steps
        host = GuardedHostKVTier(
            MooncakeHostKVTier(args.mooncake_master, args.mooncake_metadata, staging_bytes=args.staging_mb << 20),
            timeout_s=args.store_timeout_s,
            cooldown_s=args.store_cooldown_s,
        )
    role = args.role
    from kimik3.text import load_serving_tokenizer

    tok = load_serving_tokenizer(getattr(args, "tokenizer", None), getattr(args, "checkpoint", None), cfg.vocab_size)
    publish = getattr(args, "publish_to_host", None)
    if publish and host is None:
        raise ValueError("--publish-to-host writes to a shared store: pass --mooncake-master")
    if draft is None and getattr(args, "draft_tokens", None):
        raise ValueError("--draft-tokens is for speculative decoding: add --speculative eagle3")
    eos_id = getattr(args, "eos_id", None)
    # every EngineConfig field is a flag (`serving.flags`): those set pass through, the ones the
    # worker sizes itself are resolved here, the rest keep the dataclass's defaults
    values = {f.name: getattr(args, f.name, None) for f in flags.engine_fields()}
    values = {k: v for k, v in values.items() if v is not None}
    values.update(
        num_pages=num_pages,
        num_snapshots=args.num_snapshots or 4 * args.num_slots,
        page_tokens=page,
        kda_block_tokens=block,
        max_pages_per_request=max_pages,
        namespace=namespace,
        role=role,
        publish_to_host=host is not None if publish is None else publish,
        draft_tokens=_draft_tokens(args) if draft is not None else 0,
        eagle_tail="no_drop" if getattr(args, "eagle_no_drop", False) else args.eagle_tail,
        eos_id=tok.eos_id if eos_id is None else eos_id,
    )
    engine = Engine(params, cfg, EngineConfig(**values), host=host, draft=draft, mesh=meshes(args, cfg))
    info = {
        "role": role,
        "worker_id": args.worker_id or f"{role}-{args.port}",
        "model": cfg.name,
        "config": cfg.name,
        "dtype": dtype,
        "seed": args.seed,
        "namespace": namespace,
        "page_tokens": page,
        "kda_block_tokens": block,
        "max_context": min(max_len, max_pages * page),
        "vocab_size": cfg.vocab_size,
        "store": bool(host),
        "capacity": engine.capacity(),
        "tokenizer": tok.describe(),  # the router checks that its tokenizer ends requests at the same id
        # a KV handoff's layout (/adopt): one page block, and the packed KDA state
        "page_shape": list(engine.pages.block_shape),
        "snapshot_size": int(engine.snapshot_size),
        "speculative": None
        if draft is None
        else {"method": "eagle3", "draft_tokens": engine.config.draft_tokens, "eagle_tail": engine.config.eagle_tail},
    }
    return engine, host, info


def _draft_tokens(args) -> int:
    """k of a speculative worker: --draft-tokens, else 3."""
    k = getattr(args, "draft_tokens", None)
    return 3 if k is None else k


def pool_pages(args, cfg, params, page_tokens: int) -> int:
    """KV pages of the device pool: `--num-pages`, or with `--gpu-memory-utilization F` what F of the
    device's memory holds once the weights are in (the slots' and snapshots' states first, as
    `Engine.from_memory_budget` sizes them; vLLM's flag, read the same way).  With
    `--data-parallel-size` D on a decode worker every rank's device holds its own 1/D share of the
    slots and snapshots and what is left in pages (sized on device 0, which holds the most
    weights): D times that in all."""
    util = getattr(args, "gpu_memory_utilization", None)
    if util is None:
        return args.num_pages or 256
    if args.num_pages:
        raise ValueError("--num-pages and --gpu-memory-utilization both size the KV pool: pass one")
    if not 0.0 < util <= 1.0:
        raise ValueError(f"--gpu-memory-utilization must lie in (0, 1]; got {util}")
    import jax

    from serving import kv_pools

    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" not in stats:
        raise ValueError(
            f"--gpu-memory-utilization needs a device that reports its memory ({jax.default_backend()} "
            f"does not): pass --num-pages"
        )
    # what the steps' activations and workspaces need is left out of the pool: 10% of the share
    budget = 0.9 * util * stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    dp = max(1, getattr(args, "data_parallel_size", 1)) if args.role != "prefill" else 1
    dp //= max(1, getattr(args, "num_processes", None) or 1)  # in a process group: this process's ranks
    slots = args.num_slots // dp
    pages = kv_pools.pages_in_budget(
        cfg,
        params["embed_vd"].dtype,
        budget,
        num_slots=slots,
        num_snapshots=(args.num_snapshots or 4 * args.num_slots) // dp,
        page_tokens=page_tokens,
        draft_tokens=_draft_tokens(args) if getattr(args, "speculative", None) else 0,
    )
    if pages < 2:
        raise ValueError(
            f"--gpu-memory-utilization {util}: {budget / 2**30:.2f} GiB left after the weights do not "
            f"hold {slots} slots' states and two pages"
        )
    return pages * dp


def meshes(args, cfg, devices=None):
    """The engine's mesh(es) from vLLM's flags: prefill over `--tensor-parallel-size` devices, decode
    over `--data-parallel-size`, the experts split over the same devices with
    `--enable-expert-parallel` (EP = TP for prefill, EP = DP for decode); None on one device."""
    from sharding import mesh as mesh_lib

    tp, dp = getattr(args, "tensor_parallel_size", 1), getattr(args, "data_parallel_size", 1)
    ep = getattr(args, "enable_expert_parallel", False)
    if tp < 1 or dp < 1:
        raise ValueError(f"parallel sizes must be >= 1; got tensor {tp}, data {dp}")
    if getattr(args, "coordinator", None):
        # A process group serves as one DP engine: its decode mesh spans every process's devices,
        # each process's ranks together (`Engine.group`).
        import jax

        if args.role == "prefill" or tp > 1:
            raise ValueError(
                "a process group serves DP decode (--role decode or both, --data-parallel-size); "
                "tensor-parallel prefill runs within one process"
            )
        if dp != len(jax.devices()):
            raise ValueError(
                f"a process group's decode mesh spans all its {len(jax.devices())} devices: pass "
                f"--data-parallel-size {len(jax.devices())}"
            )
        devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    if args.role == "decode" and tp > 1:
        raise ValueError("a decode worker runs data-parallel attention: use --data-parallel-size")
    if args.role == "prefill" and dp > 1:
        raise ValueError("a prefill worker runs tensor-parallel attention: use --tensor-parallel-size")
    pre = (
        mesh_lib.prefill_mesh(tp, tp if ep else 1, devices, cfg) if tp > 1 or (ep and args.role == "prefill") else None
    )
    dec = mesh_lib.decode_mesh(dp, dp if ep else 1, devices, cfg) if dp > 1 or (ep and args.role == "decode") else None
    if pre is None and dec is None:
        return None
    return {"prefill": pre, "decode": dec, "both": (pre, dec)}[args.role]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, required=True, help="the port to serve on")
    parser.add_argument("--config", default="tiny", help="tiny | small | ... (kimik3.config)")
    parser.add_argument("--seed", type=int, default=0, help="random weights from this seed (every worker alike)")
    parser.add_argument("--dtype", default=None, help="params dtype (default: the config's)")
    parser.add_argument(
        "--checkpoint",
        "--model",
        dest="checkpoint",
        default=None,
        help="weights: a Hugging Face Kimi-Linear directory or `kimik3 train`'s (overrides --config)",
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        metavar="SPEC",
        help="'byte', a tokenizer.json, a tiktoken file or a directory holding one (default: the "
        "checkpoint's tokenizer if it has one, else 'byte'): its end-of-sequence id ends requests",
    )
    parser.add_argument(
        "--manifest",
        default=None,
        choices=SERVING_MANIFESTS,
        help="load --checkpoint's quantized weights (`kimik3 quantize`) as this manifest",
    )
    parser.add_argument(
        "--speculative",
        choices=("eagle3",),
        default=None,
        help="speculative decoding with an EAGLE-3 draft (colocated role 'both')",
    )
    parser.add_argument("--draft-checkpoint", default=None, metavar="DIR", help="the draft (`kimik3 train-eagle`)")
    parser.add_argument("--eagle-no-drop", action="store_true", help="the same as --eagle-tail no_drop")
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="size the KV pool to fill this share of the memory JAX may use on the GPU (in place "
        "of --num-pages; under `kimik3 launch`, whose --gpu-memory-utilization already caps "
        "that memory, a share of the cap)",
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="longest prompt + completion a request may have (default: the config's positions)",
    )
    parser.add_argument(
        "--tensor-parallel-size", type=int, default=1, help="prefill attention tensor-parallel over this many devices"
    )
    parser.add_argument(
        "--data-parallel-size", type=int, default=1, help="decode attention data-parallel over this many devices"
    )
    parser.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="split the routed experts over the same devices (EP = TP for prefill, DP for decode)",
    )
    parser.add_argument(
        "--coordinator",
        default=None,
        metavar="HOST:PORT",
        help="join a process group (JAX's multi-controller runtime) whose process 0 serves the "
        "coordination service here; with --num-processes and --process-id.  The group serves "
        "as one DP engine: the decode mesh spans every process's devices, each process serves "
        "its own requests on its own devices' ranks, and all step together",
    )
    parser.add_argument("--num-processes", type=int, default=None, help="processes in the group")
    parser.add_argument("--process-id", type=int, default=None, help="this process's id in [0, num-processes)")
    parser.add_argument("--cpu-devices", type=int, default=None, help="devices per process on CPU (a group on CPU)")
    parser.add_argument(
        "--group-heartbeat-s",
        type=int,
        default=10,
        help="a group process silent this long is dead: the others stop too (their requests fail "
        "over at the router) and `kimik3 launch` restarts them",
    )
    parser.add_argument("--mooncake-master", default=None, help="host:port of a mooncake_master (the shared store)")
    parser.add_argument("--mooncake-metadata", default=None, help="its HTTP metadata URL")
    parser.add_argument("--staging-mb", type=int, default=16, help="the store client's staging buffer")
    parser.add_argument(
        "--store-timeout-s",
        type=float,
        default=1.0,
        help="longest wait for one store call; one overrun opens the store's breaker",
    )
    parser.add_argument(
        "--store-cooldown-s",
        type=float,
        default=5.0,
        help="while the breaker is open, store lookups are misses; then one call probes",
    )
    parser.add_argument("--worker-id", default=None, help="its name in logs and metrics (default: ROLE-PORT)")
    parser.add_argument(
        "--served-model-name",
        default=None,
        help="the model_name label of its vllm:* metrics, as the router's (default kimik3-<config>)",
    )
    parser.add_argument("--max-waiting", type=int, default=32, help="queued requests before answering 429")
    parser.add_argument("--no-warmup", action="store_true", help="compile step shapes lazily")
    parser.add_argument(
        "--log-stats-interval-s",
        type=float,
        default=10.0,
        help="log a line of throughput, queue, KV use and prefix-cache hit rate this often (0: never)",
    )
    parser.add_argument("--step-delay-s", type=float, default=0.0, help="sleep after each engine step (testing)")
    parser.add_argument("--compile-cache", default=None, help="JAX persistent compilation cache directory")
    parser.add_argument("--log-level", default="warning", help="debug | info | warning | error")
    flags.add_engine_flags(parser)


def run(args) -> int:
    import uvicorn
    from prometheus_client import CollectorRegistry

    if args.compile_cache:
        import jax

        jax.config.update("jax_compilation_cache_dir", args.compile_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    if args.log_stats_interval_s < 0:
        raise ValueError(f"--log-stats-interval-s must be >= 0 (0: no stats line); got {args.log_stats_interval_s}")
    t0 = time.monotonic()
    if args.coordinator:
        from sharding import distributed

        if args.num_processes is None or args.process_id is None:
            raise ValueError("--coordinator needs --num-processes and --process-id")
        distributed.initialize(
            distributed.ProcessGroup(args.coordinator, args.num_processes, args.process_id, args.cpu_devices),
            heartbeat_timeout_s=args.group_heartbeat_s,
        )
    elif args.num_processes or args.process_id is not None:
        raise ValueError("--num-processes and --process-id join a group: pass its --coordinator too")
    engine, host, info = build_engine(args)
    if not args.no_warmup:
        engine.warmup(sampled=True)  # API clients sample by default (temperature 1)
        warm_sampling_variants(engine)  # and may ask for logprobs or penalties
    log.info("worker %s ready in %.1f s", info["worker_id"], time.monotonic() - t0)
    registry = CollectorRegistry()
    loop = EngineLoop(
        engine,
        max_waiting=args.max_waiting,
        step_delay_s=args.step_delay_s,
        worker_id=info["worker_id"],
        registry=registry,
        model_name=args.served_model_name or f"kimik3-{info['config']}",
    )
    from serving.metrics import CompileWatch

    loop.compile_watch = CompileWatch().__enter__()  # what serving builds from here on (its /metrics)
    app = create_app(loop, info, registry=registry)
    server = uvicorn.Server(
        uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)
    )
    loop.on_fault = lambda: exit_after_fault(server)
    stats = StatsLogger(loop, args.log_stats_interval_s).start() if args.log_stats_interval_s else None
    try:
        server.run()
    finally:
        if stats is not None:
            stats.stop()
        if host is not None:
            host.close()
    if loop.failed:
        log.error("worker %s exits after an engine fault: %s", info["worker_id"], loop.failed)
        return EXIT_ENGINE_FAULT
    return 0


def exit_after_fault(server, grace_s: float = 0.5, deadline_s: float = 30.0) -> None:
    """After an engine fault: let the failed requests' errors go out (`grace_s`), then shut the
    uvicorn `server` down gracefully (`run` then returns `EXIT_ENGINE_FAULT`); a shutdown that
    takes past `deadline_s` ends the process with that code anyway.  Returns at once."""

    def stop():
        time.sleep(grace_s)
        server.should_exit = True
        time.sleep(deadline_s)
        os._exit(EXIT_ENGINE_FAULT)

    threading.Thread(target=stop, name="exit-after-fault", daemon=True).start()


def main(argv=None) -> int:
    from serving.cli import standalone_main

    return standalone_main("kimik3 worker", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
