"""One load phase through the whole runtime in this process (validation, queue, policy, worker
thread, futures) on a fresh runner: closed loop (N concurrent callers) or open loop (Poisson
arrivals, open_loop.py). Overhead outside the engine = CPU time of the event-loop thread per
request plus the worker's batch assembly and splitting per request; it is CPU time, so the other
core's work does not count."""

from __future__ import annotations

import asyncio
import time

from .. import placement
from ..errors import EdgeBatcherError
from ..gc_freeze import freeze_survivors, thaw
from ..metrics import Metrics
from ..runtime import load_runner
from ..types import InferRequest
from .closed_loop import ClosedLoopRun, closed_loop
from .figures import by_status, percentiles
from .open_loop import OpenLoopRun, generator_cost_us, poisson_arrivals


async def in_process(model_config, sample, args, *, closed: bool, rate: float = 0.0,
                     auto_cpu: int | None = None, gc_freeze: bool = True) -> dict:
    """One load phase on a fresh runner; `auto_cpu`: first let placement.choose decide
    between that CPU and any CPU, as the daemon does with loop_cpu = "auto"; `gc_freeze`: keep
    what is alive then out of the collector's walks, as the daemon does once ready."""
    loop = asyncio.get_running_loop()
    metrics = Metrics()
    runner = await loop.run_in_executor(None, load_runner, model_config, metrics, True)
    await runner.start()
    choice = await placement.choose(auto_cpu, [runner]) if auto_cpu is not None else None
    if gc_freeze:
        freeze_survivors("bench phase")

    cpu0 = time.thread_time()
    if closed:
        run = await _closed_loop(runner, model_config.name, sample, args)
    else:
        arrivals = await poisson_arrivals(runner, model_config.name, sample, rate, args.duration)
    # Before the figures: the loop's CPU of the run alone (numpy's first percentile call
    # imports modules: ~25 ms of this thread's CPU).
    loop_cpu = time.thread_time() - cpu0
    figures = _closed_figures(run) if closed else _open_figures(arrivals, rate)
    stats = runner.statistics()
    await runner.close()
    if gc_freeze:
        thaw()
    answered = sum(figures["statuses"].values())
    worker_io_s = stats["execution_ns"]["assemble_and_split"] / 1e9
    overhead = (loop_cpu + worker_io_s) / answered * 1e6 if answered else None
    # The generator's own loop CPU, measured alone. The closed loop's is the same whatever the
    # runtime does, so it is subtracted; the open loop's depends on how busy the loop is (alone
    # it pays a loop turn per few arrivals, behind a saturated runtime it submits many per turn),
    # so it is shown beside the phase's figure, not subtracted from it.
    own = await (closed_generator_cost_us(model_config.name, sample) if closed
                 else generator_cost_us(model_config.name, sample, rate))
    return {
        **figures,
        "batch_sizes": {str(b["batch_size"]): b["compute_infer"]["count"] for b in stats["batch_stats"]},
        "dispatch_reasons": stats["dispatch_reasons"],
        "padding_ratio": round(stats["padding_ratio"], 4),
        # Per request answered, whatever its status: a refused request costs the loop too.
        "overhead_us_per_request": overhead,
        "generator_us_per_request": own,
        "runtime_overhead_us_per_request": overhead - own if overhead is not None and closed else None,
        "loop_cpu_us_per_request": loop_cpu / answered * 1e6 if answered else None,
        "engine_us_per_request": stats["execution_ns"]["engine"] / 1e3 / answered if answered else None,
        **({"placement_cpu": choice.cpu, "placement": choice.why} if choice else {}),
    }


async def _closed_loop(runner, model: str, sample, args) -> ClosedLoopRun:
    """`args.concurrency` callers, each sending its next request when its last is answered."""
    async def send() -> tuple[int, str | None]:
        try:
            await runner.infer(InferRequest(model, sample))
        except EdgeBatcherError as exc:  # counted, as a client would see it
            await asyncio.sleep(0)  # a refusal raises at once: let the loop run before the next
            return exc.status, type(exc).__name__
        return 200, None

    return await closed_loop(send, args.concurrency, args.duration)


def _closed_figures(run: ClosedLoopRun) -> dict:
    return {"requests": len(run.latencies), "throughput_rps": run.throughput_rps, "offered_rps": None,
            "statuses": by_status(run.statuses), "errors": dict(run.errors), **percentiles(run.latencies)}


def _open_figures(run: OpenLoopRun, rate: float) -> dict:
    """Poisson arrivals at `rate`. Throughput counts the successful answers given while
    arrivals were due, over that window: the rate the runtime kept up with."""
    lag = percentiles(run.lags)
    return {"requests": len(run.latencies), "throughput_rps": run.served_in_window / run.window_s,
            "rate": rate, "offered_rps": run.offered / run.window_s,
            "statuses": by_status(run.statuses), "errors": dict(run.errors), **percentiles(run.latencies),
            "lag_p50_ms": lag["p50_ms"], "lag_p99_ms": lag["p99_ms"]}


async def closed_generator_cost_us(model: str, sample) -> float:
    """Event-loop CPU per request of the closed-loop load generator itself: the same caller
    coroutine (building the InferRequest, awaiting, timing, recording) around a future that is
    already resolved. Subtracted to report the runtime's own overhead."""
    async def measure() -> float:
        loop = asyncio.get_running_loop()
        latencies: list[float] = []

        async def one() -> None:
            t0 = loop.time()
            InferRequest(model, sample)
            future = loop.create_future()
            future.set_result(None)
            await future
            latencies.append(loop.time() - t0)

        n = 20000
        cpu0 = time.thread_time()
        for _ in range(n):
            await one()
        return (time.thread_time() - cpu0) / n * 1e6

    # A fresh loop on a thread (on the caller's CPUs), while the bench's own loop waits idle.
    return await asyncio.get_running_loop().run_in_executor(None, asyncio.run, measure())
