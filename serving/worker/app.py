"""The worker's HTTP app: a named handler method of `WorkerApp` per route, over one `EngineLoop`.

Routes: ``POST /generate`` (an NDJSON stream of the request's events, a keepalive line whenever
nothing else was sent for `keepalive_s`), ``POST /prefill`` (one JSON answer, with the prompt's
KV where asked: `serving.worker.handoff`), ``POST /adopt`` (a direct handoff's decode, streamed
as /generate), ``GET /kv/{handle}``, ``GET /health``, ``GET /load``, ``POST /drain``, ``POST
/resume``, ``GET /metrics``.  Every POST needs the deployment's internal token
(`serving.internal_auth`) where one is configured, and so does /kv.  A request is checked in
full before it takes a place in the queue; a 400 names the field at fault (``"param"``); 429
(the queue is full) and 503 (draining, failed) are retriable elsewhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os

from fastapi import FastAPI, Request  # at module level: FastAPI resolves handler annotations in module globals
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.middleware.base import BaseHTTPMiddleware

from serving import internal_auth, router_body
from serving.engine_config import check_cache_salt
from serving.http_util import ClosingStreamingResponse
from serving.openai_api import APIError
from serving.sampling import SamplingParams
from serving.worker.config import KEEPALIVE_S
from serving.worker.handoff import Handoff
from serving.worker.schemas import (
    GenerateBody,
    QueryId,
    QueryLogprobs,
    QueryMinP,
    QueryPenalty,
    QuerySeed,
    QueryTemperature,
    QueryTokens,
    QueryTopK,
    QueryTopP,
    decode_images,
    error,
    event_error,
    invalid,
)

log = logging.getLogger(__name__)


def create_app(
    loop,
    info: dict,
    *,
    keepalive_s: float = KEEPALIVE_S,
    registry=None,
    held_kv_bytes: int = 1 << 30,
    held_kv_ttl_s: float = 60.0,
    pull_timeout_s: float = 30.0,
) -> FastAPI:
    """FastAPI app around a started or startable `EngineLoop`.  `info` goes out on /health.
    held_kv_bytes / held_kv_ttl_s: the KV a prefill worker keeps for decode workers to pull
    (`serving.kv_handoff.HeldKV`); pull_timeout_s: a decode worker's pull of one handoff."""
    return WorkerApp(loop, info, keepalive_s, registry, held_kv_bytes, held_kv_ttl_s, pull_timeout_s).app


class WorkerApp:
    """The FastAPI app of one worker (`self.app`), its routes bound to this object's handlers (see
    `create_app` for the arguments).  The app's lifespan starts the engine thread (unless it
    runs) and stops it, with the handoff client, when the app stops."""

    def __init__(self, loop, info: dict, keepalive_s, registry, held_kv_bytes, held_kv_ttl_s, pull_timeout_s):
        self.loop, self.info, self.keepalive_s, self.registry = loop, info, keepalive_s, registry
        self.token = internal_auth.token()
        if self.token is None:
            log.warning(
                "no %s: this worker's endpoints take requests from anyone who reaches its port", internal_auth.ENV
            )
        self.handoff = Handoff(loop, info, self.token, held_kv_bytes, held_kv_ttl_s, pull_timeout_s)
        self.app = self._build()

    def _build(self) -> FastAPI:
        app = FastAPI(title="kimik3 worker", lifespan=self.lifespan)
        app.add_middleware(BaseHTTPMiddleware, dispatch=self.require_token)
        # /adopt's query parameters: a 400 naming the field, as a body's
        app.add_exception_handler(RequestValidationError, self.bad_query)
        routes = (  # (path, method, handler, route name: the name FastAPI's schema shows)
            ("/generate", "POST", self.generate, "generate"),
            ("/adopt", "POST", self.adopt, "adopt"),
            ("/prefill", "POST", self.prefill, "prefill"),
            ("/kv/{handle}", "GET", self.kv, "kv"),
            ("/health", "GET", self.health, "health"),
            ("/load", "GET", self.load, "load"),
            ("/drain", "POST", self.drain, "drain"),
            ("/resume", "POST", self.resume, "resume"),
            ("/metrics", "GET", self.metrics, "metrics"),
        )
        for path, method, handler, name in routes:
            app.add_api_route(path, handler, methods=[method], name=name)
        return app

    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        self.loop.ensure_started()
        yield
        await self.handoff.close()
        self.loop.stop()

    async def require_token(self, request: Request, call_next):
        # every POST changes state (runs, adopts KV, drains): only the deployment's router may
        if request.method == "POST" and not internal_auth.authorized(request.headers.get("authorization"), self.token):
            return error(401, "missing or wrong internal token (the router's)")
        return await call_next(request)

    async def bad_query(self, request, exc):
        return invalid(exc.errors())

    # ---- a request from its body to its first event ------------------------------------------------
    async def parse(self, request: Request) -> GenerateBody | JSONResponse:
        """The body as a `GenerateBody`, or a 400 naming what is wrong (`check_body` is the rest)."""
        try:
            return GenerateBody.model_validate(router_body.loads(await request.body()))
        except APIError as err:  # malformed JSON, or an integer literal too long to convert (named)
            return error(400, err.message, param=err.param, retriable=False)
        except ValidationError as err:
            return invalid(err.errors())

    def check_body(self, body: GenerateBody) -> JSONResponse | None:
        """A 400 naming the field if the body's prompt holds an id past the vocabulary or asks for
        more tokens than the context holds; None if it does not."""
        vocab = self.loop.engine.cfg.vocab_size
        bad = next((i for i, t in enumerate(body.prompt) if t >= vocab), None)
        if bad is not None:
            return error(
                400, f"prompt.{bad}: token ids must lie in [0, {vocab})", param=f"prompt.{bad}", retriable=False
            )
        limit = self.info.get("max_context")
        if limit is not None and len(body.prompt) + body.max_tokens > limit:
            return error(
                400,
                f"max_tokens: prompt ({len(body.prompt)}) + max_tokens ({body.max_tokens}) exceeds the "
                f"context limit of {limit} tokens",
                param="max_tokens",
                retriable=False,
            )
        return None

    async def start(self, submit) -> tuple:
        """(sub, first event) or (None, an error response): a place in the queue (429 when it is
        full, 503 while draining or failed), then `submit()`'s request (`submit` returns its
        `Sub`, or an error response), up to the engine's first answer for it."""
        why = self.loop.try_reserve()
        if why:
            if why == "full":
                return None, error(429, "worker queue is full", retriable=True)
            return None, error(503, f"worker is {why}", retriable=True)
        sub = submit()
        if isinstance(sub, JSONResponse):  # refused before it was queued: its place goes back
            self.loop.unreserve()
            return None, sub
        first = await sub.events.get()
        if "error" in first:
            return None, event_error(first, retriable=False)
        return sub, first

    def submit_body(self, body: GenerateBody):
        """Queue `body`'s request (after `EngineLoop.try_reserve`): its `Sub`, or a 400 for its images."""
        loop = self.loop
        try:
            images = decode_images(body.images, loop.engine.cfg.vit)
        except ValueError as err:
            return error(400, str(err))
        return loop.submit(
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

    def ndjson(self, sub, first) -> ClosingStreamingResponse:
        """The request's events as NDJSON lines from `first` to its end, a keepalive line whenever
        none came for `keepalive_s`; a client that leaves before the end cancels the request."""
        finished = False

        async def lines():
            nonlocal finished
            yield json.dumps(first) + "\n"
            while True:
                try:
                    ev = await asyncio.wait_for(sub.events.get(), self.keepalive_s)
                except asyncio.TimeoutError:
                    yield '{"keepalive": true}\n'
                    continue
                yield json.dumps(ev) + "\n"
                if "done" in ev or "error" in ev:
                    finished = True
                    return

        def close():
            if not finished:  # the client went away: stop decoding and free the KV now
                self.loop.cancel(sub)

        return ClosingStreamingResponse(lines(), close, media_type="application/x-ndjson")

    # ---- the request routes --------------------------------------------------------------------------
    # (the routes without a docstring keep FastAPI's schema free of one: the module docstring is theirs)
    async def generate(self, request: Request):
        body = await self.parse(request)
        if isinstance(body, JSONResponse):
            return body
        if (refused := self.check_body(body)) is not None:
            return refused
        sub, first = await self.start(lambda: self.submit_body(body))
        return self.ndjson(sub, first) if sub is not None else first

    async def adopt(
        self,
        request: Request,
        max_tokens: QueryTokens,
        stop_at_eos: bool = False,
        request_id: QueryId = "req",
        temperature: QueryTemperature = 0.0,
        top_p: QueryTopP = 1.0,
        seed: QuerySeed = 0,
        top_k: QueryTopK = 0,
        min_p: QueryMinP = 0.0,
        presence_penalty: QueryPenalty = 0.0,
        frequency_penalty: QueryPenalty = 0.0,
        logprobs: QueryLogprobs = None,
        cache_salt: str | None = None,
        kv_from: str | None = None,
        kv_handle: str | None = None,
    ):
        """Direct handoff: the KV of a prefill worker's `/prefill` (npz: prompt, token, pages,
        state), pulled from `kv_from` by `kv_handle` (`hold_kv`), or the body itself (`export_kv`);
        streams like /generate from the second token.  A pull that fails is a 502 (retriable: the
        router recomputes the prompt)."""
        raw = await self.handoff.fetch(request, kv_from, kv_handle)
        if isinstance(raw, JSONResponse):
            return raw
        handed = self.handoff.adoptable(raw, max_tokens)
        if isinstance(handed, JSONResponse):
            return handed
        prompt, token, pages, state, images = handed
        try:
            sampling = SamplingParams(
                temperature, top_p, seed, top_k, min_p, presence_penalty, frequency_penalty, logprobs
            )
            check_cache_salt(cache_salt)
        except ValueError as err:
            return error(400, str(err))
        adopt = lambda: self.loop.adopt(  # noqa: E731
            prompt,
            token,
            max_tokens,
            pages,
            state,
            stop_at_eos=stop_at_eos,
            request_id=request_id,
            sampling=sampling,
            images=images,
            cache_salt=cache_salt,
        )
        sub, first = await self.start(adopt)
        return self.ndjson(sub, first) if sub is not None else first

    async def prefill(self, request: Request):
        body = await self.parse(request)
        if isinstance(body, JSONResponse):
            return body
        body.max_tokens = 1
        if (refused := self.check_body(body)) is not None:
            return refused
        sub, first = await self.start(lambda: self.submit_body(body))
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
                return event_error(ev, retriable=True)
            elif "done" in ev:
                kv = ev.pop("kv", None)
                answer = {"token": tokens[0], "tokens": tokens, **ev, **({"logprobs": first_lp} if first_lp else {})}
                if not (body.export_kv or body.hold_kv):
                    return answer
                return self.handoff.export(body, answer, kv, first_lp)

    async def kv(self, handle: str, request: Request):
        """A held handoff, once (`hold_kv`): another tenant's prompt, so only the deployment's own
        processes (the internal token) may read it."""
        if not internal_auth.authorized(request.headers.get("authorization"), self.token):
            return error(401, "missing or wrong internal token")
        return self.handoff.take(handle)

    # ---- state: health, load, drain, metrics -----------------------------------------------------------
    async def health(self):
        # 200 ok, or degraded: serving, with store lookups answered as misses until the store is
        # back (`cache.guarded_tier`); 503 draining or failed; plus the model facts a router needs
        loop = self.loop
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
        return JSONResponse(
            {"status": status, "pid": os.getpid(), **self.info, **extra, "load": loop.load()},
            status_code=200 if status in ("ok", "degraded") else 503,
        )

    async def load(self):
        return {**self.loop.load(), **self.handoff.held.stats()}

    async def drain(self):
        # refuse new requests (503: a router tries another worker), finish the admitted ones
        self.loop.draining = True
        return self.loop.load()

    async def resume(self):
        self.loop.draining = False
        return self.loop.load()

    async def metrics(self):
        loop = self.loop
        if loop.metrics is not None:
            loop.metrics.refresh(getattr(getattr(loop.engine.manager, "host", None), "stats", None), loop.compile_watch)
        registry = self.registry
        return Response(generate_latest(registry) if registry is not None else b"", media_type=CONTENT_TYPE_LATEST)
