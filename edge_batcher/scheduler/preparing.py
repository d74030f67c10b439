"""A model's prepare hook (text -> token ids) run off the event loop. Its work grows with the
input (about a microsecond per character, 15-40 us for a short question: most of the loop's
work per request for an embedding model), so the requests that arrive in one loop turn are
handed together, in arrival order, to the model's prepare thread (an EngineWorker on every CPU;
the tokenizer's Rust part releases the GIL), and come back to the loop in one callback, where
the runner queues them. The runner bounds them: its queue capacity counts the requests being
prepared.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..engines.base import PrepareHook
from ..errors import EngineError
from ..types import InferRequest, InferResponse
from .worker import EngineWorker

# Per request: its inputs as the model runs on them and its sequence length, or why not.
Prepared = tuple[dict[str, Any], int] | BaseException


@dataclass(eq=False, slots=True)
class Preparing:
    """A request taken by `submit`, on its way to the prepare thread and back."""

    request: InferRequest
    inputs: dict[str, Any]  # as the client sent them (checked)
    rows: int
    priority: int
    arrived: float  # loop time: its queue time counts from here
    deadline: float  # loop time, from its arrival: preparing it counts too
    future: asyncio.Future[InferResponse]


class PrepareStage:
    """One model's prepare thread and the requests of the current loop turn; `done(items,
    results)` is called on the loop with each job's requests and their Prepared."""

    def __init__(self, model: str, prepare: PrepareHook,
                 done: Callable[[list[Preparing], list[Prepared]], None]):
        self._prepare = prepare
        self._done = done
        self._worker = EngineWorker(f"prepare-{model}")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._turn: list[Preparing] = []
        self.count = 0  # requests taken and not handed back yet

    def serve(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._worker.serve(loop, every_cpu=True)  # beside the loop, not on its CPU

    def add(self, item: Preparing) -> None:
        assert self._loop is not None, "add() before serve()"
        self.count += 1
        self._turn.append(item)
        if len(self._turn) == 1:  # the turn's first: the rest of the turn joins its job
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        items, self._turn = self._turn, []
        if items:  # stop() may have handed this turn over already
            self._worker.submit(self._run, items, self._back)

    def _run(self, items: list[Preparing]) -> list[Prepared]:
        results: list[Prepared] = []
        for item in items:
            try:
                results.append(self._prepare(item.inputs))
            except Exception as exc:  # noqa: BLE001 - that request's answer alone
                results.append(exc)
        return results

    def _back(self, items: list[Preparing], results: list[Prepared] | None, error: BaseException | None) -> None:
        self.count -= len(items)
        if results is None:  # the job itself failed (a BaseException in the hook): every request says so
            results = [EngineError(f"preparing the request failed: {error!r}")] * len(items)
        self._done(items, results)

    async def stop(self) -> None:
        """Let the jobs handed over finish (their requests come back to `done`), end the thread."""
        if self._loop is not None:
            self._flush()  # this turn's requests too, before the thread is told to end
            await self._worker.stop()
        else:  # never served: no job was handed over
            await asyncio.get_running_loop().run_in_executor(None, self._worker.stop_now)

    def stop_now(self) -> None:
        """`stop` for a runner that never served: blocking, off the loop."""
        self._worker.stop_now()
