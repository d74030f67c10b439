"""The batching policy with hand-made requests and a fake clock: no engine, no event loop."""

from __future__ import annotations

from dataclasses import replace

import pytest

from edge_batcher.errors import Overloaded
from edge_batcher.scheduler.policy import (
    DEADLINE,
    DELAY,
    DRAIN,
    FULL,
    IDLE,
    MEMORY_RECHECK_S,
    Dispatch,
    PlanState,
    PolicySettings,
    Reject,
    Wait,
    cheapest_cover,
    decide,
)  # fmt: skip
from edge_batcher.scheduler.queues import ModelQueue, QueuedRequest
from edge_batcher.scheduler.timing import ExecTimeModel

SETTINGS = PolicySettings(preferred_batch_sizes=(2, 4, 8), max_batch_size=8, max_queue_delay_s=0.002)


def always_fits(size: int, seq_len: int) -> bool:
    return True


class FakeClock:
    def __init__(self, now: float = 100.0):
        self.now = now

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now


def linear_times(fixed: float = 1e-3, per_row: float = 1e-4) -> ExecTimeModel:
    model = ExecTimeModel()
    for s in (1, 2, 4, 8):
        model.observe(s, fixed + per_row * s)
    return model


def make_queue(capacity: int = 100, levels: int = 1) -> ModelQueue:
    return ModelQueue(capacity=capacity, priority_levels=levels)


def push(queue, clock, n=1, *, priority=0, timeout=1.0, rows=1, bucket=0, tag=None):
    reqs = []
    for i in range(n):
        r = QueuedRequest(priority=priority, arrival=clock.now, deadline=clock.now + timeout,
                          rows=rows, bucket=bucket, payload=(tag, i))
        queue.push(r)
        reqs.append(r)
    return reqs


def drain_plans(queue, clock, settings=SETTINGS, times=None, fits=always_fits, draining=False, company=1):
    """Call decide until it stops planning at this instant; return the plans."""
    plans = []
    times = times or linear_times()
    while True:
        d = decide(queue, clock.now, settings, times, fits, PlanState(draining=draining, company=company))
        if not isinstance(d, Dispatch):
            return plans, d
        plans.append(d.plan)


# ------------------------------------------------------------------ strict sizes and padding


def test_full_largest_size_dispatches_at_once():
    clock, q = FakeClock(), make_queue()
    push(q, clock, 8)
    d = decide(q, clock.now, SETTINGS, linear_times(), always_fits)
    assert isinstance(d, Dispatch)
    assert (d.plan.size, d.plan.rows, d.plan.reason, d.plan.padding) == (8, 8, FULL, 0)
    assert len(q) == 0


def test_twelve_waiting_become_eight_then_four_never_twelve_or_nine_plus_three():
    clock, q = FakeClock(), make_queue()
    push(q, clock, 12)
    clock.advance(0.003)  # past the queue delay: everything is due
    plans, _ = drain_plans(q, clock)
    assert [(p.size, p.rows) for p in plans] == [(8, 8), (4, 4)]
    assert all(p.padding == 0 for p in plans)


@pytest.mark.parametrize(
    "waiting, expected",
    [
        (1, [(2, 1)]),  # a lone request is padded to the smallest preferred size
        (2, [(2, 2)]),
        (3, [(4, 3)]),  # padding one row beats two engine calls (2 + 2)
        (5, [(8, 5)]),  # one padded 8 is cheaper than 4 + 2 with these costs
        (6, [(8, 6)]),
        (7, [(8, 7)]),
    ],
)
def test_sizes_are_always_preferred_sizes_with_padding(waiting, expected):
    clock, q = FakeClock(), make_queue()
    push(q, clock, waiting)
    clock.advance(0.003)
    plans, _ = drain_plans(q, clock)
    assert [(p.size, p.rows) for p in plans] == expected
    assert all(p.size in (2, 4, 8) for p in plans)


def test_padding_choice_follows_measured_costs():
    # When a size-8 batch is much slower than a 4 and a 2 together, 5 rows become 4 + 2(pad 1).
    times = ExecTimeModel()
    for size, seconds in ((2, 1e-3), (4, 1.2e-3), (8, 10e-3)):
        times.observe(size, seconds)
    clock, q = FakeClock(), make_queue()
    push(q, clock, 5)
    clock.advance(0.003)
    plans, _ = drain_plans(q, clock, times=times)
    assert [(p.size, p.rows) for p in plans] == [(4, 4), (2, 1)]


def test_a_request_that_found_the_model_idle_is_due_at_once_with_dispatch_when_idle():
    idle_first = PolicySettings((2, 4, 8), 8, 0.002, dispatch_when_idle=True)
    clock, q = FakeClock(), make_queue()
    (lone,) = push(q, clock)
    lone.found_idle = True
    d = decide(q, clock.now, idle_first, linear_times(), always_fits)
    assert isinstance(d, Dispatch)
    assert (d.plan.size, d.plan.rows, d.plan.reason, d.plan.requests) == (2, 1, IDLE, [lone])
    # Arrived while a batch ran (found_idle False): it waits for partners as before, ...
    (busy,) = push(q, clock)
    d = decide(q, clock.now, idle_first, linear_times(), always_fits, PlanState(busy=True))
    assert isinstance(d, Wait) and d.wake_at == pytest.approx(clock.now + 0.002)
    clock.advance(0.002)
    d = decide(q, clock.now, idle_first, linear_times(), always_fits, PlanState(busy=True))
    assert isinstance(d, Dispatch) and (d.plan.reason, d.plan.requests) == (DELAY, [busy])
    # ... and without the setting a request that found the model idle waits too.
    (waits,) = push(q, clock)
    waits.found_idle = True
    d = decide(q, clock.now, SETTINGS, linear_times(), always_fits)
    assert isinstance(d, Wait) and d.wake_at == pytest.approx(clock.now + 0.002)


def test_after_a_batch_of_n_an_idle_arrival_waits_for_n_not_for_the_delay():
    """Closed-loop clients come back about together: after a batch of 3 requests, the first to
    find the model idle waits for the other two (not for max_queue_delay_s, not for 8 rows);
    if they do not come, the queue delay still ends its wait."""
    idle_first = PolicySettings((2, 4, 8), 8, 0.002, dispatch_when_idle=True)
    clock, q = FakeClock(), make_queue()
    (first,) = push(q, clock)
    first.found_idle = True
    d = decide(q, clock.now, idle_first, linear_times(), always_fits, PlanState(company=3))
    assert isinstance(d, Wait) and d.wake_at == pytest.approx(clock.now + 0.002)
    clock.advance(0.0002)
    push(q, clock, 2)
    d = decide(q, clock.now, idle_first, linear_times(), always_fits, PlanState(company=3))
    assert isinstance(d, Dispatch) and (d.plan.size, d.plan.rows, d.plan.reason) == (4, 3, IDLE)
    (alone,) = push(q, clock)  # the company does not come: the delay ends the wait
    alone.found_idle = True
    clock.advance(0.002)
    d = decide(q, clock.now, idle_first, linear_times(), always_fits, PlanState(company=3))
    assert isinstance(d, Dispatch) and (d.plan.size, d.plan.rows, d.plan.reason) == (2, 1, DELAY)


def test_requests_queued_beside_an_idle_arrival_join_its_batch():
    """The runner plans an idle arrival one loop turn later: what arrived in that turn (a burst
    read at once) rides in the same batch, at the size that covers it."""
    idle_first = PolicySettings((2, 4, 8), 8, 0.002, dispatch_when_idle=True)
    clock, q = FakeClock(), make_queue()
    first, *rest = push(q, clock, 5)
    first.found_idle = True
    plans, after = drain_plans(q, clock, settings=idle_first)
    assert [(p.size, p.rows, p.reason) for p in plans] == [(8, 5, IDLE)]
    assert isinstance(after, Wait) and after.wake_at is None and len(q) == 0


def test_the_rest_of_a_company_split_by_the_cover_goes_at_once():
    """When a batch of 8 costs more than 4 + 2 (a CPU model, or one slow measurement), five
    requests of an idle company go as 4 + 2, both at once: the fifth must not wait the queue
    delay for partners that already came (CI saw it wait the whole 5 s)."""
    idle_first = PolicySettings((2, 4, 8), 8, 5.0, dispatch_when_idle=True)
    times = linear_times()
    for size, seconds in ((2, 0.003), (4, 0.005), (8, 0.05)):
        times.observe(size, seconds)
    assert cheapest_cover(5, [2, 4, 8], times) == [4, 2]
    clock, q = FakeClock(), make_queue()
    first, *rest = push(q, clock, 5, timeout=20.0)
    first.found_idle = True
    plans, after = drain_plans(q, clock, settings=idle_first, times=times, company=5)
    assert [(p.size, p.rows, p.reason) for p in plans] == [(4, 4, IDLE), (2, 1, IDLE)]
    assert isinstance(after, Wait) and len(q) == 0
    # A request that arrives later is no part of that company: it waits as before.
    (late,) = push(q, clock, timeout=20.0)
    d = decide(q, clock.now, idle_first, times, always_fits, PlanState(company=5, busy=True))
    assert isinstance(d, Wait) and d.wake_at == pytest.approx(clock.now + 5.0)


def test_cheapest_cover_prefers_exact_fits_of_large_sizes():
    times = linear_times()
    assert cheapest_cover(12, [2, 4, 8], times) == [8, 4]
    assert cheapest_cover(16, [2, 4, 8], times) == [8, 8]
    assert cheapest_cover(1, [2, 4, 8], times) == [2]


def test_multi_row_requests_take_several_slots():
    clock, q = FakeClock(), make_queue()
    push(q, clock, 3, rows=3)  # 9 rows in 3 requests
    clock.advance(0.003)
    plans, _ = drain_plans(q, clock)
    # Rows are never split across batches: 3+3 go together (padded to 8), then 3 (padded to 4).
    assert [(p.size, p.rows, len(p.requests)) for p in plans] == [(8, 6, 2), (4, 3, 1)]


# ------------------------------------------------------------------ waiting: delay and deadline


def test_waits_for_the_queue_delay_then_dispatches():
    clock, q = FakeClock(), make_queue()
    push(q, clock, 3)
    d = decide(q, clock.now, SETTINGS, linear_times(), always_fits)
    assert isinstance(d, Wait)
    assert d.wake_at == pytest.approx(clock.now + 0.002)
    clock.advance(0.001)
    assert isinstance(decide(q, clock.now, SETTINGS, linear_times(), always_fits), Wait)
    clock.advance(0.001)
    d = decide(q, clock.now, SETTINGS, linear_times(), always_fits)
    assert isinstance(d, Dispatch) and d.plan.reason == DELAY and d.plan.size == 4


def test_delay_counts_from_the_oldest_request():
    clock, q = FakeClock(), make_queue()
    push(q, clock, 1)
    clock.advance(0.0015)
    push(q, clock, 1)
    d = decide(q, clock.now, SETTINGS, linear_times(), always_fits)
    assert isinstance(d, Wait) and d.wake_at == pytest.approx(100.002)
    clock.advance(0.0005)
    d = decide(q, clock.now, SETTINGS, linear_times(), always_fits)
    assert isinstance(d, Dispatch) and d.plan.rows == 2


def test_deadline_minus_execution_time_cuts_the_wait_short():
    settings = PolicySettings((2, 4, 8), 8, max_queue_delay_s=0.050)
    times = linear_times(fixed=0.004, per_row=0.0)  # 4 ms at every size
    clock, q = FakeClock(), make_queue()
    push(q, clock, 1, timeout=0.010)  # deadline in 10 ms, run takes 4 ms: must go by +6 ms
    d = decide(q, clock.now, settings, times, always_fits)
    assert isinstance(d, Wait) and d.wake_at == pytest.approx(clock.now + 0.006)
    clock.advance(0.006)
    d = decide(q, clock.now, settings, times, always_fits)
    assert isinstance(d, Dispatch) and d.plan.reason == DEADLINE


def test_a_later_urgent_request_moves_the_wake_time_earlier():
    settings = PolicySettings((2, 4, 8), 8, max_queue_delay_s=0.050)
    times = linear_times(fixed=0.001, per_row=0.0)
    clock, q = FakeClock(), make_queue()
    push(q, clock, 1, timeout=1.0)
    first = decide(q, clock.now, settings, times, always_fits).wake_at
    push(q, clock, 1, timeout=0.003)
    second = decide(q, clock.now, settings, times, always_fits).wake_at
    assert first == pytest.approx(clock.now + 0.050)
    assert second == pytest.approx(clock.now + 0.002)


def test_exec_time_model_learns_and_interpolates():
    times = ExecTimeModel(alpha=0.5)
    assert times.estimate(4) == pytest.approx(1e-3 + 4e-4)  # prior before any measurement
    times.observe(2, 0.002)
    times.observe(8, 0.008)
    assert times.estimate(4) == pytest.approx(0.004)  # linear between measured sizes
    times.observe(8, 0.010)
    assert times.estimate(8) == pytest.approx(0.009)  # EWMA


# ------------------------------------------------------------------ priorities, expiry, capacity


def test_higher_priority_requests_go_first():
    clock, q = FakeClock(), make_queue(levels=3)
    low = push(q, clock, 6, priority=0, tag="low")
    clock.advance(0.0001)
    high = push(q, clock, 4, priority=2, tag="high")
    plans, _ = drain_plans(q, clock)  # 10 rows: a full 8 now
    assert len(plans) == 1 and plans[0].size == 8
    assert plans[0].requests[:4] == high  # all four high ones, though they arrived later
    assert plans[0].requests[4:] == low[:4]  # then the oldest low ones


def test_expired_requests_are_removed_before_planning():
    clock, q = FakeClock(), make_queue()
    doomed = push(q, clock, 2, timeout=0.001)
    kept = push(q, clock, 1, timeout=1.0)
    clock.advance(0.0015)
    expired = q.expire(clock.now)
    assert expired == doomed
    assert len(q) == 1
    clock.advance(0.003)
    plans, _ = drain_plans(q, clock)
    assert [p.requests for p in plans] == [kept]


def test_next_deadline_skips_taken_requests():
    clock, q = FakeClock(), make_queue()
    push(q, clock, 8, timeout=0.5)
    push(q, clock, 1, timeout=2.0)
    drain_plans(q, clock)  # the 8 are taken
    assert q.next_deadline() == pytest.approx(clock.now + 2.0)


def test_full_queue_rejects_at_once():
    clock, q = FakeClock(), make_queue(capacity=3)
    push(q, clock, 3)
    with pytest.raises(Overloaded, match="queue full: 3 requests waiting"):
        push(q, clock, 1)
    assert len(q) == 3


def test_drain_dispatches_everything_now():
    clock, q = FakeClock(), make_queue()
    push(q, clock, 3)
    plans, d = drain_plans(q, clock, draining=True)
    assert [(p.size, p.reason) for p in plans] == [(4, DRAIN)]
    assert len(q) == 0


# ------------------------------------------------------------------ buckets and admission


def test_requests_only_batch_within_their_length_bucket():
    clock, q = FakeClock(), make_queue()
    short = push(q, clock, 3, bucket=16, tag="short")
    long_ = push(q, clock, 2, bucket=64, tag="long")
    clock.advance(0.003)
    plans, _ = drain_plans(q, clock)
    assert sorted((p.bucket, p.size, p.rows) for p in plans) == [(16, 4, 3), (64, 2, 2)]
    by_bucket = {p.bucket: p.requests for p in plans}
    assert by_bucket[16] == short and by_bucket[64] == long_


def test_a_full_bucket_goes_while_another_waits():
    clock, q = FakeClock(), make_queue()
    push(q, clock, 1, bucket=16)
    push(q, clock, 8, bucket=32)
    plans, d = drain_plans(q, clock)
    assert [(p.bucket, p.size, p.reason) for p in plans] == [(32, 8, FULL)]
    assert d.wake_at == pytest.approx(clock.now + 0.002)


def test_fits_hook_limits_the_size():
    clock, q = FakeClock(), make_queue()
    push(q, clock, 8)
    plans, _ = drain_plans(q, clock, fits=lambda size, seq: size <= 4)
    # 4 is now the largest allowed size, so 4 waiting rows are already "full".
    assert [(p.size, p.reason) for p in plans] == [(4, FULL), (4, FULL)]


def test_fits_hook_sees_the_bucket_length():
    seen = []

    def fits(size, seq_len):
        seen.append((size, seq_len))
        return size * seq_len <= 128

    clock, q = FakeClock(), make_queue()
    push(q, clock, 8, bucket=32)
    plans, _ = drain_plans(q, clock, fits=fits)
    assert {p.size for p in plans} == {4}
    assert (8, 32) in seen


def test_nothing_fits_rejects_instead_of_hanging():
    clock, q = FakeClock(), make_queue()
    reqs = push(q, clock, 2)
    d = decide(q, clock.now, SETTINGS, linear_times(), lambda size, seq: False)
    assert isinstance(d, Reject) and d.requests == reqs
    assert "no batch size" in d.reason
    assert len(q) == 0


def test_what_fits_once_others_give_memory_back_waits_for_it_and_runs():
    """Nothing fits now because other models hold the memory (a generator's KV cache): the
    requests wait, looked at again every MEMORY_RECHECK_S, and run once it comes back; what would
    not fit even then is refused as before."""
    clock, q = FakeClock(), make_queue()
    reqs = push(q, clock, 2)
    held_by_others = {"now": True}
    fits_now = lambda size, seq: not held_by_others["now"]  # noqa: E731
    state = PlanState(fits_later=lambda size, seq: size <= 4)
    d = decide(q, clock.now, SETTINGS, linear_times(), fits_now, state)
    assert isinstance(d, Wait) and d.wake_at == pytest.approx(clock.now + MEMORY_RECHECK_S)
    assert d.waits_for_memory  # the runner stands in the budget's line
    assert len(q) == 2  # nothing refused, nothing taken
    clock.advance(MEMORY_RECHECK_S)
    held_by_others["now"] = False
    d = decide(q, clock.now, SETTINGS, linear_times(), fits_now, state)
    assert isinstance(d, Dispatch) and d.plan.requests == reqs and not d.waits_for_memory
    push(q, clock, 2)
    never = PlanState(fits_later=lambda size, seq: False)  # more than the whole budget
    assert isinstance(decide(q, clock.now, SETTINGS, linear_times(), lambda size, seq: False, never), Reject)


def test_max_batch_size_caps_preferred_sizes():
    settings = PolicySettings((2, 4, 8), max_batch_size=4, max_queue_delay_s=0.002)
    clock, q = FakeClock(), make_queue()
    push(q, clock, 8)
    plans, _ = drain_plans(q, clock, settings=settings)
    assert [p.size for p in plans] == [4, 4]


# ------------------------------------------------------------------ offload to a peer

from edge_batcher.scheduler.policy import (  # noqa: E402
    BACKLOG,
    DOES_NOT_FIT,
    OffloadView,
    sends_oversized_to_peer,
)  # fmt: skip

PEER = OffloadView(peer_available=True, peer_latency_s=0.005)


def test_what_fits_nowhere_locally_goes_to_the_peer():
    clock, q = FakeClock(), make_queue()
    push(q, clock, 5)
    d = decide(q, clock.now, SETTINGS, linear_times(), lambda size, seq: False, PlanState(offload=PEER))
    assert isinstance(d, Dispatch) and (d.plan.target, d.plan.reason, d.plan.rows) == ("peer", DOES_NOT_FIT, 5)
    # While local batches are in flight their memory comes back: wait instead.
    push(q, clock, 1)
    d = decide(q, clock.now, SETTINGS, linear_times(), lambda size, seq: False, PlanState(busy=True, offload=PEER))
    assert isinstance(d, Wait)


def test_a_backlog_that_would_miss_its_deadline_goes_to_the_peer():
    clock, q = FakeClock(), make_queue()
    push(q, clock, 8, timeout=0.050)
    # Local would start in 200 ms: too late for a 50 ms deadline; the peer answers in 5 ms.
    d = decide(q, clock.now, SETTINGS, linear_times(), always_fits, PlanState(busy=True, busy_s=0.200, offload=PEER))
    assert isinstance(d, Dispatch) and (d.plan.target, d.plan.reason) == ("peer", BACKLOG)
    # Same backlog, but the peer is slower than the deadline: stay local.
    push(q, clock, 8, timeout=0.050)
    slow_peer = OffloadView(peer_available=True, peer_latency_s=0.100)
    d = decide(q, clock.now, SETTINGS, linear_times(), always_fits,
               PlanState(busy=True, busy_s=0.200, offload=slow_peer))
    assert isinstance(d, Dispatch) and d.plan.target == "local"


def test_without_a_free_local_slot_only_peer_plans_are_made():
    clock, q = FakeClock(), make_queue()
    push(q, clock, 8, timeout=1.0)  # full, but no local slot and the deadline is far
    d = decide(q, clock.now, SETTINGS, linear_times(), always_fits,
               PlanState(busy=True, local_free=False, busy_s=0.010, offload=PEER))
    assert isinstance(d, Wait)
    # It looks again at half the time left (a busy engine's wait can grow), or earlier when
    # waiting any longer for a local slot would miss the deadline.
    assert d.wake_at == pytest.approx(clock.now + 0.5)
    push(q, clock, 1, timeout=0.012)
    d = decide(q, clock.now, SETTINGS, linear_times(), always_fits,
               PlanState(busy=True, local_free=False, busy_s=0.010,
                         offload=OffloadView(peer_available=True, peer_latency_s=0.5)))
    assert d.wake_at == pytest.approx(clock.now + 0.012 - linear_times().estimate(8) - 0.010)
    d = decide(q, clock.now, SETTINGS, linear_times(), always_fits, PlanState(busy=True, local_free=False))
    assert isinstance(d, Wait) and d.wake_at is None  # no peer: the runner wakes it when a slot frees


def test_requests_whose_offload_failed_are_retried_locally_not_sent_back():
    clock, q = FakeClock(), make_queue()
    for r in push(q, clock, 8, timeout=0.050):
        r.local_only = True
    d = decide(q, clock.now, SETTINGS, linear_times(), always_fits, PlanState(busy=True, busy_s=0.200, offload=PEER))
    assert isinstance(d, Dispatch) and d.plan.target == "local"


def test_requests_larger_than_the_local_engine():
    assert sends_oversized_to_peer(12, SETTINGS, PEER)
    assert not sends_oversized_to_peer(12, SETTINGS, OffloadView(peer_available=False))
    assert not sends_oversized_to_peer(100, SETTINGS, PEER)  # beyond what one peer request carries


def test_a_multi_row_head_request_is_never_left_behind_by_a_smaller_cover():
    # Found with real timings: a fast measured size 4 made size 2 look almost free, the cover
    # became 2 + 2, and a 4-row request could not be taken by a batch of 2.
    times = ExecTimeModel()
    times.observe(4, 0.0001)
    clock, q = FakeClock(), make_queue()
    (req,) = push(q, clock, 1, rows=4)
    clock.advance(0.003)
    plans, _ = drain_plans(q, clock, times=times)
    assert [(p.size, p.rows, p.requests) for p in plans] == [(4, 4, [req])]


def test_extrapolated_times_stay_positive_and_ordered():
    times = ExecTimeModel()
    times.observe(4, 0.0001)
    assert 0 < times.estimate(2) < times.estimate(4) < times.estimate(8)


# ------------------------------------------------------------------ the runner's rules, as pure functions

from edge_batcher.scheduler.policy import (  # noqa: E402
    OOM_SPLIT,
    TOO_LARGE,
    Reason,
    Target,
    capped_after_oom,
    decision_may_change,
    oom_split,
    regrown,
    retries_locally,
)


def test_reasons_and_targets_keep_their_string_values():
    assert [str(r) for r in (FULL, DELAY, IDLE, DEADLINE, DRAIN, OOM_SPLIT)] == [
        "full", "delay", "idle", "deadline", "drain", "oom_split"]
    assert f"{Reason.REMOTE_ONLY}/ok" == "remote_only/ok" and Target.PEER == "peer"


def test_an_arrival_that_fills_its_bucket_or_falls_due_first_changes_the_plan():
    clock = FakeClock()
    (r,) = push(make_queue(), clock, timeout=1.0)
    times = linear_times()
    rule = dict(slot_free=True, has_peer=False)
    assert decision_may_change(r, 8, SETTINGS, times, timer_at=clock.now + 0.5, **rule)  # full
    assert decision_may_change(r, 1, SETTINGS, times, timer_at=None, **rule)  # no timer set
    # Due by its queue delay (2 ms) before a timer at 5 ms, not before one at 1 ms.
    assert decision_may_change(r, 1, SETTINGS, times, timer_at=clock.now + 0.005, **rule)
    assert not decision_may_change(r, 1, SETTINGS, times, timer_at=clock.now + 0.001, **rule)
    # No free slot and no peer: only its expiry can matter.
    assert not decision_may_change(r, 8, SETTINGS, times, slot_free=False, has_peer=False, timer_at=clock.now + 0.5)
    assert decision_may_change(r, 8, SETTINGS, times, slot_free=False, has_peer=False, timer_at=clock.now + 2.0)


def test_a_batch_out_of_memory_splits_in_halves_at_smaller_sizes():
    clock = FakeClock()
    reqs = push(make_queue(), clock, 8)
    parts, failed = oom_split(reqs, 8, (2, 4, 8))
    assert failed == [] and [(p, rows, size) for p, rows, size in parts] == [(reqs[:4], 4, 4), (reqs[4:], 4, 4)]
    # Five rows: halves of 3 and 2 rows run at 4 and 2.
    parts, _ = oom_split(reqs[:5], 8, (2, 4, 8))
    assert [(rows, size) for _, rows, size in parts] == [(3, 4), (2, 2)]


def test_what_cannot_get_smaller_after_out_of_memory_fails():
    clock = FakeClock()
    (one,) = push(make_queue(), clock, rows=4)
    assert oom_split([one], 4, (2, 4)) == ([], [one])
    big = push(make_queue(), clock, 2, rows=4)  # two 4-row requests: each half still needs 4
    parts, failed = oom_split(big, 4, (2, 4))
    assert parts == [] and failed == big


def test_a_failed_offload_retries_locally_only_when_it_may_and_has_time():
    times = linear_times()
    assert retries_locally(BACKLOG, 0.5, times, SETTINGS)
    assert not retries_locally(BACKLOG, times.estimate(2) / 2, times, SETTINGS)  # no time left
    assert retries_locally(DOES_NOT_FIT, 0.5, times, SETTINGS)  # memory may be free by then
    assert not retries_locally(TOO_LARGE, 0.5, times, SETTINGS)


def test_warm_up_out_of_memory_caps_the_sizes_below_it():
    capped = capped_after_oom(SETTINGS, 8)
    assert capped is not None and (capped.max_batch_size, capped.preferred_batch_sizes) == (4, (2, 4, 8))
    assert capped_after_oom(SETTINGS, 2) is None


def test_sizes_shrunk_for_memory_grow_back_one_step_at_a_time_up_to_the_largest_before():
    two = replace(SETTINGS, max_batch_size=2)
    four = regrown(two, 8)
    assert four is not None and four.max_batch_size == 4
    eight = regrown(four, 8)
    assert eight is not None and eight.max_batch_size == 8
    assert regrown(eight, 8) is None
    assert regrown(four, 4) is None  # never above the largest before the shrink
    # a largest size that is no preferred size (6 of 2/4/8) comes back as itself
    six = regrown(four, 6)
    assert six is not None and six.max_batch_size == 6 and six.preferred_batch_sizes == (2, 4, 8)
