"""Drives one model: validates and queues requests, asks the policy for batches, runs them.

Threads: everything here runs on the event loop except `_execute`, which runs on the engine
instance's own worker thread (one thread per instance: inference never blocks the loop, and
an engine object is only ever touched by one thread). One future per request; a failed batch
sets the error on every future in it; a caller that went away (cancelled future) does not
disturb the rest of its batch.

The hot path is plain callbacks, no task per batch: `submit` queues a request and calls
`_schedule` when the policy's answer may have changed; `_schedule` runs the (pure) policy
and hands each planned batch to its instance's worker; the worker's completion callback
answers the batch's futures and calls `_schedule` again; a timer calls it when the policy
said to look again later (queue delay, deadlines).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from ..config import ModelConfig
from ..cpu_affinity import thread_is_pinned
from ..errors import (
    DeadlineExceeded, DoesNotFit, EdgeBatcherError, EngineError, InvalidInput, OutOfMemory, Overloaded,
    Unavailable,
)  # fmt: skip
from ..metrics import Metrics
from ..offload.conform import conform_outputs
from ..types import DATATYPE_TO_NUMPY, InferRequest, InferResponse, TensorSpec
from . import policy
from .queues import ModelQueue, QueuedRequest
from .timing import ExecTimeModel
from .worker import EngineWorker

log = logging.getLogger(__name__)

BATCHES_IN_FLIGHT_PER_INSTANCE = 2
# An engine whose batches take at least this long (measured at warm-up) runs its worker
# thread on every CPU instead of the event loop's ([server] loop_cpu): the loop then waits on
# the engine most of the time, and sharing its CPU would only keep the engine's own compute
# (ONNX Runtime runs on the calling thread with intra_op_threads = 1) off the other cores.
# Below it, sharing one CPU wins: the GIL changes hands several times per batch, cheaply on
# one core. Where the two cross: tools/bench_engine_cost.py, docs/benchmarks.md.
WORKER_ON_EVERY_CPU_FROM_S = 0.5e-3


@dataclass(eq=False, slots=True)
class Pending(QueuedRequest):
    """A validated request in the queue: what the policy plans with, and what answers it."""

    request: InferRequest | None = None
    inputs: dict[str, np.ndarray] = field(default_factory=dict)  # as the engine takes them
    future: asyncio.Future | None = None


@dataclass(eq=False, slots=True)
class LocalBatch:
    """A batch handed to an engine instance's worker."""

    plan: policy.BatchPlan
    instance: int
    reserved: int  # admission bytes held until it finishes
    dispatched: float
    holds_slot: bool  # False for the parts of a batch split after running out of memory


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
    last_inference_ms: int = 0
    batch_stats: dict[int, list[int]] = field(default_factory=dict)  # size -> [count, ns]
    reasons: dict[str, int] = field(default_factory=dict)
    padding_rows: int = 0
    batch_rows: int = 0
    expired: int = 0
    rejected: int = 0
    offloaded: dict[str, int] = field(default_factory=dict)  # "reason/outcome" -> requests


class ModelRunner:
    def __init__(self, config: ModelConfig, engines: list, metrics: Metrics, *, admission=None, offload=None):
        if not engines:
            raise ValueError("a model runner needs at least one engine instance")
        self.config = config
        self.name = config.name
        self.engines = engines
        # False for a model served by offload peers only (engines/remote.py): no worker
        # threads, no warm-up, no local batch slots; the policy plans every batch for a peer.
        self.runs_locally: bool = getattr(engines[0], "runs_locally", True)
        self.inputs: list[TensorSpec] = engines[0].inputs
        # An engine may turn what clients send into what the model runs on (text -> token ids)
        # with prepare(inputs) -> (inputs, seq_len); batches are then built from batch_inputs.
        self._prepare = getattr(engines[0], "prepare", None)
        self.batch_inputs: list[TensorSpec] = getattr(engines[0], "batch_inputs", None) or self.inputs
        self.outputs: list[TensorSpec] = engines[0].outputs
        self.metrics = metrics
        b = config.batching
        self.settings = policy.PolicySettings(
            preferred_batch_sizes=tuple(b.preferred_batch_sizes),
            max_batch_size=b.max_batch_size,
            max_queue_delay_s=b.max_queue_delay_ms / 1000.0,
        )
        self.admission = admission  # memory.admission.Admission, or None: no memory limit
        self.fits = admission.fits if admission is not None else (lambda size, seq_len: True)
        # offload.view(model) -> policy.OffloadView; await offload.infer(model, inputs, timeout_s)
        # -> (outputs, peer name). None: this daemon has no peers.
        self.offload = offload
        self.exec_time = ExecTimeModel()
        self.queue = ModelQueue(capacity=b.queue_capacity, priority_levels=b.priority_levels)
        self.stats = ModelStats()
        self._input_by_name = {spec.name: spec for spec in self.inputs}
        # Per input: (name, numpy dtype, rank, sequence axis, [(axis, size) that must match]).
        self._checks = [
            (spec.name, DATATYPE_TO_NUMPY[spec.datatype], len(spec.shape), self._seq_axis(spec.name),
             [(axis, d) for axis, d in enumerate(spec.shape) if axis > 0 and d != -1 and axis != self._seq_axis(spec.name)])
            for spec in self.inputs
        ]
        # Metric children bound once: the hot path updates them without building label keys.
        m = metrics
        self._m_ok = m.requests_total.labels(model=self.name, status="200")
        self._m_status: dict[int, object] = {200: self._m_ok}  # requests_total children, see _count_status
        self._m_depth = m.queue_depth.labels(model=self.name)
        self._m_size = m.batch_size.labels(model=self.name)
        self._m_padding = m.padding_ratio.labels(model=self.name)
        self._m_queue_s = m.queue_seconds.labels(model=self.name)
        self._m_request_s = m.request_seconds.labels(model=self.name)
        self._m_batches: dict[tuple, object] = {}  # (size, reason, target) -> batches_total child
        self._output_names = [spec.name for spec in self.outputs]
        self._default_priority = b.default_priority
        self._priority_levels = b.priority_levels
        self._default_timeout_s = b.default_timeout_ms / 1000.0
        self._max_timeout_s = b.max_timeout_ms / 1000.0
        self._loop: asyncio.AbstractEventLoop | None = None  # set by start()
        self._workers: list[EngineWorker] = []  # one per engine instance, from start()
        self._free_slots: list[int] = []  # engine instances with a free batch slot
        self._busy_until = [0.0] * len(engines)  # when each instance's dispatched work should end
        self._dispatched: list[deque[float]] = [deque() for _ in engines]  # dispatch times in flight
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None  # when the policy wants to look again; None: no timer
        self._offloads: set[asyncio.Task] = set()  # requests on their way to a peer
        self._local_batches = 0  # batches with a worker (queued there or running)
        self._draining = False
        self._closed = False
        # Set when a batch or an offload finished, or requests were rejected: drain() waits on it.
        self._progress = asyncio.Event()

    # ------------------------------------------------------------------ lifecycle

    def warm_up(self) -> None:
        """Run every allowed batch size (and bucket) on every instance once before serving, so
        the first real request at a size is not the slow one; seeds the exec-time model.
        Blocking: call off the event loop."""
        if not self.runs_locally:
            log.info("model %s: runs on offload peers only: nothing to warm up here", self.name)
            return
        buckets = self.config.sequence.buckets if self.config.sequence else [0]
        for bucket in buckets:
            for size in policy.allowed_sizes(self.settings, bucket, self.fits):
                batch = {spec.name: _zeros(spec, size, self._seq_axis(spec.name), bucket) for spec in self.batch_inputs}
                try:
                    for engine in self.engines:
                        timings = []
                        for _ in range(3):
                            t0 = time.perf_counter()
                            engine.infer(batch)
                            timings.append(time.perf_counter() - t0)
                        self.exec_time.observe(size, sorted(timings)[1])
                except OutOfMemory as exc:
                    self._cap_batch_size(size, bucket, exc)
                    break
        log.info(
            "model %s: warmed up sizes %s: %s", self.name, list(self.settings.preferred_batch_sizes),
            ", ".join(f"{s}: {t * 1e3:.2f} ms" for s, t in sorted(self.exec_time.measured().items())),
        )

    def _cap_batch_size(self, size: int, bucket: int, error: OutOfMemory) -> None:
        """Warm-up ran out of memory at `size`: serve only the smaller sizes from now on."""
        smaller = [s for s in self.settings.preferred_batch_sizes if s < size]
        if not smaller:
            raise error
        self.settings = policy.PolicySettings(
            self.settings.preferred_batch_sizes, smaller[-1], self.settings.max_queue_delay_s
        )
        if self.admission is not None:
            self.admission.raise_calibration()
        log.warning(
            "model %s: warm-up ran out of memory at batch %d%s; serving batch sizes up to %d (%s)",
            self.name, size, f" (bucket {bucket})" if bucket else "", smaller[-1], error,
        )

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        if not self.runs_locally:
            return  # no workers and no free slot: every batch goes to a peer
        slowest = max(self.exec_time.measured().values(), default=0.0)  # from warm-up; none: not warmed up
        every_cpu = slowest >= WORKER_ON_EVERY_CPU_FROM_S
        if every_cpu and thread_is_pinned():
            log.info("model %s: batches take up to %.2f ms: its engine worker threads run on every CPU, "
                     "not only on the event loop's", self.name, slowest * 1e3)
        self._workers = [EngineWorker(f"engine-{self.name}-{i}", self._loop, every_cpu=every_cpu)
                         for i in range(len(self.engines))]
        # Two batch slots per instance: the next batch waits in the worker's queue while the
        # current one runs, so the engine thread never idles through a round trip to the loop.
        self._free_slots = [i for _ in range(BATCHES_IN_FLIGHT_PER_INSTANCE) for i in range(len(self.engines))]

    async def drain(self, timeout: float) -> None:
        """Stop taking requests, run everything queued now, wait for batches in flight."""
        self._draining = True
        self._schedule()
        deadline = time.monotonic() + timeout
        while (len(self.queue) or self._offloads or self._local_batches) and time.monotonic() < deadline:
            self._progress.clear()
            try:
                await asyncio.wait_for(self._progress.wait(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                break
        for req in self.queue.take_all():
            self._fail(req, Unavailable(f"model {self.name!r}: daemon stopped before this request could run"))

    async def close(self) -> None:
        """Answer what is queued with an error, let batches with a worker finish, close the engines."""
        self._draining = True
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
        for req in self.queue.take_all():
            self._fail(req, Unavailable(f"model {self.name!r} was unloaded"))
        if self._workers:
            for engine, worker in zip(self.engines, self._workers):
                await worker.stop(engine.close)
        else:  # never started (warm-up only): close on any thread
            loop = asyncio.get_running_loop()
            for engine in self.engines:
                await loop.run_in_executor(None, engine.close)

    # ------------------------------------------------------------------ requests

    def submit(self, request: InferRequest) -> asyncio.Future:
        """Validate and queue a request; the returned future resolves to its InferResponse.
        Raises InvalidInput, Overloaded or Unavailable at once when it cannot be queued."""
        if self._draining:
            raise Unavailable(f"model {self.name!r} is not accepting requests: the daemon is draining")
        loop = self._loop
        if loop is None:
            raise Unavailable(f"model {self.name!r} is not serving yet")
        inputs, rows, seq_len = self._validate(request)
        if self._prepare is not None:
            inputs, seq_len = self._prepare(inputs)
            self._check_seq_len(seq_len)
        priority = self._default_priority if request.priority is None else request.priority
        if not 0 <= priority < self._priority_levels:
            raise InvalidInput(
                f"priority {priority} is out of range: model {self.name!r} has levels 0..{self._priority_levels - 1}"
            )
        timeout_s = self._default_timeout_s if request.timeout_s is None else request.timeout_s
        if timeout_s <= 0:
            raise DeadlineExceeded(f"request timeout {timeout_s * 1000:.1f} ms has already passed")
        if timeout_s > self._max_timeout_s:
            timeout_s = self._max_timeout_s
        now = loop.time()
        future = loop.create_future()
        pending = Pending(priority, now, now + timeout_s, rows, self._bucket(seq_len),
                          request=request, inputs=inputs, future=future)
        if rows > self.settings.max_batch_size:
            self._submit_oversized(pending)
            return future
        self.queue.push(pending)
        if self._decision_may_change(pending):
            self._schedule()
        return future

    def _submit_oversized(self, queued: Pending) -> None:
        """More rows than the local engine takes: straight to a peer, or a clear error."""
        view = self._offload_view()
        if policy.oversized_target(queued.rows, self.settings, view) != "peer":
            if view.remote_only and not view.peer_available:
                raise Unavailable(f"model {self.name!r} is remote-only and no peer is available")
            peer_note = "" if self.offload is None else " and no peer can take it now"
            raise InvalidInput(
                f"request has {queued.rows} rows, more than model {self.name!r} max_batch_size "
                f"{self.settings.max_batch_size}{peer_note}; split it into smaller requests"
            )
        queued.taken = True
        reason = policy.REMOTE_ONLY if view.remote_only else policy.TOO_LARGE  # why it is not local
        plan = policy.BatchPlan([queued], queued.rows, queued.rows, queued.bucket, reason, target="peer")
        self._start_offload(plan)

    def _decision_may_change(self, queued: Pending) -> bool:
        """Whether this arrival can change the policy's answer before its timer fires: it
        filled a bucket, no timer is set, or it falls due (queue delay, or deadline minus the
        longest batch's time) before the timer. Skipping the other calls keeps the policy off
        the per-request hot path; a timer that fires early only plans again."""
        settings = self.settings
        slot_free = bool(self._free_slots)
        full = min(settings.preferred_batch_sizes[-1], settings.max_batch_size)
        if slot_free and self.queue.buckets[queued.bucket].rows >= full:
            return True
        if self._timer_at is None:
            return True
        if not slot_free and self.offload is None:
            due = queued.deadline  # until a batch finishes, only its expiry can change anything
        else:
            due = min(queued.arrival + settings.max_queue_delay_s,
                      queued.deadline - self.exec_time.estimate(settings.max_batch_size))
        return due < self._timer_at

    def infer(self, request: InferRequest) -> asyncio.Future:
        """`await runner.infer(request)` -> InferResponse. Returns the request's future itself,
        not a coroutine around it (one coroutine less per request on the hot path): errors
        found at once (InvalidInput, Overloaded, ...) raise from the call, later ones
        (DeadlineExceeded, EngineError, ...) from the await. Every outcome is counted in
        requests_total: here, in `_fail`, or per batch in `_record`."""
        try:
            return self.submit(request)
        except EdgeBatcherError as exc:
            self._count_status(exc.status)
            raise

    def refuse_if_full(self) -> None:
        """Raise Overloaded (counted like any other answer) when the queue is already full, so a
        transport can refuse a request before reading and decoding its body. `submit` checks again."""
        if len(self.queue) >= self.queue.capacity:
            self._count_status(Overloaded.status)
            raise Overloaded(f"queue full: {len(self.queue)} requests waiting (queue_capacity {self.queue.capacity})")

    def _count_status(self, status: int) -> None:
        child = self._m_status.get(status)
        if child is None:
            child = self._m_status[status] = self.metrics.requests_total.labels(model=self.name, status=str(status))
        child.inc()

    def _validate(self, request: InferRequest) -> tuple[dict[str, np.ndarray], int, int]:
        given = request.inputs
        if request.outputs is not None:
            for name in request.outputs:
                if name not in self._output_names:
                    raise InvalidInput(
                        f"model {self.name!r} has no output {name!r}; its outputs are {', '.join(self._output_names)}"
                    )
        rows = None
        seq_len = 0
        inputs = {}
        for name, dtype, rank, seq_axis, fixed in self._checks:
            array = given.get(name)
            if array is None:
                self._check_input_names(given)  # a misspelt name explains a missing input best
                raise InvalidInput(f"missing input {name!r} for model {self.name!r}")
            spec = self._input_by_name[name]
            if array.dtype != dtype and not (dtype == object and array.dtype.kind in "OSU"):
                got = "BYTES" if array.dtype.kind in "OSU" else _v2_name(array.dtype)
                raise InvalidInput(f"input {name!r}: datatype {got}, model {self.name!r} expects {spec.datatype}")
            shape = array.shape
            if len(shape) != rank:
                raise InvalidInput(
                    f"input {name!r}: shape {list(shape)} has {len(shape)} dimensions, "
                    f"model {self.name!r} expects {rank} like {_shape_text(spec.shape)}"
                )
            for axis, want in fixed:
                if shape[axis] != want:
                    raise InvalidInput(
                        f"input {name!r}: shape {list(shape)} does not match {_shape_text(spec.shape)} "
                        f"(dimension {axis} must be {want})"
                    )
            if rows is None:
                rows = shape[0]
            elif shape[0] != rows:
                raise InvalidInput(f"inputs disagree on the batch dimension: {name!r} has {shape[0]} rows, others {rows}")
            if seq_axis is not None:
                length = shape[seq_axis]
                if seq_len and length != seq_len:
                    raise InvalidInput(f"sequence inputs disagree on length: {name!r} has {length}, others {seq_len}")
                seq_len = length
            inputs[name] = array
        if len(given) != len(inputs):
            self._check_input_names(given)
        if not rows:
            raise InvalidInput("inputs have 0 rows: nothing to infer")
        if self._prepare is None:
            self._check_seq_len(seq_len)
        return inputs, rows, seq_len

    def _check_input_names(self, given: dict) -> None:
        for given_name in given:
            if given_name not in self._input_by_name:
                raise InvalidInput(
                    f"model {self.name!r} has no input {given_name!r}; its inputs are {', '.join(self._input_by_name)}"
                )

    def _check_seq_len(self, seq_len: int) -> None:
        if self.config.sequence is not None:
            longest = self.config.sequence.buckets[-1]
            if seq_len == 0 or seq_len > longest:
                raise InvalidInput(f"sequence length {seq_len} is outside 1..{longest} (the largest bucket) of model {self.name!r}")

    def _seq_axis(self, name: str) -> int | None:
        seq = self.config.sequence
        return seq.axis if seq is not None and name in seq.inputs else None

    def _bucket(self, seq_len: int) -> int:
        if self.config.sequence is None:
            return 0
        for boundary in self.config.sequence.buckets:
            if seq_len <= boundary:
                return boundary
        raise AssertionError("validated above")

    # ------------------------------------------------------------------ scheduling

    def _schedule(self) -> None:
        """Expire what is due, ask the policy for batches until it has none to dispatch now,
        hand them out, and set the timer for when it wants to look again."""
        if self._closed or self._loop is None:
            return
        if not self.queue.count:
            self._m_depth.set(0)
            return  # nothing to plan or expire; a timer still set fires and finds nothing
        loop = self._loop
        while True:
            now = loop.time()
            for req in self.queue.expire(now):
                self.stats.expired += 1
                waited = (now - req.arrival) * 1000
                self._fail(req, DeadlineExceeded(
                    f"deadline passed after {waited:.1f} ms in the queue of model {self.name!r}, before it could run"))
            offload = self._offload_view()
            decision = policy.decide(
                self.queue, now, self.settings, self.exec_time, self.fits, self._draining,
                busy=self._local_batches > 0, local_free=bool(self._free_slots),
                # only the offload decision reads busy_s: not worth computing without a peer
                busy_s=self._busy_seconds(now) if offload.peer_available else 0.0, offload=offload,
            )
            if decision.rejected:
                self._reject(decision)
                self._progress.set()
            wake_at = decision.wake_at
            if decision.plan is None:
                break
            self._dispatch(decision.plan, now)
            if wake_at is None or wake_at > now:
                break  # the policy saw nothing else due now
            if not self._free_slots and self.offload is None:
                # Without a free slot or a peer the policy can plan nothing more: the next
                # batch to finish plans again (it would only say so, at the cost of a call).
                wake_at = None
                break
        self._m_depth.set(len(self.queue))
        # Also wake at the next deadline: a request must get its timeout error on time even
        # while every engine instance is busy (or stuck) and the policy has nothing to plan.
        expiry = self.queue.next_deadline()
        if expiry is not None and (wake_at is None or expiry < wake_at):
            wake_at = expiry
        self._arm_timer(wake_at)

    def _offload_view(self) -> policy.OffloadView:
        return self.offload.view(self.name) if self.offload is not None else policy.NO_OFFLOAD

    def _arm_timer(self, at: float | None) -> None:
        """Have `_schedule` called at `at`. A timer already set for earlier stays: firing early
        only plans again (and sets the right time then), while cancelling and re-arming on
        every batch would cost the loop a timer per batch."""
        if self._timer_at is not None and (at is None or self._timer_at <= at):
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = at
        self._timer = self._loop.call_at(at, self._on_timer) if at is not None else None

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_at = None
        self._schedule()

    def _dispatch(self, plan: policy.BatchPlan, now: float) -> None:
        if plan.target == "peer":
            self._start_offload(plan)
            return
        instance = min(self._free_slots, key=lambda i: self._busy_until[i])
        self._free_slots.remove(instance)
        self._busy_until[instance] = max(now, self._busy_until[instance]) + self.exec_time.estimate(plan.size)
        self._dispatched[instance].append(now)
        self._start_batch(plan, instance, now, holds_slot=True)

    def _busy_seconds(self, now: float) -> float:
        """Estimated wait before a batch dispatched now would start on a local instance.

        From the learned execution times; but when an instance's work has overrun its
        estimate (a stuck or suddenly slow engine), assume it needs as long again as it has
        already run, rather than trusting an estimate that has proven wrong."""
        def wait(i: int) -> float:
            expected = self._busy_until[i] - now
            if expected <= 0 and self._dispatched[i]:
                return now - self._dispatched[i][0]
            return max(0.0, expected)

        return min(wait(i) for i in (self._free_slots or range(len(self.engines))))

    def _reject(self, decision: policy.Decision) -> None:
        if decision.reject_kind == policy.NO_PEER:
            error = Unavailable(f"model {self.name!r}: {decision.reject_reason}")
        else:
            reason = decision.reject_reason
            if self.admission is not None:
                smallest = self.settings.preferred_batch_sizes[0]
                reason = "does not fit in device memory: " + self.admission.explain(smallest, decision.rejected[0].bucket)
            error = DoesNotFit(f"model {self.name!r}: {reason}")
        log.warning("model %s: rejecting %d request(s): %s", self.name, len(decision.rejected), error)
        for req in decision.rejected:
            self.stats.rejected += 1
            self._fail(req, error)

    # ------------------------------------------------------------------ local batches

    def _start_batch(self, plan: policy.BatchPlan, instance: int, now: float, *, holds_slot: bool) -> None:
        reserved = self.admission.reserve(plan.size, plan.bucket) if self.admission is not None else 0
        self._local_batches += 1
        batch = LocalBatch(plan, instance, reserved, now, holds_slot)
        self._workers[instance].submit(self._execute, batch, self._batch_done)

    def _batch_done(self, batch: LocalBatch, outcome, error: BaseException | None) -> None:
        """On the loop, when a worker finished a batch: answer its requests, free its slot
        and memory, plan again."""
        if batch.reserved:
            self.admission.release(batch.reserved)
        instance = batch.instance
        if batch.holds_slot:
            self._free_slots.append(instance)
            self._dispatched[instance].popleft()
            if self._free_slots.count(instance) == BATCHES_IN_FLIGHT_PER_INSTANCE:
                self._busy_until[instance] = 0.0  # idle: nothing of its estimate is left
        self._local_batches -= 1
        plan = batch.plan
        if error is None:
            try:
                self._answer(batch, *outcome)
            except Exception as exc:  # a bug here must not leave callers waiting forever
                log.exception("model %s: answering a batch of %d failed", self.name, plan.size)
                failed = EngineError(f"model {self.name!r}: answering the batch failed: {exc}")
                for req in plan.requests:
                    self._fail(req, failed)
        elif isinstance(error, OutOfMemory):
            self._split_after_oom(plan, instance, error)
        else:
            if not isinstance(error, EdgeBatcherError):
                error = EngineError(f"model {self.name!r}: batch failed: {error}")
            log.error("model %s: batch of %d failed: %s", self.name, plan.size, error)
            for req in plan.requests:
                self._fail(req, error)
            self.stats.fail_count += len(plan.requests)
        self._progress.set()
        self._schedule()  # memory and an instance came back: the policy may plan again

    def _answer(self, batch: LocalBatch, results: list, seconds: float, engine_seconds: float) -> None:
        requests = batch.plan.requests
        if engine_seconds:
            self._record(batch, [r for r, out in zip(requests, results) if out is not None], seconds, engine_seconds)
        name = self.name
        for req, outputs in zip(requests, results):
            if outputs is None:
                self.stats.expired += 1
                self._fail(req, DeadlineExceeded(
                    f"deadline passed while the batch waited for engine instance {batch.instance} of model {name!r}"))
                continue
            request = req.request
            if request.outputs is not None:
                outputs = {o: outputs[o] for o in request.outputs}
            if not req.future.done():  # done = the caller gave up; the rest of the batch is unaffected
                req.future.set_result(InferResponse(name, request.id, outputs))

    def _split_after_oom(self, plan: policy.BatchPlan, instance: int, error: OutOfMemory) -> None:
        """The engine ran out of memory although the estimate said the batch fits: raise the
        estimate's calibration, split the batch in two smaller preferred sizes and retry each
        on the same instance (after what its worker has queued). A batch of the smallest size
        that still fails gets the error."""
        self.metrics.oom_retries_total.inc(model=self.name)
        factor = self.admission.raise_calibration() if self.admission is not None else None
        requests = plan.requests
        if len(requests) < 2:
            log.error("model %s: out of memory on a batch of %d that cannot be split: %s", self.name, plan.size, error)
            self._fail(requests[0], error)
            return
        log.warning(
            "model %s: out of memory on a batch of %d; splitting it and retrying (estimate calibration now %s)",
            self.name, plan.size, f"{factor:.2f}" if factor else "n/a",
        )
        half = (len(requests) + 1) // 2
        now = self._loop.time()
        for part in (requests[:half], requests[half:]):
            rows = sum(r.rows for r in part)
            size = next(s for s in (*self.settings.preferred_batch_sizes, plan.size) if s >= rows)
            if size >= plan.size:  # multi-row requests that cannot get smaller: the same size would fail again
                for r in part:
                    self._fail(r, error)
                continue
            part_plan = policy.BatchPlan(part, rows, size, plan.bucket, reason="oom_split")
            self._start_batch(part_plan, instance, now, holds_slot=False)

    def _execute(self, batch: LocalBatch):
        """Worker thread: assemble the padded batch, run it, split the outputs per request.

        A batch may wait here behind the one running, so deadlines are checked again just
        before the engine runs: expired requests are left out (their slot becomes padding)
        and get None, which the loop answers with DeadlineExceeded. The clock is the event
        loop's (time.monotonic), so deadlines compare directly."""
        t0 = time.perf_counter()
        plan = batch.plan
        requests = plan.requests
        now = time.monotonic()
        live = [r for r in requests if r.deadline > now]
        if not live:
            return [None] * len(requests), 0.0, 0.0
        pad = self.config.sequence.pad_value if self.config.sequence else 0
        inputs = {
            spec.name: _stack([r.inputs[spec.name] for r in live], plan.size, self._seq_axis(spec.name), plan.bucket, pad)
            for spec in self.batch_inputs
        }
        t1 = time.perf_counter()
        outputs = self.engines[batch.instance].infer(inputs)
        engine_seconds = time.perf_counter() - t1
        self._check_outputs(outputs, sum(r.rows for r in live))
        named = list(outputs.items())
        results = []
        offset = 0
        for r in requests:
            if r.deadline > now:
                end = offset + r.rows
                results.append({name: value[offset:end] for name, value in named})
                offset = end
            else:
                results.append(None)
        return results, time.perf_counter() - t0, engine_seconds

    def _check_outputs(self, outputs: dict, rows: int) -> None:
        """An engine (a user's own backend, say) that returns too little must fail its batch
        with a clear error, not hand out empty slices or leave requests unanswered."""
        for name in self._output_names:
            value = outputs.get(name)
            if value is None:
                raise EngineError(
                    f"model {self.name!r}: the engine returned no output {name!r} (it returned {', '.join(map(repr, outputs)) or 'none'})"
                )
            if getattr(value, "ndim", 0) == 0 or value.shape[0] < rows:
                raise EngineError(
                    f"model {self.name!r}: the engine's output {name!r} has shape {list(getattr(value, 'shape', ()))}, "
                    f"fewer than the batch's {rows} rows"
                )

    def _record(self, batch: LocalBatch, answered: list[Pending], seconds: float, engine_seconds: float) -> None:
        plan = batch.plan
        now = self._loop.time()
        self.exec_time.observe(plan.size, seconds)
        s = self.stats
        s.execution_count += 1
        s.inference_count += plan.rows
        s.compute_ns += int(seconds * 1e9)
        engine_ns = int(engine_seconds * 1e9)
        s.engine_ns += engine_ns
        s.last_inference_ms = int(time.time() * 1000)
        entry = s.batch_stats.get(plan.size)
        if entry is None:
            entry = s.batch_stats[plan.size] = [0, 0]
        entry[0] += 1
        entry[1] += engine_ns
        s.reasons[plan.reason] = s.reasons.get(plan.reason, 0) + 1
        s.padding_rows += plan.padding
        s.batch_rows += plan.size
        key = (plan.size, plan.reason, plan.target)
        counter = self._m_batches.get(key)
        if counter is None:
            counter = self._m_batches[key] = self.metrics.batches_total.labels(
                model=self.name, size=str(plan.size), reason=plan.reason, target=plan.target)
        counter.inc()
        self._m_size.observe(plan.size)
        self._m_padding.set(s.padding_rows / s.batch_rows)
        n = len(answered)
        self._m_ok.inc(n)
        s.success_count += n
        arrivals = [r.arrival for r in answered]
        queued = [batch.dispatched - a for a in arrivals]
        total = [now - a for a in arrivals]
        s.queue_ns += int(sum(queued) * 1e9)
        s.success_ns += int(sum(total) * 1e9)
        self._m_queue_s.observe_all(queued)
        self._m_request_s.observe_all(total)

    def _fail(self, req: Pending, error: EdgeBatcherError) -> None:
        if not req.future.done():
            req.future.set_exception(error)
            self._count_status(error.status)
        self.stats.fail_ns += int((self._loop.time() - req.arrival) * 1e9)

    # ------------------------------------------------------------------ offload

    def _start_offload(self, plan: policy.BatchPlan) -> None:
        task = asyncio.create_task(self._offload_batch(plan))
        self._offloads.add(task)
        task.add_done_callback(self._offload_done)

    def _offload_done(self, task: asyncio.Task) -> None:
        self._offloads.discard(task)
        self._progress.set()  # only now can drain() see that the offload is over

    async def _offload_batch(self, plan: policy.BatchPlan) -> None:
        """Run a plan on a peer: each request as its own v2 request, concurrently over the
        peer's pooled connection, with what the client sent (before any prepare hook). The peer
        batches them with its own limits, which this daemon cannot know; and a peer's answer
        about one request (a 4xx) concerns that request alone. A request whose offload fails
        is retried locally while its deadline allows."""
        loop = self._loop

        async def send(r: Pending) -> None:
            outputs, peer = await self.offload.infer(self.name, r.request.inputs, r.deadline - loop.time())
            outputs = conform_outputs(outputs, self.outputs, r.rows, peer, self.name)
            self._count_offload(plan.reason, "ok", [r])
            if r.request.outputs is not None:
                outputs = {name: outputs[name] for name in r.request.outputs if name in outputs}
            if not r.future.done():
                r.future.set_result(InferResponse(self.name, r.request.id, outputs))
                self._m_ok.inc()

        results = await asyncio.gather(*(send(r) for r in plan.requests), return_exceptions=True)
        for r, outcome in zip(plan.requests, results):
            if isinstance(outcome, BaseException):
                self._offload_failed(plan.reason, r, outcome)
        self._schedule()

    def _offload_failed(self, reason: str, r: Pending, error: BaseException) -> None:
        now = self._loop.time()
        local_ok = reason not in (policy.REMOTE_ONLY, policy.TOO_LARGE)
        if local_ok and r.deadline - now > self.exec_time.estimate(self.settings.preferred_batch_sizes[0]):
            retry = dataclasses.replace(r, taken=False, local_only=True)
            try:
                self.queue.push(retry)
                self._count_offload(reason, "failed_local_retry", [r])
                log.warning("model %s: offload failed (%s); retrying locally", self.name, error)
                return
            except Overloaded:
                pass
        self._count_offload(reason, "failed", [r])
        if isinstance(error, EdgeBatcherError) and error.status < 500:
            answer = error  # the peer's verdict on this request's input (400, 404): pass it on
        else:
            why_not_local = {policy.REMOTE_ONLY: "the model is remote-only",
                             policy.TOO_LARGE: "the request is larger than the local engine takes"}
            answer = Unavailable(f"model {self.name!r}: offload to the peer failed ({error}) and "
                                 f"{why_not_local.get(reason, 'it cannot run locally in time')}")
        log.warning("model %s: offload failed: %s", self.name, answer)
        self._fail(r, answer)

    def _count_offload(self, reason: str, outcome: str, group: list[Pending]) -> None:
        n = len(group)
        self.metrics.offloaded_requests_total.inc(n, model=self.name, reason=reason, outcome=outcome)
        key = f"{reason}/{outcome}"
        self.stats.offloaded[key] = self.stats.offloaded.get(key, 0) + n

    # ------------------------------------------------------------------ introspection

    def statistics(self) -> dict:
        """Triton's statistics-extension shape, plus edge-batcher's dispatch reasons and padding."""
        s = self.stats
        return {
            "name": self.name,
            "version": "1",
            "last_inference": s.last_inference_ms,
            "inference_count": s.inference_count,
            "execution_count": s.execution_count,
            "inference_stats": {
                "success": {"count": s.success_count, "ns": s.success_ns},
                "fail": {"count": s.fail_count + s.expired + s.rejected, "ns": s.fail_ns},
                "queue": {"count": s.success_count, "ns": s.queue_ns},
                "compute_infer": {"count": s.execution_count, "ns": s.engine_ns},
                # assembling padded batches and splitting outputs, on the engine's worker thread
                "compute_input_output": {"count": s.execution_count, "ns": s.compute_ns - s.engine_ns},
            },
            "batch_stats": [
                {"batch_size": size, "compute_infer": {"count": c, "ns": ns}}
                for size, (c, ns) in sorted(s.batch_stats.items())
            ],
            "dispatch_reasons": dict(s.reasons),
            "padding_rows": s.padding_rows,
            "padding_ratio": s.padding_rows / s.batch_rows if s.batch_rows else 0.0,
            "expired": s.expired,
            "offloaded": dict(s.offloaded),
            "queue_depth": len(self.queue),
            "exec_time_ms": {str(k): round(v * 1e3, 4) for k, v in sorted(self.exec_time.measured().items())},
        }


def _stack(parts: list[np.ndarray], size: int, seq_axis: int | None, bucket: int, pad_value: float) -> np.ndarray:
    """One batch tensor of `size` rows: the parts, padded on the sequence axis to the bucket,
    then padding rows (copies of the last real row: always a valid input) up to size."""
    if seq_axis is None:
        rows = sum(part.shape[0] for part in parts)
        if rows < size:
            parts = [*parts, np.repeat(parts[-1][-1:], size - rows, axis=0)]
        return parts[0] if len(parts) == 1 else np.concatenate(parts)
    first = parts[0]
    shape = list(first.shape)
    shape[seq_axis] = bucket
    shape[0] = size
    out = np.empty(shape, dtype=first.dtype)
    out.fill(pad_value if first.dtype != object else b"")
    row = 0
    for part in parts:
        n = part.shape[0]
        index = [slice(row, row + n)] + [slice(None)] * (part.ndim - 1)
        index[seq_axis] = slice(0, part.shape[seq_axis])
        out[tuple(index)] = part
        row += n
    if row < size:
        out[row:] = out[row - 1]
    return out


def _zeros(spec: TensorSpec, size: int, seq_axis: int | None, bucket: int) -> np.ndarray:
    shape = [size] + [(bucket if axis == seq_axis else (d if d > 0 else 1)) for axis, d in enumerate(spec.shape) if axis > 0]
    dtype = DATATYPE_TO_NUMPY[spec.datatype]
    if dtype == object:
        return np.full(shape, b"", dtype=object)
    return np.zeros(shape, dtype=dtype)


def _v2_name(dtype: np.dtype) -> str:
    for name, d in DATATYPE_TO_NUMPY.items():
        if d == dtype:
            return name
    return str(dtype)


def _shape_text(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join("batch" if i == 0 else ("-1" if d < 0 else str(d)) for i, d in enumerate(shape)) + "]"
