"""The fake TensorRT runtime: IRuntime, ICudaEngine and IExecutionContext over a fake plan.

A fake plan (written by fake_trt_builder.py) embeds the ONNX model; execution runs it with ONNX
Runtime on the CPU, reading inputs from and writing outputs to FakeCuda memory, queued on the
stream. Deserializing refuses a plan from another TensorRT version, GPU or DLA setup, and the
context enforces profiles, input shapes, tensor addresses and user-managed device memory as the
module docstring of fake_tensorrt.py lists.
"""

from __future__ import annotations

import base64
import json
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from tests.fakes.fake_cuda import CudaLaunchError, CudaLogicError, CudaMemoryError, FakeAllocation
from tests.fakes.fake_trt_types import (
    FAKE_PLAN_MAGIC,
    REMOVED_IN_11,
    TRT_TO_NUMPY,
    DataType,
    EngineStat,
    ExecutionContextAllocationStrategy,
    Generational,
    ILogger,
    Severity,
    TensorIOMode,
    TensorLocation,
    check_logger,
    log_to,
)  # fmt: skip

if TYPE_CHECKING:
    from tests.fakes.fake_tensorrt import FakeTensorRT


class FakeRuntime:
    _trt: FakeTensorRT

    def __init__(self, logger: ILogger):
        check_logger(logger)
        self.logger = logger
        self._dla_core = -1

    @property
    def num_DLA_cores(self) -> int:  # noqa: N802 - TensorRT's name
        return self._trt.num_dla_cores

    @property
    def DLA_core(self) -> int:  # noqa: N802
        return self._dla_core

    @DLA_core.setter
    def DLA_core(self, value: int) -> None:  # noqa: N802
        self._dla_core = int(value)

    def deserialize_cuda_engine(self, serialized_engine) -> _Engine | None:
        data = bytes(serialized_engine)
        try:
            plan = json.loads(data.decode("utf-8"))
            if plan.get("magic") != FAKE_PLAN_MAGIC:
                raise ValueError
        except (UnicodeDecodeError, ValueError, AttributeError):
            log_to(self.logger, Severity.ERROR,
                 "FakeTensorRT IRuntime::deserializeCudaEngine: not a (fake) plan: the magic tag does not match")
            return None
        if plan["trt_version"] != self._trt.__version__:
            log_to(self.logger, Severity.ERROR,
                 f"FakeTensorRT IRuntime::deserializeCudaEngine: Version tag does not match: the plan was built by "
                 f"TensorRT {plan['trt_version']}, this is TensorRT {self._trt.__version__}")
            return None
        if tuple(plan["compute_capability"]) != tuple(self._trt.cuda.compute_capability):
            log_to(self.logger, Severity.ERROR,
                 f"FakeTensorRT IRuntime::deserializeCudaEngine: the engine plan file is generated on an incompatible "
                 f"device, expecting compute {tuple(plan['compute_capability'])} "
                 f"got {self._trt.cuda.compute_capability}")
            return None
        if plan.get("dla_core", -1) >= 0:
            if self._trt.num_dla_cores == 0:
                log_to(self.logger, Severity.ERROR, "FakeTensorRT: the plan uses DLA, but this device has no DLA cores")
                return None
            if not 0 <= self._dla_core < self._trt.num_dla_cores:
                log_to(self.logger, Severity.ERROR,
                     f"FakeTensorRT: runtime DLA_core {self._dla_core} is not in 0..{self._trt.num_dla_cores - 1}")
                return None
        engine = _Engine(self._trt, plan, self.logger, len(data))
        if plan["weights_bytes"] > 0:  # deserializing puts the weights on the device
            try:
                engine._weights = self._trt.cuda._allocate(plan["weights_bytes"], "tensorrt")
            except CudaMemoryError:
                log_to(self.logger, Severity.ERROR, "FakeTensorRT IRuntime::deserializeCudaEngine: out of memory "
                     "for the engine's weights")
                return None
        self._trt.calls.append(("deserialize_cuda_engine", plan["trt_version"]))
        return engine


@dataclass
class _IO:
    name: str
    mode: TensorIOMode
    dtype: DataType
    shape: tuple[int, ...]  # -1 for dynamic
    dim_params: tuple[str | None, ...]


class _Engine(Generational):
    _removed = REMOVED_IN_11["ICudaEngine"]

    def __init__(self, trt: FakeTensorRT, plan: dict, logger: ILogger, plan_size: int):
        self._gen = trt.major
        self._trt = trt
        self._plan = plan
        self._logger = logger
        self.plan_size = plan_size
        self._io = [_IO(t["name"], TensorIOMode[t["mode"]], DataType[t["dtype"]], tuple(t["shape"]),
                        tuple(t["dim_params"])) for t in plan["io"]]
        self._by_name = {t.name: t for t in self._io}
        self._profiles = plan["profiles"]  # [{name: [min, opt, max]}]
        self._session = None
        self._shape_cache: dict[tuple, dict[str, tuple[int, ...]]] = {}
        self._weights: FakeAllocation | None = None
        self.name = plan.get("name", "fake")

    def __del__(self) -> None:
        weights = getattr(self, "_weights", None)
        if weights is not None:
            weights.live = False

    # ------------------------------------------------------------------ properties

    @property
    def num_io_tensors(self) -> int:
        return len(self._io)

    @property
    def num_optimization_profiles(self) -> int:
        return len(self._profiles)

    @property
    def device_memory_size_v2(self) -> int:
        return max(self._plan["device_memory"])

    @property
    def device_memory_size(self) -> int:  # v1 (10.x only): the v2 number in this fake
        return self.device_memory_size_v2

    def get_device_memory_size_for_profile(self, profile_index: int) -> int:  # v1 (10.x only)
        return self.get_device_memory_size_for_profile_v2(profile_index)

    @property
    def streamable_weights_size(self) -> int:
        return 0  # not built with weight streaming

    def get_device_memory_size_for_profile_v2(self, profile_index: int) -> int:
        return int(self._plan["device_memory"][profile_index])

    def get_engine_stat(self, stat) -> int:
        if not self._trt.engine_stats:  # pragma: no cover - attribute is absent then
            raise AttributeError("get_engine_stat")
        if stat is EngineStat.TOTAL_WEIGHTS_SIZE:
            return int(self._plan["weights_bytes"])
        return 0

    def __getattribute__(self, name: str):
        if name == "get_engine_stat" and not object.__getattribute__(self, "_trt").engine_stats:
            raise AttributeError(name)
        return super().__getattribute__(name)

    def get_tensor_name(self, index: int) -> str:
        return self._io[index].name

    def get_tensor_mode(self, name: str) -> TensorIOMode:
        t = self._by_name.get(name)
        return t.mode if t else TensorIOMode.NONE

    def get_tensor_dtype(self, name: str) -> DataType:
        return self._by_name[name].dtype

    def get_tensor_shape(self, name: str) -> tuple[int, ...]:
        return self._by_name[name].shape

    def get_tensor_location(self, name: str) -> TensorLocation:
        return TensorLocation.DEVICE

    def is_shape_inference_io(self, name: str) -> bool:
        return False

    def get_tensor_profile_shape(self, name: str, profile_index: int) -> list[tuple[int, ...]]:
        if self._by_name[name].mode is not TensorIOMode.INPUT:
            raise RuntimeError(f"{name} is not an input")
        return [tuple(s) for s in self._profiles[profile_index][name]]

    def create_execution_context(self, strategy=ExecutionContextAllocationStrategy.STATIC) -> _Context | None:
        context = _Context(self, strategy)
        if strategy is not ExecutionContextAllocationStrategy.USER_MANAGED:
            try:
                context._own_memory = self._trt.cuda._allocate(self.device_memory_size_v2, "tensorrt")
            except CudaMemoryError:
                log_to(self._logger, Severity.ERROR, "FakeTensorRT createExecutionContext: out of memory")
                return None
        return context

    def serialize(self) -> bytes:
        return json.dumps(self._plan).encode()

    # ------------------------------------------------------------------ execution (ONNX Runtime on the CPU)

    def _ort(self):
        if self._session is None:
            import onnxruntime as ort

            opts = ort.SessionOptions()
            opts.intra_op_num_threads = 1
            self._session = ort.InferenceSession(
                base64.b64decode(self._plan["onnx"]), opts, providers=["CPUExecutionProvider"]
            )
        return self._session

    def output_shapes(self, input_shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        """What TensorRT's shape inference would report for the outputs at these input shapes."""
        key = tuple(sorted(input_shapes.items()))
        cached = self._shape_cache.get(key)
        if cached is not None:
            return cached
        bound: dict[str, int] = {}
        for t in self._io:
            if t.mode is TensorIOMode.INPUT:
                for p, d in zip(t.dim_params, input_shapes[t.name]):
                    if p:
                        bound[p] = d
        shapes: dict[str, tuple[int, ...]] = {}
        unresolved = False
        for t in self._io:
            if t.mode is TensorIOMode.OUTPUT:
                dims = []
                for d, p in zip(t.shape, t.dim_params):
                    if d >= 0:
                        dims.append(d)
                    elif p in bound:
                        dims.append(bound[p])
                    else:
                        unresolved = True
                        dims.append(-1)
                shapes[t.name] = tuple(dims)
        if unresolved:  # run the model once on zeros to learn them
            feeds = {t.name: np.zeros(input_shapes[t.name], dtype=TRT_TO_NUMPY[t.dtype])
                     for t in self._io if t.mode is TensorIOMode.INPUT}
            names = [t.name for t in self._io if t.mode is TensorIOMode.OUTPUT]
            for name, value in zip(names, self._ort().run(names, feeds)):
                shapes[name] = tuple(value.shape)
        self._shape_cache[key] = shapes
        return shapes

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        # Weakly typed (10.x flags): round through float16. Strongly typed: the model itself is FP16/Q-DQ.
        reduced = self._plan["precision"] in ("fp16", "int8") and self._plan.get("typing", "weak") == "weak"
        if reduced:
            feeds = {k: (v.astype(np.float16).astype(v.dtype) if v.dtype.kind == "f" else v) for k, v in feeds.items()}
        names = [t.name for t in self._io if t.mode is TensorIOMode.OUTPUT]
        values = self._ort().run(names, feeds)
        out = {}
        for name, value in zip(names, values):
            if reduced and value.dtype.kind == "f":
                value = value.astype(np.float16).astype(value.dtype)
            out[name] = value
        return out


class _Context(Generational):
    _removed = REMOVED_IN_11["IExecutionContext"]

    def __del__(self) -> None:
        own = getattr(self, "_own_memory", None)
        if own is not None:
            own.live = False

    def __init__(self, engine: _Engine, strategy):
        self._gen = engine._trt.major
        self.engine = engine
        self._strategy = strategy
        self._own_memory: FakeAllocation | None = None
        self._memory: tuple[int, int] | None = None
        self._profile = 0
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._addresses: dict[str, int] = {}
        self.name = ""

    @property
    def _logger(self) -> ILogger:
        return self.engine._logger

    def _error(self, msg: str) -> bool:
        log_to(self._logger, Severity.ERROR, f"FakeTensorRT IExecutionContext: {msg}")
        return False

    # device memory -----------------------------------------------------

    def set_device_memory(self, memory: int, size: int) -> None:
        self._memory = (int(memory), int(size))

    @property
    def device_memory(self):  # write-only in TensorRT
        raise AttributeError("device_memory is write-only")

    @device_memory.setter
    def device_memory(self, memory: int) -> None:
        self._memory = (int(memory), self.engine.device_memory_size_v2)

    # profiles and shapes ------------------------------------------------

    @property
    def active_optimization_profile(self) -> int:
        return self._profile

    def set_optimization_profile_async(self, profile_index: int, stream_handle: int) -> bool:
        if not 0 <= profile_index < self.engine.num_optimization_profiles:
            return self._error(f"optimization profile {profile_index} is out of range "
                               f"0..{self.engine.num_optimization_profiles - 1}")
        if self._trt_stream(stream_handle) is None and int(stream_handle) != 0:
            return self._error(f"stream handle 0x{int(stream_handle):x} is not a live stream")
        self.engine._trt.calls.append(("set_optimization_profile_async", profile_index))
        if profile_index != self._profile:
            self._profile = profile_index
            self._shapes.clear()  # stricter than TensorRT: shapes must be set again after a switch
        return True

    def set_input_shape(self, name: str, shape) -> bool:
        t = self.engine._by_name.get(name)
        if t is None or t.mode is not TensorIOMode.INPUT:
            return self._error(f"setInputShape: {name!r} is not an input tensor")
        shape = tuple(int(d) for d in shape)
        if len(shape) != len(t.shape):
            return self._error(f"setInputShape: {name!r} has rank {len(t.shape)}, got shape {shape}")
        for d, static in zip(shape, t.shape):
            if static >= 0 and d != static:
                return self._error(f"setInputShape: {name!r} static dimensions are {t.shape}, got {shape}")
        lo, _, hi = self.engine._profiles[self._profile][name]
        if not all(a <= d <= b for a, d, b in zip(lo, shape, hi)):
            return self._error(
                f"setInputShape: {name!r} shape {shape} is outside the selected optimization profile "
                f"{self._profile} (min {tuple(lo)}, max {tuple(hi)})"
            )
        self._shapes[name] = shape
        self.engine._trt.calls.append(("set_input_shape", name, shape))
        return True

    def _inputs_specified(self) -> bool:
        return all(t.name in self._shapes for t in self.engine._io if t.mode is TensorIOMode.INPUT)

    @property
    def all_binding_shapes_specified(self) -> bool:
        return self._inputs_specified()

    def get_tensor_shape(self, name: str) -> tuple[int, ...]:
        t = self.engine._by_name[name]
        if t.mode is TensorIOMode.INPUT:
            return self._shapes.get(name, t.shape)
        if not self._inputs_specified():
            return t.shape
        return self.engine.output_shapes(dict(self._shapes))[name]

    def set_tensor_address(self, name: str, memory: int) -> bool:
        if name not in self.engine._by_name:
            return self._error(f"setTensorAddress: {name!r} is not an I/O tensor")
        if int(memory) == 0:
            return self._error(f"setTensorAddress: null address for {name!r}")
        self._addresses[name] = int(memory)
        return True

    def get_tensor_address(self, name: str) -> int:
        return self._addresses.get(name, 0)

    # execution --------------------------------------------------------------

    def _trt_stream(self, handle: int):
        return self.engine._trt.cuda.stream_by_handle(handle)

    def execute_async_v3(self, stream_handle: int) -> bool:
        engine = self.engine
        cuda = engine._trt.cuda
        stream = self._trt_stream(stream_handle)
        if stream is None and int(stream_handle) != 0:
            return self._error(f"enqueueV3: stream handle 0x{int(stream_handle):x} is not a live stream")
        if not self._inputs_specified():
            missing = [t.name for t in engine._io if t.mode is TensorIOMode.INPUT and t.name not in self._shapes]
            return self._error(f"enqueueV3: input shapes not specified for {missing} (profile {self._profile})")
        required = engine.get_device_memory_size_for_profile_v2(self._profile)
        if self._strategy is ExecutionContextAllocationStrategy.USER_MANAGED:
            if self._memory is None:
                return self._error("enqueueV3: no device memory was set for this USER_MANAGED context")
            ptr, size = self._memory
            if size < required:
                return self._error(f"enqueueV3: device memory of {size} bytes is smaller than the "
                                   f"{required} bytes profile {self._profile} needs")
            try:
                cuda.lookup(ptr, required)
            except CudaLogicError as exc:
                return self._error(f"enqueueV3: device memory: {exc}")
        out_shapes = engine.output_shapes(dict(self._shapes))
        plan: dict[str, tuple[int, tuple[int, ...], Any]] = {}
        for t in engine._io:
            if t.name not in self._addresses:
                return self._error(f"enqueueV3: no address set for tensor {t.name!r}")
            shape = self._shapes[t.name] if t.mode is TensorIOMode.INPUT else out_shapes[t.name]
            dtype = np.dtype(TRT_TO_NUMPY[t.dtype])
            nbytes = math.prod(shape) * dtype.itemsize
            try:
                cuda.lookup(self._addresses[t.name], nbytes)
            except CudaLogicError as exc:
                return self._error(f"enqueueV3: tensor {t.name!r} {shape}: {exc}")
            plan[t.name] = (self._addresses[t.name], shape, dtype)

        def run() -> None:
            feeds = {}
            for t in engine._io:
                if t.mode is TensorIOMode.INPUT:
                    ptr, shape, dtype = plan[t.name]
                    raw = cuda.read(ptr, math.prod(shape) * dtype.itemsize)
                    feeds[t.name] = raw.view(dtype).reshape(shape)
            for name, value in engine.run(feeds).items():
                ptr, shape, dtype = plan[name]
                if tuple(value.shape) != tuple(shape):
                    raise CudaLaunchError(f"FakeTensorRT: output {name} came out {value.shape}, expected {shape}")
                cuda.write(ptr, value.astype(dtype, copy=False))

        capturing = stream is not None and stream.capture is not None
        if capturing and not engine._trt.capturable:
            return self._error("enqueueV3: this engine's work cannot be captured into a CUDA graph "
                               "(FakeTensorRT(capturable=False))")
        engine._trt.calls.append(("capture_execute_async_v3" if capturing else "execute_async_v3", self._profile,
                                  dict(self._shapes)))
        if stream is None:
            log_to(self._logger, Severity.WARNING, "FakeTensorRT enqueueV3: using the default stream")
            run()
        else:
            stream.enqueue(run)
        return True
