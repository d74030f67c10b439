"""The batching policy: every scheduling rule, as pure synchronous functions of plain data.

`decide()` takes a model's queue, a clock reading and a frozen `PlanState` (what the runner
knows right now: draining, batches in flight, a free local slot, the peer's state) and returns
one of `Dispatch`, `Wait` or `Reject`. It is deterministic and never awaits; it takes the
requests it plans out of the queue. The other rules the runner applies are here too: whether an
arrival can change the plan (`decision_may_change`), how a batch splits after running out of
memory (`oom_split`), whether a request whose offload failed retries locally
(`retries_locally`), and the size cap after warm-up runs out of memory (`capped_after_oom`) or
the memory budget is overdrawn, and its way back (`regrown`).
The README ("How batches are formed") states the rules with examples; docs/architecture.md
("How a request flows") where the runner applies them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum

from .queues import BucketQueue, ModelQueue, QueuedRequest
from .timing import ExecTimeModel

FitsHook = Callable[[int, int], bool]  # (batch_size, seq_len) -> bool
# Nothing fits while other models hold the memory: the budget announces their releases to the
# runner (on_memory_back), but not memory freed outside it (the probe's free figure), so it also
# looks again this often (the requests' deadlines still bound the wait).
MEMORY_RECHECK_S = 0.02


class Reason(str, Enum):
    """Why a batch was dispatched (metrics label `reason`, stats `dispatch_reasons` and
    `offloaded`), or why requests were rejected (DOES_NOT_FIT)."""

    FULL = "full"
    DELAY = "delay"
    IDLE = "idle"  # it found the model idle, and its company came (dispatch_when_idle)
    DEADLINE = "deadline"
    DRAIN = "drain"
    OOM_SPLIT = "oom_split"
    # Why a batch goes to a peer (also the `reason` of offloaded_requests_total).
    DOES_NOT_FIT = "does_not_fit"
    TOO_LARGE = "too_large"
    BACKLOG = "backlog"
    # Not a policy decision: a model served by peers only (offload/remote_model.py) counts its
    # requests under this reason.
    REMOTE_ONLY = "remote_only"

    def __str__(self) -> str:  # the plain value in metric labels, logs and f-strings
        return self.value


class Target(str, Enum):
    """Where a batch runs (metrics label `target`)."""

    LOCAL = "local"
    PEER = "peer"

    def __str__(self) -> str:
        return self.value


# The names tests and callers have used since the reasons were strings.
FULL, DELAY, DEADLINE, DRAIN, OOM_SPLIT = Reason.FULL, Reason.DELAY, Reason.DEADLINE, Reason.DRAIN, Reason.OOM_SPLIT
IDLE = Reason.IDLE
DOES_NOT_FIT, TOO_LARGE, BACKLOG, REMOTE_ONLY = (
    Reason.DOES_NOT_FIT, Reason.TOO_LARGE, Reason.BACKLOG, Reason.REMOTE_ONLY
)


@dataclass(frozen=True)
class PolicySettings:
    preferred_batch_sizes: tuple[int, ...]
    max_batch_size: int
    max_queue_delay_s: float
    # A request that found the model idle waits only for the company the last batch had (one
    # request: none), not for max_queue_delay_s; requests arriving while a batch runs batch as ever.
    dispatch_when_idle: bool = False


@dataclass
class BatchPlan:
    requests: list[QueuedRequest]
    rows: int  # real rows in the batch
    size: int  # the batch size the engine runs (rows + padding)
    bucket: int
    reason: Reason
    target: Target = Target.LOCAL

    @property
    def padding(self) -> int:
        return self.size - self.rows


@dataclass(frozen=True)
class OffloadView:
    """What the policy knows about offloading at this instant (plain data from the runner)."""

    peer_available: bool  # a peer is healthy and its breaker lets requests through
    peer_latency_s: float | None = None  # measured round trip; None: not measured yet
    on_backlog: bool = True  # offload when the local backlog would miss deadlines
    max_rows: int = 64  # rows per request sent to a peer


NO_OFFLOAD = OffloadView(peer_available=False, on_backlog=False)


@dataclass(frozen=True)
class PlanState:
    """The runner's state that `decide` plans with, at one instant."""

    draining: bool = False  # dispatch everything now
    busy: bool = False  # batches are in flight locally (their memory comes back)
    local_free: bool = True  # a local batch slot is free now; without one only peer plans are made
    busy_s: float = 0.0  # estimated seconds until a batch dispatched now would start locally
    offload: OffloadView = NO_OFFLOAD
    company: int = 1  # requests in the last local batch: how many to expect back after it
    # Whether a size would fit once the memory reserved now comes back (other models' batches, a
    # generator's KV cache): None, when the budget does not say (no memory admission).
    fits_later: FitsHook | None = None


@dataclass(frozen=True)
class Dispatch:
    """Run `plan` now; call `decide` again at `wake_at` (now: another batch may be due)."""

    plan: BatchPlan
    wake_at: float | None = None
    waits_for_memory: bool = False  # another bucket waits for memory others hold (see Wait)


@dataclass(frozen=True)
class Wait:
    """Nothing to dispatch now; call `decide` again at `wake_at` (None: when something changes).
    `waits_for_memory`: a bucket's requests wait for memory others hold (PlanState.fits_later),
    so the runner stands in the budget's line for it."""

    wake_at: float | None = None
    waits_for_memory: bool = False


@dataclass(frozen=True)
class Reject:
    """These requests cannot run anywhere: answer them with an error of `kind`."""

    requests: list[QueuedRequest] = field(default_factory=list)
    kind: Reason = Reason.DOES_NOT_FIT
    reason: str = ""
    wake_at: float | None = None  # always None: the runner plans again after answering them


Decision = Dispatch | Wait | Reject


def _local_sizes(settings: PolicySettings) -> list[int]:
    return [s for s in settings.preferred_batch_sizes if s <= settings.max_batch_size]


def allowed_sizes(settings: PolicySettings, bucket: int, fits: FitsHook) -> list[int]:
    return [s for s in _local_sizes(settings) if fits(s, bucket)]


def cheapest_cover(rows: int, sizes: list[int], exec_time: ExecTimeModel) -> list[int]:
    """Sizes (largest first) covering `rows` with the least total estimated execution time."""
    cost = [0.0] + [float("inf")] * rows
    choice = [0] * (rows + 1)
    for k in range(1, rows + 1):
        for s in sizes:
            c = exec_time.estimate(s) + cost[max(0, k - s)]
            # Ties go to the larger size: fewer engine calls for the same estimated time.
            if c < cost[k] - 1e-12 or (abs(c - cost[k]) <= 1e-12 and s > choice[k]):
                cost[k], choice[k] = c, s
    cover, k = [], rows
    while k > 0:
        cover.append(choice[k])
        k = max(0, k - choice[k])
    return sorted(cover, reverse=True)


def sends_oversized_to_peer(rows: int, settings: PolicySettings, offload: OffloadView) -> bool:
    """A request with more rows than the local engine takes goes to a peer when one can take
    it in one request; otherwise it is refused at submit."""
    return rows > settings.max_batch_size and offload.peer_available and rows <= offload.max_rows


def decide(
    queue: ModelQueue,
    now: float,
    settings: PolicySettings,
    exec_time: ExecTimeModel,
    fits: FitsHook,
    state: PlanState = PlanState(),
) -> Decision:
    """Plan the next batch to dispatch, say when to look again, or reject what cannot run.
    Takes planned and rejected requests out of the queue (expired ones must be removed by the
    caller with queue.expire(now) first). Synchronous and deterministic."""
    due: list[tuple[int, float, BucketQueue, Reason, list[int]]] = []
    wake_at: float | None = None
    waits_for_memory = False
    offload = state.offload
    peer = offload.peer_available
    for bq in queue.nonempty_buckets():
        sizes = allowed_sizes(settings, bq.bucket, fits)
        if not sizes and state.busy:
            continue  # memory held by batches in flight comes back when they finish
        if not sizes:
            if peer and not _head_is_local_only(bq):
                return _peer_plan(queue, bq, offload, Reason.DOES_NOT_FIT)
            if state.fits_later is not None and any(state.fits_later(s, bq.bucket) for s in _local_sizes(settings)):
                recheck = now + MEMORY_RECHECK_S  # held by others now: wait for it, do not refuse
                wake_at = recheck if wake_at is None else min(wake_at, recheck)
                waits_for_memory = True
                continue
            rejected = queue.take(bq.bucket, bq.rows)
            return Reject(rejected, Reason.DOES_NOT_FIT,
                          f"no batch size of {list(settings.preferred_batch_sizes)} fits (bucket {bq.bucket})")
        if state.draining:
            reason, at = Reason.DRAIN, now
        elif bq.rows >= sizes[-1]:
            reason, at = Reason.FULL, now
        else:
            reason, at = _due_time(bq, sizes, settings, exec_time, state.company)
        if peer and offload.on_backlog and not state.draining and not _head_is_local_only(bq):
            # Backlog: would the requests at the head miss their deadline locally (no slot
            # soon enough), while the peer's measured round trip would meet it?
            run_size = sizes[-1] if bq.rows >= sizes[-1] else _smallest_at_least(bq.rows, sizes)
            deadline = min(r.deadline for r in bq.in_order())
            local_done = now + state.busy_s + exec_time.estimate(run_size)
            peer_done = now + (offload.peer_latency_s or 0.0)
            if local_done > deadline and peer_done <= deadline and (at <= now or not state.local_free):
                return _peer_plan(queue, bq, offload, Reason.BACKLOG)
            if not state.local_free:
                # Look again when waiting for a local slot would start to miss the deadline,
                # and at half the time left at the latest: a stuck engine's wait keeps growing.
                at = min(deadline - exec_time.estimate(run_size) - state.busy_s,
                         now + max((deadline - now) / 2, 0.001))
                wake_at = at if wake_at is None else min(wake_at, at)
                continue
        if not state.local_free:
            continue  # the runner wakes us when a slot frees
        if at <= now:
            due.append((-bq.top_priority(), bq.oldest_arrival(), bq, reason, sizes))
        elif wake_at is None or at < wake_at:
            wake_at = at
    if not due:
        return Wait(wake_at, waits_for_memory)
    due.sort(key=lambda d: (d[0], d[1]))
    _, _, bq, reason, sizes = due[0]
    size = sizes[-1] if bq.rows >= sizes[-1] else cheapest_cover(bq.rows, sizes, exec_time)[0]
    # Requests are never split: the batch must hold at least the head request's rows.
    size = max(size, _smallest_at_least(next(bq.in_order()).rows, sizes))
    # An idle arrival's company split by the cheapest cover (5 rows: 4 + 2), or by the largest
    # size when it is more than one batch holds: the rest came with it and is due too, not after
    # max_queue_delay_s waiting for partners already gone.
    company_split = company_arrived(bq, settings, state.company)  # Reason.IDLE's test, or a full batch's
    taken = queue.take(bq.bucket, size)
    if company_split:
        for r in bq.in_order():
            r.left_by_company = True
    rows = sum(r.rows for r in taken)
    plan = BatchPlan(requests=taken, rows=rows, size=_smallest_at_least(rows, sizes), bucket=bq.bucket, reason=reason)
    # Another bucket (or the rest of this one) may be due now too: the caller decides again.
    return Dispatch(plan, now if len(due) > 1 or bq.count else wake_at, waits_for_memory)


def decision_may_change(
    arrival: QueuedRequest,
    bucket_rows: int,
    settings: PolicySettings,
    exec_time: ExecTimeModel,
    *,
    slot_free: bool,
    has_peer: bool,
    timer_at: float | None,
) -> bool:
    """Whether this arrival can change `decide`'s answer before the timer set for `timer_at`
    fires: it filled its bucket (`bucket_rows`, with it) while a slot is free, no timer is
    set, or it falls due (queue delay, or deadline minus the longest batch's time) before the
    timer. Skipping the other calls keeps the policy off the per-request hot path; a timer
    that fires early only plans again."""
    full = min(settings.preferred_batch_sizes[-1], settings.max_batch_size)
    if slot_free and bucket_rows >= full:
        return True
    if timer_at is None:
        return True
    if not slot_free and not has_peer:
        due = arrival.deadline  # until a batch finishes, only its expiry can change anything
    else:
        due = min(arrival.arrival + settings.max_queue_delay_s,
                  arrival.deadline - exec_time.estimate(settings.max_batch_size))
    return due < timer_at


def oom_split(
    requests: Sequence[QueuedRequest], size: int, preferred_sizes: Sequence[int]
) -> tuple[list[tuple[list[QueuedRequest], int, int]], list[QueuedRequest]]:
    """A batch of `size` ran out of memory: split its requests in two halves, each to run at
    the smallest preferred size that holds it. Returns ([(part, rows, size)], failed): a part
    that cannot get smaller than `size` (multi-row requests) would fail the same way, so its
    requests are given up; so is a batch of one request, which cannot be split."""
    if len(requests) < 2:
        return [], list(requests)
    half = (len(requests) + 1) // 2
    parts: list[tuple[list[QueuedRequest], int, int]] = []
    failed: list[QueuedRequest] = []
    for part in (list(requests[:half]), list(requests[half:])):
        rows = sum(r.rows for r in part)
        part_size = next(s for s in (*preferred_sizes, size) if s >= rows)
        if part_size >= size:
            failed.extend(part)
        else:
            parts.append((part, rows, part_size))
    return parts, failed


def retries_locally(reason: Reason, time_left_s: float, exec_time: ExecTimeModel, settings: PolicySettings) -> bool:
    """A request whose offload failed runs locally when it was offloaded for a reason that
    allows local execution (not too large) and its deadline leaves time for the smallest batch."""
    if reason is Reason.TOO_LARGE:
        return False
    return time_left_s > exec_time.estimate(settings.preferred_batch_sizes[0])


def capped_after_oom(settings: PolicySettings, size: int) -> PolicySettings | None:
    """Warm-up ran out of memory at `size`: the settings that serve only the smaller sizes, or
    None when there is no smaller size (the model cannot run here)."""
    smaller = [s for s in settings.preferred_batch_sizes if s < size]
    if not smaller:
        return None
    return replace(settings, max_batch_size=smaller[-1])


def regrown(settings: PolicySettings, ceiling: int) -> PolicySettings | None:
    """The memory budget has room again after a shrink: the settings that serve the next size
    up, never above `ceiling` (the largest before the shrink), or None when already there."""
    if settings.max_batch_size >= ceiling:
        return None
    larger = [s for s in settings.preferred_batch_sizes if settings.max_batch_size < s <= ceiling]
    return replace(settings, max_batch_size=larger[0] if larger else ceiling)


def _peer_plan(queue: ModelQueue, bq: BucketQueue, offload: OffloadView, reason: Reason) -> Dispatch:
    """Send the head of the bucket to the peer, unpadded: the peer batches it itself."""
    taken = queue.take(bq.bucket, offload.max_rows)
    rows = sum(r.rows for r in taken)
    plan = BatchPlan(requests=taken, rows=rows, size=rows, bucket=bq.bucket, reason=reason, target=Target.PEER)
    return Dispatch(plan, None)


def _head_is_local_only(bq: BucketQueue) -> bool:
    """Requests whose offload already failed are retried locally, never sent back."""
    head = next(bq.in_order(), None)
    return head is not None and head.local_only


def company_arrived(bq: BucketQueue, settings: PolicySettings, company: int) -> bool:
    """Whether the bucket's head found the model idle and as many requests as the last batch
    carried are now here: then waiting longer only delays them (dispatch_when_idle). After a
    batch of one (a lone client) that is at once; after a batch of 8 closed-loop clients' requests,
    when the eight are back. O(1): a request that found the model idle heads its bucket, nothing
    was queued before it (with priority levels, a higher one arriving meanwhile takes the head,
    and the queue delay ends the wait as before). What an idle batch's cheapest cover left of
    its company is due at once."""
    if not settings.dispatch_when_idle:
        return False
    head = next(bq.in_order())
    return head.left_by_company or (head.found_idle and bq.count >= company)


def _due_time(
    bq: BucketQueue, sizes: list[int], settings: PolicySettings, exec_time: ExecTimeModel, company: int
) -> tuple[Reason, float]:
    if company_arrived(bq, settings, company):
        return Reason.IDLE, bq.oldest_arrival()
    by_delay = bq.oldest_arrival() + settings.max_queue_delay_s
    run_size = _smallest_at_least(bq.rows, sizes)
    earliest_deadline = min(r.deadline for r in bq.in_order())
    by_deadline = earliest_deadline - exec_time.estimate(run_size)
    return (Reason.DEADLINE, by_deadline) if by_deadline < by_delay else (Reason.DELAY, by_delay)


def _smallest_at_least(rows: int, sizes: list[int]) -> int:
    for s in sizes:
        if s >= rows:
            return s
    return sizes[-1]
