"""The batching policy: pure and synchronous. Queue state and a clock reading in, a plan out.

Rules (docs/architecture.md explains them with examples):

* Strict sizes. A batch is always one of the allowed sizes: the preferred sizes that are
  <= max_batch_size and that the admission hook `fits(size, seq_len)` accepts. When fewer rows
  wait than a size, the batch is padded up to it, so engines only see sizes they were built
  and warmed for.
* Dispatch at once when the largest allowed size is full ("full").
* Otherwise wait, but no longer than the oldest request's arrival + max_queue_delay ("delay"),
  and no longer than the earliest deadline minus the estimated execution time at the size it
  would run at ("deadline"). While draining, dispatch everything now ("drain").
* Which size, when fewer rows than the largest size wait: the cover of the waiting rows by
  allowed sizes with the least estimated execution time (learned per size). 12 rows with
  sizes 2/4/8 become 8 + 4; 3 rows become one 4 (one padding row) rather than 2 + 2.
  The largest chunk of that cover is dispatched first; the rest is planned again next call.
* Buckets: requests only batch with their own length bucket. Among buckets that are due,
  the one holding the highest priority goes first, then the one waiting longest.
* No allowed size at all: while batches are in flight (`busy`), their memory will come back,
  so wait; with nothing in flight, the requests go to a peer ("does_not_fit") or, without
  one, are rejected, never left to hang.
* Offload (docs/offload.md): remote-only models always go to a peer; a bucket goes to the
  peer when its head would miss its deadline locally (no slot soon enough) while the peer's
  measured round trip would meet it ("backlog"); requests too large for the local engine go
  to a peer at submit (`oversized_target`). Requests whose offload failed stay local.

The runner owns the clock, the engines and the futures; this module never awaits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .queues import BucketQueue, ModelQueue, QueuedRequest
from .timing import ExecTimeModel

FitsHook = Callable[[int, int], bool]  # (batch_size, seq_len) -> bool

FULL, DELAY, DEADLINE, DRAIN = "full", "delay", "deadline", "drain"
# Why a batch goes to a peer (the `reason` of a peer plan and of offloaded_requests_total).
DOES_NOT_FIT, TOO_LARGE, BACKLOG, REMOTE_ONLY = "does_not_fit", "too_large", "backlog", "remote_only"
NO_PEER = "no_peer"


@dataclass(frozen=True)
class PolicySettings:
    preferred_batch_sizes: tuple[int, ...]
    max_batch_size: int
    max_queue_delay_s: float


@dataclass
class BatchPlan:
    requests: list[QueuedRequest]
    rows: int  # real rows in the batch
    size: int  # the batch size the engine runs (rows + padding)
    bucket: int
    reason: str  # full | delay | deadline | drain | oom_split, or an offload reason
    target: str = "local"  # or "peer"

    @property
    def padding(self) -> int:
        return self.size - self.rows


@dataclass
class Decision:
    plan: BatchPlan | None = None
    wake_at: float | None = None  # when to call decide() again if nothing else happens
    rejected: list[QueuedRequest] | None = None  # requests that cannot run anywhere
    reject_kind: str = ""  # DOES_NOT_FIT or NO_PEER
    reject_reason: str = ""


def allowed_sizes(settings: PolicySettings, bucket: int, fits: FitsHook) -> list[int]:
    return [
        s for s in settings.preferred_batch_sizes if s <= settings.max_batch_size and fits(s, bucket)
    ]


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


@dataclass(frozen=True)
class OffloadView:
    """What the policy knows about offloading at this instant (plain data from the runner)."""

    peer_available: bool  # a peer is healthy and its breaker lets requests through
    peer_latency_s: float | None = None  # measured round trip; None: not measured yet
    remote_only: bool = False  # this model always runs on a peer
    on_backlog: bool = True  # offload when the local backlog would miss deadlines
    max_rows: int = 64  # rows per request sent to a peer


NO_OFFLOAD = OffloadView(peer_available=False, on_backlog=False)


def oversized_target(rows: int, settings: PolicySettings, offload: OffloadView) -> str:
    """A request with more rows than the local engine takes: "peer" or "reject"."""
    if rows > settings.max_batch_size and offload.peer_available and rows <= offload.max_rows:
        return "peer"
    return "reject"


def decide(
    queue: ModelQueue,
    now: float,
    settings: PolicySettings,
    exec_time: ExecTimeModel,
    fits: FitsHook,
    draining: bool = False,
    busy: bool = False,
    *,
    local_free: bool = True,
    busy_s: float = 0.0,
    offload: OffloadView = NO_OFFLOAD,
) -> Decision:
    """Plan the next batch to dispatch, or say when to look again. Takes planned requests out
    of the queue (expired ones must be removed by the caller with queue.expire(now) first).

    busy: batches are in flight locally (their memory comes back). local_free: a local batch
    slot is free now; without one only peer plans are made. busy_s: estimated seconds until
    a batch dispatched now would start locally. offload: the peer's state, see OffloadView.
    """
    due: list[tuple[int, float, BucketQueue, str, list[int]]] = []
    wake_at: float | None = None
    peer = offload.peer_available
    for bq in queue.nonempty_buckets():
        if offload.remote_only:
            if peer:
                return _peer_plan(queue, bq, offload, REMOTE_ONLY)
            return Decision(rejected=queue.take(bq.bucket, bq.rows), reject_kind=NO_PEER,
                            reject_reason="the model is remote-only and no peer is available")
        sizes = allowed_sizes(settings, bq.bucket, fits)
        if not sizes and busy:
            continue  # memory held by batches in flight comes back when they finish
        if not sizes:
            if peer and not _head_is_local_only(bq):
                return _peer_plan(queue, bq, offload, DOES_NOT_FIT)
            rejected = queue.take(bq.bucket, bq.rows)
            return Decision(rejected=rejected, reject_kind=DOES_NOT_FIT,
                            reject_reason=f"no batch size of {list(settings.preferred_batch_sizes)} fits (bucket {bq.bucket})")
        if draining:
            reason, at = DRAIN, now
        elif bq.rows >= sizes[-1]:
            reason, at = FULL, now
        else:
            reason, at = _due_time(bq, sizes, settings, exec_time)
        if peer and offload.on_backlog and not draining and not _head_is_local_only(bq):
            # Backlog: would the requests at the head miss their deadline locally (no slot
            # soon enough), while the peer's measured round trip would meet it?
            run_size = sizes[-1] if bq.rows >= sizes[-1] else _smallest_at_least(bq.rows, sizes)
            deadline = min(r.deadline for r in bq.in_order())
            local_done = now + busy_s + exec_time.estimate(run_size)
            peer_done = now + (offload.peer_latency_s or 0.0)
            if local_done > deadline and peer_done <= deadline and (at <= now or not local_free):
                return _peer_plan(queue, bq, offload, BACKLOG)
            if not local_free:
                # Look again when waiting for a local slot would start to miss the deadline,
                # and at half the time left at the latest: a stuck engine's wait keeps growing.
                at = min(deadline - exec_time.estimate(run_size) - busy_s, now + max((deadline - now) / 2, 0.001))
                wake_at = at if wake_at is None else min(wake_at, at)
                continue
        if not local_free:
            continue  # the runner wakes us when a slot frees
        if at <= now:
            due.append((-bq.top_priority(), bq.oldest_arrival(), bq, reason, sizes))
        elif wake_at is None or at < wake_at:
            wake_at = at
    if not due:
        return Decision(wake_at=wake_at)
    due.sort(key=lambda d: (d[0], d[1]))
    _, _, bq, reason, sizes = due[0]
    size = sizes[-1] if bq.rows >= sizes[-1] else cheapest_cover(bq.rows, sizes, exec_time)[0]
    # Requests are never split: the batch must hold at least the head request's rows.
    size = max(size, _smallest_at_least(next(bq.in_order()).rows, sizes))
    taken = queue.take(bq.bucket, size)
    rows = sum(r.rows for r in taken)
    plan = BatchPlan(requests=taken, rows=rows, size=_smallest_at_least(rows, sizes), bucket=bq.bucket, reason=reason)
    # Another bucket (or the rest of this one) may be due now too: the caller decides again.
    return Decision(plan=plan, wake_at=now if len(due) > 1 or bq.count else wake_at)


def _peer_plan(queue: ModelQueue, bq: BucketQueue, offload: OffloadView, reason: str) -> Decision:
    """Send the head of the bucket to the peer, unpadded: the peer batches it itself."""
    taken = queue.take(bq.bucket, offload.max_rows)
    rows = sum(r.rows for r in taken)
    plan = BatchPlan(requests=taken, rows=rows, size=rows, bucket=bq.bucket, reason=reason, target="peer")
    return Decision(plan=plan, wake_at=None)


def _head_is_local_only(bq: BucketQueue) -> bool:
    """Requests whose offload already failed are retried locally, never sent back."""
    head = next(bq.in_order(), None)
    return head is not None and head.local_only


def _due_time(
    bq: BucketQueue, sizes: list[int], settings: PolicySettings, exec_time: ExecTimeModel
) -> tuple[str, float]:
    by_delay = bq.oldest_arrival() + settings.max_queue_delay_s
    run_size = _smallest_at_least(bq.rows, sizes)
    earliest_deadline = min(r.deadline for r in bq.in_order())
    by_deadline = earliest_deadline - exec_time.estimate(run_size)
    return (DEADLINE, by_deadline) if by_deadline < by_delay else (DELAY, by_delay)


def _smallest_at_least(rows: int, sizes: list[int]) -> int:
    for s in sizes:
        if s >= rows:
            return s
    return sizes[-1]
