"""A per-peer circuit breaker: pure, synchronous, with an injectable clock.

States and transitions::

              N consecutive failures                 reset_s elapsed, or a passing
    CLOSED ───────────────────────────> OPEN ─────── health check (half_open_now) ──┐
       ^                                 ^                                           v
       │                                 └───────── the trial fails ─────────── HALF_OPEN
       └─────────────────────────────── the trial succeeds ─────────────────────────┘

* closed: every request may go; a success resets the consecutive-failure count.
* open: no request may go (``allow()`` is False) until ``reset_s`` has passed since it opened.
* half-open: exactly one trial request at a time may go. Its success closes the breaker, its
  failure opens it again for another ``reset_s``. A trial abandoned without a verdict (the
  caller was cancelled) hands its permit back with ``release()``.

Outcomes that arrive while the breaker is open (a request that started before it opened)
are counted but move nothing: only a trial may close an open breaker.

The breaker never sleeps or awaits: the open -> half-open step happens when the state is next
looked at, so it can be driven by a fake clock in tests and shared by asyncio code without
locks (everything runs on the event loop thread).
"""

from __future__ import annotations

import time
from collections.abc import Callable

CLOSED = "closed"
OPEN = "open"
HALF_OPEN = "half_open"


class Breaker:
    """Circuit breaker for one peer; see the module docstring."""

    def __init__(
        self,
        failures: int,
        reset_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[str, str], None] | None = None,
    ):
        if failures < 1:
            raise ValueError(f"breaker failures must be >= 1, got {failures}")
        if reset_s <= 0:
            raise ValueError(f"breaker reset_s must be > 0, got {reset_s}")
        self.failures_to_open = failures
        self.reset_s = reset_s
        self._clock = clock
        self._on_change = on_change
        self._state = CLOSED
        self._opened_at = 0.0
        self._trial_in_flight = False
        # Counters (read-only for callers).
        self.successes = 0
        self.failures = 0
        self.consecutive_failures = 0
        self.rejected = 0  # allow() answered False
        self.times_opened = 0

    # -- queries

    @property
    def state(self) -> str:
        """"closed", "open" or "half_open" (open turns half-open once reset_s has passed)."""
        self._refresh()
        return self._state

    def would_allow(self) -> bool:
        """Whether allow() would say yes now, without taking the half-open trial permit."""
        self._refresh()
        if self._state == CLOSED:
            return True
        if self._state == HALF_OPEN:
            return not self._trial_in_flight
        return False

    def retry_in(self) -> float:
        """Seconds until an open breaker turns half-open (0.0 when it is not open)."""
        self._refresh()
        if self._state != OPEN:
            return 0.0
        return max(0.0, self._opened_at + self.reset_s - self._clock())

    # -- request lifecycle

    def allow(self) -> bool:
        """May a request go to the peer now? In half-open this takes the one trial permit:
        the caller must then report record_success(), record_failure() or release()."""
        self._refresh()
        if self._state == CLOSED:
            return True
        if self._state == HALF_OPEN and not self._trial_in_flight:
            self._trial_in_flight = True
            return True
        self.rejected += 1
        return False

    def record_success(self) -> None:
        self._refresh()
        self.successes += 1
        if self._state == OPEN:
            return  # a late answer to a request sent before the breaker opened
        self.consecutive_failures = 0
        self._trial_in_flight = False
        self._set(CLOSED)

    def record_failure(self) -> None:
        """A failed request or timeout (or a failed health check)."""
        self._refresh()
        self.failures += 1
        self.consecutive_failures += 1
        if self._state == OPEN:
            return  # already open: a late failure does not push the reset further out
        if self._state == HALF_OPEN or self.consecutive_failures >= self.failures_to_open:
            self._open()

    def release(self) -> None:
        """Hand back a half-open trial permit without a verdict (the request was abandoned)."""
        self._trial_in_flight = False

    def half_open_now(self) -> bool:
        """Let an open breaker go half-open before reset_s (a health check passed).
        Returns True when that changed the state."""
        self._refresh()
        if self._state != OPEN:
            return False
        self._trial_in_flight = False
        self._set(HALF_OPEN)
        return True

    def snapshot(self) -> dict:
        """State and counters, for status endpoints and logs."""
        return {
            "state": self.state,
            "consecutive_failures": self.consecutive_failures,
            "successes": self.successes,
            "failures": self.failures,
            "rejected": self.rejected,
            "times_opened": self.times_opened,
            "retry_in_s": round(self.retry_in(), 3),
        }

    # -- internals

    def _open(self) -> None:
        self._opened_at = self._clock()
        self._trial_in_flight = False
        self.times_opened += 1
        self._set(OPEN)

    def _refresh(self) -> None:
        if self._state == OPEN and self._clock() >= self._opened_at + self.reset_s:
            self._trial_in_flight = False
            self._set(HALF_OPEN)

    def _set(self, state: str) -> None:
        old, self._state = self._state, state
        if old != state and self._on_change is not None:
            self._on_change(old, state)
