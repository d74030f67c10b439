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
from ..metrics import Metrics
from ..runtime import load_runner
from ..types import InferRequest
from .figures import percentiles
from .open_loop import poisson_arrivals


async def in_process(model_config, sample, args, *, closed: bool, rate: float = 0.0,
                      auto_cpu: int | None = None) -> dict:
    """One load phase on a fresh runner; `auto_cpu`: first let placement.choose decide
    between that CPU and any CPU, as the daemon does with loop_cpu = "auto"."""
    loop = asyncio.get_running_loop()
    metrics = Metrics()
    runner = await loop.run_in_executor(None, load_runner, model_config, metrics, True)
    await runner.start()
    choice = await placement.choose(auto_cpu, [runner]) if auto_cpu is not None else None

    latencies: list[float] = []
    errors: dict[str, int] = {}
    stop_at = loop.time() + args.duration

    async def one() -> None:
        t0 = loop.time()
        try:
            await runner.infer(InferRequest(model_config.name, sample))
        except EdgeBatcherError as exc:  # open loop past capacity: count it, as a client would see it
            errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
            return
        latencies.append(loop.time() - t0)

    async def caller() -> None:
        while loop.time() < stop_at:
            await one()

    cpu0 = time.thread_time()
    t0 = loop.time()
    if closed:
        await asyncio.gather(*(caller() for _ in range(args.concurrency)))
    else:
        await poisson_arrivals(runner, model_config.name, sample, rate, stop_at, latencies, errors)
    wall = loop.time() - t0
    loop_cpu = time.thread_time() - cpu0
    stats = runner.statistics()
    await runner.close()
    n = len(latencies)
    worker_io_s = stats["execution_ns"]["assemble_and_split"] / 1e9
    return {
        "requests": n,
        "throughput_rps": n / wall,
        "offered_rps": rate if not closed else None,
        "errors": errors,
        **percentiles(latencies),
        "batch_sizes": {str(b["batch_size"]): b["compute_infer"]["count"] for b in stats["batch_stats"]},
        "dispatch_reasons": stats["dispatch_reasons"],
        "padding_ratio": round(stats["padding_ratio"], 4),
        "overhead_us_per_request": (loop_cpu + worker_io_s) / n * 1e6 if n else None,
        "runtime_overhead_us_per_request": (
            (loop_cpu + worker_io_s) / n * 1e6 - generator_cost_us(model_config.name, sample)
        ) if n and closed else None,
        "loop_cpu_us_per_request": loop_cpu / n * 1e6 if n else None,
        "engine_us_per_request": stats["execution_ns"]["engine"] / 1e3 / n if n else None,
        **({"placement_cpu": choice.cpu, "placement": choice.why} if choice else {}),
    }


def generator_cost_us(model: str, sample) -> float:
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

    # A fresh loop on a thread: this runs inside the benchmark's own event loop.
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, measure()).result()
