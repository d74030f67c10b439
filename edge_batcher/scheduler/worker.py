"""One engine instance's own thread (EngineWorker), and a model's set of them (EngineThreads).

The thread exists from the model's load on, and everything that ever runs the instance runs on
it: the device measurement and the warm-up (`call`, blocking, before serving) as well as every
served batch (`submit`). A device library keeps per-thread state: ONNX Runtime's CUDA provider
gives each thread that runs a session its own cuBLAS/cuDNN handles and workspace (+74-76 MiB on
an H100), so warming up on one thread and serving on another held memory that no measurement
saw. Why not `loop.run_in_executor` for serving: each call there costs a concurrent future, a
wrapping asyncio future and a task wake-up on the loop, per batch. Here a job is a queue entry,
and its outcome comes back as one `call_soon_threadsafe` callback, the least an engine thread can
cost the event loop. EngineWorker runs jobs in order and hands each outcome to the loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from ..cpu_affinity import follow_this_thread, pin_thread

log = logging.getLogger(__name__)

T = TypeVar("T")
# done(arg, result, error) runs on the event loop; error is None when fn(arg) returned.
Done = Callable[[Any, Any, "BaseException | None"], None]
# A job: fn(arg), then done() on the loop; with done None, fn(arg) reports its outcome itself.
Job = tuple[Callable[[Any], Any], Any, "Done | None"]


class EngineWorker:
    def __init__(self, name: str):
        """The thread starts with the mask of the thread creating it (the loader's: every CPU,
        cpu_affinity.full_affinity) and stays there until `serve` says otherwise."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self.every_cpu = True
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()
        assert self._thread.native_id is not None  # set before start() returns
        self.native_id: int = self._thread.native_id  # for moving it with the loop (placement.py)

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run fn(*args) on the worker thread and wait for it: the load-time work (measurement,
        warm-up) that must happen on the thread that will serve. Blocking: never on the loop."""
        result: concurrent.futures.Future[T] = concurrent.futures.Future()

        def run(_arg: Any) -> None:
            try:
                result.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - re-raised in the calling thread
                result.set_exception(exc)

        self._jobs.put((run, None, None))
        return result.result()

    def serve(self, loop: asyncio.AbstractEventLoop, *, every_cpu: bool = False) -> None:
        """Hand outcomes to `loop` from now on. Called on the loop: the thread moves to the loop
        thread's CPUs (cpu_affinity.py: the two share one CPU when the loop is pinned), or with
        every_cpu to every CPU of the process."""
        self._loop = loop
        self.every_cpu = every_cpu
        try:
            if every_cpu:
                pin_thread(self.native_id, None)
            else:
                follow_this_thread(self.native_id)
        except OSError as exc:
            log.warning("%s: could not set its CPUs (%s); it keeps the loader's", self._thread.name, exc)

    def submit(self, fn: Callable[[Any], Any], arg: Any, done: Done) -> None:
        """Run fn(arg) on the worker thread after the jobs before it; then done() on the loop."""
        self._jobs.put((fn, arg, done))

    async def stop(self, last: Callable[[], Any] | None = None) -> None:
        """Let the queued jobs finish, run `last` (closing the engine) on the thread, end it."""
        finished = asyncio.get_running_loop().create_future()

        def resolve(_arg: Any, _result: Any, error: BaseException | None) -> None:
            if not finished.done():
                finished.set_result(error)

        self.submit(lambda _: last() if last is not None else None, None, resolve)
        self._jobs.put(None)
        error = await finished
        if error is not None:
            raise error

    def stop_now(self, last: Callable[[], Any] | None = None) -> None:
        """`stop` for a worker that never served (a load that failed, a runner never started):
        blocking, off the loop."""
        try:
            if last is not None:
                self.call(last)
        finally:
            self._jobs.put(None)
            self._thread.join()

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, arg, done = job
            try:
                result, error = fn(arg), None
            except BaseException as exc:  # noqa: BLE001 - every outcome goes back to the loop
                result, error = None, exc
            if done is not None:
                assert self._loop is not None  # submit() only once serving
                try:
                    self._loop.call_soon_threadsafe(done, arg, result, error)
                except RuntimeError:  # the loop closed while this ran: nobody waits for the answer
                    return
            # Not kept while waiting for the next job: a batch's inputs may be views of a request
            # body or of a shared memory region, freed (unmapped) only when the last view goes.
            del job, arg, result, error


class EngineThreads:
    """One EngineWorker per engine instance of a model, and their lifecycle: load-time calls,
    serving, stopping (each engine is closed on its own thread)."""

    def __init__(self, name: str, engines: list[Any]):
        self.engines = engines
        self.workers = [EngineWorker(f"engine-{name}-{i}") for i in range(len(engines))]
        self.serving = False

    def call(self, instance: int, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) on an instance's thread, waited for (EngineWorker.call)."""
        return self.workers[instance].call(fn, *args)

    def serve(self, loop: asyncio.AbstractEventLoop, *, every_cpu: bool) -> None:
        for worker in self.workers:
            worker.serve(loop, every_cpu=every_cpu)
        self.serving = True

    def submit(self, instance: int, fn: Callable[[Any], Any], arg: Any, done: Done) -> None:
        self.workers[instance].submit(fn, arg, done)

    def loop_cpu_threads(self) -> list[int]:
        """Native ids of the threads that follow the event loop's CPU (not those on every CPU)."""
        return [w.native_id for w in self.workers if not w.every_cpu]

    async def stop(self) -> None:
        """Let queued batches finish, close each engine on its thread, end the threads."""
        if self.serving:
            for engine, worker in zip(self.engines, self.workers):
                await worker.stop(engine.close)
        else:
            await asyncio.get_running_loop().run_in_executor(None, self.stop_now)

    def stop_now(self) -> None:
        """`stop` for threads that never served (a load that failed): blocking, off the loop."""
        for engine, worker in zip(self.engines, self.workers):
            worker.stop_now(engine.close)
