"""Sending a model's planned peer batches to the offload peers, and what happens when that fails.

`Offloader` belongs to one ModelRunner and runs on its event loop. Each request of a batch the
policy planned for a peer goes as its own v2 request through the `OffloadPort` (the daemon's
PeerPool), concurrently; a request whose offload fails goes back to the runner's queue when the
policy's `retries_locally` allows it (the runner's `requeue`), else it is answered with the
peer's 4xx verdict or a 503 naming the failure. docs/offload.md describes the rules.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, Protocol, cast

from numpy.typing import NDArray

from ..errors import EdgeBatcherError, InvalidInput, Unavailable
from ..shared_memory.device_tensor import holds_device_tensor
from ..types import InferResponse, TensorSpec
from .policy import BatchPlan, OffloadView, Reason
from .queues import Pending
from .stats import RunnerStats

log = logging.getLogger(__name__)


class OffloadPort(Protocol):
    """What a runner needs of the offload peers (offload/peers.py's PeerPool)."""

    def view(self, model: str) -> OffloadView: ...

    async def infer(self, model: str, inputs: dict[str, NDArray[Any]], timeout_s: float, *,
                    conform_to: list[TensorSpec] | None = None) -> tuple[dict[str, NDArray[Any]], str]:
        """(outputs shaped and typed as `conform_to` says, peer name)."""
        ...


class Offloader:
    """One model's batches on their way to a peer."""

    def __init__(self, model: str, port: OffloadPort, outputs: list[TensorSpec], stats: RunnerStats, *,
                 requeue: Callable[[Pending, Reason], bool], fail: Callable[[Pending, EdgeBatcherError], None],
                 settled: Callable[[], None], progress: asyncio.Event,
                 non_finite: Callable[[dict[str, Any]], InvalidInput | None] | None = None) -> None:
        self.model = model
        self.port = port
        self.outputs = outputs
        self._stats = stats
        self._requeue = requeue  # True: the request is back in the runner's queue, to run locally
        self._fail = fail
        self._settled = settled  # a batch's requests are all answered or requeued: plan again
        self._progress = progress  # set when a batch is over (drain waits on it)
        # NaN or Infinity in a request's inputs, where the runner leaves that check to the local
        # worker, which a peer batch never reaches: refused here, never sent, never retried.
        self._non_finite = non_finite
        self.tasks: set[asyncio.Task[None]] = set()

    def __len__(self) -> int:
        return len(self.tasks)

    def send(self, plan: BatchPlan) -> None:
        task = asyncio.create_task(self._send_batch(plan))
        self.tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        self._progress.set()  # only now can drain() see that the offload is over

    async def _send_batch(self, plan: BatchPlan) -> None:
        """Each request as its own v2 request, concurrently over the peer's pooled connection,
        with what the client sent (before any prepare hook): the peer batches them with its own
        limits, which this daemon cannot know, and a peer's answer about one request (a 4xx)
        concerns that request alone."""
        loop = asyncio.get_running_loop()
        requests = cast("list[Pending]", plan.requests)  # a runner queues only Pending

        async def send(r: Pending) -> None:
            if holds_device_tensor(r.request.inputs):  # not the head of the queue when planned: back to local
                raise Unavailable("its inputs are in CUDA shared memory, which a peer cannot read")
            outputs, _ = await self.port.infer(self.model, r.request.inputs, r.deadline - loop.time(),
                                               conform_to=self.outputs)
            self._stats.count_offload(plan.reason, "ok", 1)
            if r.request.outputs is not None:
                outputs = {name: outputs[name] for name in r.request.outputs if name in outputs}
            if not r.future.done():
                r.future.set_result(InferResponse(self.model, r.request.id, outputs))
                self._stats.ok.inc()
                self._stats.record_offloaded(r.rows, r.arrival, loop.time())

        check = self._non_finite
        refused = {} if check is None else {
            id(r): error for r in requests if (error := check(r.request.inputs)) is not None}
        for r in requests:
            if id(r) in refused:
                self._fail(r, refused[id(r)])
        requests = [r for r in requests if id(r) not in refused]
        results = await asyncio.gather(*(send(r) for r in requests), return_exceptions=True)
        for r, outcome in zip(requests, results):
            if isinstance(outcome, BaseException):
                self._failed(plan.reason, r, outcome)
        self._settled()

    def _failed(self, reason: Reason, r: Pending, error: BaseException) -> None:
        if self._requeue(r, reason):
            self._stats.count_offload(reason, "failed_local_retry", 1)
            log.warning("model %s: offload failed (%s); retrying locally", self.model, error)
            return
        self._stats.count_offload(reason, "failed", 1)
        if isinstance(error, EdgeBatcherError) and error.status < 500:
            answer = error  # the peer's verdict on this request's input (400, 404): pass it on
        else:
            why_not_local = ("the request is larger than the local engine takes" if reason is Reason.TOO_LARGE
                             else "it cannot run locally in time")
            answer = Unavailable(f"model {self.model!r}: offload to the peer failed ({error}) and {why_not_local}")
        log.warning("model %s: offload failed: %s", self.model, answer)
        self._fail(r, answer)
