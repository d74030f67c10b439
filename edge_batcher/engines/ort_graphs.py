"""Fixed buffers per batch shape for ONNX Runtime (IOBinding), and CUDA graphs on them. The
scheduler's strict sizes (2/4/8, per sequence bucket) mean an engine sees a handful of shapes, all
warmed up; for each, `BoundShape` keeps input and output OrtValues on the session's device bound
once, copies a batch into the inputs, runs, and copies the outputs out (so a buffer reused by the
next batch never shows in an earlier response). With the CUDA EP's `enable_cuda_graph`, each shape
gets its own `gpu_graph_id`: ONNX Runtime captures its kernels on the first runs and replays them
after, one launch instead of one per node (docs/benchmarks.md, "CUDA graphs"). With a CUDA Python
binding, each shape also gets page-locked host arrays (`PinnedStaging`) that the executor assembles
its host batches in (Engine.host_batch_buffers), so the copy to the device is a DMA from them
rather than the driver's staging of pageable memory, as Triton's `input_pinned_memory` does.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from typing import Any, cast

import numpy as np

from .base import DeviceArray
from .cuda_api import CudaApi, DeviceContext, HostBuffer

log = logging.getLogger(__name__)

# Runs of a new shape before its graph is replayed: ONNX Runtime runs it normally first (its
# allocations), captures on a later run, and replays from then on.
CAPTURE_RUNS = 3
MAX_GRAPHS = 64  # shapes per session (sizes x buckets); a shape beyond runs without a graph
# One graph per `gpu_graph_id` since onnxruntime 1.18 (its pull request 19636). An older build
# ignores the id and captures one graph per session, which it would replay for every shape.
GRAPH_IDS_SINCE = (1, 18)


def older_than(version: str, since: tuple[int, int]) -> bool:
    """Whether an onnxruntime version string is below major.minor `since` (an unusual string,
    a build of its own: assumed current)."""
    try:
        major, minor = (int(part) for part in version.split(".")[:2])
    except ValueError:
        return False
    return (major, minor) < since


def graph_ids_missing(version: str) -> str | None:
    """Why this onnxruntime version cannot keep a graph per batch shape, or None if it can."""
    if not older_than(version, GRAPH_IDS_SINCE):
        return None
    return (f"onnxruntime {version} keeps one CUDA graph per session, not one per batch shape "
            f"(gpu_graph_id needs {'.'.join(map(str, GRAPH_IDS_SINCE))} or newer)")


def outside_graphs() -> Any:
    """RunOptions for a run that neither captures nor replays a graph (ONNX Runtime's id -1)."""
    import onnxruntime as ort

    options = ort.RunOptions()
    options.add_run_config_entry("gpu_graph_id", "-1")
    return options


# staging(shape, dtype) -> a host array of that shape for a bound shape's input
Staging = Callable[[tuple[int, ...], np.dtype], np.ndarray]


class PinnedStaging:
    """Page-locked host arrays on one device's primary context (the one ONNX Runtime's CUDA EP
    uses), allocated when a shape is bound at warm-up and freed by close()."""

    def __init__(self, api: CudaApi, device_id: int):
        self.api = api
        self.context: DeviceContext = api.open_device(device_id)
        self.buffers: list[HostBuffer] = []

    @property
    def nbytes(self) -> int:
        return sum(buffer.array.nbytes for buffer in self.buffers)

    def __call__(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        self.context.push()
        try:
            buffer = self.api.pinned_empty(math.prod(shape), dtype)
        finally:
            self.context.pop()
        self.buffers.append(buffer)
        return buffer.array.reshape(shape)

    def close(self) -> None:
        self.context.push()
        try:
            for buffer in self.buffers:
                buffer.free()
        finally:
            self.context.pop()
            self.context.release()
        self.buffers.clear()


class BoundShape:
    """One input shape's device buffers, bound once, its graph id (or none) and its host staging
    (or none)."""

    def __init__(self, session: Any, inputs: dict[str, np.ndarray], device: str, graph_id: int | None,
                 staging: Staging | None = None):
        import onnxruntime as ort

        self.session = session
        # Where the executor assembles this shape's host batches (Engine.host_batch_buffers)
        self.host_inputs = _staged(staging, inputs) if staging is not None else {}
        self.binding = session.io_binding()
        self.input_values = {}
        for name, array in inputs.items():
            value = ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(array), device, 0)
            self.input_values[name] = value
            self.binding.bind_ortvalue_input(name, value)
        # the outputs' shapes from a plain run of this shape, outside any graph (gpu_graph_id -1)
        plain = session.run(None, inputs, outside_graphs())
        self.output_names = [o.name for o in session.get_outputs()]
        self.output_values = []
        for name, example in zip(self.output_names, plain, strict=True):
            value = ort.OrtValue.ortvalue_from_shape_and_type(example.shape, example.dtype, device, 0)
            self.output_values.append(value)
            self.binding.bind_ortvalue_output(name, value)
        self.run_options = ort.RunOptions()
        if graph_id is not None:
            self.run_options.add_run_config_entry("gpu_graph_id", str(graph_id))
        self.graph_id = graph_id
        self.on_host = device == "cpu"
        self.runs = 0

    def run(self, inputs: Mapping[str, np.ndarray | DeviceArray]) -> list[np.ndarray]:
        for name, value in inputs.items():
            if isinstance(value, DeviceArray):  # a batch assembled on the device
                target = self.input_values[name].data_ptr()
                if value.ptr != target:  # assembled elsewhere (not in buffers_for's): copied here
                    value.copy_to(target)
            else:
                self.input_values[name].update_inplace(np.ascontiguousarray(value))
        for _ in range(CAPTURE_RUNS if self.runs == 0 else 1):
            self.session.run_with_iobinding(self.binding, self.run_options)
        self.runs += 1
        if self.on_host:  # numpy() is a view of the buffer, which is the next batch's: a copy
            return [np.array(value.numpy(), copy=True) for value in self.output_values]
        return [value.numpy() for value in self.output_values]  # copied from the device already


class BoundSession:
    """A session's BoundShapes, one per input shape seen, made on first use (at warm-up)."""

    def __init__(self, session: Any, device: str, graphs: bool, staging: Staging | None = None):
        self.session = session
        self.device = device
        self.graphs = graphs
        self.staging = staging
        self.shapes: dict[tuple, BoundShape] = {}

    def knows(self, inputs: Mapping[str, np.ndarray | DeviceArray]) -> bool:
        """Whether this shape has its buffers (and graph) already: made by a host batch at warm-up."""
        return _key(inputs) in self.shapes

    def buffers_for(self, shapes: dict[str, tuple[tuple[int, ...], np.dtype]]) -> dict[str, int] | None:
        """The device addresses of the bound input buffers of a batch of these shapes, or None
        for a shape not bound yet (Engine.device_batch_buffers)."""
        bound = self.shapes.get(_shape_key(shapes))
        if bound is None:
            return None
        return {name: value.data_ptr() for name, value in bound.input_values.items()}

    def host_buffers_for(self, shapes: dict[str, tuple[tuple[int, ...], np.dtype]]) -> dict[str, np.ndarray] | None:
        """The host staging of a bound shape's inputs, for a batch of exactly these shapes of
        every input (Engine.host_batch_buffers), or None."""
        bound = self.shapes.get(_shape_key(shapes))
        if bound is None or bound.host_inputs.keys() != shapes.keys():
            return None
        return bound.host_inputs

    def run(self, inputs: Mapping[str, np.ndarray | DeviceArray]) -> list[np.ndarray]:
        key = _key(inputs)
        bound = self.shapes.get(key)
        if bound is None:
            # ids from 1: 0 is ONNX Runtime's default graph, -1 its "no graph"
            graph_id = len(self.shapes) + 1 if self.graphs and len(self.shapes) < MAX_GRAPHS else None
            if self.graphs and graph_id is None:
                log.warning("more than %d input shapes: shape %s runs without a CUDA graph", MAX_GRAPHS, key)
            assert not any(isinstance(v, DeviceArray) for v in inputs.values()), "a shape is bound from a host batch"
            bound = BoundShape(self.session, cast("dict[str, np.ndarray]", inputs), self.device, graph_id,
                               self.staging)
            self.shapes[key] = bound
        return bound.run(inputs)


def _staged(staging: Staging, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A shape's staging arrays, or none if they cannot be had (its batches then reach the
    device from pageable memory, as without staging)."""
    try:
        return {name: staging(array.shape, array.dtype) for name, array in inputs.items() if array.dtype != object}
    except Exception as exc:  # CudaError, or pycuda's own: page-locked memory is a speed-up, not a need
        log.warning("no page-locked staging for batch shape %s (%s): its host batches are copied to the "
                    "device from pageable memory", {n: a.shape for n, a in inputs.items()}, exc)
        return {}


def _key(inputs: Mapping[str, np.ndarray | DeviceArray]) -> tuple:
    return _shape_key({name: (value.shape, value.dtype) for name, value in inputs.items()})


def _shape_key(shapes: Mapping[str, tuple[tuple[int, ...], Any]]) -> tuple:
    """A batch's shapes as BoundSession keys its BoundShapes: (name, shape, dtype) by name."""
    return tuple((name, tuple(shape), np.dtype(dtype).str) for name, (shape, dtype) in sorted(shapes.items()))
