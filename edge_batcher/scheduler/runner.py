"""Drives one model: validates and queues requests, asks the policy for batches, runs them.

Threads: everything here runs on the event loop; a batch runs on its engine instance's own
worker thread (execute.py; one thread per instance: inference never blocks the loop, and an
engine object is only ever touched by one thread). The hot path is plain callbacks, no task
per batch: `submit` queues a request and calls `_schedule` when the policy says the arrival may
change its answer; `_schedule` runs the (pure) policy and hands each planned batch to the
instance slots.py picks; the worker's completion callback answers the batch's futures and
calls `_schedule` again; a timer calls it when the policy said to look again later. Input
checks live in validate.py, batch assembly in batch.py, counters and metrics in stats.py,
warm-up in warmup.py, sending peer batches in offloading.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar, cast

from ..config import ModelConfig
from ..cpu_affinity import thread_is_pinned
from ..engines.base import Engine, with_hook_defaults
from ..errors import (
    DeadlineExceeded,
    DoesNotFit,
    EdgeBatcherError,
    EngineError,
    InvalidInput,
    OutOfMemory,
    Overloaded,
    Unavailable,
)  # fmt: skip
from ..metrics import Metrics
from ..shared_memory.device_tensor import holds_device_tensor
from ..types import InferRequest, InferResponse, TensorSpec
from . import policy
from .execute import Answers, BatchExecutor, DispatchRound, LocalBatch, Outcome
from .offloading import Offloader, OffloadPort
from .policy import Dispatch, Reason, Reject, Target, Wait
from .preparing import Prepared, PrepareStage, Preparing
from .queues import ModelQueue, Pending, QueuedRequest
from .slots import InstanceSlots
from .stats import ModelStats, RunnerStats
from .timing import ExecTimeModel
from .validate import RequestValidator
from .warmup import warm_up
from .worker import EngineThreads

if TYPE_CHECKING:
    from ..memory.admission import Admission

log = logging.getLogger(__name__)

T = TypeVar("T")

# An engine whose batches take at least this long (measured at warm-up) runs its worker
# thread on every CPU instead of the event loop's ([server] loop_cpu): the loop then waits on
# the engine most of the time, and sharing its CPU would only keep the engine's own compute
# (ONNX Runtime runs on the calling thread with intra_op_threads = 1) off the other cores.
# Below it, sharing one CPU wins: the GIL changes hands several times per batch, cheaply on
# one core. Where the two cross: tools/bench_engine_cost.py, docs/benchmarks.md.
WORKER_ON_EVERY_CPU_FROM_S = 0.5e-3


class ModelRunner:
    def __init__(self, config: ModelConfig, engines: list[Any], metrics: Metrics, *, admission: Admission | None = None,
                 offload: OffloadPort | None = None, resident_bytes: int = 0) -> None:
        if not engines:
            raise ValueError("a model runner needs at least one engine instance")
        self.config = config
        self.name = config.name
        self.engines: list[Engine] = [with_hook_defaults(e) for e in engines]
        first = self.engines[0]
        self.inputs: list[TensorSpec] = first.inputs
        # An engine may turn what clients send into what the model runs on (text -> token ids),
        # on a thread of its own, never on the event loop (preparing.py); batches are then built
        # from its batch_inputs.
        self._preparing = PrepareStage(self.name, first.prepare, self._prepared) if first.prepare else None
        self.batch_inputs: list[TensorSpec] = first.batch_inputs or self.inputs
        self.outputs: list[TensorSpec] = first.outputs
        self.metrics = metrics
        self.resident_bytes = resident_bytes  # weights counted as resident in the memory budget
        b = config.batching
        self.settings = policy.PolicySettings(
            preferred_batch_sizes=tuple(b.preferred_batch_sizes),
            max_batch_size=b.max_batch_size,
            max_queue_delay_s=b.max_queue_delay_ms / 1000.0,
            dispatch_when_idle=b.dispatch_when_idle,
        )
        self.admission = admission  # memory.admission.Admission, or None: no memory limit
        self.fits = admission.fits if admission is not None else (lambda size, seq_len: True)
        # None: this daemon has no peers.
        self.offload = offload
        self.exec_time = ExecTimeModel()
        # Set by warm-up: the slowest size's fastest run. Where the engine's workers run is decided
        # by it, not by the median, which a busy machine (a CI's other jobs) can push past the bar.
        self.engine_floor_s = 0.0
        self.queue = ModelQueue(capacity=b.queue_capacity, priority_levels=b.priority_levels)
        self.validator = RequestValidator(self.name, self.inputs, self.outputs, config.sequence,
                                          allow_non_finite=config.allow_non_finite_inputs, batching=b)
        self._stats = RunnerStats(self.name, metrics)
        self._loop: asyncio.AbstractEventLoop | None = None  # set by start()
        # One thread per engine instance, from now on: measurement and warm-up run on the
        # thread that serves (worker.py: device libraries keep per-thread memory).
        self._threads = EngineThreads(self.name, self.engines)
        # Without a prepare hook a batch carries the clients' tensors as they came: its worker
        # checks them for NaN and Infinity once per batch instead of the loop once per request
        # (a numpy call costs the busy loop ~10 us even for 256 values: docs/benchmarks.md).
        self._finite_on_worker = self._preparing is None
        worker_checks = self._finite_on_worker and bool(self.validator.finite_inputs)
        self._execute = BatchExecutor(self.name, self.engines, self.batch_inputs, self.validator.seq_axis,
                                      config.sequence.pad_value if config.sequence else 0,
                                      [spec.name for spec in self.outputs],
                                      finite_check=self.validator if worker_checks else None)
        self._slots = InstanceSlots(len(engines))  # which instance takes the next batch (slots.py)
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None  # when the policy wants to look again; None: no timer
        self._memory_back_due = False  # a look-again after memory came back is on the loop's queue
        self._local_batches = 0  # batches with a worker (queued there or running)
        self._company = 1  # requests the last finished batch's round carried (policy.PlanState.company)
        self.batches_started = 0  # local batches handed to a worker, ever (the memory watch's "what ran")
        self.shrunk_from: int | None = None  # the largest batch size before the memory watch shrank it
        self._draining = False
        self._closed = False
        # Set when a batch or an offload finished, or requests were rejected: drain() waits on it.
        self._progress = asyncio.Event()
        # Batches on their way to a peer; None: this daemon has no peers.
        self._offloads = None if offload is None else Offloader(
            self.name, offload, self.outputs, self._stats, requeue=self._retry_locally, fail=self._fail,
            settled=self._schedule, progress=self._progress,
            # with a prepare hook, submit() has checked the client's inputs already
            non_finite=self.validator.non_finite if self._finite_on_worker else None)

    # ------------------------------------------------------------------ lifecycle

    def set_admission(self, admission: Admission | None, resident_bytes: int) -> None:
        """The model's memory plan, measured after the runner exists (memory/wiring.py runs the
        measurement on its instances' threads): admission control and the resident bytes
        counted in the budget."""
        self.admission = admission
        self.fits = admission.fits if admission is not None else (lambda size, seq_len: True)
        self.resident_bytes = resident_bytes

    @property
    def resident_meter(self) -> str | None:
        device = self.admission.device if self.admission is not None else None
        return device.meter if device is not None else None

    def shrink_batch_size(self) -> int | None:
        """Serve only the sizes below the largest (the memory budget is overdrawn): the new
        largest size, or None when only the smallest is left."""
        capped = policy.capped_after_oom(self.settings, self.settings.max_batch_size)
        if capped is None:
            return None
        if self.shrunk_from is None:
            self.shrunk_from = self.settings.max_batch_size
        self.settings = capped
        return capped.max_batch_size

    def regrow_batch_size(self) -> int | None:
        """One size back up after shrink_batch_size (the budget has room again): the new largest
        size, or None when the model is not shrunk."""
        if self.shrunk_from is None:
            return None
        grown = policy.regrown(self.settings, self.shrunk_from)
        if grown is not None:
            self.settings = grown
        if self.settings.max_batch_size >= self.shrunk_from:
            self.shrunk_from = None
        return self.settings.max_batch_size

    def on_instance(self, instance: int, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) on an engine instance's own thread, waited for: load-time work only
        (measurement, warm-up). Blocking: call off the event loop, before start()."""
        return self._threads.call(instance, fn, *args)

    def infer_on(self, instance: int, batch: dict[str, Any]) -> dict[str, Any]:
        """One batch on an instance's own thread, waited for (the memory measurement's runs)."""
        return self.on_instance(instance, self.engines[instance].infer, batch)

    def warm_up(self) -> None:
        """Run every allowed batch size on every instance once before serving (warmup.py).
        Blocking: call off the event loop."""
        warm_up(self)

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        every_cpu = self.engine_floor_s >= WORKER_ON_EVERY_CPU_FROM_S  # 0 when not warmed up
        if every_cpu and thread_is_pinned():
            log.info("model %s: batches take up to %.2f ms: its engine worker threads run on every CPU, "
                     "not only on the event loop's", self.name, self.engine_floor_s * 1e3)
        self._threads.serve(self._loop, every_cpu=every_cpu)
        if self._preparing is not None:
            self._preparing.serve(self._loop)
        self._slots.open()
        if self.admission is not None:
            self.admission.budget.on_memory_back(self.admission.line_key, self._memory_back)

    async def drain(self, timeout: float) -> None:
        """Stop taking requests, run everything queued now, wait for batches in flight."""
        self._draining = True
        self._schedule()
        deadline = time.monotonic() + timeout
        while (len(self.queue) or self._offloads or self._local_batches or self._being_prepared) \
                and time.monotonic() < deadline:
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
        self._wait_for_memory(False)
        if self.admission is not None:
            self.admission.budget.forget_waker(self.admission.line_key, self._memory_back)
        if self._timer is not None:
            self._timer.cancel()
        for req in self.queue.take_all():
            self._fail(req, Unavailable(f"model {self.name!r} was unloaded"))
        if self._preparing is not None:
            await self._preparing.stop()  # what it hands back now is answered Unavailable
        await self._threads.stop()

    def close_unstarted(self) -> None:
        """close() for a runner that never served (its load failed): blocking, off the loop."""
        if self._preparing is not None:
            self._preparing.stop_now()
        self._threads.stop_now()

    @property
    def _being_prepared(self) -> int:
        return self._preparing.count if self._preparing is not None else 0

    # ------------------------------------------------------------------ requests

    def submit(self, request: InferRequest) -> asyncio.Future[InferResponse]:
        """Validate and queue a request; the returned future resolves to its InferResponse.
        Raises InvalidInput, Overloaded or Unavailable at once when it cannot be queued. A
        model with a prepare hook gets the request back from its prepare thread first
        (preparing.py), so what that finds comes from the future."""
        if self._draining:
            raise Unavailable(f"model {self.name!r} is not accepting requests: the daemon is draining")
        loop = self._loop
        if loop is None:
            raise Unavailable(f"model {self.name!r} is not serving yet")
        validator = self.validator
        inputs, rows, seq_len = validator.validate(request, check_length=self._preparing is None,
                                                   check_finite=not self._finite_on_worker)
        # Inputs in CUDA shared memory are read on the worker thread only: never by a prepare hook
        # on the host, never by a peer (another machine cannot read this one's device memory).
        on_device = holds_device_tensor(inputs)
        priority, timeout_s = validator.priority(request), validator.timeout_s(request)
        now = loop.time()
        future = loop.create_future()
        if self._preparing is not None:
            if on_device:
                raise InvalidInput(f"model {self.name!r} prepares its inputs on the host (text -> tokens): "
                                   "send them as data or in system shared memory, not CUDA shared memory")
            self._refuse_if_full()  # the queue's capacity counts the requests being prepared
            self._preparing.add(Preparing(request, inputs, rows, priority, now, now + timeout_s, future))
            return future
        self._queue(Pending(priority, now, now + timeout_s, rows, validator.bucket(seq_len), request=request,
                            inputs=inputs, future=future, local_only=on_device,
                            found_idle=not self.queue and self._local_batches == 0), now)
        return future

    def _prepared(self, items: list[Preparing], results: list[Prepared]) -> None:
        """Requests back from the prepare thread (on the loop): queued, or answered with why not."""
        for item, result in zip(items, results):
            if item.future.done():  # the caller gave up
                continue
            try:
                if isinstance(result, BaseException):
                    raise result
                if self._closed:
                    raise Unavailable(f"model {self.name!r} was unloaded")
                inputs, seq_len = result
                self.validator.check_seq_len(seq_len)
                assert self._loop is not None  # requests are taken only once start() set the loop
                self._queue(Pending(item.priority, item.arrived, item.deadline, item.rows,
                                    self.validator.bucket(seq_len), request=item.request, inputs=inputs,
                                    future=item.future, found_idle=not self.queue and self._local_batches == 0),
                            now=self._loop.time())
            except EdgeBatcherError as exc:
                self._count_status(exc.status)
                item.future.set_exception(exc)
            except Exception as exc:  # noqa: BLE001 - the transport's unexpected-error answer
                item.future.set_exception(exc)
        self._progress.set()

    def _queue(self, pending: Pending, now: float) -> None:
        """Queue a checked (and prepared) request; raises Overloaded or InvalidInput when it
        cannot be."""
        if pending.rows > self.settings.max_batch_size:
            self._submit_oversized(pending)
            return
        self.queue.push(pending)
        bucket = self.queue.buckets[pending.bucket]
        if policy.company_arrived(bucket, self.settings, self._company):
            # Due at once (policy.IDLE), planned one loop turn later: requests that arrive in the
            # same turn (a burst read at once, a gather of calls) still join its batch.
            self._arm_timer(now)
        elif policy.decision_may_change(
            pending, bucket.rows, self.settings, self.exec_time,
            slot_free=bool(self._slots.free), has_peer=self.offload is not None, timer_at=self._timer_at,
        ):
            self._schedule()

    def _submit_oversized(self, queued: Pending) -> None:
        """More rows than the local engine takes: straight to a peer, or a clear error."""
        view = self._offload_view()
        if queued.local_only:  # inputs in CUDA shared memory: no peer can take it
            raise InvalidInput(f"request has {queued.rows} rows, more than model {self.name!r} max_batch_size "
                               f"{self.settings.max_batch_size}; split it into smaller requests")
        if self._offloads is None or not policy.sends_oversized_to_peer(queued.rows, self.settings, view):
            peer_note = ""
            if self.offload is not None:
                peer_note = (f" and than a peer takes in one request ([offload] max_rows {view.max_rows})"
                             if view.peer_available and queued.rows > view.max_rows else " and no peer can take it now")
            raise InvalidInput(
                f"request has {queued.rows} rows, more than model {self.name!r} max_batch_size "
                f"{self.settings.max_batch_size}{peer_note}; split it into smaller requests"
            )
        queued.taken = True
        plan = policy.BatchPlan([queued], queued.rows, queued.rows, queued.bucket, Reason.TOO_LARGE, target=Target.PEER)
        self._offloads.send(plan)

    def infer(self, request: InferRequest) -> asyncio.Future[InferResponse]:
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

    @property
    def stats(self) -> ModelStats:
        return self._stats.counts

    @property
    def cuda_graphs(self) -> bool:
        """Whether its engines replay captured CUDA graphs (all instances load alike)."""
        return any(engine.cuda_graphs for engine in self.engines)

    def loop_cpu_threads(self) -> list[int]:
        """Native ids of the engine worker threads that follow the event loop's CPU (all but
        those of a model with long batches, which run on every CPU)."""
        return self._threads.loop_cpu_threads()

    @contextlib.contextmanager
    def unrecorded(self) -> Iterator[None]:
        """Requests answered inside the block are not counted in this model's statistics or
        metrics (the daemon's own calibration load, placement.py)."""
        kept = self._stats
        self._stats = RunnerStats(self.name, Metrics())
        try:
            yield
        finally:
            self._stats = kept

    def not_ready(self) -> str | None:
        """Why this model cannot serve now, or None: not started, draining, or (without a peer)
        not even its smallest batch fits the memory budget in some length bucket, also once the
        memory others hold now (batches in flight, a generator's KV cache) comes back."""
        if self._draining:
            return "draining"
        if not self._threads.serving:
            return "not serving yet"
        if self.admission is not None and self.offload is None:
            smallest = self.settings.preferred_batch_sizes[0]
            for bucket in self.config.sequence.buckets if self.config.sequence else [0]:
                if not self.admission.fits_later(smallest, bucket):
                    return "does not fit in device memory: " + self.admission.explain(smallest, bucket)
        return None

    def refuse_if_full(self) -> None:
        """Raise Overloaded (counted like any other answer) when the queue is already full, so a
        transport can refuse a request before reading and decoding its body. `submit` checks again."""
        try:
            self._refuse_if_full()
        except Overloaded:
            self._count_status(Overloaded.status)
            raise

    def _refuse_if_full(self) -> None:
        waiting = len(self.queue) + self._being_prepared
        if waiting >= self.queue.capacity:
            raise Overloaded(f"queue full: {waiting} requests waiting (queue_capacity {self.queue.capacity})")

    def _count_status(self, status: int) -> None:
        self._stats.count_status(status)

    # ------------------------------------------------------------------ scheduling

    def _schedule(self) -> None:
        """Expire what is due, ask the policy for batches until it has none to dispatch now,
        hand them out, and set the timer for when it wants to look again."""
        if self._closed or self._loop is None:
            return
        if not self.queue.count:
            self._stats.depth.set(0)
            self._wait_for_memory(False)
            return  # nothing to plan or expire; a timer still set fires and finds nothing
        loop = self._loop
        round_ = DispatchRound()  # the batches this call dispatches go together
        while True:
            now = loop.time()
            for req in self.queue.expire(now):
                self.stats.expired += 1
                waited = (now - req.arrival) * 1000
                self._fail(req, DeadlineExceeded(
                    f"deadline passed after {waited:.1f} ms in the queue of model {self.name!r}, before it could run"))
            offload = self._offload_view()
            state = policy.PlanState(
                draining=self._draining, busy=self._local_batches > 0, local_free=bool(self._slots.free),
                # only the offload decision reads busy_s: not worth computing without a peer
                busy_s=self._slots.wait_s(now) if offload.peer_available else 0.0, offload=offload,
                company=self._company,
                fits_later=self.admission.fits_later if self.admission is not None else None,
            )
            decision = policy.decide(self.queue, now, self.settings, self.exec_time, self.fits, state)
            if isinstance(decision, Reject):
                self._reject(decision)
                self._progress.set()
            wake_at = decision.wake_at
            if not isinstance(decision, Dispatch):
                break
            self._dispatch(decision.plan, now, round_)
            if wake_at is None or wake_at > now:
                break  # the policy saw nothing else due now
            if not self._slots.free and self.offload is None:
                # Without a free slot or a peer the policy can plan nothing more: the next
                # batch to finish plans again (it would only say so, at the cost of a call).
                wake_at = None
                break
        self._stats.depth.set(len(self.queue))
        # Also wake at the next deadline: a request must get its timeout error on time even
        # while every engine instance is busy (or stuck) and the policy has nothing to plan.
        expiry = self.queue.next_deadline()
        if expiry is not None and (wake_at is None or expiry < wake_at):
            wake_at = expiry
        self._wait_for_memory(isinstance(decision, (Wait, Dispatch)) and decision.waits_for_memory)
        self._arm_timer(wake_at)

    def _wait_for_memory(self, waiting: bool) -> None:
        """Stand in the budget's line while requests wait for memory others hold: a generator
        admits no new sequence meanwhile (memory/budget.py)."""
        if self.admission is None:
            return
        if waiting:
            self.admission.budget.wait_in_line(self.admission.line_key)
        else:
            self.admission.budget.leave_line(self.admission.line_key)

    def _memory_back(self) -> None:
        """The budget, on whichever thread: memory came back, or someone ahead left the line,
        while this model stands in it. Plan again now rather than at the next recheck
        (MEMORY_RECHECK_S)."""
        if self._memory_back_due or self._loop is None:
            return
        self._memory_back_due = True
        try:
            self._loop.call_soon_threadsafe(self._on_memory_back)
        except RuntimeError:  # the event loop is closed: nothing left to plan
            self._memory_back_due = False

    def _on_memory_back(self) -> None:
        self._memory_back_due = False
        self._schedule()

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
        assert self._loop is not None  # only _schedule arms it, once start() set the loop
        self._timer = self._loop.call_at(at, self._on_timer) if at is not None else None

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_at = None
        self._schedule()

    def _dispatch(self, plan: policy.BatchPlan, now: float, round_: DispatchRound) -> None:
        if plan.target is Target.PEER:
            assert self._offloads is not None  # the policy plans for a peer only when there is one
            self._offloads.send(plan)
            return
        instance = self._slots.take(now, self.exec_time.estimate(plan.size))
        round_.requests += len(plan.requests)
        self._start_batch(plan, instance, now, holds_slot=True, round_=round_)

    def _reject(self, decision: Reject) -> None:
        reason = decision.reason
        if self.admission is not None:
            smallest = self.settings.preferred_batch_sizes[0]
            reason = "does not fit in device memory: " + self.admission.explain(smallest, decision.requests[0].bucket)
        error = DoesNotFit(f"model {self.name!r}: {reason}")
        log.warning("model %s: rejecting %d request(s): %s", self.name, len(decision.requests), error)
        for req in decision.requests:
            self.stats.rejected += 1
            self._fail(req, error)

    # ------------------------------------------------------------------ local batches

    def _start_batch(self, plan: policy.BatchPlan, instance: int, now: float, *, holds_slot: bool,
                     round_: DispatchRound) -> None:
        reserved = self.admission.reserve(plan.size, plan.bucket) if self.admission is not None else 0
        self._local_batches += 1
        self.batches_started += 1
        batch = LocalBatch(plan, instance, reserved, now, holds_slot, round_)
        self._threads.submit(instance, self._execute, batch, self._batch_done)

    def _batch_done(self, batch: LocalBatch, outcome: Outcome | None, error: BaseException | None) -> None:
        """On the loop, when a worker finished a batch: answer its requests, free its slot
        and memory, plan again."""
        if batch.reserved and self.admission is not None:  # reserved: only with an admission
            self.admission.release(batch.reserved)
        instance = batch.instance
        if batch.holds_slot:
            self._slots.give_back(instance)
        self._local_batches -= 1
        plan = batch.plan
        self._company = batch.round.requests
        if error is None:
            assert outcome is not None  # the executor returned
            try:
                self._answer(batch, *outcome)
            except Exception as exc:  # a bug here must not leave callers waiting forever
                log.exception("model %s: answering a batch of %d failed", self.name, plan.size)
                failed = EngineError(f"model {self.name!r}: answering the batch failed: {exc}")
                for req in plan.requests:
                    self._fail(req, failed)
        elif isinstance(error, OutOfMemory):
            self._split_after_oom(plan, instance, error, batch.round)
        else:
            if not isinstance(error, EdgeBatcherError):
                error = EngineError(f"model {self.name!r}: batch failed: {error}")
            log.error("model %s: batch of %d failed: %s", self.name, plan.size, error)
            for req in plan.requests:
                self._fail(req, error)
            self.stats.fail_count += len(plan.requests)
        self._progress.set()
        self._schedule()  # memory and an instance came back: the policy may plan again

    def _answer(self, batch: LocalBatch, results: Answers, seconds: float, engine_seconds: float) -> None:
        requests = cast("list[Pending]", batch.plan.requests)  # the queue holds only Pending
        if engine_seconds:
            self._record(batch, [r for r, out in zip(requests, results) if isinstance(out, dict)], seconds,
                         engine_seconds)
        name = self.name
        for req, outputs in zip(requests, results):
            if outputs is None:
                self.stats.expired += 1
                self._fail(req, DeadlineExceeded(
                    f"deadline passed while the batch waited for engine instance {batch.instance} of model {name!r}"))
                continue
            if isinstance(outputs, EdgeBatcherError):  # NaN or Infinity, or its outputs not written
                self._fail(req, outputs)
                continue
            request = req.request
            if request.outputs is not None:
                outputs = {o: outputs[o] for o in request.outputs}
            if not req.future.done():  # done = the caller gave up; the rest of the batch is unaffected
                req.future.set_result(InferResponse(name, request.id, outputs))

    def _split_after_oom(self, plan: policy.BatchPlan, instance: int, error: OutOfMemory,
                         round_: DispatchRound) -> None:
        """The engine ran out of memory although the estimate said the batch fits: raise the
        estimate's calibration, split the batch in two smaller preferred sizes and retry each
        on the same instance (after what its worker has queued), as part of the batch's round. A
        batch of the smallest size that still fails gets the error."""
        self.metrics.oom_retries_total.inc(model=self.name)
        factor = self.admission.raise_calibration() if self.admission is not None else None
        parts, failed = policy.oom_split(plan.requests, plan.size, self.settings.preferred_batch_sizes)
        if parts:
            log.warning(
                "model %s: out of memory on a batch of %d; splitting it and retrying (estimate calibration now %s)",
                self.name, plan.size, f"{factor:.2f}" if factor else "n/a",
            )
        else:
            log.error("model %s: out of memory on a batch of %d that cannot be split: %s", self.name, plan.size, error)
        for req in failed:
            self._fail(req, error)
        assert self._loop is not None  # batches run only once start() set the loop
        now = self._loop.time()
        for part, rows, size in parts:
            part_plan = policy.BatchPlan(part, rows, size, plan.bucket, reason=Reason.OOM_SPLIT)
            self._start_batch(part_plan, instance, now, holds_slot=False, round_=round_)

    def _record(self, batch: LocalBatch, answered: list[Pending], seconds: float, engine_seconds: float) -> None:
        self.exec_time.observe(batch.plan.size, seconds)
        assert self._loop is not None  # batches run only once start() set the loop
        self._stats.record_batch(batch.plan, [r.arrival for r in answered], sum(r.rows for r in answered),
                                 batch.dispatched, self._loop.time(), seconds, engine_seconds)

    def _fail(self, req: QueuedRequest, error: EdgeBatcherError) -> None:
        future = cast(Pending, req).future  # the queue holds only Pending
        if not future.done():
            future.set_exception(error)
            self._count_status(error.status)
        assert self._loop is not None  # requests are queued only once start() set the loop
        self.stats.fail_ns += int((self._loop.time() - req.arrival) * 1e9)

    def _retry_locally(self, r: Pending, reason: Reason) -> bool:
        """A request whose offload failed goes back to the queue, never to a peer again, when
        the policy says it may run here in time (and the queue has room)."""
        assert self._loop is not None  # offloads run only once start() set the loop
        if not policy.retries_locally(reason, r.deadline - self._loop.time(), self.exec_time, self.settings):
            return False
        try:
            self.queue.push(dataclasses.replace(r, taken=False, local_only=True))
        except Overloaded:
            return False
        return True

    # ------------------------------------------------------------------ introspection

    def statistics(self) -> dict[str, Any]:
        """Triton's statistics-extension shape, plus edge-batcher's dispatch reasons, padding,
        and what `edge-batcher ps` shows: instances, the batch sizes served, memory."""
        stats = self._stats.to_json(len(self.queue), self.exec_time.measured().items())
        device = self.admission.device if self.admission is not None else None
        buckets = self.config.sequence.buckets if self.config.sequence else [0]
        stats["instances"] = len(self.engines)
        stats["batch_sizes"] = [s for s in self.settings.preferred_batch_sizes if s <= self.settings.max_batch_size
                                and not (device is not None and all(device.refuses(s, b) for b in buckets))]
        stats["memory"] = {"resident_bytes": self.resident_bytes,
                           "measured_by": device.meter if device is not None else "estimate"}
        return stats
