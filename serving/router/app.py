"""The router's HTTP app: OpenAI's /v1 routes, /health, /metrics, the operator's /admin routes and
the API docs, each a named handler method of `RouterApp` over one `serving.router.Router`.

A /v1 request goes: the caller's tenant (`Access.client_tenant`), its body read under the bounds
of `read_body`, parsed and tokenized on threads (`RouterApp.parse_off_loop`), admitted
(`Admission`: 429 past the queue), then answered from a `RequestStream`: as server-sent events
when it asked to stream, else as one JSON answer that is dropped (499, the workers' request
cancelled) once its client has gone.  Errors are OpenAI-shaped; a bug is a 500 with one log
line and no traceback to the client.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid

import httpx
from fastapi import FastAPI, Request  # at module level: FastAPI resolves handler annotations in module globals
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from serving import router_body
from serving.http_util import ClosingStreamingResponse
from serving.openai_api import APIError, ChatCompletionRequest, CompletionRequest
from serving.router.access import Access
from serving.router.admission import Overloaded
from serving.router.config import DISCONNECT_POLL_S, LARGE_BODY_BYTES
from serving.router.intake import Parsed, read_body
from serving.router.streaming import RequestStream

log = logging.getLogger(__name__)


class RouterApp:
    """The FastAPI app of `router` (`self.app`), its routes bound to this object's handlers.  The
    app's lifespan starts and stops the router (its client, health checks and store probe)."""

    def __init__(self, router):
        self.router = router
        self.access = Access(router.keys, router.metrics)
        # parsing and decoding off the event loop, bounded (`parse_off_loop`)
        self.decoders = asyncio.Semaphore(router.cfg.image_decoders)
        self.large = asyncio.Semaphore(router.cfg.large_body_parsers)
        self.app = self._build()

    def _build(self) -> FastAPI:
        # /docs and /openapi.json are served below, behind the operator's credentials; no /redoc
        app = FastAPI(
            title="kimik3 router",
            lifespan=self.lifespan,
            docs_url=None,
            redoc_url=None,
            openapi_url=None,
            swagger_ui_oauth2_redirect_url=None,
        )
        app.add_exception_handler(StarletteHTTPException, self.http_error)
        app.add_exception_handler(RequestValidationError, self.validation_error)
        app.add_exception_handler(Exception, self.internal_error)
        routes = (  # (path, method, handler, route name: the name FastAPI's schema shows)
            ("/v1/chat/completions", "POST", self.chat, "chat"),
            ("/v1/completions", "POST", self.completions, "completions"),
            ("/v1/models", "GET", self.models, "models"),
            ("/health", "GET", self.health, "health"),
            ("/metrics", "GET", self.prometheus, "metrics"),
            ("/admin/workers", "GET", self.workers, "workers"),
            ("/admin/drain", "POST", self.drain, "drain"),
            ("/admin/resume", "POST", self.resume, "resume"),
        )
        for path, method, handler, name in routes:
            app.add_api_route(path, handler, methods=[method], name=name)
        app.add_api_route("/openapi.json", self.openapi, methods=["GET"], name="openapi", include_in_schema=False)
        app.add_api_route("/docs", self.docs, methods=["GET"], name="docs", include_in_schema=False)
        app.openapi = self.openapi_schema
        return app

    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        await self.router.start()
        yield
        await self.router.stop()

    # ---- errors ------------------------------------------------------------------------------------
    def error_response(self, e: APIError, endpoint: str) -> JSONResponse:
        """`e` as the client's answer, counted under `endpoint` by its status."""
        self.router.metrics.requests.labels(endpoint, str(e.status)).inc()
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    async def http_error(self, request, exc):
        return JSONResponse(
            APIError(exc.status_code, str(exc.detail), type="invalid_request_error").body(),
            status_code=exc.status_code,
        )

    async def validation_error(self, request, exc):
        return JSONResponse(APIError(400, f"invalid request: {exc.errors()}").body(), status_code=400)

    async def internal_error(self, request, exc):
        """A bug: an OpenAI-shaped 500, one log line, no traceback to the client."""
        log.error("internal error on %s: %r", request.url.path, exc)
        return JSONResponse(APIError(500, "internal server error", type="server_error").body(), status_code=500)

    # ---- /v1 ----------------------------------------------------------------------------------------
    async def chat(self, request: Request):
        return await self.complete(request, "chat")

    async def completions(self, request: Request):
        return await self.complete(request, "completion")

    async def models(self, request: Request):
        if isinstance(refused := self.access.client_tenant(request), JSONResponse):
            return refused
        r = self.router
        return {
            "object": "list",
            "data": [
                {
                    "id": r.model_name,
                    "object": "model",
                    "created": r.created,
                    "owned_by": "kimik3",
                    "max_model_len": r.max_context,
                }
            ],
        }

    async def parse_off_loop(self, kind: str, raw, tenant: str) -> Parsed:
        """`Router.validate` and `Router.build` on threads: the JSON of large bodies
        `large_body_parsers` at a time (a parse holds the interpreter: more threads would only
        take turns), prompts with images `image_decoders` at a time (decoding and fetching
        cost CPU and memory, and decoders let other threads run)."""
        async with self.large if len(raw) > LARGE_BODY_BYTES else contextlib.nullcontext():
            req = await asyncio.to_thread(self.router.validate, kind, raw)
        async with self.decoders if b"image_url" in raw else contextlib.nullcontext():
            return await asyncio.to_thread(self.router.build, kind, req, tenant)

    async def complete(self, request: Request, kind: str):
        """A /v1 completion ("chat" or "completion") from its request to its answer (module docstring)."""
        r, endpoint = self.router, ("/v1/chat/completions" if kind == "chat" else "/v1/completions")
        t0 = time.monotonic()
        tenant = self.access.client_tenant(request)
        if isinstance(tenant, JSONResponse):
            r.metrics.requests.labels(endpoint, "401").inc()
            return tenant
        try:
            raw = await read_body(request, r.cfg.max_body_bytes, r.cfg.body_timeout_s, max_values=r.max_values)
            parsed = await self.parse_off_loop(kind, raw, tenant)
        except APIError as e:
            r.metrics.rejected.labels("invalid").inc()
            return self.error_response(e, endpoint)
        finally:
            raw = None  # the body's buffer goes now, not when a long stream ends
        if (refused := await self.admit(endpoint)) is not None:
            return refused
        r.metrics.inflight.inc()
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        req = parsed.req
        stream = RequestStream(
            r, kind, req, parsed.prompt, parsed.max_tokens, rid, t0, endpoint, parsed.images_b64, parsed.salt
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
            return await self.stream_events(stream, first)
        return await self.collect_unless_gone(request, stream, first)

    async def admit(self, endpoint: str) -> JSONResponse | None:
        """None once the request holds an admission place (its `RequestStream` releases it), else
        the 429 for a router at capacity."""
        r = self.router
        try:
            r.metrics.queued.inc()
            await r.admission.acquire()
        except Overloaded as e:
            r.metrics.rejected.labels("overloaded").inc()
            return self.error_response(
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
            r.metrics.queued.dec()
        return None

    async def stream_events(self, stream: RequestStream, first) -> ClosingStreamingResponse:
        """The request's answer as server-sent events.  The SSE generator starts here: once started,
        its `finally` (which releases the admission place) runs even if the response never
        iterates it; the response closes the stream (and so the worker's request) even when the
        client leaves mid-way."""
        events = stream.sse(first)
        head = await events.__anext__()
        return ClosingStreamingResponse(
            _chain(head, events), stream.close, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )

    async def collect_unless_gone(self, request: Request, stream: RequestStream, first):
        """A non-streamed answer, or, once its client has gone, nothing: the stream closes, which
        closes the worker's connection and so cancels its request (no decoding for nobody)."""
        collect = asyncio.ensure_future(stream.collect(first))
        watch = asyncio.ensure_future(_disconnected(request))
        await asyncio.wait({collect, watch}, return_when=asyncio.FIRST_COMPLETED)
        if collect.done():
            watch.cancel()
            return collect.result()
        collect.cancel()
        with contextlib.suppress(BaseException):
            await collect  # its `finally` closes the stream
        self.router.metrics.abandoned.inc()
        return Response(status_code=499)

    # ---- health, metrics ------------------------------------------------------------------------------
    async def health(self, request: Request):
        """Open: the status and the model; the workers' details (URLs, pids, load) only for an
        operator (`is_operator`)."""
        r = self.router
        ok = r.pools.serving()
        degraded = any(w.info.get("status") == "degraded" for w in r.workers if w.available())
        l1 = getattr(r.media, "cache", None)
        l1_down = hasattr(l1, "ping") and not await asyncio.to_thread(l1.ping)  # the shared L1 (Redis)
        body = {
            "status": ("degraded" if degraded or l1_down else "ok") if ok else "unavailable",
            "model": r.model_name,
        }
        if hasattr(l1, "ping"):
            body["l1"] = "down" if l1_down else "ok"
        if self.access.is_operator(request):
            body["workers"] = r.pools.describe()
        return JSONResponse(body, status_code=200 if ok else 503)

    async def prometheus(self):
        """Open, as vLLM's: the router's series, and its workers' engine series (KV use, the
        prefix cache, preemptions, kimik3_worker_*) labelled worker=URL, scraped now
        (`scrape_workers`; a worker that does not answer is kimik3_router_worker_metrics_up 0)."""
        r = self.router
        stats = r.media.stats() if r.media is not None else {}
        scraped = await r.scrape_workers()
        text = r.metrics.exposition(scraped, stats, r.admission.running, r.admission.waiting)
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    # ---- the operator's routes ------------------------------------------------------------------------
    async def workers(self, request: Request):
        if (refused := self.access.operator_only(request)) is not None:
            return refused
        r = self.router
        return {
            "workers": r.pools.describe(),
            "admission": {"running": r.admission.running, "waiting": r.admission.waiting},
        }

    async def drain(self, request: Request):
        return await self.set_drain(request, True)

    async def resume(self, request: Request):
        return await self.set_drain(request, False)

    async def set_drain(self, request: Request, drain: bool):
        """Take the worker named by the body ({"url": ...}) out of the pools (`drain`) or back in, and
        tell the worker, which then refuses new requests from any router and finishes its own."""
        if (refused := self.access.admin_only(request)) is not None:
            return refused
        r = self.router
        try:
            raw = await read_body(request, 1 << 16, r.cfg.body_timeout_s)
            url = router_body.loads(raw)["url"].rstrip("/")
        except APIError as e:
            return JSONResponse(e.body(), status_code=e.status)
        except (KeyError, TypeError, AttributeError):
            return JSONResponse(APIError(400, 'body must be {"url": "<worker url>"}').body(), status_code=400)
        w = r.pools.find(url)
        if w is None:
            return JSONResponse(APIError(404, f"no worker {url}").body(), status_code=404)
        w.drained_by_router = drain
        try:  # the worker refuses new requests (from any router) and finishes the admitted ones
            await r.client.post(w.url + ("/drain" if drain else "/resume"), timeout=r.cfg.health_timeout_s)
        except httpx.HTTPError as e:
            log.warning("could not tell %s to %s: %r", w.url, "drain" if drain else "resume", e)
        if not drain:
            w.draining = False
        return w.describe()

    async def openapi(self, request: Request):
        if (refused := self.access.operator_only(request)) is not None:
            return refused
        return JSONResponse(self.app.openapi())

    async def docs(self, request: Request):
        if (refused := self.access.operator_only(request)) is not None:
            return refused
        return get_swagger_ui_html(openapi_url="/openapi.json", title="kimik3 router")

    def openapi_schema(self) -> dict:
        """The app's OpenAPI schema, with what FastAPI cannot see in handlers that read their own
        bodies: the /v1 request bodies (`serving.openai_api`'s models) and the bearer scheme."""
        app = self.app
        if app.openapi_schema:
            return app.openapi_schema

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


async def _chain(head: str, events):
    """`head`, then the rest of `events`."""
    yield head
    async for chunk in events:
        yield chunk


async def _disconnected(request: Request) -> None:
    """Returns once the client of `request` has gone."""
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)
