"""Prefill/Decode disaggregation: a prefill engine hands finished prefills to a decode engine.

Handoff modes:
* ``direct``: the prompt's page contents and the live KDA state move from the
  prefill engine's pools into the decode engine's (device to device when both
  share a device; the arrays pass through host memory otherwise).
* ``store``: the prefill engine publishes its committed pages and KDA snapshots
  to the shared host tier and lets go; the decode engine admits the prompt like
  any request, finds the prefix there (up to the last full page with a
  snapshot) and prefills only the short tail itself.

Each engine may run on its own device mesh (``Engine(mesh=...)``): the prefill engine's
chunks on a `sharding.mesh.prefill_mesh` (TP/SP attention, EP MoE), the decode engine's
batches on a `sharding.mesh.decode_mesh` (DP attention, EP MoE).  The handoff moves pool
contents (pages and the packed KDA state), never mesh-sharded arrays, so the two meshes
need not match in size or devices.

Stepping: serial (``concurrent=False``: `step` runs a prefill step, the handoffs, then a decode
step, so a decode step waits for every prefill step before it) or concurrent (each engine
steps in its own thread, as separate prefill and decode instances do: the decode engine's
token rate is then protected from the prefill engine's work, which is disaggregation's point).
Concurrent, each engine is touched under its own lock only (its thread's steps, the client's
`submit` and reads), the handoff list under a third; `devices` runs each engine's thread under
`jax.default_device` of its device (engines built with their params on it: one engine a GPU).
"""

from __future__ import annotations

import contextlib
import threading

import jax

from serving.engine import Engine, Request
from serving.metrics import RequestRecord


class DisaggregatedServer:
    def __init__(
        self,
        prefill: Engine,
        decode: Engine,
        handoff: str = "direct",
        *,
        concurrent: bool = False,
        devices=(None, None),
    ):
        if handoff not in ("direct", "store"):
            raise ValueError(f"handoff must be 'direct' or 'store'; got {handoff!r}")
        if handoff == "store" and (prefill.manager.host is None or prefill.manager.host is not decode.manager.host):
            raise ValueError("handoff='store' needs both engines on one shared host tier")
        if prefill.role != "prefill" or decode.role == "prefill":
            raise ValueError("engines must have roles 'prefill' and 'decode'")
        if (prefill.spec is None) != (decode.spec is None) or (
            prefill.spec is not None and prefill.spec.fingerprint != decode.spec.fingerprint
        ):
            raise ValueError(
                "speculative P/D needs the same draft on both engines (the prefill engine writes "
                "the draft's rows the decode engine reads)"
            )
        self.prefill, self.decode, self.handoff = prefill, decode, handoff
        self.requests: dict[str, Request] = {}  # the client's view: filled as tokens arrive
        self._pending: list[tuple] = []  # handoffs waiting for decode capacity
        self._prefilled: dict[str, Request] = {}  # the prefill side of each handed-over request
        prefill.on_prefilled = self._on_prefilled
        self.concurrent = concurrent
        self.devices = tuple(devices)
        self._locks = {"prefill": threading.Lock(), "decode": threading.Lock()}
        self._pending_lock = threading.Lock()
        self._wake = {"prefill": threading.Event(), "decode": threading.Event()}
        self._progress = threading.Condition()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._error: BaseException | None = None

    def _engine_lock(self, name: str):
        return self._locks[name] if self.concurrent else contextlib.nullcontext()

    def submit(self, prompt, max_new_tokens: int, *, request_id: str | None = None, **kw) -> Request:
        """Queue a request on the prefill engine (`kw`: `Engine.submit`'s stop_at_eos, sampling)."""
        with self._engine_lock("prefill"):  # held until the client view exists: no step can hand it over first
            req = self.prefill.submit(prompt, max_new_tokens, request_id=request_id, **kw)
            with self._pending_lock:
                self.requests[req.request_id] = req
        self._wake["prefill"].set()
        return req

    def _on_prefilled(self, engine: Engine, req: Request) -> None:
        if req.max_new_tokens == 1:
            return  # the prefill produced the only token
        if self.handoff == "direct":
            pages, state = engine.export_kv(req)
            # a speculative decode engine also takes the draft's feature of the last prompt slot
            feature = engine.export_draft_feature(req) if engine.spec is not None else None
            handoff = (req, pages, (state, feature))
        else:
            engine.manager_of(req).publish_to_host(req.request_id)
            handoff = (req, None, None)
        with self._pending_lock:
            self._pending.append(handoff)
        self._wake["decode"].set()

    def _hand_over(self) -> None:
        """Admit the waiting handoffs the decode engine has room for (the decode engine's lock
        held).  A handoff leaves the waiting list in the same locked moment its request's
        client view becomes the decode side, so `done` never sees it in neither place."""
        with self._pending_lock:
            waiting = list(self._pending)
        for item in waiting:
            req, pages, state = item
            if pages is not None:
                new = self.decode.adopt(
                    req.prompt,
                    req.output[0],
                    req.max_new_tokens,
                    pages,
                    state[0],
                    request_id=req.request_id,
                    arrival_s=req.arrival_s,
                    stop_at_eos=req.stop_at_eos,
                    sampling=req.sampling,
                    images=req.images,
                    cache_salt=req.cache_salt,
                    draft_feature=state[1],
                    first_logprobs=req.logprobs[0] if req.logprobs else None,
                )
                if new is None:
                    continue  # no room yet: it waits
            else:
                new = self.decode.submit(
                    req.prompt,
                    req.max_new_tokens,
                    request_id=req.request_id,
                    stop_at_eos=req.stop_at_eos,
                    sampling=req.sampling,
                    images=req.images,
                    cache_salt=req.cache_salt,
                )
                new.arrival_s = req.arrival_s
            with self._pending_lock:
                self._prefilled[req.request_id] = req
                self.requests[req.request_id] = new
                self._pending = [p for p in self._pending if p is not item]

    def records(self):
        """One metrics record per finished request: the prompt's cache hits and the first
        token from the prefill engine (which computed them), later tokens from the decode engine."""
        out = []
        with self._engine_lock("decode"):
            decode_finished = list(self.decode.finished)
        with self._engine_lock("prefill"):
            prefill_finished = list(self.prefill.finished)
        for r in decode_finished:
            p = self._prefilled.get(r.request_id)
            if r.error is not None or p is None:
                continue
            out.append(
                RequestRecord(
                    p.arrival_s,
                    p.token_times_s[:1] + r.token_times_s[1:],
                    len(p.prompt),
                    p.cached_tokens - p.cached_tokens_host,
                    p.cached_tokens_host,
                    p.admitted_s,
                    p.token_mixed[:1] + r.token_mixed[1:],
                )
            )
        for p in prefill_finished:  # single-token requests never reach the decode engine
            if p.error is None and p.max_new_tokens == 1:
                out.append(
                    RequestRecord(
                        p.arrival_s,
                        p.token_times_s,
                        len(p.prompt),
                        p.cached_tokens - p.cached_tokens_host,
                        p.cached_tokens_host,
                        p.admitted_s,
                    )
                )
        return out

    def done(self, request_id: str) -> bool:
        """Whether a request has finished end to end: a prefilled request waiting for decode
        capacity is not (its prefill side is released, and `requests` still shows that side)."""
        self._raise()
        with self._pending_lock:  # the client view and the waiting list change together (`_hand_over`)
            waiting = any(p[0].request_id == request_id for p in self._pending)
            req = self.requests[request_id]
        return req.done and not waiting

    def has_work(self) -> bool:
        # In the order a request moves (concurrent: each side may move it between two looks):
        # a prefill step hands it to the waiting list before the step ends, and a handoff leaves
        # the list only once the decode engine holds it, so looked at in this order no request
        # is missed in between.
        self._raise()
        with self._engine_lock("prefill"):
            if self.prefill.has_work():
                return True
        with self._pending_lock:
            if self._pending:
                return True
        with self._engine_lock("decode"):
            return self.decode.has_work()

    def step(self) -> None:
        """Serial: a prefill step, the handoffs, a decode step.  Concurrent: start the engines'
        threads on the first call; then wait until either engine has stepped (at most 10 ms)."""
        if not self.concurrent:
            self.prefill.step()
            self._hand_over()
            self.decode.step()
            return
        self._raise()
        if not self._threads:
            self._start()
        with self._progress:
            self._progress.wait(timeout=0.01)
        self._raise()

    def run(self, max_steps: int = 1_000_000):
        try:
            for _ in range(max_steps):
                if not self.has_work():
                    break
                self.step()
        finally:
            if self.concurrent:
                self.close()
        return self.requests

    # ---- concurrent stepping ----------------------------------------------------------------

    def _start(self) -> None:
        self._stop.clear()
        self._threads = [
            threading.Thread(target=self._loop, args=(name, device), name=f"pd-{name}", daemon=True)
            for name, device in zip(("prefill", "decode"), self.devices)
        ]
        for t in self._threads:
            t.start()

    def _loop(self, name: str, device) -> None:
        engine = self.prefill if name == "prefill" else self.decode
        try:
            with jax.default_device(device) if device is not None else contextlib.nullcontext():
                while not self._stop.is_set():
                    with self._locks[name]:
                        if name == "decode":
                            self._hand_over()
                        busy = engine.has_work()
                        if busy:
                            engine.step()
                    if busy:
                        with self._progress:
                            self._progress.notify_all()
                    else:  # idle until a submission or a handoff (or 1 ms: handoffs that waited for room)
                        self._wake[name].wait(0.001)
                        self._wake[name].clear()
        except BaseException as e:  # noqa: BLE001 - handed to the client's thread by `_raise`
            self._error = e
            self._stop.set()
            with self._progress:
                self._progress.notify_all()

    def _raise(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            self.close()
            raise RuntimeError(f"P/D engine thread failed: {error!r}") from error

    def close(self) -> None:
        """Stop the engines' threads (concurrent stepping); a later `step` starts them again."""
        self._stop.set()
        for name in self._wake:
            self._wake[name].set()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join()
        self._threads = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
