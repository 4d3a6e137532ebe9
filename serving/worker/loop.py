"""The engine thread: the one thread that owns a worker's `Engine` (`EngineLoop`), and the events a
request's stream is made of.

The engine is not thread-safe, so HTTP handlers (asyncio) never call it: they reserve a place
(`EngineLoop.try_reserve`), queue a command (`submit`, `adopt`, `cancel`) and read the request's
events from its own asyncio queue (`Sub.events`), which the engine thread fills between steps.
A request's events: ``{"accepted": true, "worker": id}``, one ``{"token", "index"}`` per token
(with ``"logprob"`` / ``"top_logprobs"`` where asked, the first with the prefix cache's share),
then ``{"done": true, ...}`` or an error event (`request_failure`, `engine_failure`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import os
import queue
import resource
import threading
import time
from typing import Any, Callable

import numpy as np

from serving.metrics import IntervalStats
from serving.sampling import GREEDY, SamplingParams
from serving.worker.metrics import WorkerMetrics

log = logging.getLogger(__name__)

# exceptions of a request's own values (its failure is a 400): the rest of its own failures are 500s
_VALUE_ERRORS = (ValueError, TypeError, OverflowError, ArithmeticError)


def request_failure(message: str, invalid: bool) -> dict:
    """The event (and error body) of a request that failed on its own: not retriable."""
    return {"error": message, "status": 400 if invalid else 500, "retriable": False, "code": "request_failed"}


def engine_failure(message: str) -> dict:
    """The event of a request that failed with its engine: retriable on another worker."""
    return {"error": message, "status": 500, "retriable": True, "code": "engine_fault"}


@dataclasses.dataclass
class Sub:
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
        self._subs: dict[str, Sub] = {}  # engine thread only
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
        self.metrics = (
            WorkerMetrics(registry, model_name, profile=lambda: engine.profile) if registry is not None else None
        )
        if engine.role == "prefill":  # a prefill engine stops after the first token; export on request
            engine.on_prefilled = self._on_prefilled

    # ---- called from HTTP handlers (any thread) ------------------------------------------------
    def start(self) -> "EngineLoop":
        self._thread.start()
        return self

    def ensure_started(self) -> None:
        """Start the engine thread unless it runs already or was stopped (an app's lifespan: the
        loop may have been started by whoever made it)."""
        if not self._thread.is_alive() and not self._stop.is_set():
            self.start()

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

    def unreserve(self) -> None:
        """Give back a place `try_reserve` took for a request that was refused before it was queued
        (its own 400): a bad request never holds a place."""
        with self._lock:
            self._pending -= 1
            self.counters["submitted"] -= 1

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
    ) -> Sub:
        """Queue a request (after `try_reserve`).  Its events arrive on the returned queue."""
        sub = Sub(f"{request_id}#{next(self._ids)}", asyncio.get_running_loop(), asyncio.Queue(), export=export)
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
    ) -> Sub:
        """Take over a request another worker prefilled (direct handoff), after `try_reserve`."""
        sub = Sub(f"{request_id}#{next(self._ids)}", asyncio.get_running_loop(), asyncio.Queue())
        self._cmds.put(
            (
                "adopt",
                (sub, prompt, first_token, max_new_tokens, pages, state, stop_at_eos, sampling, images, cache_salt),
            )
        )
        return sub

    def cancel(self, sub: Sub) -> None:
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

    def _push(self, sub: Sub, event: dict) -> None:
        try:
            sub.loop.call_soon_threadsafe(sub.events.put_nowait, event)
        except RuntimeError:  # the HTTP loop is gone (shutdown)
            pass

    def _finish(self, sub: Sub, counter: str) -> None:
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

    def _publish_one(self, sub: Sub) -> None:
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
            if self.metrics is not None:
                self.metrics.observe(req)
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
                if self.metrics is not None:  # a request that left between steps frees its pages
                    self.metrics.gauges(self._load)
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
            if self.metrics is not None:
                self.metrics.gauges(self._load)
            if self.step_delay_s:
                time.sleep(self.step_delay_s)
