"""One engine instance's own thread: runs jobs in order and hands each outcome to the loop.

Why not `loop.run_in_executor`: each call there costs a concurrent future, a wrapping asyncio
future and a task wake-up on the loop, per batch. Here a job is a queue entry, and its outcome
comes back as one `call_soon_threadsafe` callback, the least an engine thread can cost the
event loop. An engine object is only ever touched by its own thread once serving starts.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from ..cpu_affinity import pin_this_thread

log = logging.getLogger(__name__)

# done(arg, result, error) runs on the event loop; error is None when fn(arg) returned.
Done = Callable[[Any, Any, "BaseException | None"], None]


class EngineWorker:
    def __init__(self, name: str, loop: asyncio.AbstractEventLoop, *, every_cpu: bool = False):
        """every_cpu: run on every CPU of the process instead of inheriting the CPU of the
        thread that starts it (the event loop's, see cpu_affinity.py)."""
        self._loop = loop
        self.every_cpu = every_cpu
        self._jobs: queue.SimpleQueue[tuple[Callable[[Any], Any], Any, Done] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()
        assert self._thread.native_id is not None  # set before start() returns
        self.native_id: int = self._thread.native_id  # for moving it with the loop (placement.py)

    def submit(self, fn: Callable[[Any], Any], arg: Any, done: Done) -> None:
        """Run fn(arg) on the worker thread after the jobs before it; then done() on the loop."""
        self._jobs.put((fn, arg, done))

    async def stop(self, last: Callable[[], Any] | None = None) -> None:
        """Let the queued jobs finish, run `last` (closing the engine) on the thread, end it."""
        finished = self._loop.create_future()

        def resolve(_arg: Any, _result: Any, error: BaseException | None) -> None:
            if not finished.done():
                finished.set_result(error)

        self.submit(lambda _: last() if last is not None else None, None, resolve)
        self._jobs.put(None)
        error = await finished
        if error is not None:
            raise error

    def _work(self) -> None:
        if self.every_cpu:
            try:
                pin_this_thread(None)
            except OSError as exc:
                log.warning("%s: could not leave the event loop's CPU (%s); it shares that CPU",
                            threading.current_thread().name, exc)
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, arg, done = job
            try:
                result, error = fn(arg), None
            except BaseException as exc:  # noqa: BLE001 - every outcome goes back to the loop
                result, error = None, exc
            try:
                self._loop.call_soon_threadsafe(done, arg, result, error)
            except RuntimeError:  # the loop closed while this ran: nobody waits for the answer
                return
