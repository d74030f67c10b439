"""FakeTensorRT and FakeCuda: honest stand-ins for `tensorrt` and `pycuda.driver` in tests.

This module is the family's face: FakeTensorRT (the module-like object) and the names tests
import; the parts live in fake_cuda.py, fake_trt_types.py, fake_trt_runtime.py and
fake_trt_builder.py.

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

# The fakes live in four modules; their names are re-exported here, so tests import them from
# one place: fake_cuda (FakeCuda), fake_trt_types (the API's enums and logger), fake_trt_runtime
# (IRuntime, ICudaEngine, IExecutionContext), fake_trt_builder (IBuilder, the ONNX parser).
from edge_batcher.engines.tensorrt import TensorRTEngine
from edge_batcher.engines.trt_api import import_tensorrt_module
from tests.fakes.fake_cuda import (
    CudaError,
    CudaLaunchError,
    CudaLogicError,
    CudaMemoryError,
    CudaRuntimeError,
    DeviceAllocation,
    FakeContext,
    FakeCuda,
    FakeDevice,
    FakeStream,
)
from tests.fakes.fake_trt_builder import FakeBuilder, FakeOnnxParser
from tests.fakes.fake_trt_runtime import FakeRuntime
from tests.fakes.fake_trt_types import (
    FAKE_PLAN_MAGIC,
    REMOVED_IN_11,
    TRT_TO_NUMPY,
    BuilderFlag,
    BuilderFlag11,
    DataType,
    DeviceType,
    EngineStat,
    ExecutionContextAllocationStrategy,
    IInt8Calibrator,
    IInt8EntropyCalibrator2,
    ILogger,
    IProgressMonitor,
    Logger,
    MemoryPoolType,
    NetworkDefinitionCreationFlag,
    NetworkDefinitionCreationFlag11,
    TensorIOMode,
    TensorLocation,
)

__all__ = [
    "CudaError", "CudaLaunchError", "CudaLogicError", "CudaMemoryError", "CudaRuntimeError", "DeviceAllocation",
    "FakeContext", "FakeCuda", "FakeDevice", "FakeStream", "FAKE_PLAN_MAGIC", "REMOVED_IN_11", "FakeTensorRT",
    "FakeTensorRTEngine", "tensorrt_installed", "require_real_tensorrt",
]


class FakeTensorRT:
    """A module-like object standing in for `import tensorrt` (a 10.x or 11.x API subset).

    version: the TensorRT version this fake claims; a plan built by another version will not
    deserialize. Its major version picks the API generation (see the module docstring).
    num_dla_cores: 0 like an Orin Nano, 2 like an AGX Orin. engine_stats: whether
    ICudaEngine.get_engine_stat exists (only newer TensorRT 10 releases have it). capturable:
    whether execute_async_v3 may be captured into a CUDA graph (engines with data-dependent
    shapes or host-side work cannot).
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

    def __init__(self, cuda: FakeCuda, version: str = "10.3.0", num_dla_cores: int = 0, engine_stats: bool = True,
                 capturable: bool = True):
        self.cuda = cuda
        self.capturable = capturable  # False: enqueueV3 fails while its stream captures a CUDA graph
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

        class Runtime(FakeRuntime):
            _trt = trt

        class Builder(FakeBuilder):
            _trt = trt

        class OnnxParser(FakeOnnxParser):
            _trt = trt

        self.Runtime = Runtime
        self.Builder = Builder
        self.OnnxParser = OnnxParser

    @staticmethod
    def nptype(dtype: DataType):
        return TRT_TO_NUMPY[dtype]


# =========================================================================== the real thing?


def tensorrt_installed() -> bool:
    """Whether TensorRT's Python package is importable (not this tests/trt directory, which
    imports as an empty namespace package named tensorrt while tests/ is on sys.path)."""
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


class FakeTensorRTEngine(TensorRTEngine):
    """The real TensorRT backend over a FakeTensorRT + FakeCuda of its own, for daemon tests:
    backend = "tests.fakes.fake_tensorrt:FakeTensorRTEngine" in a test model.toml. Plans must be
    built by a FakeTensorRT with the default version and compute capability."""

    def __init__(self, config):
        cuda = FakeCuda()
        super().__init__(config, trt_module=FakeTensorRT(cuda), cuda_module=cuda)
