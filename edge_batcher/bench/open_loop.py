"""Open-loop load: Poisson arrivals at a fixed rate, whatever the answers do."""

from __future__ import annotations

import asyncio
import functools
import random

from ..errors import EdgeBatcherError
from ..types import InferRequest


async def poisson_arrivals(runner, model: str, sample, rate: float, stop_at: float,
                            latencies: list[float], errors: dict[str, int]) -> None:
    """Open-loop load: requests arrive at Poisson times whatever the answers do, until stop_at;
    returns when every one is answered. Arrivals are timer callbacks and answers done
    callbacks, not a task per arrival: that cost the loop more than the runtime's own work
    and made the phase measure its generator. A timer that fires late submits every arrival
    already due, and latency counts from the scheduled arrival time, so falling behind (the
    generator's or the runtime's) shows in the latencies instead of lowering the load."""
    loop = asyncio.get_running_loop()
    rng = random.Random(1)
    all_answered = loop.create_future()
    outstanding = 0
    next_at = loop.time()

    def finish_if_done() -> None:
        if outstanding == 0 and next_at >= stop_at and not all_answered.done():
            all_answered.set_result(None)

    def count_error(exc: BaseException) -> None:
        if not isinstance(exc, EdgeBatcherError):  # a bug, not load: stop the phase with it
            if not all_answered.done():
                all_answered.set_exception(exc)
            return
        errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1

    def answered(future: asyncio.Future, arrived_at: float) -> None:
        nonlocal outstanding
        outstanding -= 1
        exc = future.exception()
        if exc is None:
            latencies.append(loop.time() - arrived_at)
        else:
            count_error(exc)
        finish_if_done()

    def arrive() -> None:
        nonlocal next_at, outstanding
        now = loop.time()
        while next_at <= now and next_at < stop_at:
            try:
                future = runner.infer(InferRequest(model, sample))
            except EdgeBatcherError as exc:
                count_error(exc)
            else:
                outstanding += 1
                future.add_done_callback(functools.partial(answered, arrived_at=next_at))
            next_at += rng.expovariate(rate)
        if next_at < stop_at:
            loop.call_at(next_at, arrive)
        finish_if_done()

    arrive()
    await all_answered
