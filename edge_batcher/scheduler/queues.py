"""The waiting room of one model: bounded, split by length bucket and priority.

Requests of one bucket batch together; inside a bucket, higher priorities go first and
arrival order breaks ties. The queue is bounded (queue_capacity): a push beyond it raises
Overloaded at once rather than letting memory grow. Expired requests are found through a
deadline heap, so checking for them costs nothing while none is due.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from numpy.typing import NDArray

from ..errors import Overloaded
from ..types import InferRequest, InferResponse


@dataclass(eq=False, slots=True)
class QueuedRequest:
    """The scheduler's view of a request: what it needs to plan, plus an opaque payload."""

    priority: int
    arrival: float
    deadline: float
    rows: int = 1  # batch slots the request takes (a request may carry several rows)
    bucket: int = 0  # sequence bucket length, 0 for fixed-shape models
    payload: Any = None
    seq: int = field(default=0)
    taken: bool = False  # dispatched or expired: no longer in the queue
    local_only: bool = False  # its offload failed: retry locally, never send it back
    found_idle: bool = False  # nothing was queued or running when it arrived
    left_by_company: bool = False  # queued with an idle arrival's company, not in its (split) batch


@dataclass(eq=False, slots=True)
class Pending(QueuedRequest):
    """A validated request in a runner's queue: what the policy plans with, and what answers it."""

    request: InferRequest = field(kw_only=True)
    inputs: dict[str, NDArray[Any]] = field(default_factory=dict)  # as the engine takes them
    future: asyncio.Future[InferResponse] = field(kw_only=True)


class BucketQueue:
    """Requests of one bucket, one deque per priority (arrival order inside each)."""

    def __init__(self, bucket: int, priority_levels: int):
        self.bucket = bucket
        self._by_priority: list[deque[QueuedRequest]] = [deque() for _ in range(priority_levels)]
        self.rows = 0  # batch slots waiting
        self.count = 0

    def push(self, req: QueuedRequest) -> None:
        self._by_priority[req.priority].append(req)
        self.rows += req.rows
        self.count += 1

    def remove(self, req: QueuedRequest) -> None:
        self._by_priority[req.priority].remove(req)
        self.rows -= req.rows
        self.count -= 1

    def in_order(self) -> Iterator[QueuedRequest]:
        """Highest priority first, oldest first within a priority."""
        for dq in reversed(self._by_priority):
            yield from dq

    def oldest_arrival(self) -> float:
        return min(dq[0].arrival for dq in self._by_priority if dq)

    def top_priority(self) -> int:
        for level in range(len(self._by_priority) - 1, -1, -1):
            if self._by_priority[level]:
                return level
        raise ValueError("empty bucket")

    def take(self, max_rows: int) -> list[QueuedRequest]:
        """Pop requests in order while their rows fit in max_rows (skipping any that do not)."""
        taken: list[QueuedRequest] = []
        room = max_rows
        for dq in reversed(self._by_priority):
            kept: deque[QueuedRequest] = deque()
            while dq:
                req = dq.popleft()
                if req.rows <= room:
                    taken.append(req)
                    room -= req.rows
                else:
                    kept.append(req)
                if room == 0:
                    break
            dq.extendleft(reversed(kept))
            if room == 0:
                break
        for req in taken:
            req.taken = True
            self.rows -= req.rows
            self.count -= 1
        return taken


class ModelQueue:
    def __init__(self, *, capacity: int, priority_levels: int):
        self.capacity = capacity
        self.priority_levels = priority_levels
        self.buckets: dict[int, BucketQueue] = {}
        self._deadlines: list[tuple[float, int, QueuedRequest]] = []
        self._seq = itertools.count()
        self.count = 0

    def __len__(self) -> int:
        return self.count

    def push(self, req: QueuedRequest) -> None:
        if self.count >= self.capacity:
            raise Overloaded(f"queue full: {self.count} requests waiting (queue_capacity {self.capacity})")
        req.seq = next(self._seq)
        bq = self.buckets.get(req.bucket)
        if bq is None:
            bq = self.buckets[req.bucket] = BucketQueue(req.bucket, self.priority_levels)
        bq.push(req)
        heapq.heappush(self._deadlines, (req.deadline, req.seq, req))
        self.count += 1

    def next_deadline(self) -> float | None:
        self._drop_taken_heads()
        return self._deadlines[0][0] if self._deadlines else None

    def expire(self, now: float) -> list[QueuedRequest]:
        """Remove and return every request whose deadline is at or before now."""
        expired: list[QueuedRequest] = []
        while True:
            self._drop_taken_heads()
            if not self._deadlines or self._deadlines[0][0] > now:
                return expired
            _, _, req = heapq.heappop(self._deadlines)
            self.buckets[req.bucket].remove(req)
            req.taken = True
            self.count -= 1
            expired.append(req)

    def take(self, bucket: int, max_rows: int) -> list[QueuedRequest]:
        taken = self.buckets[bucket].take(max_rows)
        self.count -= len(taken)
        return taken

    def take_all(self) -> list[QueuedRequest]:
        out = []
        for bq in self.buckets.values():
            out.extend(bq.take(bq.rows))
        self.count = 0
        self._deadlines.clear()
        return out

    def nonempty_buckets(self) -> list[BucketQueue]:
        return [bq for bq in self.buckets.values() if bq.count]

    def _drop_taken_heads(self) -> None:
        heap = self._deadlines
        while heap and heap[0][2].taken:
            heapq.heappop(heap)
