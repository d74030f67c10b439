"""The per-peer circuit breaker, driven by a fake clock: every state and transition."""

from __future__ import annotations

import pytest

from edge_batcher.offload.breaker import CLOSED, HALF_OPEN, OPEN, Breaker


class FakeClock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, s: float) -> None:
        self.t += s


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def make(clock, failures=3, reset_s=10.0):
    changes: list[tuple[str, str]] = []
    b = Breaker(failures, reset_s, clock=clock, on_change=lambda old, new: changes.append((old, new)))
    return b, changes


def open_breaker(b: Breaker) -> None:
    for _ in range(b.failures_to_open):
        assert b.allow()
        b.record_failure()
    assert b.state == OPEN


def test_starts_closed_and_allows_everything(clock):
    b, changes = make(clock)
    assert b.state == CLOSED
    assert all(b.allow() for _ in range(100))
    assert b.would_allow()
    assert b.retry_in() == 0.0
    assert changes == []


def test_opens_after_exactly_n_consecutive_failures(clock):
    b, changes = make(clock, failures=3)
    b.record_failure()
    b.record_failure()
    assert b.state == CLOSED and b.allow()
    b.record_failure()
    assert b.state == OPEN
    assert changes == [(CLOSED, OPEN)]
    assert b.times_opened == 1 and b.consecutive_failures == 3


def test_a_success_resets_the_consecutive_count(clock):
    b, _ = make(clock, failures=3)
    for _ in range(5):
        b.record_failure()
        b.record_failure()
        b.record_success()
    assert b.state == CLOSED
    assert b.failures == 10 and b.successes == 5 and b.consecutive_failures == 0


def test_one_failure_opens_when_n_is_1(clock):
    b, _ = make(clock, failures=1)
    b.record_failure()
    assert b.state == OPEN


def test_open_rejects_until_reset_then_half_open(clock):
    b, changes = make(clock, failures=2, reset_s=10.0)
    open_breaker(b)
    assert not b.allow() and not b.would_allow()
    assert b.rejected == 1
    assert b.retry_in() == pytest.approx(10.0)
    clock.advance(9.999)
    assert b.state == OPEN and not b.allow()
    assert b.retry_in() == pytest.approx(0.001)
    clock.advance(0.001)
    assert b.state == HALF_OPEN
    assert changes == [(CLOSED, OPEN), (OPEN, HALF_OPEN)]
    assert b.retry_in() == 0.0


def test_half_open_allows_exactly_one_trial_at_a_time(clock):
    b, _ = make(clock)
    open_breaker(b)
    clock.advance(10)
    assert b.would_allow()
    assert b.would_allow()  # a query takes no permit
    assert b.allow()
    assert not b.allow() and not b.allow()
    assert not b.would_allow()
    assert b.state == HALF_OPEN


def test_trial_success_closes(clock):
    b, changes = make(clock)
    open_breaker(b)
    clock.advance(10)
    assert b.allow()
    b.record_success()
    assert b.state == CLOSED and b.consecutive_failures == 0
    assert all(b.allow() for _ in range(10))
    assert changes == [(CLOSED, OPEN), (OPEN, HALF_OPEN), (HALF_OPEN, CLOSED)]


def test_trial_failure_reopens_for_another_reset_period(clock):
    b, changes = make(clock, reset_s=10.0)
    open_breaker(b)
    clock.advance(15)
    assert b.allow()
    clock.advance(2)
    b.record_failure()
    assert b.state == OPEN and b.times_opened == 2
    clock.advance(9.5)
    assert b.state == OPEN  # the new period counts from the trial's failure
    clock.advance(0.5)
    assert b.state == HALF_OPEN
    assert changes == [(CLOSED, OPEN), (OPEN, HALF_OPEN), (HALF_OPEN, OPEN), (OPEN, HALF_OPEN)]


def test_release_hands_the_trial_permit_back(clock):
    b, _ = make(clock)
    open_breaker(b)
    clock.advance(10)
    assert b.allow()
    assert not b.allow()
    b.release()
    assert b.state == HALF_OPEN
    assert b.allow()


def test_late_outcomes_while_open_move_nothing(clock):
    b, changes = make(clock, reset_s=10.0)
    open_breaker(b)
    clock.advance(5)
    b.record_success()  # a request sent before it opened
    assert b.state == OPEN
    b.record_failure()
    assert b.state == OPEN
    assert b.retry_in() == pytest.approx(5.0)  # not pushed further out
    assert b.successes == 1 and b.failures == 4
    assert changes == [(CLOSED, OPEN)]


def test_half_open_now_skips_the_rest_of_the_wait(clock):
    b, changes = make(clock, reset_s=60.0)
    assert not b.half_open_now()  # closed: nothing to do
    open_breaker(b)
    clock.advance(1)
    assert b.half_open_now()
    assert b.state == HALF_OPEN
    assert not b.half_open_now()  # already half-open
    assert b.allow() and not b.allow()
    b.record_success()
    assert b.state == CLOSED
    assert changes == [(CLOSED, OPEN), (OPEN, HALF_OPEN), (HALF_OPEN, CLOSED)]


def test_failure_in_half_open_without_a_trial_reopens(clock):
    """A failed health check while half-open (no trial in flight) counts too."""
    b, _ = make(clock)
    open_breaker(b)
    clock.advance(10)
    assert b.state == HALF_OPEN
    b.record_failure()
    assert b.state == OPEN


def test_success_in_half_open_without_a_trial_closes(clock):
    b, _ = make(clock)
    open_breaker(b)
    b.half_open_now()
    b.record_success()
    assert b.state == CLOSED


def test_reopen_after_closing_needs_n_fresh_failures(clock):
    b, _ = make(clock, failures=3)
    open_breaker(b)
    clock.advance(10)
    assert b.allow()
    b.record_success()
    b.record_failure()
    b.record_failure()
    assert b.state == CLOSED
    b.record_failure()
    assert b.state == OPEN and b.times_opened == 2


def test_snapshot_reports_state_and_counters(clock):
    b, _ = make(clock, failures=2, reset_s=4.0)
    b.allow()
    b.record_success()
    open_breaker(b)
    b.allow()
    clock.advance(1)
    assert b.snapshot() == {
        "state": OPEN, "consecutive_failures": 2, "successes": 1, "failures": 2,
        "rejected": 1, "times_opened": 1, "retry_in_s": 3.0,
    }


def test_no_callback_is_fine(clock):
    b = Breaker(1, 1.0, clock=clock)
    b.record_failure()
    clock.advance(1)
    assert b.state == HALF_OPEN


@pytest.mark.parametrize("failures, reset_s", [(0, 1.0), (-1, 1.0), (1, 0.0), (1, -2.0)])
def test_rejects_impossible_settings(failures, reset_s):
    with pytest.raises(ValueError):
        Breaker(failures, reset_s)
