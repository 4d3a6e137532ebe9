"""Direct P/D handoff on the worker's side: the KV moves worker to worker (`serving.kv_handoff`).

A prefill worker answers a `/prefill` with ``export_kv`` or ``hold_kv`` by packing the prompt's
exported KV (`Handoff.export`): the packed file itself, or (``hold_kv``) a one-time handle under
which it keeps the file (`serving.kv_handoff.HeldKV`: bounded in bytes and time) for a decode
worker to take (`Handoff.take`, ``GET /kv/<handle>``, internal token).  A decode worker's
``/adopt`` pulls that file by handle (`Handoff.fetch`) or reads it from its own body, and checks
it (`Handoff.adoptable`) before the engine commits it under the prompt's prefix.
"""

from __future__ import annotations

import json

import httpx
from fastapi.responses import JSONResponse, Response

from serving import internal_auth, kv_handoff
from serving.engine_config import check_handoff
from serving.worker.schemas import decode_images, error


class Handoff:
    """The handoff side of one worker's app: the KV it holds for decode workers (at most
    `held_kv_bytes`, each for `held_kv_ttl_s`), and the HTTP client it pulls handoffs with (made
    on first use; `close` closes it), each pull within `pull_timeout_s`.  `loop`: the worker's
    `EngineLoop`; `info`: its /health facts (the context and vocabulary a handoff must fit);
    `token`: the deployment's internal token, sent on every pull."""

    def __init__(
        self, loop, info: dict, token: str | None, held_kv_bytes: int, held_kv_ttl_s: float, pull_timeout_s: float
    ):
        self.loop, self.info, self.token = loop, info, token
        self.held = kv_handoff.HeldKV(held_kv_bytes, held_kv_ttl_s)
        self.pull_timeout_s = pull_timeout_s
        self._clients: list = []

    def client(self):
        """The HTTP client a decode worker pulls handoffs with (one per app, made on first use)."""
        if not self._clients:
            self._clients.append(httpx.AsyncClient(limits=httpx.Limits(max_connections=64)))
        return self._clients[0]

    async def close(self) -> None:
        for c in self._clients:
            await c.aclose()

    async def fetch(self, request, kv_from: str | None, kv_handle: str | None) -> bytes | JSONResponse:
        """An /adopt's packed KV: pulled from the prefill worker at `kv_from` by `kv_handle`, or the
        request's body without them.  400 when only one of the two is given; 502 (retriable: the
        router recomputes the prompt) when the pull fails."""
        if (kv_from is None) != (kv_handle is None):
            return error(400, "kv_from and kv_handle go together")
        if kv_from is None:
            return await request.body()
        try:
            return await kv_handoff.pull(
                self.client(),
                kv_from,
                kv_handle,
                headers=internal_auth.headers(self.token),
                timeout_s=self.pull_timeout_s,
                max_bytes=self.held.max_bytes,
            )
        except kv_handoff.HandoffError as err:
            return error(502, f"could not pull the KV: {err}", retriable=True)

    def adoptable(self, raw: bytes, max_tokens: int) -> tuple | JSONResponse:
        """(prompt, first token, pages, state, images) of a packed handoff this worker can continue
        for `max_tokens` in all, or a 400: a file that does not unpack, a prompt or budget past
        the context, a layout of another model or page size, or values the cache must not take."""
        try:
            prompt, token, pages, state, images = kv_handoff.unpack(raw)
        except ValueError as err:
            return error(400, str(err))
        engine = self.loop.engine
        limit = self.info.get("max_context", 1 << 30)
        if not prompt or max_tokens < 2 or len(prompt) + max_tokens > limit:
            return error(400, f"adopt needs a prompt and 2 <= max_tokens with prompt + max_tokens <= {limit}")
        if state.shape != (engine.snapshot_size,) or (pages and pages[0].shape != engine.pages.block_shape):
            return error(400, "the KV handoff does not match this worker's model or page size")
        try:
            # what /adopt commits becomes the cached KV of the prompt's prefix: check it as /generate
            # checks a prompt, and that every value is finite (NaN pages would poison every later hit)
            check_handoff(
                prompt,
                token,
                pages,
                state,
                vocab_size=self.info.get("vocab_size", 1 << 31),
                page_tokens=engine.page_tokens,
            )
        except ValueError as err:
            return error(400, str(err))
        return prompt, token, pages, state, images

    def export(self, body, answer: dict, kv: tuple | None, first_lp: dict | None):
        """A prefill's answer with its KV (`body` asked for ``export_kv`` or ``hold_kv``): `answer`
        (the done event with the first token) plus the handle the KV is held under, or the packed
        KV itself with the first token, its cache counts and logprobs in ``x-kimik3-*`` headers.
        400 when this worker exported no KV (only prefill workers do); 503 (retriable) when the
        held KV is at its bound."""
        if kv is None:
            return error(400, "this worker cannot export KV (only prefill workers do)")
        tokens = answer["tokens"]
        images = decode_images(body.images, self.loop.engine.cfg.vit) if body.images else None
        packed = kv_handoff.pack(body.prompt, tokens[0], kv[0], kv[1], images)
        if body.hold_kv:  # the decode worker pulls it (GET /kv/<handle>): the router sees the handle
            try:
                return {**answer, "kv_handle": self.held.put(packed), "kv_bytes": len(packed)}
            except ValueError as err:
                return error(503, str(err), retriable=True)
        headers = {
            "x-kimik3-token": str(tokens[0]),
            "x-kimik3-cached-tokens": str(answer["cached_tokens"]),
            "x-kimik3-cached-tokens-host": str(answer["cached_tokens_host"]),
        }
        if first_lp is not None:  # the first token's logprobs: the router sends them (the adopter starts after)
            headers["x-kimik3-logprobs"] = json.dumps(first_lp)
        return Response(packed, media_type="application/octet-stream", headers=headers)

    def take(self, handle: str) -> Response:
        """The KV held under `handle`, once; 404 when it was taken, expired or dropped."""
        data = self.held.take(handle)
        if data is None:
            return error(404, "no KV held under this handle (taken, expired or dropped)")
        return Response(data, media_type="application/octet-stream")
