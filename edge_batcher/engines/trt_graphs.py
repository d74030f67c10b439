"""CUDA graphs for the TensorRT backend: TensorRT's work for one batch shape (an optimization
profile and its input shapes) captured once as a graph from the engine's stream and replayed for
every later batch of that shape, instead of TensorRT enqueuing its kernels one by one. The strict
preferred sizes make this safe: the device buffers are allocated once at load (their addresses
never change) and each shape the engine sees is warmed, so captured at warm-up. Inputs are
copied into those buffers and outputs out of them outside the graph, per batch. `[tensorrt]
cuda_graphs = "auto"` (the default) captures where it can and otherwise says once why not and
runs without; "on" makes a refusal an error; "off" never tries. docs/tensorrt.md, "CUDA graphs".
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import ConfigError, EngineError
from .cuda_api import CudaApi, CudaGraph, Stream

log = logging.getLogger(__name__)

# (optimization profile, ((input name, shape), ...)): what one captured graph was captured for
GraphKey = tuple[int, tuple[tuple[str, tuple[int, ...]], ...]]


@dataclass
class CapturedBatch:
    graph: CudaGraph
    output_shapes: dict[str, tuple[int, ...]]  # what the context said when it was captured


class TrtGraphs:
    """One engine's captured graphs by batch shape."""

    def __init__(self, model: str, mode: str, cuda: CudaApi):
        self.model, self.mode, self.cuda = model, mode, cuda
        self._captured: dict[GraphKey, CapturedBatch] = {}

    @classmethod
    def for_engine(cls, model: str, mode: str, cuda: CudaApi, dla_core: int) -> TrtGraphs | None:
        """The engine's graphs, or None where they are off or cannot be (ConfigError with "on")."""
        if mode == "off":
            return None
        why = None
        if not cuda.can_capture:
            why = f"the {cuda.name} binding cannot capture a stream (cuda-python can: pip install cuda-bindings)"
        elif dla_core >= 0:
            why = f"the plan runs on DLA core {dla_core} (CUDA graphs hold GPU work only)"
        if why is None:
            return cls(model, mode, cuda)
        if mode == "on":
            raise ConfigError(f"model {model!r}: [tensorrt] cuda_graphs = \"on\" but {why}")
        log.info("model %s: no CUDA graphs: %s", model, why)
        return None

    def __len__(self) -> int:
        return len(self._captured)

    def get(self, key: GraphKey) -> CapturedBatch | None:
        return self._captured.get(key)

    def capture(self, key: GraphKey, output_shapes: dict[str, tuple[int, ...]], stream: Stream,
                enqueue: Callable[[], None]) -> bool:
        """Capture what `enqueue` puts on the (idle) stream for this shape. False (with "auto",
        after one warning; every graph is dropped) when the capture fails; EngineError with "on"."""
        try:
            graph = self.cuda.capture(stream, enqueue)
        except Exception as exc:
            if self.mode == "on":
                raise EngineError(f"model {self.model!r}: [tensorrt] cuda_graphs = \"on\" but the batch "
                                  f"{dict(key[1])} could not be captured: {exc}") from exc
            log.warning("model %s: no CUDA graphs (capturing a batch of %s failed: %s); serving with "
                        "execute_async_v3 ([tensorrt] cuda_graphs = \"off\" skips the attempt)",
                        self.model, dict(key[1]), exc)
            self.close()
            return False
        self._captured[key] = CapturedBatch(graph, output_shapes)
        return True

    def close(self) -> None:
        """Destroy every graph (the primary context must be current)."""
        for captured in self._captured.values():
            captured.graph.destroy()
        self._captured.clear()
