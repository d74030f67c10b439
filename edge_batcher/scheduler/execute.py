"""A local batch, and what an engine instance's worker thread does with it: assemble the
padded batch from its requests' tensors (batch.py; device_batch.py when some are in CUDA shared
memory), check it for NaN and Infinity where the runner left that to the worker, run the engine,
cut the outputs per request. The only scheduler code that runs off the event loop (runner.py
hands batches to the workers of worker.py and answers them on the loop).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

from ..engines.base import Engine
from ..errors import EdgeBatcherError, EngineError, InvalidInput
from ..types import TensorSpec
from . import batch as batching
from . import device_batch, policy
from .queues import Pending
from .validate import RequestValidator

# Per request, in batch order: its outputs, None (it expired before the run), or its error: why
# its inputs were refused (NaN or Infinity; its rows became padding) or its outputs not written.
Answers = list[dict[str, Any] | EdgeBatcherError | None]
Outcome = tuple[Answers, float, float]  # answers per request, seconds, engine seconds


@dataclass(eq=False, slots=True)
class DispatchRound:
    """The batches one planning round dispatched together (an idle burst's cheapest cover may
    be 4 + 2): how many requests they carried, the company the next idle arrival waits for."""

    requests: int = 0


@dataclass(eq=False, slots=True)
class LocalBatch:
    """A batch handed to an engine instance's worker."""

    plan: policy.BatchPlan
    instance: int
    reserved: int  # admission bytes held until it finishes
    dispatched: float
    holds_slot: bool  # False for the parts of a batch split after running out of memory
    round: DispatchRound = field(default_factory=DispatchRound)


@dataclass(frozen=True)
class BatchExecutor:
    """Runs one model's batches; called on the worker thread of the batch's instance."""

    model: str
    engines: list[Engine]
    batch_inputs: list[TensorSpec]
    seq_axis: Callable[[str], int | None]
    pad_value: float
    output_names: list[str]
    # The validator whose NaN and Infinity check the runner left to the worker: one numpy call
    # per batch here instead of one per request on the event loop. None: checked before
    # queueing, or not at all.
    finite_check: RequestValidator | None = None

    def __call__(self, batch: LocalBatch) -> Outcome:
        """A batch may wait in the worker's queue behind the one running, so deadlines are
        checked again just before the engine runs: expired requests are left out (their slot
        becomes padding) and get None, which the loop answers with DeadlineExceeded. The clock
        is the event loop's (time.monotonic), so deadlines compare directly. A request whose
        inputs hold NaN or Infinity is left out the same way and gets its InvalidInput."""
        t0 = time.perf_counter()
        plan = batch.plan
        requests = cast("list[Pending]", plan.requests)  # the queue holds only Pending
        now = time.monotonic()
        live = [r for r in requests if r.deadline > now]
        refused: dict[int, InvalidInput] = {}  # by id() of the request
        outputs = None
        engine_seconds = 0.0
        engine = self.engines[batch.instance]
        releases: list[device_batch.Release] = []  # batches assembled on a device, freed after the run
        try:
            inputs = self._assemble(live, plan, engine, releases) if live else {}
            check = self.finite_check
            if live and check is not None and not check.batch_is_finite(inputs):
                # Rare (a broken sensor): find the requests to blame, assemble the rest again.
                refused = {id(r): error for r in live if (error := check.non_finite(r.inputs)) is not None}
                if refused:
                    live = [r for r in live if id(r) not in refused]
                    _release(releases)
                    inputs = self._assemble(live, plan, engine, releases) if live else {}
            if live:
                t1 = time.perf_counter()
                outputs = engine.infer(inputs)
                engine_seconds = time.perf_counter() - t1
        finally:
            _release(releases)
        answers: Answers = [refused.get(id(r)) for r in requests]
        if outputs is not None:
            batching.check_outputs(outputs, self.output_names, sum(r.rows for r in live), self.model)
            ran = {id(r) for r in live}
            cut = batching.split_rows(outputs, [r.rows if id(r) in ran else None for r in requests])
            answers = [mine if id(r) in ran else answer for r, mine, answer in zip(requests, cut, answers)]
            for i, (r, answer) in enumerate(zip(requests, answers)):
                if r.request.finish_outputs is not None and isinstance(answer, dict):
                    answers[i] = _finish(r.request.finish_outputs, answer, self.model)
        return answers, time.perf_counter() - t0, engine_seconds

    def _assemble(self, live: list[Pending], plan: policy.BatchPlan, engine: Engine,
                  releases: list[device_batch.Release]) -> dict[str, Any]:
        inputs: dict[str, Any] = {}
        parts_of = {spec.name: [r.inputs[spec.name] for r in live] for spec in self.batch_inputs}
        on_device = {name for name, parts in parts_of.items() if device_batch.has_device_part(parts)}
        targets = self._engine_buffers(parts_of, plan.size, engine) if on_device else {}
        staging = self._staging(parts_of, plan, engine) if len(on_device) < len(parts_of) else {}
        for spec in self.batch_inputs:
            parts = parts_of[spec.name]
            seq_axis = self.seq_axis(spec.name)
            if spec.name in on_device:
                inputs[spec.name], release = device_batch.assemble(
                    parts, plan.size, seq_axis, plan.bucket, self.pad_value, engine.accepts_any_length,
                    engine.device_inputs, targets.get(spec.name))
                if release is not None:
                    releases.append(release)
            else:
                inputs[spec.name] = batching.stack(parts, plan.size, seq_axis, plan.bucket, self.pad_value,
                                                   engine.accepts_any_length, staging.get(spec.name))
        return inputs

    def _staging(self, parts_of: dict[str, list[Any]], plan: policy.BatchPlan, engine: Engine
                 ) -> dict[str, Any]:
        """The engine's own host arrays for this batch's shapes (Engine.host_batch_buffers:
        page-locked staging its copy to the device reads by DMA), or none."""
        buffers_for = engine.host_batch_buffers
        if buffers_for is None:
            return {}
        shapes = {}
        for name, parts in parts_of.items():
            if device_batch.has_device_part(parts):
                continue
            shape = batching.stack_shape(parts, plan.size, self.seq_axis(name), plan.bucket, engine.accepts_any_length)
            if shape is None:
                return {}  # parts that disagree on their shape: stack says so
            shapes[name] = shape
        return buffers_for(shapes) or {}

    def _engine_buffers(self, parts_of: dict[str, list[Any]], size: int, engine: Engine) -> dict[str, int]:
        """The engine's own buffers for this batch's shapes, to assemble a batch with parts in
        device memory in (Engine.device_batch_buffers: a CUDA graph's inputs), or none. None
        for a batch with a sequence input (padded on the host)."""
        buffers_for = engine.device_batch_buffers
        if buffers_for is None or any(self.seq_axis(name) is not None for name in parts_of):
            return {}
        try:
            shapes = {name: device_batch.batch_shape(parts, size) for name, parts in parts_of.items()}
        except EngineError:
            return {}  # rows that disagree on their shape: assemble says so
        return buffers_for(shapes) or {}


def _finish(finish: Callable[[dict[str, Any]], None], outputs: dict[str, Any], model: str
            ) -> dict[str, Any] | EdgeBatcherError:
    """A request's outputs after its finish_outputs hook, or the error that answers it alone."""
    try:
        finish(outputs)
    except EdgeBatcherError as exc:
        # without its traceback, whose frames would keep the hook (and the regions it holds
        # open) alive until the cyclic collector runs
        return exc.with_traceback(None)
    except Exception as exc:  # a device library's own error: this request's, not the batch's
        return EngineError(f"model {model!r}: writing this request's outputs failed: {exc}")
    return outputs


def _release(releases: list[device_batch.Release]) -> None:
    for release in releases:
        release()
    releases.clear()
