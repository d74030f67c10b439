"""Warm-up: every allowed batch size (and bucket) run on every engine instance before serving.

The first real request at a size is then not the slow one, and the runner's exec-time model
starts with measured times. An out-of-memory error at a size caps the sizes served from then on
(the policy's `capped_after_oom`) and raises the memory estimate's calibration. Blocking: the
loader runs it off the event loop, before the runner starts.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from ..config import ModelConfig
from ..engines.base import Engine
from ..errors import OutOfMemory
from ..types import TensorSpec
from . import batch as batching
from . import policy
from .timing import ExecTimeModel
from .validate import RequestValidator

log = logging.getLogger(__name__)

T = TypeVar("T")

RUNS_PER_SIZE = 3  # the median of three is the time seeded: the first run of a size is often slow


class Warmable(Protocol):
    """What warm-up reads and sets of a ModelRunner."""

    name: str
    config: ModelConfig
    engines: list[Engine]
    batch_inputs: list[TensorSpec]
    validator: RequestValidator
    settings: policy.PolicySettings  # capped here after an out-of-memory error
    fits: policy.FitsHook
    exec_time: ExecTimeModel
    admission: Any  # memory.admission.Admission or None
    engine_floor_s: float  # set here: the slowest size's fastest run

    def on_instance(self, instance: int, fn: Callable[..., T], *args: Any) -> T: ...


def warm_up(runner: Warmable) -> None:
    """Run the runner's sizes on its engines, seed its exec-time model, cap its settings on
    out of memory."""
    buckets = runner.config.sequence.buckets if runner.config.sequence else [0]
    for bucket in buckets:
        for size in policy.allowed_sizes(runner.settings, bucket, runner.fits):
            batch = {spec.name: batching.zeros(spec, size, runner.validator.seq_axis(spec.name), bucket)
                     for spec in runner.batch_inputs}
            try:
                for instance, engine in enumerate(runner.engines):
                    times = runner.on_instance(instance, _run_times, engine, batch)
                    runner.exec_time.observe(size, times[RUNS_PER_SIZE // 2])
                    # The fastest run is the engine's own cost: a busy machine only adds to it.
                    runner.engine_floor_s = max(runner.engine_floor_s, times[0])
            except OutOfMemory as exc:
                _cap_batch_size(runner, size, bucket, exc)
                break
    log.info(
        "model %s: warmed up sizes %s: %s", runner.name, list(runner.settings.preferred_batch_sizes),
        ", ".join(f"{s}: {t * 1e3:.2f} ms" for s, t in sorted(runner.exec_time.measured().items())),
    )


def _run_times(engine: Engine, batch: dict[str, Any]) -> list[float]:
    """Seconds of RUNS_PER_SIZE runs, shortest first (on the instance's own thread)."""
    timings = []
    for _ in range(RUNS_PER_SIZE):
        t0 = time.perf_counter()
        engine.infer(batch)
        timings.append(time.perf_counter() - t0)
    return sorted(timings)


def _cap_batch_size(runner: Warmable, size: int, bucket: int, error: OutOfMemory) -> None:
    """Warm-up ran out of memory at `size`: serve only the smaller sizes from now on."""
    capped = policy.capped_after_oom(runner.settings, size)
    if capped is None:
        raise error
    runner.settings = capped
    if runner.admission is not None:
        runner.admission.raise_calibration()
    log.warning(
        "model %s: warm-up ran out of memory at batch %d%s; serving batch sizes up to %d (%s)",
        runner.name, size, f" (bucket {bucket})" if bucket else "", capped.max_batch_size, error,
    )
