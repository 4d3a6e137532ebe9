"""One admitted request's answer: the generation task, and OpenAI's responses rendered from it --
a whole JSON answer (`RequestStream.collect`) or server-sent events (`RequestStream.sse`).

Text is detokenized incrementally; a stop sequence or a stop token ends the answer early
(finish_reason "stop") and cancels the generation, which closes the worker's stream and so
cancels the worker's request.  Text that may begin a stop sequence is held back until the next
token settles it.  `close` releases the request's admission place and records its metrics,
once, however the answer ended (finished, failed, or its client gone).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time

from fastapi.responses import JSONResponse

from serving.openai_api import (
    APIError,
    chat_logprobs,
    completion_logprobs,
    logprobs_count,
    sampling_options,
    stop_strings,
)
from serving.stop import StopMatcher

log = logging.getLogger(__name__)


class RequestStream:
    """One admitted request: a task runs `Router.generate` into a queue (so the stream's
    upstream connections live in one task), and the handler renders OpenAI responses from it.
    `router`: the `serving.router.Router` that admitted it (its admission place is released by
    `close`); `kind`: "chat" or "completion"; `t0`: its arrival (monotonic), for its latencies."""

    def __init__(self, router, kind: str, req, prompt, max_tokens, rid, t0, endpoint, images_b64=None, salt=None):
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
        """The next event of `Router.generate`; its APIError raised (and its status kept for `close`)."""
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
        """End the request once: cancel the generation (closing the workers' streams), release its
        admission place, and count it (status, latency, tokens, vLLM's finished request)."""
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
        """The whole answer as OpenAI's JSON (a dict), or the JSONResponse of the error that ended
        it; closes the stream either way."""
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
        """The answer as server-sent events: chunks, the finish, the usage where asked, [DONE].  An
        error after the first event is a final event (retriable or not, and how many tokens were
        sent) before [DONE]: the status line has gone out already.  Closes the stream at the end."""
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
