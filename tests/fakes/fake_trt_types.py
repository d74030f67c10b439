"""The TensorRT Python API's plain names as the fakes model them: the logger classes, the enums
(with TensorRT 10.x and 11.x variants of BuilderFlag and NetworkDefinitionCreationFlag), the
calibrator and progress-monitor bases, and Generational, which makes an 11.x fake raise
AttributeError for what TensorRT 11 removed (REMOVED_IN_11). Shared by fake_trt_runtime.py,
fake_trt_builder.py and FakeTensorRT (fake_tensorrt.py).
"""

from __future__ import annotations

import enum
from typing import Any

import numpy as np

FAKE_PLAN_MAGIC = "edge-batcher-FAKE-tensorrt-plan"


class Severity(enum.IntEnum):
    INTERNAL_ERROR = 0
    ERROR = 1
    WARNING = 2
    INFO = 3
    VERBOSE = 4


class ILogger:
    """tensorrt.ILogger: subclass it, call ILogger.__init__(self), implement log(severity, msg)."""

    Severity = Severity
    INTERNAL_ERROR = Severity.INTERNAL_ERROR
    ERROR = Severity.ERROR
    WARNING = Severity.WARNING
    INFO = Severity.INFO
    VERBOSE = Severity.VERBOSE

    def __init__(self) -> None:
        self.min_severity = Severity.WARNING

    def log(self, severity, msg: str) -> None:  # pragma: no cover - overridden
        raise NotImplementedError


class Logger(ILogger):
    """tensorrt.Logger: keeps messages in a list instead of printing them."""

    def __init__(self, min_severity=Severity.WARNING):
        super().__init__()
        self.min_severity = min_severity
        self.messages: list[tuple[Severity, str]] = []

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


class Generational:
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


ONNX_TO_TRT = {1: DataType.FLOAT, 10: DataType.HALF, 3: DataType.INT8, 6: DataType.INT32,
                7: DataType.INT64, 9: DataType.BOOL, 2: DataType.UINT8}
TRT_TO_NUMPY = {DataType.FLOAT: np.float32, DataType.HALF: np.float16, DataType.INT8: np.int8,
                 DataType.INT32: np.int32, DataType.INT64: np.int64, DataType.BOOL: np.bool_,
                 DataType.UINT8: np.uint8}


def log_to(logger: ILogger, severity: Severity, msg: str) -> None:
    logger.log(severity, msg)


def check_logger(logger: Any) -> None:
    if not isinstance(logger, ILogger):
        raise TypeError("incompatible constructor arguments: expected a tensorrt.ILogger (FakeTensorRT)")
