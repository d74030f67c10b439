"""A model served by offload peers only: a servable of its own, beside runners and services.

For a model too big for the device (an LLM on a 4 GB Jetson) that a nearby server serves:
`backend = "remote"` in its model.toml and no model file, its inputs and outputs declared there
(`[[inputs]]` / `[[outputs]]`, each with `datatype` and the whole `shape`, batch dimension
first, -1 for a dynamic dimension: `declared_specs`); or a model listed in `[offload]
remote_only`, whose specs are read from its model file at load. Nothing of it runs here:
`RemoteModel` checks each request against the specs, on the event loop, and sends it to the
first usable peer with its deadline; without a usable peer the answer is a 503 at once.
Its statistics count every request under the `remote_only` reason. docs/offload.md.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from ..config import ModelConfig, TensorOverride
from ..errors import ConfigError, EdgeBatcherError, InvalidInput, Overloaded, Unavailable
from ..metrics import Metrics
from ..scheduler.offloading import OffloadPort
from ..scheduler.policy import Reason
from ..scheduler.stats import RunnerStats
from ..scheduler.validate import RequestValidator
from ..types import DATATYPE_TO_NUMPY, InferRequest, InferResponse, TensorSpec

log = logging.getLogger(__name__)


class RemoteModel:
    """A servable (servable.Servable) whose every request runs on an offload peer."""

    resident_bytes = 0  # nothing of it is loaded here
    resident_meter: str | None = None
    cuda_graphs = False
    batches_started = 0  # its batches run on the peers

    def __init__(self, config: ModelConfig, inputs: list[TensorSpec], outputs: list[TensorSpec],
                 peers: OffloadPort, metrics: Metrics) -> None:
        self.name = config.name
        self.config = config
        self.inputs = inputs
        self.outputs = outputs
        self.peers = peers
        self.validator = RequestValidator(self.name, inputs, outputs, config.sequence,
                                          allow_non_finite=config.allow_non_finite_inputs, batching=config.batching)
        self._stats = RunnerStats(self.name, metrics)
        self.stats = self._stats.counts
        b = config.batching
        self._capacity = b.queue_capacity  # requests on their way to a peer at once
        # Requests on their way to a peer: what the transports and drain see as not yet answered.
        self.queue: set[object] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._serving = False
        self._draining = False

    async def start(self) -> None:
        self._serving = True

    def refuse_if_full(self) -> None:
        """Raise Overloaded (counted) when queue_capacity requests are already on their way."""
        if len(self.queue) >= self._capacity:
            self._stats.count_status(Overloaded.status)
            raise Overloaded(f"queue full: {len(self.queue)} requests on their way to a peer "
                             f"(queue_capacity {self._capacity})")

    async def infer(self, request: InferRequest) -> InferResponse:
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            timeout_s = self._admit(request)
        except EdgeBatcherError as exc:
            self._stats.count_status(exc.status)
            raise
        token = object()
        self.queue.add(token)
        self._idle.clear()
        try:
            outputs, _ = await self.peers.infer(self.name, request.inputs, timeout_s, conform_to=self.outputs)
        except asyncio.CancelledError:
            raise  # the caller went away: no answer to count
        except BaseException as exc:
            self._stats.count_offload(Reason.REMOTE_ONLY, "failed", 1)
            answer = exc if isinstance(exc, EdgeBatcherError) and exc.status < 500 else Unavailable(
                f"model {self.name!r}: offload to the peer failed ({exc}) and the model is remote-only")
            log.warning("model %s: offload failed: %s", self.name, answer)
            self._stats.count_status(answer.status)
            self.stats.fail_ns += int((loop.time() - started) * 1e9)
            if answer is exc:
                raise
            raise answer from exc
        finally:
            self.queue.discard(token)
            if not self.queue:
                self._idle.set()
        self._stats.count_offload(Reason.REMOTE_ONLY, "ok", 1)
        self._stats.ok.inc()
        self._stats.record_offloaded(next(iter(request.inputs.values())).shape[0] if request.inputs else 1,
                                     started, loop.time())
        if request.outputs is not None:
            outputs = {name: outputs[name] for name in request.outputs if name in outputs}
        return InferResponse(self.name, request.id, outputs)

    def not_ready(self) -> str | None:
        if self._draining:
            return "draining"
        if not self._serving:
            return "not serving yet"
        if not self.peers.view(self.name).peer_available:
            return "remote-only and no peer is available"
        return None

    def _admit(self, request: InferRequest) -> float:
        """The request's timeout in seconds, once it is known to be valid and a peer can take it."""
        if self._draining:
            raise Unavailable(f"model {self.name!r} is not accepting requests: the daemon is draining")
        if not self._serving:
            raise Unavailable(f"model {self.name!r} is not serving yet")
        _, rows, _ = self.validator.validate(request)
        self.validator.priority(request)
        timeout_s = self.validator.timeout_s(request)
        view = self.peers.view(self.name)
        if not view.peer_available:
            self.stats.rejected += 1
            raise Unavailable(f"model {self.name!r} is remote-only and no peer is available")
        limit = max(self.config.batching.max_batch_size, view.max_rows)
        if rows > limit:
            raise InvalidInput(f"request has {rows} rows, more than model {self.name!r} sends to a peer in "
                               f"one request ({limit}); split it into smaller requests")
        self.refuse_if_full()
        return timeout_s

    def statistics(self) -> dict[str, Any]:
        """Triton's statistics-extension shape: nothing executes here, every request is offloaded."""
        return self._stats.to_json(len(self.queue), ())

    async def drain(self, timeout: float) -> None:
        """Take no more requests; wait (bounded) for those on their way to a peer."""
        self._draining = True
        if self.queue:
            try:
                await asyncio.wait_for(self._idle.wait(), timeout)
            except asyncio.TimeoutError:
                log.warning("model %s: %d request(s) still on their way to a peer after %.1f s",
                            self.name, len(self.queue), timeout)

    async def close(self) -> None:
        """Nothing to free here: the peers belong to the runtime."""
        self._draining = True


def declared_specs(config: ModelConfig) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """(inputs, outputs) of a `backend = "remote"` model, as its model.toml declares them whole;
    ConfigError naming the file and table otherwise."""
    where = f"{config.directory / 'model.toml'}"
    return _declared(config.inputs, "inputs", where), _declared(config.outputs, "outputs", where)


def _declared(entries: list[TensorOverride], table: str, where: str) -> list[TensorSpec]:
    if not entries:
        raise ConfigError(
            f"{where}: backend \"remote\" has no model file to read {table} from: declare each one as "
            f"[[{table}]] with name, datatype and shape (batch dimension first, -1 for dynamic)"
        )
    specs = []
    for entry in entries:
        if entry.datatype not in DATATYPE_TO_NUMPY:
            raise ConfigError(
                f"{where}: [[{table}]] {entry.name!r}: datatype: expected one of "
                f"{', '.join(DATATYPE_TO_NUMPY)}, got {entry.datatype!r}"
            )
        if not entry.shape or any(d == 0 or d < -1 for d in entry.shape):
            raise ConfigError(
                f"{where}: [[{table}]] {entry.name!r}: shape: expected the whole shape, batch dimension "
                f"first, with positive sizes or -1 for dynamic (e.g. [-1, 256]), got {entry.shape}"
            )
        specs.append(TensorSpec(entry.name, entry.datatype, tuple(entry.shape)))
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ConfigError(f"{where}: [[{table}]] names a tensor twice: {names}")
    return specs
