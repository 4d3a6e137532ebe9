"""Admission: a bound on the requests a router runs at once and on those that wait for a place.

Beyond both, a request is refused at once (the app answers 429 with ``Retry-After``): a router
under more load than its workers can take sheds it instead of queueing without end.
"""

from __future__ import annotations

import asyncio


class Overloaded(Exception):
    """No place now and none within the queue's bound: the message says which."""


class Admission:
    """At most `max_inflight` requests run; `max_queue` more wait up to `timeout_s`; the rest: 429."""

    def __init__(self, max_inflight: int, max_queue: int, timeout_s: float):
        self.max_inflight, self.max_queue, self.timeout_s = max_inflight, max_queue, timeout_s
        self.running = 0
        self.waiting = 0
        self._cond: asyncio.Condition | None = None

    async def acquire(self) -> None:
        """A running place (a newcomer takes none while others wait for one), or Overloaded: the
        queue is full, or no place came within `timeout_s`."""
        if self._cond is None:
            self._cond = asyncio.Condition()
        async with self._cond:
            if self.running < self.max_inflight and not self.waiting:
                self.running += 1
                return
            if self.waiting >= self.max_queue:
                raise Overloaded(f"{self.running} requests running and {self.waiting} queued")
            self.waiting += 1
            try:
                await asyncio.wait_for(self._cond.wait_for(lambda: self.running < self.max_inflight), self.timeout_s)
            except asyncio.TimeoutError:
                raise Overloaded(f"no capacity within {self.timeout_s:g} s") from None
            finally:
                self.waiting -= 1
            self.running += 1

    async def release(self) -> None:
        """Give back a place `acquire` gave; the waiters get to take it."""
        async with self._cond:
            self.running -= 1
            self._cond.notify_all()
