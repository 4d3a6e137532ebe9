"""The per-worker circuit breaker: consecutive failures open it, a cooldown half-opens it, the next
success closes it.

State is read through a clock (`time.monotonic` unless given), so a test can move time instead
of sleeping through cooldowns.
"""

from __future__ import annotations

import time

CLOSED, HALF_OPEN, OPEN = "closed", "half_open", "open"


class CircuitBreaker:
    """Consecutive-failure breaker: closed -> open (cooldown, doubling) -> half-open -> closed.

    `threshold` consecutive failures while closed open it for `cooldown_s`; once that has passed it
    reads half-open (one trial may go through); a failed trial opens it again for twice as long
    (at most `max_cooldown_s`), a success closes it and resets the cooldown."""

    def __init__(self, threshold: int = 3, cooldown_s: float = 5.0, max_cooldown_s: float = 60.0, clock=time.monotonic):
        self.threshold, self.base_cooldown_s, self.max_cooldown_s = threshold, cooldown_s, max_cooldown_s
        self.cooldown_s = cooldown_s
        self.clock = clock
        self._state = CLOSED
        self.failures = 0
        self.opened_at = 0.0
        self.opens = 0

    @property
    def state(self) -> str:
        if self._state == OPEN and self.clock() - self.opened_at >= self.cooldown_s:
            return HALF_OPEN
        return self._state

    def available(self) -> bool:
        return self.state != OPEN

    def success(self) -> None:
        if self.state == OPEN:
            return  # a success still in flight from before the circuit opened does not close it
        self._state, self.failures, self.cooldown_s = CLOSED, 0, self.base_cooldown_s

    def failure(self) -> None:
        state = self.state
        self.failures += 1
        if state == HALF_OPEN:
            self.cooldown_s = min(self.max_cooldown_s, 2 * self.cooldown_s)
            self._open()
        elif state == CLOSED and self.failures >= self.threshold:
            self._open()

    def _open(self) -> None:
        self._state, self.opened_at = OPEN, self.clock()
        self.opens += 1
