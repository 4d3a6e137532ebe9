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
"""

from __future__ import annotations

from serving.engine import Engine, Request


class DisaggregatedServer:
    def __init__(self, prefill: Engine, decode: Engine, handoff: str = "direct"):
        if handoff not in ("direct", "store"):
            raise ValueError(f"handoff must be 'direct' or 'store'; got {handoff!r}")
        if handoff == "store" and (prefill.manager.host is None or prefill.manager.host is not decode.manager.host):
            raise ValueError("handoff='store' needs both engines on one shared host tier")
        if prefill.role != "prefill" or decode.role == "prefill":
            raise ValueError("engines must have roles 'prefill' and 'decode'")
        if (prefill.spec is None) != (decode.spec is None) or (
                prefill.spec is not None and prefill.spec.fingerprint != decode.spec.fingerprint):
            raise ValueError("speculative P/D needs the same draft on both engines (the prefill engine writes "
                             "the draft's rows the decode engine reads)")
        self.prefill, self.decode, self.handoff = prefill, decode, handoff
        self.requests: dict[str, Request] = {}  # the client's view: filled as tokens arrive
        self._pending: list[tuple] = []  # handoffs waiting for decode capacity
        self._prefilled: dict[str, Request] = {}  # the prefill side of each handed-over request
        prefill.on_prefilled = self._on_prefilled

    def submit(self, prompt, max_new_tokens: int, *, request_id: str | None = None, **kw) -> Request:
        """Queue a request on the prefill engine (`kw`: `Engine.submit`'s stop_at_eos, sampling)."""
        req = self.prefill.submit(prompt, max_new_tokens, request_id=request_id, **kw)
        self.requests[req.request_id] = req
        return req

    def _on_prefilled(self, engine: Engine, req: Request) -> None:
        if req.max_new_tokens == 1:
            return  # the prefill produced the only token
        if self.handoff == "direct":
            pages, state = engine.export_kv(req)
            # a speculative decode engine also takes the draft's feature of the last prompt slot
            feature = engine.export_draft_feature(req) if engine.spec is not None else None
            self._pending.append((req, pages, (state, feature)))
        else:
            engine.manager_of(req).publish_to_host(req.request_id)
            self._pending.append((req, None, None))

    def _hand_over(self) -> None:
        still = []
        for req, pages, state in self._pending:
            if pages is not None:
                new = self.decode.adopt(req.prompt, req.output[0], req.max_new_tokens, pages, state[0],
                                        request_id=req.request_id, arrival_s=req.arrival_s,
                                        stop_at_eos=req.stop_at_eos, sampling=req.sampling, images=req.images,
                                        cache_salt=req.cache_salt, draft_feature=state[1],
                                        first_logprobs=req.logprobs[0] if req.logprobs else None)
                if new is None:
                    still.append((req, pages, state))
                    continue
            else:
                new = self.decode.submit(req.prompt, req.max_new_tokens, request_id=req.request_id,
                                         stop_at_eos=req.stop_at_eos, sampling=req.sampling, images=req.images,
                                         cache_salt=req.cache_salt)
                new.arrival_s = req.arrival_s
            self._prefilled[req.request_id] = req
            self.requests[req.request_id] = new
        self._pending = still

    def records(self):
        """One metrics record per finished request: the prompt's cache hits and the first
        token from the prefill engine (which computed them), later tokens from the decode engine."""
        from serving.metrics import RequestRecord

        out = []
        for r in self.decode.finished:
            p = self._prefilled.get(r.request_id)
            if r.error is not None or p is None:
                continue
            out.append(RequestRecord(p.arrival_s, p.token_times_s[:1] + r.token_times_s[1:], len(p.prompt),
                                     p.cached_tokens - p.cached_tokens_host, p.cached_tokens_host, p.admitted_s,
                                     p.token_mixed[:1] + r.token_mixed[1:]))
        for p in self.prefill.finished:  # single-token requests never reach the decode engine
            if p.error is None and p.max_new_tokens == 1:
                out.append(RequestRecord(p.arrival_s, p.token_times_s, len(p.prompt),
                                         p.cached_tokens - p.cached_tokens_host, p.cached_tokens_host, p.admitted_s))
        return out

    def done(self, request_id: str) -> bool:
        """Whether a request has finished end to end: a prefilled request waiting for decode
        capacity is not (its prefill side is released, and `requests` still shows that side)."""
        return self.requests[request_id].done and all(p[0].request_id != request_id for p in self._pending)

    def has_work(self) -> bool:
        return self.prefill.has_work() or self.decode.has_work() or bool(self._pending)

    def step(self) -> None:
        self.prefill.step()
        self._hand_over()
        self.decode.step()

    def run(self, max_steps: int = 1_000_000):
        for _ in range(max_steps):
            if not self.has_work():
                break
            self.step()
        return self.requests
