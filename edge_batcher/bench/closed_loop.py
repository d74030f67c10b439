"""The closed loop: `concurrency` callers for `duration` seconds, each sending its next request
when its last is answered. One loop for the in-process phase (a runner) and the transport
phases (a client): each passes how to send one request and read its answer's status."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

# send() -> (HTTP-like status, error name or None): one request, answered.
Send = Callable[[], Awaitable[tuple[int, str | None]]]


@dataclass
class ClosedLoopRun:
    latencies: list[float] = field(default_factory=list)  # seconds, of the answered (200) requests
    statuses: Counter = field(default_factory=Counter)
    errors: Counter = field(default_factory=Counter)  # by error name, where send() names one
    wall_s: float = 0.0

    @property
    def throughput_rps(self) -> float:
        return len(self.latencies) / self.wall_s


async def closed_loop(send: Send, concurrency: int, duration: float) -> ClosedLoopRun:
    loop = asyncio.get_running_loop()
    run = ClosedLoopRun()
    stop_at = loop.time() + duration

    async def caller() -> None:
        while loop.time() < stop_at:
            t0 = loop.time()
            status, error = await send()
            run.statuses[status] += 1
            if status != 200:
                if error is not None:
                    run.errors[error] += 1
                continue
            run.latencies.append(loop.time() - t0)

    t0 = loop.time()
    await asyncio.gather(*(caller() for _ in range(concurrency)))
    run.wall_s = loop.time() - t0
    return run
