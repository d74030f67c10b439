"""The interface of everything the runtime's model table holds and the transports call.

A servable is a model as the transports see it: a ModelRunner (scheduler/runner.py, one engine
model with its queue and batches), a service (rag/pipeline.py's RagService, rag/generate.py's
GenerationService: models that are not one engine), or a RemoteModel (offload/remote_model.py:
served by offload peers only). All run on the event loop. Services that
stream also have `stream(request)` (an async iterator of InferResponse chunks).
"""

from __future__ import annotations

from collections.abc import Awaitable, Sized
from typing import Any, Protocol

from .config import ModelConfig
from .types import InferRequest, InferResponse, TensorSpec


class Servable(Protocol):
    name: str
    config: ModelConfig
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    # Bytes of the memory budget its weights hold while loaded (given back when unloaded).
    resident_bytes: int
    # Engine runs it started in this process, ever (a generator's prefills and decode steps): the
    # memory watch names the models whose count moved since its last look.
    batches_started: int

    @property
    def resident_meter(self) -> str | None:
        """The meter that measured resident_bytes at load (memory/device.py: "process", a
        device's); None: not measured (an estimate, or nothing loaded). The memory plan counts
        them under it."""

    @property
    def cuda_graphs(self) -> bool:
        """Whether its engines replay captured CUDA graphs (Triton's optimization.cuda.graphs)."""

    @property
    def queue(self) -> Sized:
        """len(): its requests not answered yet (the daemon's status line). Read-only here, so that
        each servable's own container type satisfies it."""

    async def start(self) -> None:
        """Start serving (on the event loop, after a blocking load)."""

    def infer(self, request: InferRequest) -> Awaitable[InferResponse]:
        """`await servable.infer(request)` -> InferResponse, or an EdgeBatcherError."""
        ...

    def not_ready(self) -> str | None:
        """Why it cannot serve a request now (readiness: /v2/health/ready, /v2/models/{m}/ready,
        gRPC ModelReady), or None when it can."""

    def refuse_if_full(self) -> None:
        """Raise Overloaded before a transport reads a request's body, when it would be refused."""

    def statistics(self) -> dict[str, Any]:
        """Triton's statistics-extension shape for GET /v2/models/{m}/stats."""
        ...

    async def drain(self, timeout: float) -> None:
        """Stop taking requests; answer what is queued and in flight within `timeout` seconds."""

    async def close(self) -> None:
        """Answer what is left with an error and free the model."""
