"""One model's statistics: the counters behind GET /v2/models/{m}/stats (Triton's statistics
extension, plus dispatch reasons, padding and offload outcomes) and its Prometheus children.

`RunnerStats` binds the metric children once per model, so the hot path updates them without
building label keys; it runs on the event loop only (the worker thread hands its timings back
through the batch's completion callback).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ..metrics import Metrics
from .policy import BatchPlan, Reason, Target


@dataclass
class ModelStats:
    """Counters behind GET /v2/models/{m}/stats (Triton's statistics extension)."""

    inference_count: int = 0  # rows answered successfully
    execution_count: int = 0  # engine runs
    success_count: int = 0
    success_ns: int = 0
    fail_count: int = 0
    fail_ns: int = 0
    queue_ns: int = 0
    compute_ns: int = 0  # whole batch on the worker: assemble + engine + split
    engine_ns: int = 0  # the engine's infer() alone
    # Triton's per-request view: every request of a batch is charged the batch's whole time.
    request_engine_ns: int = 0
    request_io_ns: int = 0
    last_inference_ms: int = 0
    batch_stats: dict[int, list[int]] = field(default_factory=dict)  # size -> [count, engine ns, io ns]
    reasons: dict[str, int] = field(default_factory=dict)
    padding_rows: int = 0
    batch_rows: int = 0
    expired: int = 0
    rejected: int = 0
    offloaded: dict[str, int] = field(default_factory=dict)  # "reason/outcome" -> requests
    offloaded_ok: int = 0  # requests a peer answered (in success_count too)


class RunnerStats:
    """A model's counters and its bound metric children."""

    def __init__(self, model: str, metrics: Metrics) -> None:
        self.model = model
        self.metrics = metrics
        self.counts = ModelStats()
        m = metrics
        self.ok = m.requests_total.labels(model=model, status="200")
        self._status: dict[int, Any] = {200: self.ok}  # requests_total children by status
        self.depth = m.queue_depth.labels(model=model)
        self._size = m.batch_size.labels(model=model)
        self._padding = m.padding_ratio.labels(model=model)
        self._queue_s = m.queue_seconds.labels(model=model)
        self._request_s = m.request_seconds.labels(model=model)
        self._batches: dict[tuple[int, Reason, Target], Any] = {}  # (size, reason, target) -> batches_total child

    def count_status(self, status: int) -> None:
        """One request answered with `status` (requests_total)."""
        child = self._status.get(status)
        if child is None:
            child = self._status[status] = self.metrics.requests_total.labels(model=self.model, status=str(status))
        child.inc()

    def record_batch(self, plan: BatchPlan, arrivals: list[float], rows: int, dispatched: float, now: float,
                     seconds: float, engine_seconds: float) -> None:
        """A local batch ran: `arrivals` of the requests it answered and their `rows`, the
        loop's clock at dispatch and now, the worker's whole time and the engine's share of it.
        The rows of requests it did not answer (expired on the worker, refused for NaN) ran as
        padding."""
        s = self.counts
        s.execution_count += 1
        s.inference_count += rows
        s.compute_ns += int(seconds * 1e9)
        engine_ns = int(engine_seconds * 1e9)
        s.engine_ns += engine_ns
        s.last_inference_ms = int(time.time() * 1000)
        io_ns = int(seconds * 1e9) - engine_ns  # assembling the batch and splitting its outputs
        entry = s.batch_stats.get(plan.size)
        if entry is None:
            entry = s.batch_stats[plan.size] = [0, 0, 0]
        entry[0] += 1
        entry[1] += engine_ns
        entry[2] += io_ns
        reason = str(plan.reason)
        s.reasons[reason] = s.reasons.get(reason, 0) + 1
        s.padding_rows += plan.padding + plan.rows - rows
        s.batch_rows += plan.size
        key = (plan.size, plan.reason, plan.target)
        counter = self._batches.get(key)
        if counter is None:
            counter = self._batches[key] = self.metrics.batches_total.labels(
                model=self.model, size=str(plan.size), reason=str(plan.reason), target=str(plan.target))
        counter.inc()
        self._size.observe(plan.size)
        self._padding.set(s.padding_rows / s.batch_rows)
        n = len(arrivals)
        self.ok.inc(n)
        s.success_count += n
        s.request_engine_ns += n * engine_ns
        s.request_io_ns += n * io_ns
        queued = [dispatched - a for a in arrivals]
        total = [now - a for a in arrivals]
        s.queue_ns += int(sum(queued) * 1e9)
        s.success_ns += int(sum(total) * 1e9)
        self._queue_s.observe_all(queued)
        self._request_s.observe_all(total)

    def record_offloaded(self, rows: int, arrival: float, now: float) -> None:
        """A request a peer answered: a success (its rows and its time from arrival) like any
        other, though not a run of the local engine (no execution, queue or compute counts)."""
        s = self.counts
        s.inference_count += rows
        s.success_count += 1
        s.offloaded_ok += 1
        s.success_ns += int((now - arrival) * 1e9)
        s.last_inference_ms = int(time.time() * 1000)

    def count_offload(self, reason: str, outcome: str, n: int) -> None:
        self.metrics.offloaded_requests_total.inc(n, model=self.model, reason=str(reason), outcome=outcome)
        key = f"{reason}/{outcome}"
        self.counts.offloaded[key] = self.counts.offloaded.get(key, 0) + n

    def to_json(self, queue_depth: int, exec_times: Iterable[tuple[int, float]]) -> dict[str, Any]:
        """Triton's statistics-extension shape, with Triton's counts (perf_analyzer checks them),
        plus edge-batcher's dispatch reasons, padding and per-execution worker times.

        As in Triton, `inference_stats` counts requests: `success` every request answered,
        offloaded ones included (their time is from arrival to the peer's answer); `queue` and
        the three `compute_*` count the requests answered from local batches, each charged its
        batch's whole time (a peer's queue and compute are the peer's own); each
        `batch_stats` entry counts executions of that size. edge-batcher does not time a batch's
        assembly apart from its output split, so both are in `compute_input` and `compute_output`
        has their count and 0 ns; `execution_ns` has the same times once per batch.
        """
        s = self.counts
        answered = s.success_count - s.offloaded_ok  # requests answered from local batches
        return {
            "name": self.model,
            "version": "1",
            "last_inference": s.last_inference_ms,
            "inference_count": s.inference_count,
            "execution_count": s.execution_count,
            "inference_stats": {
                "success": {"count": s.success_count, "ns": s.success_ns},
                "fail": {"count": s.fail_count + s.expired + s.rejected, "ns": s.fail_ns},
                "queue": {"count": answered, "ns": s.queue_ns},
                "compute_input": {"count": answered, "ns": s.request_io_ns},
                "compute_infer": {"count": answered, "ns": s.request_engine_ns},
                "compute_output": {"count": answered, "ns": 0},
            },
            "batch_stats": [
                {"batch_size": size, "compute_input": {"count": c, "ns": io_ns},
                 "compute_infer": {"count": c, "ns": engine_ns}, "compute_output": {"count": c, "ns": 0}}
                for size, (c, engine_ns, io_ns) in sorted(s.batch_stats.items())
            ],
            # per batch on the engine's worker thread: the engine's run, and assembling padded
            # batches and splitting outputs around it
            "execution_ns": {"engine": s.engine_ns, "assemble_and_split": s.compute_ns - s.engine_ns},
            "dispatch_reasons": dict(s.reasons),
            "padding_rows": s.padding_rows,
            "padding_ratio": s.padding_rows / s.batch_rows if s.batch_rows else 0.0,
            "expired": s.expired,
            "offloaded": dict(s.offloaded),
            "queue_depth": queue_depth,
            "exec_time_ms": {str(k): round(v * 1e3, 4) for k, v in sorted(exec_times)},
        }
