"""FakeCudaEpEngine: ONNX Runtime's CUDA execution provider's memory behaviour over FakeCuda.

NOT a GPU. The outputs come from a real ONNX Runtime CPU session (the engine is an
OnnxRuntimeEngine); the device memory the CUDA EP would take is allocated from a FakeCuda device
(tests/fakes/fake_cuda.py), which the real CudaProbe reads through `mem_get_info`:

* load: the primary context's first user pays CONTEXT_BYTES once per device, then the weights
  (the model file's size) are allocated;
* first run on each thread: WORKSPACE_BYTES outside the arena (the CUDA EP's per-thread
  context: cuBLAS/cuDNN handles and workspace, +74-76 MiB per thread on an H100, issue 26);
* every run needs PLANNER_FACTOR x the liveness estimate at its shape from the arena (ONNX
  Runtime's per-shape pools, 1.75x on the encoder: docs/memory.md), as REQUESTS_PER_RUN
  separate buffers; with the memory pattern on (`memory_pattern`, default: what the real
  engine sets for the CUDA EP, off) as one contiguous block from a shape's second run on;
* the arena is a BFC arena: it extends by whole regions, kSameAsRequested by what a request
  lacks, kNextPowerOfTwo by the larger of that and a region size that doubles each time (1 MiB
  first); a block fits only in one region; no region is given back before close(). So the
  second run at a new, larger shape grows the arena again, as measured on an H200;
* gpu_mem_limit caps the arena: growing past it, or past the device, raises OutOfMemory, as
  ONNX Runtime's "Failed to allocate memory" does in the real engine.

The arena options are the real engine's: `provider_options(...)` from edge_batcher's ONNX
Runtime backend, with `cuda_ep_options` and the budget's limit (`device_memory_limit`, set by
memory.device.DeviceLoad). Set `FakeCudaEpEngine.device` to the FakeCuda the test reads.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from edge_batcher.engines.onnxruntime import (
    OnnxRuntimeEngine,
    provider_options,
    uses_memory_pattern,
)
from edge_batcher.errors import OutOfMemory
from edge_batcher.memory.estimator import OnnxFootprintEstimator
from tests.fakes.fake_cuda import CudaMemoryError, FakeCuda

MiB = 1 << 20
CONTEXT_BYTES = 300 * MiB
WORKSPACE_BYTES = 32 * MiB
PLANNER_FACTOR = 1.75
INITIAL_REGION_BYTES = 1 * MiB
REQUESTS_PER_RUN = 4

_contexts: dict[int, object] = {}  # id(FakeCuda) -> the allocation standing for its context


class FakeArena:
    """BFC-arena growth on a FakeCuda device: regions added, none given back until free_all()."""

    def __init__(self, device: FakeCuda, strategy: str, limit: int | None):
        if strategy not in ("kSameAsRequested", "kNextPowerOfTwo"):
            raise ValueError(f"unknown arena_extend_strategy {strategy!r}")
        self.device = device
        self.strategy = strategy
        self.limit = limit
        self.regions: list = []
        self.region_sizes: list[int] = []
        self.capacity = 0
        self._next_region = INITIAL_REGION_BYTES

    def hold_buffers(self, need: int) -> None:
        """A shape's first run: `need` bytes as REQUESTS_PER_RUN buffers, anywhere in the arena."""
        if need <= self.capacity:
            return
        shortfall = need - self.capacity
        piece = -(-shortfall // REQUESTS_PER_RUN)
        for _ in range(REQUESTS_PER_RUN):
            self._extend(piece)

    def hold_block(self, need: int) -> None:
        """A later run: `need` bytes in one block, which only a region that large can hold."""
        if need > max(self.region_sizes, default=0):
            self._extend(need)

    def _extend(self, shortfall: int) -> None:
        extension = shortfall
        if self.strategy == "kNextPowerOfTwo":
            extension = max(1 << (shortfall - 1).bit_length(), self._next_region)
            self._next_region = extension * 2
        if self.limit is not None and self.capacity + extension > self.limit:
            raise OutOfMemory(f"Failed to allocate memory for requested buffer of size {extension} "
                              f"(fake arena at {self.capacity} bytes, gpu_mem_limit {self.limit})")
        try:
            self.regions.append(self.device.mem_alloc(extension))
        except CudaMemoryError as exc:
            raise OutOfMemory(f"Failed to allocate memory for requested buffer of size {extension}: {exc}") from exc
        self.region_sizes.append(extension)
        self.capacity += extension

    def free_all(self) -> None:
        for region in self.regions:
            region.free()
        self.regions.clear()
        self.region_sizes.clear()
        self.capacity = 0


class FakeCudaEpEngine(OnnxRuntimeEngine):
    device: FakeCuda | None = None
    # What model.toml would give the CUDA EP. Not read from model.toml: the session underneath
    # must stay on the CPU EP, also on a machine whose onnxruntime has the CUDA EP.
    cuda_ep_options: dict = {}
    memory_pattern: bool | None = None  # None: as uses_memory_pattern() decides for the CUDA EP

    def load(self) -> None:
        super().load()  # the real CPU session computes the outputs
        fake = self.device
        assert fake is not None, "set FakeCudaEpEngine.device to a FakeCuda first"
        fake.init()
        self._context = fake.get_device(0).retain_primary_context()
        self.cuda_options = provider_options("CUDAExecutionProvider", self.cuda_ep_options, self.device_memory_limit)
        limit = self.cuda_options.get("gpu_mem_limit")
        seq = self.config.sequence
        self._estimator = OnnxFootprintEstimator(
            self.config.model_path, sequence_axes={n: seq.axis for n in seq.inputs} if seq else None)
        with self._current():
            if id(fake) not in _contexts:
                _contexts[id(fake)] = fake.mem_alloc(CONTEXT_BYTES)
            self._weights = fake.mem_alloc(self.config.model_path.stat().st_size)
        self.arena = FakeArena(fake, self.cuda_options["arena_extend_strategy"], int(limit) if limit else None)
        self._workspaces: dict[int, object | None] = {}  # thread id -> its context's allocation
        self._shapes_run: set[tuple] = set()
        self._pattern = (uses_memory_pattern(["CUDAExecutionProvider"]) if self.memory_pattern is None
                         else self.memory_pattern)
        self.providers = ["CUDAExecutionProvider", "CPUExecutionProvider"]  # what this fake stands for

    def need(self, inputs: dict[str, np.ndarray]) -> int:
        """Arena bytes one run at this shape needs."""
        first = next(iter(inputs.values()))
        seq = self.config.sequence
        seq_len = first.shape[seq.axis] if seq and first.ndim > seq.axis else None
        return int(self._estimator.activation_peak(first.shape[0], seq_len) * PLANNER_FACTOR)

    def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        with self._current():
            if threading.get_ident() not in self._workspaces:
                self._workspaces[threading.get_ident()] = (
                    self.device.mem_alloc(WORKSPACE_BYTES) if WORKSPACE_BYTES else None)
            shape = tuple(a.shape for a in inputs.values())
            if shape in self._shapes_run:
                if self._pattern:
                    self.arena.hold_block(self.need(inputs))
            else:
                self._shapes_run.add(shape)
                self.arena.hold_buffers(self.need(inputs))
        return super().infer(inputs)

    def close(self) -> None:
        if getattr(self, "arena", None) is not None:
            with self._current():
                self.arena.free_all()
                for allocation in (self._weights, *self._workspaces.values()):
                    if allocation is not None:
                        allocation.free()
                self._workspaces.clear()
            self._context.detach()
            self.arena = None
        super().close()

    @contextmanager
    def _current(self) -> Iterator[None]:
        self._context.push()
        try:
            yield
        finally:
            self._context.pop()
