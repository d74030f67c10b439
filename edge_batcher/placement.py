"""`[server] loop_cpu = "auto"`: measure, on this host and these models, whether the event loop
and the short-batch engine workers are faster sharing one CPU or on any CPU, and keep the faster.

Neither placement wins everywhere. Sharing one CPU makes each GIL hand-over between the loop and
a worker a same-core switch: 1.1-1.7x the throughput on the 2-core VM. On a 16-CPU GPU machine
the same sharing gave 0.62-0.76x of threads on any CPU with the CUDA EP (issue 20): the worker's time in the engine
call (CUDA's waits, ONNX Runtime's compute on the calling thread) is taken from the loop's one
core. So after warm-up, before the daemon listens, one local model (the one with the shortest
batches, which the placement moves most) runs an in-process closed loop of its sample request
for 0.2 s per placement, alternated over three rounds, and the placement with the higher median
rate is kept; the start-up log gives both. Calibration requests never reach the model's
statistics or metrics, though what the runner learns from them (batch times, an out-of-memory
split) it keeps. Models with a peer are left out (their load could go to it), as are models
whose workers run on every CPU anyway (cpu_affinity.py); a model whose engine fails a request
hands the measurement to the next.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import statistics
import threading
import time
from dataclasses import dataclass

import numpy as np

from .cpu_affinity import pin_this_thread, pin_thread
from .errors import EdgeBatcherError
from .scheduler.runner import ModelRunner
from .types import DATATYPE_TO_NUMPY, InferRequest

ROUNDS = 3
SECONDS_PER_RUN = 0.2  # 1.2 s in all: 3 rounds of both placements


@dataclass(frozen=True)
class Choice:
    cpu: int | None  # the CPU the loop and short-batch workers share; None: any CPU
    rates: dict[str, tuple[float, float]]  # model -> median req/s (shared CPU, any CPU)
    why: str

    def describe(self) -> str:
        where = f"event loop and short-batch engine workers on CPU {self.cpu}" if self.cpu is not None \
            else "threads on any CPU"
        return f"{where} ([server] loop_cpu = \"auto\"): {self.why}"


def shared_cpu_wins(rates: dict[str, tuple[float, float]]) -> bool:
    """Whether sharing one CPU gave the higher geometric mean of the models' rates."""
    logs = [math.log(shared / anywhere) for shared, anywhere in rates.values() if shared > 0 and anywhere > 0]
    return bool(logs) and statistics.fmean(logs) > 0


def apply(cpu: int | None, runners: list[ModelRunner]) -> None:
    """Put the calling thread (the event loop) and every worker that follows it on `cpu`; None:
    every thread of the process on every CPU. Threads started later inherit the loop's mask."""
    pin_this_thread(cpu)
    if cpu is None:
        # Not only the workers: the threads the loop started while it was pinned for the
        # measurement inherited its CPU (the default executor's, which loaded the models and
        # later decode large bodies and correct a question's spelling).
        for thread in threading.enumerate():
            if thread.native_id is not None:
                with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
                    pin_thread(thread.native_id, None)
        return
    for runner in runners:
        for tid in runner.loop_cpu_threads():
            pin_thread(tid, cpu)


async def choose(cpu: int, runners: list[ModelRunner]) -> Choice:
    """Measure both placements on one of `runners` (started, warmed up) and apply the faster."""
    candidates = [r for r in runners if r.offload is None and r.loop_cpu_threads()]
    if not candidates:
        apply(None, runners)
        return Choice(None, {}, "no local model has an engine worker that would share the loop's CPU")
    # The model with the shortest batches: the one whose throughput the placement moves most.
    candidates.sort(key=lambda r: max(r.exec_time.measured().values(), default=0.0))
    failures = []
    for runner in candidates:
        try:
            shared, anywhere = await _measure(cpu, runner, runners)
        except EdgeBatcherError as exc:  # this model's engine failed a request: try the next model
            failures.append(f"{runner.name}: {exc}")
            continue
        rates = {runner.name: (shared, anywhere)}
        chosen = cpu if shared_cpu_wins(rates) else None
        apply(chosen, runners)
        return Choice(chosen, rates, f"measured shared CPU vs any CPU: {runner.name} {shared:.0f} vs {anywhere:.0f} "
                                     f"req/s (medians of {ROUNDS} x {SECONDS_PER_RUN:.1f} s)")
    apply(None, runners)
    return Choice(None, {}, f"measuring failed ({'; '.join(failures)}); threads stay on any CPU")


async def _measure(cpu: int, runner: ModelRunner, runners: list[ModelRunner]) -> tuple[float, float]:
    """Median req/s of `runner` with the threads on `cpu` and on any CPU, over alternated rounds."""
    runs: tuple[list[float], list[float]] = ([], [])
    for round_ in range(ROUNDS):
        # Alternate which placement goes first, so a drift in the machine's speed cancels out.
        for placement in ((cpu, None) if round_ % 2 == 0 else (None, cpu)):
            apply(placement, runners)
            runs[placement is None].append(await closed_loop_rate(runner, SECONDS_PER_RUN))
    return statistics.median(runs[0]), statistics.median(runs[1])


async def closed_loop_rate(runner: ModelRunner, seconds: float) -> float:
    """Requests per second that `runner` answers to enough closed-loop callers to fill its
    batch slots, over `seconds`; not counted in its statistics."""
    sample = sample_inputs(runner)
    callers = max(1, min(runner.queue.capacity // 2, 4 * runner.settings.max_batch_size * len(runner.engines)))
    done = 0
    stop_at = time.perf_counter() + seconds

    async def caller() -> None:
        nonlocal done
        while time.perf_counter() < stop_at:
            await runner.infer(InferRequest(runner.name, sample))
            done += 1

    with runner.unrecorded():
        started = time.perf_counter()
        await asyncio.gather(*(caller() for _ in range(callers)))
        return done / (time.perf_counter() - started)


def sample_inputs(runner: ModelRunner) -> dict[str, np.ndarray]:
    """One request's inputs: random data of the model's input shapes (rows = 1); sequence
    inputs at the smallest bucket's length, the work the runner pads to that bucket."""
    rng = np.random.default_rng(0)
    inputs = {}
    seq = runner.config.sequence
    for spec in runner.inputs:
        shape = [1] + [seq.buckets[0] if seq and spec.name in seq.inputs and axis == seq.axis else (d if d > 0 else 16)
                       for axis, d in enumerate(spec.shape) if axis > 0]
        dtype = DATATYPE_TO_NUMPY[spec.datatype]
        if dtype.kind == "f":
            inputs[spec.name] = rng.standard_normal(shape).astype(dtype)
        elif dtype.kind in "iub":
            inputs[spec.name] = rng.integers(0, 2, shape).astype(dtype)
        else:
            inputs[spec.name] = np.full(shape, b"edge-batcher", dtype=object)
    return inputs
