"""What the RAG and generation services share.

Services are models that are not one engine (engines/registry.py SERVICES). They present the
runner interface the transports use (name, config, inputs, outputs, queue, start, infer,
statistics, drain, close) and, for streaming, `stream(request)`: an async iterator of
InferResponse chunks, each carrying `parameters["triton_final_response"]` (False, ..., True:
Triton's convention for decoupled models). The HTTP generate extension and MQTT stream them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import EdgeBatcherError, InvalidInput, Overloaded
from ..types import InferRequest, InferResponse, TensorSpec
from .tokenize import texts_from_bytes

if TYPE_CHECKING:
    from ..config import ModelConfig
    from ..runtime import Runtime

FINAL = "triton_final_response"


def text_rows(request: InferRequest, model: str, spec: TensorSpec, outputs: list[TensorSpec],
              max_rows: int, max_chars: int) -> list[str]:
    """The request's texts from its one BYTES input, checked: known names, datatype BYTES,
    shape [rows] (or [rows, 1]), 1..max_rows rows, each 1..max_chars characters (a longer one
    is refused before it is decoded), no empty text."""
    for name in request.inputs:
        if name != spec.name:
            raise InvalidInput(f"model {model!r} has no input {name!r}; its input is {spec.name!r} (BYTES)")
    if request.outputs is not None:
        names = [o.name for o in outputs]
        for name in request.outputs:
            if name not in names:
                raise InvalidInput(f"model {model!r} has no output {name!r}; its outputs are {', '.join(names)}")
    array = request.inputs.get(spec.name)
    if array is None:
        raise InvalidInput(f"missing input {spec.name!r} for model {model!r}")
    if array.dtype.kind not in "OSU":
        raise InvalidInput(
            f"input {spec.name!r}: datatype {_v2_name(array.dtype)}, model {model!r} expects BYTES (text)"
        )
    if array.ndim == 2 and array.shape[1] == 1:
        array = array[:, 0]
    if array.ndim != 1:
        raise InvalidInput(f"input {spec.name!r}: shape {list(array.shape)}, model {model!r} expects [rows] of text")
    if not 1 <= array.shape[0] <= max_rows:
        raise InvalidInput(
            f"input {spec.name!r}: {array.shape[0]} rows; model {model!r} takes 1 to {max_rows} per request"
        )
    texts = texts_from_bytes(array, spec.name, max_chars, f"model {model!r}")
    for i, text in enumerate(texts):
        if not text.strip():
            raise InvalidInput(f"input {spec.name!r}: element {i} is empty; send some text")
    return texts


def bytes_array(values: list[str]) -> np.ndarray:
    out = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        out[i] = v.encode("utf-8")
    return out


def _v2_name(dtype: np.dtype) -> str:
    from ..types import NUMPY_TO_DATATYPE

    return NUMPY_TO_DATATYPE.get(dtype, str(dtype))


class InFlight:
    """A service's `queue`: what the transports and drain see as requests not yet answered."""

    def __init__(self) -> None:
        self.count = 0

    def __len__(self) -> int:
        return self.count


@dataclass
class ServiceStats:
    """Triton-statistics-shaped counters of one service (updated on the event loop)."""

    inference_count: int = 0
    execution_count: int = 0
    success_count: int = 0
    success_ns: int = 0
    fail_count: int = 0
    fail_ns: int = 0
    last_inference_ms: int = 0
    failures: dict[str, int] = field(default_factory=dict)

    def ok(self, started: float, rows: int = 1) -> None:
        self.inference_count += rows
        self.execution_count += 1
        self.success_count += 1
        self.success_ns += int((time.monotonic() - started) * 1e9)
        self.last_inference_ms = int(time.time() * 1000)

    def failed(self, started: float, error: BaseException) -> None:
        self.fail_count += 1
        self.fail_ns += int((time.monotonic() - started) * 1e9)
        key = str(error.status) if isinstance(error, EdgeBatcherError) else "500"
        self.failures[key] = self.failures.get(key, 0) + 1

    def triton(self, name: str) -> dict:
        return {
            "name": name,
            "version": "1",
            "last_inference": self.last_inference_ms,
            "inference_count": self.inference_count,
            "execution_count": self.execution_count,
            "inference_stats": {
                "success": {"count": self.success_count, "ns": self.success_ns},
                "fail": {"count": self.fail_count, "ns": self.fail_ns},
            },
            "failures_by_status": dict(self.failures),
        }


class ServiceAccounting:
    """Counting answered requests, shared by the services: needs self.name, self.stats
    (ServiceStats) and self.runtime (for its metrics)."""

    resident_bytes = 0  # budget bytes its own weights hold: none, unless it loads some (the generator)
    resident_meter: str | None = None  # the meter that measured them (Servable)
    cuda_graphs = False  # a service runs no engine batches of its own
    name: str
    config: ModelConfig
    queue: Any  # Sized, each service its own: the rag pipeline's requests in flight, the generator's waiting sequences
    stats: ServiceStats
    runtime: Runtime

    @property
    def batches_started(self) -> int:
        """None of its own: the rag pipeline's run in its models (the generator counts its steps)."""
        return 0

    def _ok(self, started: float, rows: int) -> None:
        self.stats.ok(started, rows)
        self.runtime.metrics.requests_total.inc(model=self.name, status="200")
        self.runtime.metrics.request_seconds.observe(time.monotonic() - started, model=self.name)

    def refuse_if_full(self) -> None:
        """The runner interface's check before a transport reads a body: 429 while queue_capacity
        requests already wait (the generator's own submit checks its admission queue again)."""
        capacity = self.config.batching.queue_capacity
        if len(self.queue) >= capacity:
            exc = Overloaded(f"model {self.name!r}: {len(self.queue)} requests already wait "
                             f"(queue_capacity {capacity})")
            self._failed(time.monotonic(), exc)
            raise exc

    def _failed(self, started: float, exc: BaseException) -> None:
        if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
            return  # the caller went away: not a failure of the service
        self.stats.failed(started, exc)
        status = str(exc.status) if isinstance(exc, EdgeBatcherError) else "500"
        self.runtime.metrics.requests_total.inc(model=self.name, status=status)


async def wait_idle(in_flight: InFlight, timeout: float) -> None:
    """Wait (bounded) until nothing is in flight: drain. Polls at 10 ms: draining happens once,
    at shutdown, and the counters have no waiters to notify."""
    deadline = time.monotonic() + timeout
    while len(in_flight) and time.monotonic() < deadline:
        await asyncio.sleep(0.01)


def final_response(model: str, request_id: str | None, outputs: dict[str, np.ndarray], **parameters) -> InferResponse:
    return InferResponse(model, request_id, outputs, {FINAL: True, **parameters})


async def token_responses(
    model: str, request_id: str | None, output: str, events: AsyncIterator, **final_parameters
) -> AsyncIterator[InferResponse]:
    """A generation's events as streamed v2 responses: one per piece of text in `output`, then
    the final one (empty text) carrying the generation's parameters (finish_reason, counts)."""
    async for kind, payload in events:
        if kind == "token":
            yield InferResponse(model, request_id, {output: bytes_array([payload])}, {FINAL: False})
        else:
            yield final_response(model, request_id, {output: bytes_array([""])},
                                 **final_parameters, **payload.parameters())
