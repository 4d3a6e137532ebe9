"""HTTP pieces the worker and the router share."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Awaitable, Callable

from starlette.responses import StreamingResponse


class ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that stops as soon as its client goes away and then runs `on_close`.

    Under ASGI spec >= 2.4 Starlette stops a stream only when a send fails, and uvicorn may
    swallow sends after a disconnect: the body then runs to its end for nobody (a worker decoding
    to max_tokens).  This one always listens for `http.disconnect` beside the stream (as Starlette
    does under older specs), cancels the stream when it comes, and calls `on_close` (idempotent)
    however the response ends, so the work behind it stops at once."""

    def __init__(self, content, on_close: Callable[[], Awaitable[None] | None], **kw):
        super().__init__(content, **kw)
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        stream = asyncio.ensure_future(self.stream_response(send))
        gone = asyncio.ensure_future(self.listen_for_disconnect(receive))
        try:
            await asyncio.wait({stream, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (stream, gone):
                task.cancel()
                with contextlib.suppress(BaseException):  # a failed send is the client leaving too
                    await task
            out = self._on_close()
            if out is not None:
                await out
