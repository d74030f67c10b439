"""A local batch, and what an engine instance's worker thread does with it: assemble the
padded batch from its requests' tensors (batch.py; device_batch.py when some are in CUDA shared
memory), run the engine, cut the outputs per request. The only scheduler code that runs off the
event loop (runner.py hands batches to the workers of worker.py and answers them on the loop).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

from ..engines.base import Engine
from ..types import TensorSpec
from . import batch as batching
from . import device_batch, policy
from .queues import Pending

Outcome = tuple[batching.Outputs, float, float]  # outputs per request, seconds, engine seconds


@dataclass(eq=False, slots=True)
class LocalBatch:
    """A batch handed to an engine instance's worker."""

    plan: policy.BatchPlan
    instance: int
    reserved: int  # admission bytes held until it finishes
    dispatched: float
    holds_slot: bool  # False for the parts of a batch split after running out of memory


@dataclass(frozen=True)
class BatchExecutor:
    """Runs one model's batches; called on the worker thread of the batch's instance."""

    model: str
    engines: list[Engine]
    batch_inputs: list[TensorSpec]
    seq_axis: Callable[[str], int | None]
    pad_value: float
    output_names: list[str]

    def __call__(self, batch: LocalBatch) -> Outcome:
        """A batch may wait in the worker's queue behind the one running, so deadlines are
        checked again just before the engine runs: expired requests are left out (their slot
        becomes padding) and get None, which the loop answers with DeadlineExceeded. The clock
        is the event loop's (time.monotonic), so deadlines compare directly."""
        t0 = time.perf_counter()
        plan = batch.plan
        requests = cast("list[Pending]", plan.requests)  # the queue holds only Pending
        now = time.monotonic()
        live = [r for r in requests if r.deadline > now]
        if not live:
            return [None] * len(requests), 0.0, 0.0
        engine = self.engines[batch.instance]
        inputs: dict[str, Any] = {}
        releases: list[device_batch.Release] = []  # batches assembled on a device, freed after the run
        try:
            for spec in self.batch_inputs:
                parts = [r.inputs[spec.name] for r in live]
                seq_axis = self.seq_axis(spec.name)
                if device_batch.has_device_part(parts):
                    inputs[spec.name], release = device_batch.assemble(
                        parts, plan.size, seq_axis, plan.bucket, self.pad_value, engine.accepts_any_length,
                        engine.device_inputs)
                    if release is not None:
                        releases.append(release)
                else:
                    inputs[spec.name] = batching.stack(parts, plan.size, seq_axis, plan.bucket, self.pad_value,
                                                       engine.accepts_any_length)
            t1 = time.perf_counter()
            outputs = engine.infer(inputs)
            engine_seconds = time.perf_counter() - t1
        finally:
            for release in releases:
                release()
        batching.check_outputs(outputs, self.output_names, sum(r.rows for r in live), self.model)
        results = batching.split_rows(outputs, [r.rows if r.deadline > now else None for r in requests])
        return results, time.perf_counter() - t0, engine_seconds
