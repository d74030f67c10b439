"""FakeTensorRT and FakeCuda: honest stand-ins for `tensorrt` and `pycuda.driver` in tests.

NOT TensorRT. Nothing here runs on a GPU or compiles anything. They implement only the part
of the TensorRT 10 and 11 Python APIs and of pycuda that edge-batcher's TensorRT backend
(edge_batcher/engines/tensorrt.py), its engine builder (trt_build.py) and the Jetson
self-test use, with the same names, so those run unchanged in CI. They are passed in
explicitly (`TensorRTEngine(config, trt_module=FakeTensorRT(cuda), cuda_module=cuda)`),
never patched over the real modules.

What is real: the numbers. A fake "plan" embeds the ONNX model, and execution runs it with
ONNX Runtime on the CPU, reading inputs from and writing outputs to fake device memory, so a
test can compare the backend's outputs with onnxruntime's. An FP16/INT8 plan rounds inputs
and float outputs through float16 (a crude stand-in for reduced precision, not TensorRT's
numerics).

What is enforced, as real TensorRT / CUDA do (cheap checks only):
  * deserialize_cuda_engine returns None and logs an error for a plan from another TensorRT
    version, another GPU (compute capability), or bytes that are not a plan;
  * set_input_shape returns False (and logs) outside the *selected* profile's min..max, for a
    wrong rank, a static dimension changed, or a name that is not an input;
  * set_optimization_profile_async rejects an index out of range;
  * execute_async_v3 fails (returns False, logs) unless every input shape is set and every
    I/O tensor has an address, and unless a USER_MANAGED context was given device memory of at
    least get_device_memory_size_for_profile_v2(selected profile);
  * pycuda calls that need a CUDA context (mem_alloc, Stream, pagelocked_empty, memcpy_*)
    raise LogicError when no context is current on the calling thread;
  * mem_alloc beyond the fake device's memory raises pycuda's MemoryError.
Stricter than real TensorRT (each would be a crash or silent corruption on hardware):
  * switching profiles forgets the input shapes (the backend must set them after a switch);
  * a tensor address must lie in a live allocation big enough for the tensor's current shape;
  * memcpy_htod_async / memcpy_dtoh_async host buffers must be page-locked.
Modelled: streams are asynchronous. Copies and executions queue on the stream and happen at
stream.synchronize(), so reading an output before synchronizing sees stale data, as on a GPU.

Two API generations (FakeTensorRT(cuda, version=...)): a "10.x" fake has the weak-typing
precision flags (BuilderFlag.FP16/INT8/BF16/FP8...), the INT8 calibrator API, the
EXPLICIT_BATCH network flag and the v1 memory queries (device_memory_size,
get_device_memory_size_for_profile, context.device_memory); an "11.x" fake has none of them
(AttributeError, as NVIDIA's 10.x -> 11.x migration guide lists them removed) and builds every
network strongly typed: the plan's precision is the ONNX model's own (FP16 tensors, Q/DQ nodes).
tests/fakes/fake_cuda_bindings.py fakes cuda-python's `cuda.bindings.driver` over the same
FakeCuda device, so either binding can drive the same fake GPU.

What only hardware can tell (not modelled): kernel selection and speed, real FP16/INT8
numerics, real activation sizes (the fake's are synthetic), DLA, unified-memory behaviour on
Jetson, driver/TensorRT/JetPack compatibility, and whether the real bindings accept exactly
these argument forms.
"""

from __future__ import annotations

import base64
import enum
import hashlib
import json
import math
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

FAKE_PLAN_MAGIC = "edge-batcher-FAKE-tensorrt-plan"
_ALIGN = 256


# =========================================================================== FakeCuda


class CudaError(Exception):
    """pycuda.driver.Error"""


class CudaMemoryError(CudaError):
    """pycuda.driver.MemoryError"""


class CudaLogicError(CudaError):
    """pycuda.driver.LogicError"""


class CudaLaunchError(CudaError):
    """pycuda.driver.LaunchError"""


class CudaRuntimeError(CudaError):
    """pycuda.driver.RuntimeError"""


@dataclass
class _Alloc:
    ptr: int
    size: int
    data: np.ndarray  # uint8
    owner: str  # "user" (mem_alloc) or "tensorrt" (a STATIC context's own memory)
    live: bool = True


class FakeCuda:
    """The pycuda.driver surface the backend uses, over numpy "device" memory."""

    IS_FAKE = True
    Error = CudaError
    MemoryError = CudaMemoryError
    LogicError = CudaLogicError
    LaunchError = CudaLaunchError
    RuntimeError = CudaRuntimeError

    def __init__(self, total_memory: int = 8 << 30, device_name: str = "FakeCuda device (not a GPU)",
                 compute_capability: tuple[int, int] = (8, 7), device_count: int = 1):
        self.total_memory = int(total_memory)
        self.device_name = device_name
        self.compute_capability = compute_capability
        self.device_count = device_count
        self.initialized = False
        self.allocations: dict[int, _Alloc] = {}
        self._next_ptr = 1 << 20
        self._pinned: list[tuple[int, int]] = []
        self._tls = threading.local()
        self._lock = threading.Lock()
        self.streams: dict[int, FakeStream] = {}
        self._next_stream = 0x5000
        # Counters a test can read to check behaviour ("no allocation per batch").
        self.counters = {"mem_alloc": 0, "pagelocked_empty": 0, "memcpy_htod": 0, "memcpy_dtoh": 0, "free": 0}
        self.primary_retained = 0
        self.driver_version = 12060  # cuDriverGetVersion: CUDA 12.6, as JetPack 6.2
        fake = self

        class Context:
            """pycuda.driver.Context: only the static pop() is used on the class."""

            @staticmethod
            def pop() -> None:
                stack = fake._stack()
                if not stack:
                    raise CudaLogicError("cuCtxPopCurrent failed: invalid device context")
                stack.pop()

            @staticmethod
            def get_current():
                stack = fake._stack()
                return stack[-1] if stack else None

        self.Context = Context

    # ------------------------------------------------------------------ context handling

    def _stack(self) -> list:
        if not hasattr(self._tls, "stack"):
            self._tls.stack = []
        return self._tls.stack

    def require_context(self, what: str) -> None:
        if not self.initialized:
            raise CudaLogicError(f"{what} failed: cuInit has not been called")
        if not self._stack():
            raise CudaLogicError(f"{what} failed: invalid device context (no CUDA context is current on this thread)")

    def init(self, flags: int = 0) -> None:
        self.initialized = True

    @property
    def Device(self) -> "_DeviceClass":  # noqa: N802 - pycuda's name: Device(i), Device.count()
        return _DeviceClass(self)

    def get_device(self, index: int) -> "FakeDevice":
        if not self.initialized:
            raise CudaLogicError("cuDeviceGet failed: cuInit has not been called")
        if not 0 <= index < self.device_count:
            raise CudaLogicError(f"cuDeviceGet failed: invalid device ordinal {index}")
        return FakeDevice(self, index)

    def get_driver_version(self) -> int:
        return self.driver_version

    # ------------------------------------------------------------------ memory

    def _allocate(self, nbytes: int, owner: str) -> _Alloc:
        nbytes = int(nbytes)
        if nbytes <= 0:
            raise CudaLogicError("cuMemAlloc failed: invalid argument (size 0)")
        with self._lock:
            if self.used_memory() + nbytes > self.total_memory:
                raise CudaMemoryError("cuMemAlloc failed: out of memory")
            ptr = self._next_ptr
            self._next_ptr += (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN + _ALIGN
            alloc = _Alloc(ptr, nbytes, np.zeros(nbytes, dtype=np.uint8), owner)
            self.allocations[ptr] = alloc
        return alloc

    def used_memory(self) -> int:
        return sum(a.size for a in self.allocations.values() if a.live)

    def mem_alloc(self, nbytes: int) -> "DeviceAllocation":
        self.require_context("cuMemAlloc")
        self.counters["mem_alloc"] += 1
        return DeviceAllocation(self, self._allocate(nbytes, "user"))

    def mem_get_info(self) -> tuple[int, int]:
        self.require_context("cuMemGetInfo")
        return self.total_memory - self.used_memory(), self.total_memory

    def pagelocked_empty(self, shape, dtype, order: str = "C", mem_flags: int = 0) -> np.ndarray:
        self.require_context("cuMemHostAlloc")
        self.counters["pagelocked_empty"] += 1
        array = np.empty(shape, dtype=dtype, order=order)
        start = array.__array_interface__["data"][0]
        self._pinned.append((start, start + max(array.nbytes, 1)))
        return array

    def _is_pinned(self, array: np.ndarray) -> bool:
        start = array.__array_interface__["data"][0]
        end = start + array.nbytes
        return any(lo <= start and end <= hi for lo, hi in self._pinned)

    def lookup(self, ptr: int, nbytes: int) -> tuple[_Alloc, int]:
        """The live allocation holding [ptr, ptr + nbytes) and the offset into it."""
        ptr = int(ptr)
        for alloc in self.allocations.values():
            if alloc.live and alloc.ptr <= ptr < alloc.ptr + alloc.size:
                offset = ptr - alloc.ptr
                if offset + nbytes > alloc.size:
                    raise CudaLogicError(
                        f"access of {nbytes} bytes at 0x{ptr:x} overruns its allocation of {alloc.size} bytes"
                    )
                return alloc, offset
        raise CudaLogicError(f"0x{ptr:x} is not device memory (freed or never allocated)")

    def read(self, ptr: int, nbytes: int) -> np.ndarray:
        alloc, off = self.lookup(ptr, nbytes)
        return alloc.data[off:off + nbytes].copy()

    def write(self, ptr: int, data: np.ndarray) -> None:
        raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        alloc, off = self.lookup(ptr, raw.size)
        alloc.data[off:off + raw.size] = raw

    # ------------------------------------------------------------------ copies and streams

    def Stream(self, flags: int = 0) -> "FakeStream":  # noqa: N802 - pycuda's name
        self.require_context("cuStreamCreate")
        with self._lock:
            handle = self._next_stream
            self._next_stream += 1
        stream = FakeStream(self, handle)
        self.streams[handle] = stream
        return stream

    def memcpy_htod_async(self, dest, src: np.ndarray, stream: "FakeStream | None" = None) -> None:
        self.require_context("cuMemcpyHtoDAsync")
        if not isinstance(src, np.ndarray) or not src.flags.c_contiguous:
            raise CudaLogicError("memcpy_htod_async: source must be a C-contiguous numpy array")
        if not self._is_pinned(src):
            raise CudaLogicError("memcpy_htod_async: source is pageable host memory (FakeCuda requires page-locked buffers)")
        ptr, nbytes = int(dest), src.nbytes
        self.lookup(ptr, nbytes)  # fail at enqueue time for a bad pointer, as the driver does
        self.counters["memcpy_htod"] += 1
        # Read the host buffer when the stream runs, not now: that is what an async copy does.
        self._enqueue(stream, lambda: self.write(ptr, src))

    def memcpy_dtoh_async(self, dest: np.ndarray, src, stream: "FakeStream | None" = None) -> None:
        self.require_context("cuMemcpyDtoHAsync")
        if not isinstance(dest, np.ndarray) or not dest.flags.c_contiguous:
            raise CudaLogicError("memcpy_dtoh_async: destination must be a C-contiguous numpy array")
        if not self._is_pinned(dest):
            raise CudaLogicError("memcpy_dtoh_async: destination is pageable host memory (FakeCuda requires page-locked buffers)")
        ptr, nbytes = int(src), dest.nbytes
        self.lookup(ptr, nbytes)
        self.counters["memcpy_dtoh"] += 1

        def copy() -> None:
            dest.reshape(-1).view(np.uint8)[:] = self.read(ptr, nbytes)

        self._enqueue(stream, copy)

    def _enqueue(self, stream: "FakeStream | None", op) -> None:
        if stream is None:
            op()
        else:
            stream.pending.append(op)

    def stream_by_handle(self, handle: int) -> "FakeStream | None":
        return self.streams.get(int(handle))


class _DeviceClass:
    """pycuda.driver.Device: called with an ordinal, or count() (a static method in pycuda)."""

    def __init__(self, cuda: FakeCuda):
        self._cuda = cuda

    def __call__(self, index: int) -> "FakeDevice":
        return self._cuda.get_device(index)

    def count(self) -> int:
        if not self._cuda.initialized:
            raise CudaLogicError("cuDeviceGetCount failed: cuInit has not been called")
        return self._cuda.device_count


class DeviceAllocation:
    """pycuda.driver.DeviceAllocation: int() is the device pointer."""

    def __init__(self, cuda: FakeCuda, alloc: _Alloc):
        self._cuda = cuda
        self._alloc = alloc

    def __int__(self) -> int:
        return self._alloc.ptr

    __index__ = __int__

    def free(self) -> None:
        if self._alloc.live:
            self._alloc.live = False
            self._cuda.counters["free"] += 1


class FakeStream:
    """pycuda.driver.Stream: work queues here and runs at synchronize()."""

    def __init__(self, cuda: FakeCuda, handle: int):
        self._cuda = cuda
        self.handle = handle
        self.pending: list = []

    def synchronize(self) -> None:
        self._cuda.require_context("cuStreamSynchronize")
        ops, self.pending = self.pending, []
        for op in ops:
            op()

    def is_done(self) -> bool:
        return not self.pending


class FakeDevice:
    def __init__(self, cuda: FakeCuda, index: int):
        self._cuda = cuda
        self.index = index

    def name(self) -> str:
        return self._cuda.device_name

    def compute_capability(self) -> tuple[int, int]:
        return self._cuda.compute_capability

    def total_memory(self) -> int:
        return self._cuda.total_memory

    def retain_primary_context(self) -> "FakeContext":
        self._cuda.primary_retained += 1
        return FakeContext(self._cuda, self)


class FakeContext:
    """A retained primary context: push() makes it current on this thread, detach() releases it."""

    def __init__(self, cuda: FakeCuda, device: FakeDevice):
        self._cuda = cuda
        self.device = device
        self.detached = False

    def push(self) -> None:
        if self.detached:
            raise CudaLogicError("cuCtxPushCurrent failed: context was released")
        self._cuda._stack().append(self)

    def pop(self) -> None:
        self._cuda.Context.pop()

    def detach(self) -> None:
        if not self.detached:
            self.detached = True
            self._cuda.primary_retained -= 1


# =========================================================================== FakeTensorRT


class _Severity(enum.IntEnum):
    INTERNAL_ERROR = 0
    ERROR = 1
    WARNING = 2
    INFO = 3
    VERBOSE = 4


class ILogger:
    """tensorrt.ILogger: subclass it, call ILogger.__init__(self), implement log(severity, msg)."""

    Severity = _Severity
    INTERNAL_ERROR = _Severity.INTERNAL_ERROR
    ERROR = _Severity.ERROR
    WARNING = _Severity.WARNING
    INFO = _Severity.INFO
    VERBOSE = _Severity.VERBOSE

    def __init__(self) -> None:
        self.min_severity = _Severity.WARNING

    def log(self, severity, msg: str) -> None:  # pragma: no cover - overridden
        raise NotImplementedError


class Logger(ILogger):
    """tensorrt.Logger: keeps messages in a list instead of printing them."""

    def __init__(self, min_severity=_Severity.WARNING):
        super().__init__()
        self.min_severity = min_severity
        self.messages: list[tuple[_Severity, str]] = []

    def log(self, severity, msg: str) -> None:
        if severity <= self.min_severity:
            self.messages.append((severity, msg))


class DataType(enum.Enum):
    FLOAT = 0
    HALF = 1
    INT8 = 2
    INT32 = 3
    BOOL = 4
    UINT8 = 5
    FP8 = 6
    BF16 = 7
    INT64 = 8
    INT4 = 9


class TensorIOMode(enum.Enum):
    NONE = 0
    INPUT = 1
    OUTPUT = 2


class TensorLocation(enum.Enum):
    DEVICE = 0
    HOST = 1


class ExecutionContextAllocationStrategy(enum.Enum):
    STATIC = 0
    ON_PROFILE_CHANGE = 1
    USER_MANAGED = 2


class BuilderFlag(enum.Enum):
    """TensorRT 10.x: with the weak-typing precision flags."""

    FP16 = 0
    INT8 = 1
    DEBUG = 2
    GPU_FALLBACK = 3
    REFIT = 4
    DISABLE_TIMING_CACHE = 5
    TF32 = 6
    SPARSE_WEIGHTS = 7
    OBEY_PRECISION_CONSTRAINTS = 10
    PREFER_PRECISION_CONSTRAINTS = 11
    DIRECT_IO = 12
    FP8 = 16
    BF16 = 17
    INT4 = 22


class BuilderFlag11(enum.Enum):
    """TensorRT 11.x: the precision flags are gone (strong typing only)."""

    DEBUG = 2
    GPU_FALLBACK = 3
    REFIT = 4
    DISABLE_TIMING_CACHE = 5
    TF32 = 6
    SPARSE_WEIGHTS = 7


class NetworkDefinitionCreationFlag(enum.IntEnum):
    """TensorRT 10.x (EXPLICIT_BATCH is deprecated there and ignored)."""

    EXPLICIT_BATCH = 0
    STRONGLY_TYPED = 1


class NetworkDefinitionCreationFlag11(enum.IntEnum):
    """TensorRT 11.x: EXPLICIT_BATCH removed; strong typing is always on."""

    STRONGLY_TYPED = 1


REMOVED_IN_11 = {
    "module": ("IInt8Calibrator", "IInt8EntropyCalibrator2"),
    "BuilderFlag": ("FP16", "INT8", "BF16", "FP8", "INT4", "OBEY_PRECISION_CONSTRAINTS",
                    "PREFER_PRECISION_CONSTRAINTS", "DIRECT_IO"),
    "NetworkDefinitionCreationFlag": ("EXPLICIT_BATCH",),
    "IBuilder": ("platform_has_fast_fp16", "platform_has_fast_int8"),
    "IBuilderConfig": ("int8_calibrator", "set_calibration_profile", "get_calibration_profile"),
    "ICudaEngine": ("device_memory_size", "get_device_memory_size_for_profile"),
    "IExecutionContext": ("device_memory",),
}


class _Generational:
    """Attributes TensorRT 11 removed raise AttributeError on an 11.x fake, as the real 11.x
    bindings do (they do not exist there). `_gen` is the fake's major version."""

    _removed: tuple[str, ...] = ()
    _gen: int = 10

    def __getattribute__(self, name: str):
        if name in type(self)._removed and object.__getattribute__(self, "_gen") >= 11:
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}' (removed in TensorRT 11)")
        return object.__getattribute__(self, name)

    def __setattr__(self, name: str, value) -> None:
        if name in type(self)._removed and object.__getattribute__(self, "_gen") >= 11:
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}' (removed in TensorRT 11)")
        object.__setattr__(self, name, value)


class MemoryPoolType(enum.Enum):
    WORKSPACE = 0
    DLA_MANAGED_SRAM = 1
    DLA_LOCAL_DRAM = 2
    DLA_GLOBAL_DRAM = 3


class DeviceType(enum.Enum):
    GPU = 0
    DLA = 1


class EngineStat(enum.Enum):
    TOTAL_WEIGHTS_SIZE = 0
    STRIPPED_WEIGHTS_SIZE = 1


class IProgressMonitor:
    """tensorrt.IProgressMonitor: subclass, call IProgressMonitor.__init__(self), implement
    phase_start(phase_name, parent_phase, num_steps), step_complete(phase_name, step) -> bool,
    phase_finish(phase_name)."""

    def __init__(self) -> None:
        pass


class IInt8Calibrator:
    def __init__(self) -> None:
        pass


class IInt8EntropyCalibrator2(IInt8Calibrator):
    """tensorrt.IInt8EntropyCalibrator2 (deprecated in TensorRT 10.1, still present)."""


_ONNX_TO_TRT = {1: DataType.FLOAT, 10: DataType.HALF, 3: DataType.INT8, 6: DataType.INT32,
                7: DataType.INT64, 9: DataType.BOOL, 2: DataType.UINT8}
_TRT_TO_NUMPY = {DataType.FLOAT: np.float32, DataType.HALF: np.float16, DataType.INT8: np.int8,
                 DataType.INT32: np.int32, DataType.INT64: np.int64, DataType.BOOL: np.bool_,
                 DataType.UINT8: np.uint8}


class FakeTensorRT:
    """A module-like object standing in for `import tensorrt` (a 10.x or 11.x API subset).

    version: the TensorRT version this fake claims; a plan built by another version will not
    deserialize. Its major version picks the API generation (see the module docstring). num_dla_cores: 0 like an Orin Nano, 2 like an AGX Orin. engine_stats: whether
    ICudaEngine.get_engine_stat exists (only newer TensorRT 10 releases have it).
    """

    IS_FAKE = True

    ILogger = ILogger
    Logger = Logger
    DataType = DataType
    TensorIOMode = TensorIOMode
    TensorLocation = TensorLocation
    ExecutionContextAllocationStrategy = ExecutionContextAllocationStrategy
    MemoryPoolType = MemoryPoolType
    DeviceType = DeviceType
    IProgressMonitor = IProgressMonitor

    def __init__(self, cuda: FakeCuda, version: str = "10.3.0", num_dla_cores: int = 0, engine_stats: bool = True):
        self.cuda = cuda
        # What the code under test asked TensorRT to do, for tests to check behaviour at this
        # boundary: ("set_optimization_profile_async", index), ("set_input_shape", name, shape),
        # ("execute_async_v3", profile, {input: shape}), ("deserialize_cuda_engine", version).
        self.calls: list[tuple] = []
        self.__version__ = version
        self.major = int(version.split(".")[0])
        if self.major >= 11:
            self.BuilderFlag = BuilderFlag11
            self.NetworkDefinitionCreationFlag = NetworkDefinitionCreationFlag11
        else:
            self.BuilderFlag = BuilderFlag
            self.NetworkDefinitionCreationFlag = NetworkDefinitionCreationFlag
            self.IInt8Calibrator = IInt8Calibrator
            self.IInt8EntropyCalibrator2 = IInt8EntropyCalibrator2
        self.num_dla_cores = num_dla_cores
        self.engine_stats = engine_stats
        if engine_stats:
            self.EngineStat = EngineStat
        trt = self

        class Runtime(_Runtime):
            _trt = trt

        class Builder(_Builder):
            _trt = trt

        class OnnxParser(_OnnxParser):
            _trt = trt

        self.Runtime = Runtime
        self.Builder = Builder
        self.OnnxParser = OnnxParser

    @staticmethod
    def nptype(dtype: DataType):
        return _TRT_TO_NUMPY[dtype]


def _log(logger: ILogger, severity: _Severity, msg: str) -> None:
    logger.log(severity, msg)


def _check_logger(logger: Any) -> None:
    if not isinstance(logger, ILogger):
        raise TypeError("incompatible constructor arguments: expected a tensorrt.ILogger (FakeTensorRT)")


# --------------------------------------------------------------------------- runtime


class _Runtime:
    _trt: FakeTensorRT

    def __init__(self, logger: ILogger):
        _check_logger(logger)
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

    def deserialize_cuda_engine(self, serialized_engine) -> "_Engine | None":
        data = bytes(serialized_engine)
        try:
            plan = json.loads(data.decode("utf-8"))
            if plan.get("magic") != FAKE_PLAN_MAGIC:
                raise ValueError
        except (UnicodeDecodeError, ValueError, AttributeError):
            _log(self.logger, _Severity.ERROR,
                 "FakeTensorRT IRuntime::deserializeCudaEngine: not a (fake) plan: the magic tag does not match")
            return None
        if plan["trt_version"] != self._trt.__version__:
            _log(self.logger, _Severity.ERROR,
                 f"FakeTensorRT IRuntime::deserializeCudaEngine: Version tag does not match: the plan was built by "
                 f"TensorRT {plan['trt_version']}, this is TensorRT {self._trt.__version__}")
            return None
        if tuple(plan["compute_capability"]) != tuple(self._trt.cuda.compute_capability):
            _log(self.logger, _Severity.ERROR,
                 f"FakeTensorRT IRuntime::deserializeCudaEngine: the engine plan file is generated on an incompatible "
                 f"device, expecting compute {tuple(plan['compute_capability'])} got {self._trt.cuda.compute_capability}")
            return None
        if plan.get("dla_core", -1) >= 0:
            if self._trt.num_dla_cores == 0:
                _log(self.logger, _Severity.ERROR, "FakeTensorRT: the plan uses DLA, but this device has no DLA cores")
                return None
            if not 0 <= self._dla_core < self._trt.num_dla_cores:
                _log(self.logger, _Severity.ERROR,
                     f"FakeTensorRT: runtime DLA_core {self._dla_core} is not in 0..{self._trt.num_dla_cores - 1}")
                return None
        engine = _Engine(self._trt, plan, self.logger, len(data))
        if plan["weights_bytes"] > 0:  # deserializing puts the weights on the device
            try:
                engine._weights = self._trt.cuda._allocate(plan["weights_bytes"], "tensorrt")
            except CudaMemoryError:
                _log(self.logger, _Severity.ERROR, "FakeTensorRT IRuntime::deserializeCudaEngine: out of memory "
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


class _Engine(_Generational):
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
        self._weights: _Alloc | None = None
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

    def create_execution_context(self, strategy=ExecutionContextAllocationStrategy.STATIC) -> "_Context | None":
        context = _Context(self, strategy)
        if strategy is not ExecutionContextAllocationStrategy.USER_MANAGED:
            try:
                context._own_memory = self._trt.cuda._allocate(self.device_memory_size_v2, "tensorrt")
            except CudaMemoryError:
                _log(self._logger, _Severity.ERROR, "FakeTensorRT createExecutionContext: out of memory")
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
            feeds = {t.name: np.zeros(input_shapes[t.name], dtype=_TRT_TO_NUMPY[t.dtype])
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


class _Context(_Generational):
    _removed = REMOVED_IN_11["IExecutionContext"]

    def __del__(self) -> None:
        own = getattr(self, "_own_memory", None)
        if own is not None:
            own.live = False

    def __init__(self, engine: _Engine, strategy):
        self._gen = engine._trt.major
        self.engine = engine
        self._strategy = strategy
        self._own_memory: _Alloc | None = None
        self._memory: tuple[int, int] | None = None
        self._profile = 0
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._addresses: dict[str, int] = {}
        self.name = ""

    @property
    def _logger(self) -> ILogger:
        return self.engine._logger

    def _error(self, msg: str) -> bool:
        _log(self._logger, _Severity.ERROR, f"FakeTensorRT IExecutionContext: {msg}")
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
            dtype = np.dtype(_TRT_TO_NUMPY[t.dtype])
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

        engine._trt.calls.append(("execute_async_v3", self._profile, dict(self._shapes)))
        if stream is None:
            _log(self._logger, _Severity.WARNING, "FakeTensorRT enqueueV3: using the default stream")
            run()
        else:
            stream.pending.append(run)
        return True


# --------------------------------------------------------------------------- builder


class _OptimizationProfile:
    def __init__(self) -> None:
        self.shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]] = {}

    def set_shape(self, input: str, min, opt, max) -> None:  # noqa: A002 - TensorRT's keyword names
        self.shapes[input] = (tuple(int(d) for d in min), tuple(int(d) for d in opt), tuple(int(d) for d in max))

    def get_shape(self, input: str):  # noqa: A002
        return list(self.shapes[input])


class _TimingCache:
    def __init__(self, data: bytes):
        self.entries: list[str] = json.loads(data.decode()) if data else []

    def serialize(self) -> bytes:
        return json.dumps(self.entries).encode()

    def combine(self, input_cache: "_TimingCache", ignore_mismatch: bool) -> bool:
        self.entries = sorted(set(self.entries) | set(input_cache.entries))
        return True


class _BuilderConfig(_Generational):
    _removed = REMOVED_IN_11["IBuilderConfig"]

    def __init__(self, gen: int = 10) -> None:
        self._gen = gen
        self.flags: set = set()
        self.pool_limits: dict[MemoryPoolType, int] = {}
        self.default_device_type = DeviceType.GPU
        self.DLA_core = -1
        self.profiles: list[_OptimizationProfile] = []
        self.timing_cache: _TimingCache | None = None
        self.progress_monitor: IProgressMonitor | None = None
        self.calibration_profile: _OptimizationProfile | None = None
        if gen < 11:
            self.int8_calibrator: IInt8Calibrator | None = None

    def set_flag(self, flag: BuilderFlag) -> None:
        self.flags.add(flag)

    def clear_flag(self, flag: BuilderFlag) -> None:
        self.flags.discard(flag)

    def get_flag(self, flag: BuilderFlag) -> bool:
        return flag in self.flags

    def set_memory_pool_limit(self, pool: MemoryPoolType, pool_size: int) -> None:
        self.pool_limits[pool] = int(pool_size)

    def get_memory_pool_limit(self, pool: MemoryPoolType) -> int:
        return self.pool_limits.get(pool, 1 << 62)

    def add_optimization_profile(self, profile: _OptimizationProfile) -> int:
        self.profiles.append(profile)
        return len(self.profiles) - 1

    @property
    def num_optimization_profiles(self) -> int:
        return len(self.profiles)

    def create_timing_cache(self, serialized_timing_cache: bytes) -> _TimingCache:
        return _TimingCache(bytes(serialized_timing_cache))

    def set_timing_cache(self, cache: _TimingCache, ignore_mismatch: bool) -> bool:
        self.timing_cache = cache
        return True

    def get_timing_cache(self) -> _TimingCache | None:
        return self.timing_cache

    def set_calibration_profile(self, profile: _OptimizationProfile) -> bool:
        self.calibration_profile = profile
        return True

    def get_calibration_profile(self) -> _OptimizationProfile | None:
        return self.calibration_profile


@dataclass
class _NetTensor:
    name: str
    shape: tuple[int, ...]
    dtype: DataType
    dim_params: tuple[str | None, ...]


class _Network:
    def __init__(self, flags: int):
        self.flags = flags
        self.inputs: list[_NetTensor] = []
        self.outputs: list[_NetTensor] = []
        self.onnx: bytes = b""
        self.weights_bytes = 0
        self.has_qdq = False
        self.has_fp16 = False  # FP16 initializers or Casts to FP16: a strongly typed build runs them in FP16

    @property
    def num_inputs(self) -> int:
        return len(self.inputs)

    @property
    def num_outputs(self) -> int:
        return len(self.outputs)

    def get_input(self, index: int) -> _NetTensor:
        return self.inputs[index]

    def get_output(self, index: int) -> _NetTensor:
        return self.outputs[index]


class _ParserError:
    def __init__(self, text: str):
        self._text = text

    def desc(self) -> str:
        return self._text

    def __str__(self) -> str:
        return self._text


class _OnnxParser:
    _trt: FakeTensorRT

    def __init__(self, network: _Network, logger: ILogger):
        _check_logger(logger)
        self.network = network
        self.logger = logger
        self._errors: list[_ParserError] = []

    @property
    def num_errors(self) -> int:
        return len(self._errors)

    def get_error(self, index: int) -> _ParserError:
        return self._errors[index]

    def clear_errors(self) -> None:
        self._errors.clear()

    def parse_from_file(self, model: str) -> bool:
        with open(model, "rb") as fh:
            return self.parse(fh.read())

    def parse(self, model: bytes, path: str | None = None) -> bool:
        import onnx
        from onnx import numpy_helper

        try:
            proto = onnx.load_from_string(bytes(model))
            onnx.checker.check_model(proto)
        except Exception as exc:  # onnx raises several types
            self._errors.append(_ParserError(f"FakeTensorRT OnnxParser: cannot parse the model: {exc}"))
            return False
        init_names = {i.name for i in proto.graph.initializer}

        def tensors(values) -> list[_NetTensor] | None:
            out = []
            for v in values:
                if v.name in init_names:
                    continue
                tt = v.type.tensor_type
                dtype = _ONNX_TO_TRT.get(tt.elem_type)
                if dtype is None:
                    self._errors.append(_ParserError(f"FakeTensorRT OnnxParser: {v.name}: unsupported element type {tt.elem_type}"))
                    return None
                dims = tuple(d.dim_value if d.HasField("dim_value") else -1 for d in tt.shape.dim)
                params = tuple(d.dim_param if d.HasField("dim_param") else None for d in tt.shape.dim)
                out.append(_NetTensor(v.name, dims, dtype, params))
            return out

        inputs, outputs = tensors(proto.graph.input), tensors(proto.graph.output)
        if inputs is None or outputs is None:
            return False
        self.network.inputs, self.network.outputs = inputs, outputs
        self.network.onnx = bytes(model)
        self.network.weights_bytes = sum(numpy_helper.to_array(i).nbytes for i in proto.graph.initializer)
        self.network.has_qdq = any(n.op_type in ("QuantizeLinear", "DequantizeLinear") for n in proto.graph.node)
        self.network.has_fp16 = any(i.data_type == 10 for i in proto.graph.initializer) or any(
            n.op_type == "Cast" and any(a.name == "to" and a.i == 10 for a in n.attribute) for n in proto.graph.node)
        return True


class _Builder(_Generational):
    _trt: FakeTensorRT
    _removed = REMOVED_IN_11["IBuilder"]

    def __init__(self, logger: ILogger):
        _check_logger(logger)
        self._gen = self._trt.major
        self.logger = logger

    @property
    def platform_has_fast_fp16(self) -> bool:
        return True

    @property
    def platform_has_fast_int8(self) -> bool:
        return True

    @property
    def num_DLA_cores(self) -> int:  # noqa: N802
        return self._trt.num_dla_cores

    def create_network(self, flags: int = 0) -> _Network | None:
        known = sum(1 << int(f) for f in self._trt.NetworkDefinitionCreationFlag)
        if int(flags) & ~known:
            self._error(f"createNetworkV2: unknown NetworkDefinitionCreationFlag bits 0x{int(flags) & ~known:x} "
                        f"(TensorRT {self._trt.__version__})")
            return None
        return _Network(flags)

    def create_builder_config(self) -> _BuilderConfig:
        return _BuilderConfig(self._trt.major)

    def create_optimization_profile(self) -> _OptimizationProfile:
        return _OptimizationProfile()

    def _error(self, msg: str) -> None:
        _log(self.logger, _Severity.ERROR, f"FakeTensorRT IBuilder::buildSerializedNetwork: {msg}")
        return None

    def build_serialized_network(self, network: _Network, config: _BuilderConfig) -> bytes | None:
        if not network.inputs:
            return self._error("the network has no inputs (was the ONNX model parsed?)")
        dynamic = [t for t in network.inputs if any(d < 0 for d in t.shape)]
        if dynamic and not config.profiles:
            return self._error(f"network has dynamic inputs {[t.name for t in dynamic]} but no optimization profile")
        profiles = []
        for index, p in enumerate(config.profiles):
            ranges = {}
            for t in network.inputs:
                if t.name not in p.shapes:
                    if t in dynamic:
                        return self._error(f"optimization profile {index} has no shape for dynamic input {t.name!r}")
                    ranges[t.name] = [list(t.shape)] * 3
                    continue
                lo, opt, hi = p.shapes[t.name]
                if not (len(lo) == len(opt) == len(hi) == len(t.shape)):
                    return self._error(f"profile {index}: {t.name!r} rank does not match the network's {t.shape}")
                for a, b, c, s in zip(lo, opt, hi, t.shape):
                    if not 0 <= a <= b <= c or (s >= 0 and not a == b == c == s):
                        return self._error(f"profile {index}: {t.name!r} min {lo} opt {opt} max {hi} is invalid for {t.shape}")
                ranges[t.name] = [list(lo), list(opt), list(hi)]
            profiles.append(ranges)
        strongly_typed = self._trt.major >= 11 or bool(
            network.flags & (1 << int(self._trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)))
        if strongly_typed:
            weak = [f.name for f in config.flags if f.name in REMOVED_IN_11["BuilderFlag"]]
            if weak:  # TensorRT 10 refuses precision flags on a strongly typed network
                return self._error(f"precision flags {weak} are not allowed on a strongly typed network")
            precision = "int8" if network.has_qdq else "fp16" if network.has_fp16 else "fp32"
        else:
            precision = ("int8" if config.get_flag(BuilderFlag.INT8)
                         else "fp16" if config.get_flag(BuilderFlag.FP16) else "fp32")
        on_dla = config.default_device_type is DeviceType.DLA
        if on_dla:
            if precision == "fp32":
                return self._error("DLA needs FP16 or INT8 (BuilderFlag.FP16/INT8 on 10.x, an FP16 or Q/DQ "
                                   "model when strongly typed)")
            if not 0 <= config.DLA_core < self._trt.num_dla_cores:
                if not config.get_flag(self._trt.BuilderFlag.GPU_FALLBACK):
                    return self._error(f"DLA core {config.DLA_core} does not exist on this device "
                                       f"({self._trt.num_dla_cores} DLA cores) and GPU fallback is off")
                _log(self.logger, _Severity.WARNING, "FakeTensorRT: no DLA available, all layers fall back to the GPU")
                on_dla = False
        monitor = config.progress_monitor
        phases = ["Parsing network", "Building optimization profiles", "Serializing engine"]
        if monitor is not None:
            monitor.phase_start("Building engine", None, len(phases))
        for step, phase in enumerate(phases):
            if monitor is not None:
                monitor.phase_start(phase, "Building engine", 1 if phase != phases[1] else len(profiles))
                for s in range(len(profiles) if phase == phases[1] else 1):
                    if monitor.step_complete(phase, s) is False:
                        monitor.phase_finish(phase)
                        monitor.phase_finish("Building engine")
                        return self._error("build cancelled by the progress monitor")
                monitor.phase_finish(phase)
                monitor.step_complete("Building engine", step)
        if monitor is not None:
            monitor.phase_finish("Building engine")
        if config.timing_cache is not None:
            for ranges in profiles:
                key = hashlib.sha256(json.dumps([precision, ranges], sort_keys=True).encode()).hexdigest()[:16]
                if key not in config.timing_cache.entries:
                    config.timing_cache.entries.append(key)
        # Synthetic activation sizes: 4x the inputs at the profile's max, plus 64 KiB, halved in
        # reduced precision. Real TensorRT decides these; tests only check the arithmetic around them.
        device_memory = []
        by_name = {t.name: t for t in network.inputs}
        for ranges in profiles:
            elems = sum(math.prod(ranges[name][2]) * np.dtype(_TRT_TO_NUMPY[by_name[name].dtype]).itemsize
                        for name in ranges)
            device_memory.append((4 * elems + 65536) // (2 if precision != "fp32" else 1))
        plan = {
            "magic": FAKE_PLAN_MAGIC,
            "trt_version": self._trt.__version__,
            "compute_capability": list(self._trt.cuda.compute_capability),
            "precision": precision,
            "typing": "strong" if strongly_typed else "weak",
            "dla_core": config.DLA_core if on_dla else -1,
            "workspace": config.pool_limits.get(MemoryPoolType.WORKSPACE),
            "io": [{"name": t.name, "mode": mode, "dtype": t.dtype.name, "shape": list(t.shape),
                    "dim_params": list(t.dim_params)}
                   for mode, ts in (("INPUT", network.inputs), ("OUTPUT", network.outputs)) for t in ts],
            "profiles": profiles,
            "device_memory": device_memory,
            "weights_bytes": network.weights_bytes,
            "onnx": base64.b64encode(network.onnx).decode(),
        }
        return json.dumps(plan).encode()


# =========================================================================== the real thing?


def tensorrt_installed() -> bool:
    """Whether TensorRT's Python package is importable (not this tests/trt directory, which
    imports as an empty namespace package named tensorrt while tests/ is on sys.path)."""
    from edge_batcher.engines.tensorrt import import_tensorrt_module

    try:
        import_tensorrt_module()
    except ImportError:
        return False
    return True


def require_real_tensorrt():
    """Skip unless real TensorRT and a CUDA binding are installed (i.e. on the device); returns
    (tensorrt, the binding module: cuda.bindings.driver, else pycuda.driver)."""
    import pytest

    trt = pytest.importorskip("tensorrt", reason="needs NVIDIA TensorRT (a Jetson or a GPU machine)")
    if not tensorrt_installed():
        pytest.skip("needs NVIDIA TensorRT (a Jetson or a GPU machine): 'tensorrt' here is only the tests/trt "
                    "directory")
    from edge_batcher.engines.cuda_api import load_cuda_api

    try:
        api = load_cuda_api()
    except ImportError as exc:
        pytest.skip(f"needs cuda-python or pycuda with a CUDA driver: {exc}")
    return trt, api.d



# =========================================================================== a backend for daemon tests


from edge_batcher.engines.tensorrt import TensorRTEngine  # noqa: E402 - the backend these fakes serve


class FakeTensorRTEngine(TensorRTEngine):
    """The real TensorRT backend over a FakeTensorRT + FakeCuda of its own, for daemon tests:
    backend = "tests.fakes.fake_tensorrt:FakeTensorRTEngine" in a test model.toml. Plans must be
    built by a FakeTensorRT with the default version and compute capability."""

    def __init__(self, config):
        cuda = FakeCuda()
        super().__init__(config, trt_module=FakeTensorRT(cuda), cuda_module=cuda)
