"""Open-loop load: Poisson arrivals at each --rate, whatever the answers do. Arrivals are timer
callbacks and answers done callbacks, not a task per arrival (that cost the loop more than the
runtime's own work). A timer that fires late submits every arrival already due, and latency
counts from the scheduled arrival, so falling behind (the generator's or the runtime's) shows
in the latencies instead of lowering the load (no coordinated omission); how late each arrival
was submitted is kept as its lag: the loop sleeps in whole milliseconds (epoll's timeout), so
even an idle runtime sees arrivals up to ~1 ms late, a busy loop more."""

from __future__ import annotations

import argparse
import asyncio
import functools
import math
import random
import time
from collections import Counter
from dataclasses import dataclass, field

from ..errors import EdgeBatcherError
from ..types import InferRequest

GENERATOR_ALONE_S = 0.3  # how long the generator runs alone after each open-loop run (generator_cost_us)


@dataclass
class OpenLoopRun:
    """What one open-loop run saw. Statuses are the HTTP-like ones of the error tree (200 for
    an answer), as a client of the daemon would see them."""

    window_s: float  # arrivals were due from 0 to window_s
    offered: int = 0  # arrivals submitted
    served_in_window: int = 0  # successful answers before the last arrival was due
    latencies: list[float] = field(default_factory=list)  # successful answers, from the scheduled arrival
    lags: list[float] = field(default_factory=list)  # per arrival: submitted - scheduled
    statuses: Counter = field(default_factory=Counter)
    errors: Counter = field(default_factory=Counter)  # by error class name


@dataclass(frozen=True)
class Rate:
    """An open-loop rate: arrivals per second, or a share of the closed-loop throughput."""

    value: float
    share: bool  # value is a fraction of the closed-loop throughput

    def per_second(self, closed_loop_rps: float) -> float:
        return self.value * closed_loop_rps if self.share else self.value

    def __str__(self) -> str:
        return f"{self.value * 100:g}%" if self.share else f"{self.value:g}/s"


def rates(text: str) -> list[Rate]:
    """--rate: "20000", "50%" or a comma-separated list of them."""
    out = []
    for item in text.split(","):
        item = item.strip()
        try:
            value = float(item.removesuffix("%"))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{item!r}: expected arrivals per second (20000) or a share of the closed loop's (50%)") from None
        if not (value > 0 and math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"{item!r}: a rate must be a number above 0")
        out.append(Rate(value / 100, True) if item.endswith("%") else Rate(value, False))
    return out


async def poisson_arrivals(runner, model: str, sample, rate: float, duration: float) -> OpenLoopRun:
    """Submit `rate` arrivals per second (Poisson) to `runner.infer` for `duration` seconds;
    returns when every one is answered."""
    loop = asyncio.get_running_loop()
    rng = random.Random(1)
    all_answered = loop.create_future()
    start = loop.time()
    stop_at = start + duration
    run = OpenLoopRun(window_s=duration)
    outstanding = 0
    next_at = start

    def finish_if_done() -> None:
        if outstanding == 0 and next_at >= stop_at and not all_answered.done():
            all_answered.set_result(None)

    def count_error(exc: BaseException) -> None:
        if not isinstance(exc, EdgeBatcherError):  # a bug, not load: stop the phase with it
            if not all_answered.done():
                all_answered.set_exception(exc)
            return
        run.statuses[exc.status] += 1
        run.errors[type(exc).__name__] += 1

    def answered(future: asyncio.Future, arrived_at: float) -> None:
        nonlocal outstanding
        outstanding -= 1
        exc = future.exception()
        if exc is None:
            now = loop.time()
            run.latencies.append(now - arrived_at)
            run.statuses[200] += 1
            run.served_in_window += now <= stop_at
        else:
            count_error(exc)
        finish_if_done()

    def arrive() -> None:
        nonlocal next_at, outstanding
        now = loop.time()
        while next_at <= now and next_at < stop_at:
            run.offered += 1
            run.lags.append(now - next_at)
            try:
                # As the HTTP and gRPC transports do: a full queue refuses before any work on
                # the request (past saturation, validating each refused one cost the loop more).
                runner.refuse_if_full()
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
    return run


class _AnsweredAtOnce:
    """A runner whose answer is ready when `infer` returns: only the generator's own work is left."""

    def refuse_if_full(self) -> None:
        pass

    def infer(self, request: InferRequest) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        future.set_result(None)
        return future


async def generator_cost_us(model: str, sample, rate: float, seconds: float = GENERATOR_ALONE_S) -> float:
    """Event-loop CPU per arrival of this generator alone at `rate`: the same arrivals, timers
    and answer callbacks in front of a runner that answers at once (the loop idle between
    arrivals: behind a busy runtime, one timer submits more arrivals at a time)."""
    async def measure() -> float:
        cpu0 = time.thread_time()
        run = await poisson_arrivals(_AnsweredAtOnce(), model, sample, rate, seconds)
        return (time.thread_time() - cpu0) / max(1, run.offered) * 1e6

    # A fresh loop on a thread (on the caller's CPUs), while the bench's own loop waits idle.
    return await asyncio.get_running_loop().run_in_executor(None, asyncio.run, measure())
