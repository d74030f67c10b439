"""TensorRT backend: TensorRTEngine runs a serialized plan (model.plan) built on this device for
its GPU or DLA, one execution context per instance, all device memory allocated at load so a
batch allocates nothing. load() and close() run on other threads than infer(), so every call
makes the device's primary CUDA context current for its duration. `tensorrt` and the CUDA
binding are imported in load() (trt_api.py), never at import time; tests pass FakeTensorRT and a
fake binding (tests/fakes/) through the constructor. docs/tensorrt.md explains the design.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..config import ModelConfig
from ..errors import ConfigError, EngineError, OutOfMemory
from ..types import DATATYPE_TO_NUMPY, TensorSpec
from . import trt_profiles as tp
from .base import HostBuffersHook, apply_overrides
from .cuda_api import CudaApi, DeviceBuffer, HostBuffer
from .trt_api import (
    TensorRTCapabilities,
    import_tensorrt,
    make_logger,
    tensorrt_capabilities,  # noqa: F401 - re-exported: tools/jetson_selftest.py imports it here
)
from .trt_graphs import GraphKey, TrtGraphs
from .trt_settings import TensorRTSettings, plan_info_path, read_plan_info, rebuild_command, tensorrt_settings

log = logging.getLogger(__name__)


def datatype_of_trt(dtype: Any) -> str | None:
    """The v2 datatype of a tensorrt.DataType, or None when the v2 protocol cannot carry it."""
    name = getattr(dtype, "name", None) or str(dtype).rsplit(".", 1)[-1]
    return tp.TRT_DTYPE_TO_DATATYPE.get(name)


def _is_oom(exc: BaseException, cuda: CudaApi) -> bool:
    return cuda.is_out_of_memory(exc)


# --------------------------------------------------------------------------- the engine


@dataclass
class _Buffer:
    name: str
    datatype: str
    dtype: np.dtype
    is_input: bool
    nbytes: int
    device: DeviceBuffer
    pinned: HostBuffer

    @property
    def host(self) -> np.ndarray:  # page-locked, flat
        return self.pinned.array


class TensorRTEngine:
    """One TensorRT execution context over a deserialized plan (see the module docstring)."""

    def __init__(self, config: ModelConfig, trt_module: Any = None, cuda_module: Any = None):
        self.config = config
        self.settings = TensorRTSettings()
        self._trt_module = trt_module
        self._cuda_module = cuda_module
        self.inputs: list[TensorSpec] = []
        self.outputs: list[TensorSpec] = []
        self.profiles: list[tp.Profile] = []
        self.trt_version = ""
        self.capabilities: TensorRTCapabilities | None = None
        self.plan_info: dict[str, Any] | None = None
        self._trt: Any = None
        self._cuda: CudaApi | None = None
        self._cuda_context: Any = None
        self._logger: Any = None
        self._runtime: Any = None
        self._engine: Any = None
        self._context: Any = None
        self._stream: Any = None
        self._device_memory: Any = None
        self._buffers: dict[str, _Buffer] = {}
        self._input_names: list[str] = []
        self._output_names: list[str] = []
        self._current_profile = -1
        self._weights = 0
        self._activations: list[int] = []
        self._io_per_profile: list[dict[str, int]] = []
        self.graphs: TrtGraphs | None = None  # captured batches by shape ([tensorrt] cuda_graphs)

    # ------------------------------------------------------------------ lifecycle

    def load(self) -> None:
        c = self.config
        self.settings = tensorrt_settings(c)
        modules = import_tensorrt(self._trt_module, self._cuda_module)
        trt, cuda = modules.trt, modules.cuda
        self._trt, self._cuda, self.capabilities = trt, cuda, modules.capabilities
        self.trt_version = modules.capabilities.version
        path = c.model_path
        if not path.is_file():
            raise ConfigError(
                f"model {c.name!r}: plan {path} not found; build it on this device: {self._rebuild_command()}"
            )
        plan = path.read_bytes()
        self.plan_info = read_plan_info(path)
        try:
            cuda.init()
            self._cuda_context = cuda.open_device(self.settings.device)
        except Exception as exc:  # each binding raises its own error types
            raise ConfigError(f"model {c.name!r}: cannot open CUDA device {self.settings.device} "
                              f"({cuda.name}): {exc}") from exc
        self._cuda_context.push()
        try:
            self._load(plan)
        except Exception as exc:
            self._release()
            self._cuda_context.pop()
            self._detach()
            if isinstance(exc, (ConfigError, EngineError)):
                raise
            if _is_oom(exc, cuda):
                raise OutOfMemory(f"model {c.name!r}: out of memory loading {path}: {exc}") from exc
            raise EngineError(f"model {c.name!r}: loading {path} failed: {exc}") from exc
        self._cuda_context.pop()
        self.graphs = TrtGraphs.for_engine(c.name, self.settings.cuda_graphs, cuda, self.settings.dla_core)
        log.info(
            "model %s: TensorRT %s plan %s, %d profile(s), device memory %d B (activations) + %d B (I/O)%s",
            c.name, self.trt_version, path.name, len(self.profiles), max(self._activations),
            sum(b.nbytes for b in self._buffers.values()),
            f", DLA core {self.settings.dla_core}" if self.settings.dla_core >= 0 else "",
        )

    def _load(self, plan: bytes) -> None:
        """Everything load() does with the primary context current, step by step; whatever it
        allocated before a failure is freed by the caller (_release)."""
        engine = self._deserialize(plan)
        specs_in, specs_out, datatypes = self._read_io_tensors(engine)
        self._read_profiles(engine, specs_in)
        self.inputs = apply_overrides(specs_in, self.config.inputs, "input", self.config.name)
        self.outputs = apply_overrides(specs_out, self.config.outputs, "output", self.config.name)
        # Memory, all of it now: TensorRT's activations, then the I/O buffers.
        self._weights = self._weights_bytes(len(plan))
        self._activations = [self._activation_bytes(p) for p in range(len(self.profiles))]
        self._create_context(engine)
        self._io_per_profile = [self._io_bytes_at_max(profile, datatypes) for profile in self.profiles]
        self._stream.synchronize()
        self._allocate_buffers(datatypes)

    def _deserialize(self, plan: bytes) -> Any:
        """A runtime (on the configured DLA core, if any) and the plan deserialized by it."""
        c, s = self.config, self.settings
        self._logger = make_logger(self._trt)
        self._runtime = self._trt.Runtime(self._logger)
        if s.dla_core >= 0:
            cores = int(getattr(self._runtime, "num_DLA_cores", 0))
            if s.dla_core >= cores:
                raise ConfigError(
                    f"model {c.name!r}: [tensorrt] dla_core = {s.dla_core}, but this device has {cores} DLA core(s)"
                    + (" (Orin Nano has none; Orin NX and AGX Orin have 1-2)" if cores == 0 else "")
                )
            self._runtime.DLA_core = s.dla_core  # must be set before deserializing
        try:
            engine = self._runtime.deserialize_cuda_engine(plan)
        except Exception as exc:  # some TensorRT releases raise instead of returning None
            self._logger.errors.append(str(exc))
            engine = None
        if engine is None:
            raise ConfigError(self._mismatch_message(self._logger.take()))
        self._engine = engine
        return engine

    def _read_io_tensors(self, engine: Any) -> tuple[list[TensorSpec], list[TensorSpec], dict[str, str]]:
        """Input and output specs and each tensor's v2 datatype, from the engine itself (-1 = dynamic)."""
        c, trt = self.config, self._trt
        specs_in: list[TensorSpec] = []
        specs_out: list[TensorSpec] = []
        datatypes: dict[str, str] = {}
        for i in range(engine.num_io_tensors):
            name = engine.get_tensor_name(i)
            mode = engine.get_tensor_mode(name)
            if mode == trt.TensorIOMode.NONE:
                continue
            if getattr(engine, "is_shape_inference_io", None) and engine.is_shape_inference_io(name):
                raise ConfigError(f"model {c.name!r}: {name!r} is a shape tensor; the tensorrt backend serves "
                                  "execution tensors only (rebuild the model without shape-tensor inputs)")
            datatype = datatype_of_trt(engine.get_tensor_dtype(name))
            if datatype is None:
                raise ConfigError(
                    f"model {c.name!r}: tensor {name!r} is {engine.get_tensor_dtype(name)} in the plan, which the "
                    "v2 protocol cannot carry; keep I/O tensors FP32/FP16/INT8/INT32/INT64/BOOL/UINT8"
                )
            spec = TensorSpec(name, datatype, tuple(int(d) for d in engine.get_tensor_shape(name)))
            datatypes[name] = datatype
            (specs_in if mode == trt.TensorIOMode.INPUT else specs_out).append(spec)
        self._input_names = [sp.name for sp in specs_in]
        self._output_names = [sp.name for sp in specs_out]
        return specs_in, specs_out, datatypes

    def _read_profiles(self, engine: Any, specs_in: list[TensorSpec]) -> None:
        """The plan's optimization profiles; ConfigError unless they serve every preferred size
        (and sequence bucket)."""
        c = self.config
        self.profiles = []
        static = {sp.name: sp.shape for sp in specs_in}
        for p in range(max(1, engine.num_optimization_profiles)):
            ranges = {}
            for name in self._input_names:
                lo, opt, hi = (tuple(int(d) for d in dims) for dims in engine.get_tensor_profile_shape(name, p))
                if len(lo) != len(static[name]) or min(lo + hi, default=0) < 0:
                    if min(static[name], default=0) < 0:
                        raise ConfigError(
                            f"model {c.name!r}: the plan has no profile shapes for dynamic input {name!r}"
                        )
                    lo = opt = hi = static[name]  # a static input: its one shape is its profile
                ranges[name] = tp.ShapeRange(lo, opt, hi)
            self.profiles.append(tp.Profile(p, ranges))
        seq = c.sequence
        missing = tp.uncovered(self.profiles, c.batching.preferred_batch_sizes,
                               list(seq.inputs) if seq else (), seq.axis if seq else 1,
                               list(seq.buckets) if seq else ())
        if missing:
            raise ConfigError(
                f"model {c.name!r}: the plan has no optimization profile for batch size(s) {', '.join(missing)} "
                f"of [batching] preferred_batch_sizes {c.batching.preferred_batch_sizes} "
                f"({'; '.join(p.describe() for p in self.profiles)}); rebuild it: {self._rebuild_command()}"
            )

    def _create_context(self, engine: Any) -> None:
        """The execution context, its stream, and one user-managed activation block sized for the
        hungriest profile."""
        assert self._cuda is not None  # load() set it
        context = engine.create_execution_context(self._trt.ExecutionContextAllocationStrategy.USER_MANAGED)
        if context is None:
            raise EngineError(f"model {self.config.name!r}: TensorRT could not create an execution context: "
                              f"{self._logger.take() or 'no reason given'}")
        self._context = context
        self._stream = self._cuda.stream()
        size = max(max(self._activations), 1)
        self._device_memory = self._cuda.mem_alloc(size)
        if hasattr(context, "set_device_memory"):  # TensorRT >= 10.1 (and 11): pointer and size
            context.set_device_memory(self._device_memory.ptr, size)
        else:  # TensorRT 10.0
            context.device_memory = self._device_memory.ptr

    def _io_bytes_at_max(self, profile: tp.Profile, datatypes: dict[str, str]) -> dict[str, int]:
        """Bytes of each I/O tensor at the profile's max shapes; output shapes come from
        TensorRT's shape inference."""
        context = self._context
        self._select_profile(profile.index)
        shapes = {}
        for name in self._input_names:
            shapes[name] = profile.inputs[name].max
            self._check(context.set_input_shape(name, profile.inputs[name].max), f"set_input_shape({name})")
        for name in self._output_names:
            shape = tuple(int(d) for d in context.get_tensor_shape(name))
            if any(d < 0 for d in shape):
                raise ConfigError(
                    f"model {self.config.name!r}: output {name!r} has a data-dependent shape {shape}; the tensorrt "
                    "backend needs output shapes that follow from the input shapes"
                )
            shapes[name] = shape
        return tp.profile_buffer_bytes(shapes, datatypes)

    def _allocate_buffers(self, datatypes: dict[str, str]) -> None:
        """One device and one page-locked host buffer per I/O tensor, sized for the largest profile."""
        assert self._cuda is not None  # load() set it
        for name, nbytes in tp.shared_buffer_bytes(self._io_per_profile).items():
            datatype = datatypes[name]
            dtype = DATATYPE_TO_NUMPY[datatype]
            n = max(nbytes, dtype.itemsize)
            device = self._cuda.mem_alloc(n)
            try:
                pinned = self._cuda.pinned_empty(n // dtype.itemsize, dtype)
            except Exception:
                device.free()
                raise
            self._buffers[name] = _Buffer(name, datatype, dtype, name in self._input_names, n, device, pinned)

    def close(self) -> None:
        """Free the buffers, the context, the engine and the runtime, in that order."""
        if self._cuda_context is None:
            return
        self._cuda_context.push()
        try:
            if self._stream is not None:
                try:
                    self._stream.synchronize()
                except Exception:  # closing after a failed batch: free what we can
                    log.warning("model %s: stream did not synchronize on close", self.config.name, exc_info=True)
            self._release()
        finally:
            self._cuda_context.pop()
            self._detach()

    def _detach(self) -> None:
        """Drop our reference to the primary context (after popping it)."""
        if self._cuda_context is not None:
            self._cuda_context.release()
            self._cuda_context = None

    def _release(self) -> None:
        """Free everything load() allocated; the primary context must be current."""
        if self.graphs is not None:  # the graphs before the buffers and context they use
            self.graphs.close()
            self.graphs = None
        for buf in self._buffers.values():
            buf.device.free()
            buf.pinned.free()
        self._buffers = {}
        self._context = None  # the context before its engine, the engine before its runtime
        if self._device_memory is not None:
            self._device_memory.free()
            self._device_memory = None
        self._engine = None
        self._runtime = None
        if self._stream is not None:
            self._stream.close()
            self._stream = None
        self._current_profile = -1

    # ------------------------------------------------------------------ inference

    @property
    def cuda_graphs(self) -> bool:
        return self.graphs is not None

    @property
    def host_batch_buffers(self) -> HostBuffersHook | None:
        return self._host_buffers_for if self._buffers else None

    def _host_buffers_for(self, shapes: dict[str, tuple[tuple[int, ...], np.dtype]]) -> dict[str, np.ndarray] | None:
        """Views of the page-locked input buffers for a batch of these shapes of every input (the
        executor assembles the batch there, so infer() copies nothing on the host), or None."""
        if set(shapes) != set(self._input_names):
            return None
        views = {}
        for name, (shape, dtype) in shapes.items():
            buf = self._buffers[name]
            count = int(np.prod(shape, dtype=np.int64))
            if np.dtype(dtype) != buf.dtype or count * buf.dtype.itemsize > buf.nbytes:
                return None
            views[name] = buf.host[:count].reshape(shape)
        return views

    def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self._run(inputs, replay=True)

    def infer_without_graphs(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """execute_async_v3 whatever is captured: the reference `edge-batcher bench` measures
        graph replay against (the same context, buffers and copies)."""
        return self._run(inputs, replay=False)

    def _run(self, inputs: dict[str, np.ndarray], replay: bool) -> dict[str, np.ndarray]:
        if self._context is None:
            raise EngineError(f"model {self.config.name!r}: infer() before load() or after close()")
        assert self._cuda is not None  # load() set it before the context
        self._cuda_context.push()
        try:
            return self._infer(inputs, replay)
        except EngineError:
            raise
        except Exception as exc:
            if _is_oom(exc, self._cuda):
                raise OutOfMemory(f"model {self.config.name!r}: out of memory: {exc}") from exc
            raise EngineError(f"model {self.config.name!r}: TensorRT failed: {exc}") from exc
        finally:
            self._cuda_context.pop()

    def _infer(self, inputs: dict[str, np.ndarray], replay: bool) -> dict[str, np.ndarray]:
        c, cuda, context, stream = self.config, self._cuda, self._context, self._stream
        assert cuda is not None  # infer() checked
        arrays = {}
        for name in self._input_names:
            if name not in inputs:
                raise EngineError(f"model {c.name!r}: batch has no input {name!r}")
            buf = self._buffers[name]
            arrays[name] = np.ascontiguousarray(inputs[name], dtype=buf.dtype)
        shapes = {name: a.shape for name, a in arrays.items()}
        profile = tp.select_profile(shapes, self.profiles)
        if profile is None:
            raise EngineError(
                f"model {c.name!r}: batch shapes {', '.join(f'{n} {list(s)}' for n, s in shapes.items())} are outside "
                f"every optimization profile of the plan ({'; '.join(p.describe() for p in self.profiles)})"
            )
        key: GraphKey = (profile, tuple((name, tuple(shape)) for name, shape in shapes.items()))
        captured = self.graphs.get(key) if self.graphs is not None and replay else None
        if captured is None:
            self._select_profile(profile)
        for name, array in arrays.items():
            buf = self._buffers[name]
            if captured is None:
                self._check(context.set_input_shape(name, array.shape), f"set_input_shape({name}, {list(array.shape)})")
            host = buf.host[: array.size].reshape(array.shape)
            if array.ctypes.data != host.ctypes.data:  # else assembled there (host_batch_buffers)
                np.copyto(host, array)
            cuda.copy_htod_async(buf.device, host, stream)
        out_shapes = captured.output_shapes if captured is not None else self._output_shapes()
        out_views = {name: self._buffers[name].host[:int(np.prod(shape, dtype=np.int64))].reshape(shape)
                     for name, shape in out_shapes.items()}
        if captured is not None:
            captured.graph.launch(stream)  # the shapes and addresses it was captured with: this batch's
        else:
            for name, buf in self._buffers.items():
                self._check(context.set_tensor_address(name, buf.device.ptr), f"set_tensor_address({name})")
            self._check(context.execute_async_v3(stream.handle), "execute_async_v3")
        for name, view in out_views.items():
            cuda.copy_dtoh_async(view, self._buffers[name].device, stream)
        stream.synchronize()
        # Copies: the pinned buffers are reused by the next batch while the runner still splits these.
        results = {name: view.copy() for name, view in out_views.items()}
        if captured is None and replay and self.graphs is not None:
            # the context now holds this shape and the buffers' addresses: what the graph replays
            def enqueue() -> None:
                self._check(context.execute_async_v3(stream.handle), "execute_async_v3 (captured)")

            if not self.graphs.capture(key, out_shapes, stream, enqueue):
                self.graphs = None
        return results

    def _output_shapes(self) -> dict[str, tuple[int, ...]]:
        """Each output's shape for the input shapes just set, checked against its buffer."""
        shapes = {}
        for name in self._output_names:
            buf = self._buffers[name]
            shape = tuple(int(d) for d in self._context.get_tensor_shape(name))
            count = int(np.prod(shape, dtype=np.int64))
            if any(d < 0 for d in shape) or count * buf.dtype.itemsize > buf.nbytes:
                raise EngineError(f"model {self.config.name!r}: output {name!r} shape {shape} does not fit its buffer")
            shapes[name] = shape
        return shapes

    def _select_profile(self, index: int) -> None:
        if index != self._current_profile:
            self._check(self._context.set_optimization_profile_async(index, self._stream.handle),
                        f"set_optimization_profile_async({index})")
            self._current_profile = index

    def _check(self, ok: Any, what: str) -> None:
        """TensorRT reports most failures as a False return plus a logged error."""
        if ok is False:
            reason = self._logger.take() or "no reason logged"
            if "out of memory" in reason.lower():
                raise OutOfMemory(f"model {self.config.name!r}: TensorRT {what}: {reason}")
            raise EngineError(f"model {self.config.name!r}: TensorRT {what} failed: {reason}")

    # ------------------------------------------------------------------ memory

    def _weights_bytes(self, plan_size: int) -> int:
        """TensorRT's own count of the weights when this version has it (get_engine_stat), else the
        plan size: an upper bound, since the plan holds the weights plus kernels and metadata."""
        stat = getattr(self._trt, "EngineStat", None)
        if stat is not None and hasattr(self._engine, "get_engine_stat"):
            try:
                return int(self._engine.get_engine_stat(stat.TOTAL_WEIGHTS_SIZE))
            except Exception:  # older bindings may lack the overload
                log.debug("get_engine_stat failed; using the plan size", exc_info=True)
        return plan_size

    def _activation_bytes(self, profile: int) -> int:
        engine = self._engine
        if hasattr(engine, "get_device_memory_size_for_profile_v2"):  # TensorRT >= 10.1; the only one in 11
            return int(engine.get_device_memory_size_for_profile_v2(profile))
        if hasattr(engine, "get_device_memory_size_for_profile"):
            return int(engine.get_device_memory_size_for_profile(profile))
        return int(getattr(engine, "device_memory_size_v2", getattr(engine, "device_memory_size", 0)))

    def memory_footprint(self, batch: int, seq_len: int | None = None) -> dict[str, int]:
        """Device bytes of this instance for a batch of `batch` rows, from TensorRT's own numbers.

        Keys (see trt_profiles.TrtFootprint): weights, activations and io of the profile serving
        this batch, reserved (activations + I/O held from load to close), resident (weights +
        reserved) and per_batch (0: a batch allocates nothing). With a [sequence] model and no
        seq_len, the longest bucket's profile is reported.
        """
        if not self.profiles:
            raise EngineError(f"model {self.config.name!r}: memory_footprint() before load()")
        seq = self.config.sequence
        # Without a sequence length, a sequence model is sized for its longest bucket.
        lengths: list[int | None] = list(seq.buckets) if seq is not None and seq_len is None else [seq_len]
        best = None
        for length in lengths:
            try:
                index = tp.profile_for_batch(batch, self.profiles, length, seq.axis if seq else 1,
                                             list(seq.inputs) if seq else ())
            except ValueError as exc:
                raise EngineError(f"model {self.config.name!r}: {exc}") from None
            f = tp.footprint(self._weights, self._activations, self._io_per_profile, index)
            if best is None or f.activations + f.io > best.activations + best.io:
                best = f
        assert best is not None
        return best.as_dict()

    # ------------------------------------------------------------------ errors

    def _rebuild_command(self) -> str:
        return rebuild_command(self.config, self.settings, self.capabilities)

    def _mismatch_message(self, trt_said: str) -> str:
        c = self.config
        info = self.plan_info or {}
        built = []
        if info.get("tensorrt"):
            built.append(f"TensorRT {info['tensorrt']}")
        if info.get("gpu"):
            built.append(f"on {info['gpu']}")
        if info.get("compute_capability"):
            built.append(f"(compute {info['compute_capability']})")
        built_text = (" ".join(built) + f" according to {plan_info_path(c.model_path).name}") if built else (
            "an unknown TensorRT version (no build record next to the plan)"
        )
        return (
            f"model {c.name!r}: TensorRT {self.trt_version} cannot load the plan {c.model_path}: it was built for "
            f"another TensorRT version or GPU. Plans only load with the exact TensorRT version and GPU model they "
            f"were built with; this one was built with {built_text}. Rebuild it on this device: "
            f"{self._rebuild_command()} (or python tools/build_engine.py with the same arguments). "
            f"TensorRT said: {trt_said or 'nothing'}"
        )
