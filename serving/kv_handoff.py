"""Worker-to-worker KV handoff for direct P/D: the router carries a handle, never the KV.

The prefill worker answers `/prefill` with ``"hold_kv": true`` by packing the prompt's exported KV
(`pack`) into `HeldKV` under a random one-time handle and returning the handle with the first
token.  The router then posts `/adopt?kv_from=<prefill worker>&kv_handle=<handle>` to a decode
worker, which pulls the KV from the prefill worker's ``GET /kv/<handle>`` (`pull`, with the
deployment's internal token: the KV is another tenant's prompt) and adopts it.  As vLLM's and
SGLang's connectors, the KV moves between the workers; the router sees metadata only.

A handle is taken once; held KV is dropped after `ttl_s` or when newer handoffs need the room
(`max_bytes`), so a decode worker that never comes costs bounded memory.  A handle that is gone
is a 404; the decode worker answers 502 and the router recomputes the prompt elsewhere.
"""

from __future__ import annotations

import collections
import io
import secrets
import threading
import time

import numpy as np


class HandoffError(Exception):
    """The KV could not be pulled (gone, refused, unreachable, malformed)."""


def pack(prompt, token: int, pages, state, images=None) -> bytes:
    """One handoff as npz bytes: prompt int32 [T], token, pages [n, *page block], state f32 [S],
    images uint8 [N, S, S, 3] or none."""
    buf = io.BytesIO()
    extra = {"images": images} if images is not None else {}
    np.savez(buf, prompt=np.asarray(prompt, np.int32), token=np.int32(token), pages=pages, state=state, **extra)
    return buf.getvalue()


def unpack(raw: bytes):
    """(prompt list, token, pages list, state, images or None); ValueError for bytes that are not one."""
    try:
        with np.load(io.BytesIO(raw)) as z:
            return (
                [int(t) for t in z["prompt"]],
                int(z["token"]),
                list(z["pages"]),
                z["state"],
                z["images"] if "images" in z.files else None,
            )
    except (ValueError, KeyError, OSError, EOFError) as err:
        raise ValueError(f"not a KV handoff: {err}") from None


class HeldKV:
    """Packed handoffs by one-time handle, at most `max_bytes` and `ttl_s` old (thread-safe)."""

    def __init__(self, max_bytes: int = 1 << 30, ttl_s: float = 60.0, clock=time.monotonic):
        self.max_bytes, self.ttl_s, self._clock = max_bytes, ttl_s, clock
        self._held: collections.OrderedDict[str, tuple[float, bytes]] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.bytes_held = 0
        self.served = self.dropped = 0

    def _drop_oldest(self) -> None:
        _, (_, data) = self._held.popitem(last=False)
        self.bytes_held -= len(data)
        self.dropped += 1

    def put(self, data: bytes) -> str:
        if len(data) > self.max_bytes:
            raise ValueError(f"a KV handoff of {len(data)} bytes is over the held budget of {self.max_bytes}")
        handle = secrets.token_urlsafe(16)
        with self._lock:
            self._expire()
            while self._held and self.bytes_held + len(data) > self.max_bytes:
                self._drop_oldest()
            self._held[handle] = (self._clock(), data)
            self.bytes_held += len(data)
        return handle

    def take(self, handle: str) -> bytes | None:
        """The handoff's bytes, once (None: unknown, taken, expired or dropped)."""
        with self._lock:
            self._expire()
            item = self._held.pop(handle, None)
            if item is None:
                return None
            self.bytes_held -= len(item[1])
            self.served += 1
            return item[1]

    def _expire(self) -> None:
        now = self._clock()
        while self._held and now - next(iter(self._held.values()))[0] > self.ttl_s:
            self._drop_oldest()

    def stats(self) -> dict:
        with self._lock:
            self._expire()
            return {
                "kv_held": len(self._held),
                "kv_held_bytes": self.bytes_held,
                "kv_served": self.served,
                "kv_dropped": self.dropped,
            }


async def pull(client, source: str, handle: str, *, headers: dict, timeout_s: float, max_bytes: int) -> bytes:
    """The held handoff `handle` from the worker at `source` (an http(s) URL), through `client`
    (an httpx.AsyncClient).  HandoffError for anything but the bytes."""
    import httpx  # optional: httpx (the serve extra)

    if not source.startswith(("http://", "https://")) or not handle.replace("-", "").replace("_", "").isalnum():
        raise HandoffError(f"not a KV source: {source!r} / {handle!r}")
    try:
        async with client.stream("GET", f"{source.rstrip('/')}/kv/{handle}", headers=headers, timeout=timeout_s) as r:
            if r.status_code != 200:
                raise HandoffError(
                    f"{source} answered {r.status_code} for the KV: {(await r.aread()).decode(errors='replace')[:200]}"
                )
            chunks, n = [], 0
            async for chunk in r.aiter_bytes():
                n += len(chunk)
                if n > max_bytes:
                    raise HandoffError(f"{source} sent more than {max_bytes} bytes of KV")
                chunks.append(chunk)
            return b"".join(chunks)
    except httpx.HTTPError as e:
        raise HandoffError(f"{source}: {type(e).__name__}: {e}") from None
