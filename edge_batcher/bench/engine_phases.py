"""The engine alone, the references the runtime is measured against: its raw ceiling (infer()
called directly at the largest preferred size) and a minimal asyncio batcher on the same engine
(how far any asyncio design gets on this interpreter)."""

from __future__ import annotations

import asyncio
import time

import numpy as np


def raw_ceiling(engine, sample: dict[str, np.ndarray], size: int, duration: float, infer=None) -> float:
    """Rows/s of `infer` (the engine's own by default) called back to back on one batch."""
    infer = infer or engine.infer
    batch = {k: np.repeat(v, size, axis=0) for k, v in sample.items()}
    infer(batch)
    n = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < duration:
        infer(batch)
        n += 1
    return n * size / (time.perf_counter() - t0)


async def minimal_batcher(engine, sample: dict[str, np.ndarray], size: int, args) -> float:
    """Req/s of the least an asyncio batcher can do with the same callers and engine: a list
    of futures, full batches only, one engine thread fed by a queue, one call_soon_threadsafe
    per batch; no validation, policy, deadlines, stats or metrics. Not a usable runtime: a
    reference that shows how much of the gap to the raw ceiling is the interpreter's."""
    import queue
    import threading

    loop = asyncio.get_running_loop()
    waiting: list[tuple[asyncio.Future, dict]] = []
    jobs: queue.SimpleQueue = queue.SimpleQueue()
    in_flight = 0

    def complete(batch, outputs) -> None:
        nonlocal in_flight
        in_flight -= 1
        for i, (future, _) in enumerate(batch):
            future.set_result({name: value[i:i + 1] for name, value in outputs.items()})
        dispatch()

    def work() -> None:
        while (batch := jobs.get()) is not None:
            inputs = {name: np.concatenate([x[name] for _, x in batch]) for name in sample}
            loop.call_soon_threadsafe(complete, batch, engine.infer(inputs))

    def dispatch() -> None:
        nonlocal in_flight
        while len(waiting) >= size and in_flight < 2:
            batch = waiting[:size]
            del waiting[:size]
            in_flight += 1
            jobs.put(batch)

    worker = threading.Thread(target=work, daemon=True)
    worker.start()
    done = 0
    stop_at = loop.time() + args.duration

    async def caller() -> None:
        nonlocal done
        while loop.time() < stop_at:
            future = loop.create_future()
            waiting.append((future, sample))
            dispatch()
            await future
            done += 1

    t0 = loop.time()
    callers = [asyncio.ensure_future(caller()) for _ in range(args.concurrency)]
    while loop.time() < stop_at:
        await asyncio.sleep(0.05)
    wall = loop.time() - t0
    finished = done
    while not all(c.done() for c in callers):  # the last callers wait short of a full batch: pad it
        if 0 < len(waiting) < size and in_flight == 0:
            waiting.extend((loop.create_future(), sample) for _ in range(size - len(waiting)))
            dispatch()
        await asyncio.sleep(0.01)
    jobs.put(None)
    worker.join()
    return finished / wall
