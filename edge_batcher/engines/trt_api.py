"""TensorRT's Python package as the backend and the builder use it: importing it (lazily, with a
CUDA binding from cuda_api.py), what it can do (TensorRTCapabilities, found by looking for the
API rather than by comparing versions, so 10.x and 11.x both work) and a logger that forwards
TensorRT's messages to Python logging and keeps its errors for the next error message.
Nothing here imports tensorrt at import time.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from .cuda_api import CudaApi, cuda_api_from, load_cuda_api

log = logging.getLogger(__name__)

INSTALL_HINT = (
    "on a Jetson, TensorRT and its Python bindings come with JetPack (apt install nvidia-jetpack / "
    "python3-libnvinfer): use a venv made with --system-site-packages and pip install 'edge-batcher[jetpack6]' "
    "(or [jetpack7]) for cuda-python; on a desktop GPU: pip install 'edge-batcher[tensorrt]' (TensorRT 10, CUDA 12) "
    "or 'edge-batcher[tensorrt-cu13]' (newest TensorRT, CUDA 13 driver); docs/tensorrt.md"
)
# The TensorRT generations this code was written and tested (against fakes) for.
KNOWN_MAJORS = (10, 11)


def import_tensorrt_module() -> Any:
    """`import tensorrt`, refusing anything that is not TensorRT's Python package.

    A directory named tensorrt on sys.path (this project's tests/trt, when tests/ is on the
    path) imports as an empty namespace package; treat that as "not installed".
    """
    import tensorrt  # noqa: PLC0415 - lazily, see the module docstring

    if not hasattr(tensorrt, "Runtime"):
        where = list(getattr(tensorrt, "__path__", [])) or str(getattr(tensorrt, "__file__", "?"))
        raise ImportError(f"the module named tensorrt found at {where} is not TensorRT's Python package")
    return tensorrt


@dataclass(frozen=True)
class TensorRTCapabilities:
    """What the installed TensorRT's Python API offers, found by looking (hasattr), not by version.

    precision_flags:     BuilderFlag.FP16/INT8 exist (weak typing: TensorRT 10.x). Without them
                         (11.x) every network is strongly typed: precision comes from the model.
    int8_calibration:    the INT8 calibrator API exists (IInt8EntropyCalibrator2; 10.x only).
    strongly_typed_flag: NetworkDefinitionCreationFlag.STRONGLY_TYPED exists.
    explicit_batch_flag: NetworkDefinitionCreationFlag.EXPLICIT_BATCH exists (deprecated in 10, gone in 11).
    """

    version: str
    precision_flags: bool
    int8_calibration: bool
    strongly_typed_flag: bool
    explicit_batch_flag: bool

    @property
    def major(self) -> int:
        return _major(self.version)

    @property
    def strongly_typed_only(self) -> bool:
        return not self.precision_flags

    def describe(self) -> str:
        if self.precision_flags:
            precision = "FP16/INT8 builder flags" + (", INT8 calibration" if self.int8_calibration else "")
        else:
            precision = "strongly typed networks only (precision from the ONNX model: FP16 tensors, Q/DQ nodes)"
        return f"TensorRT {self.version}: {precision}"


def tensorrt_capabilities(trt: Any) -> TensorRTCapabilities:
    flags = getattr(trt, "BuilderFlag", None)
    network_flags = getattr(trt, "NetworkDefinitionCreationFlag", None)
    return TensorRTCapabilities(
        version=str(getattr(trt, "__version__", "?")),
        precision_flags=hasattr(flags, "FP16") and hasattr(flags, "INT8"),
        int8_calibration=hasattr(trt, "IInt8EntropyCalibrator2"),
        strongly_typed_flag=hasattr(network_flags, "STRONGLY_TYPED"),
        explicit_batch_flag=hasattr(network_flags, "EXPLICIT_BATCH"),
    )


# What the backend needs at module level; the per-object calls are feature-detected where used.
REQUIRED_NAMES = ("Runtime", "ILogger", "TensorIOMode", "ExecutionContextAllocationStrategy")


@dataclass(frozen=True)
class TensorRTModules:
    """import_tensorrt()'s answer: the tensorrt module, the CUDA binding, what TensorRT can do."""

    trt: Any
    cuda: CudaApi
    capabilities: TensorRTCapabilities

    def describe(self) -> str:
        return f"{self.capabilities.describe()}; CUDA binding {self.cuda.describe()}"


def import_tensorrt(trt_module: Any = None, cuda_module: Any = None) -> TensorRTModules:
    """tensorrt, a CUDA binding (cuda-python preferred, else pycuda) and TensorRT's capabilities:
    the given ones or the installed ones. ConfigError when one is missing, TensorRT is older
    than 10, or it lacks a name the backend needs."""
    trt = trt_module
    try:
        if trt is None:
            trt = import_tensorrt_module()
        cuda = load_cuda_api() if cuda_module is None else cuda_api_from(cuda_module)
    except ImportError as exc:
        raise ConfigError(
            f"the tensorrt backend needs TensorRT and a CUDA Python binding ({exc}); {INSTALL_HINT}"
        ) from exc
    caps = tensorrt_capabilities(trt)
    if caps.major < 10:
        raise ConfigError(
            f"the tensorrt backend needs TensorRT >= 10 (JetPack 6.1 or newer); "
            f"this device has TensorRT {caps.version}. "
            "Use the onnxruntime backend with the TensorrtExecutionProvider there (docs/tensorrt.md)"
        )
    missing = [name for name in REQUIRED_NAMES if not hasattr(trt, name)]
    if missing:
        raise ConfigError(f"TensorRT {caps.version} lacks {', '.join(missing)}, which the tensorrt backend needs "
                          f"(it knows TensorRT {' and '.join(f'{m}.x' for m in KNOWN_MAJORS)})")
    if caps.major not in KNOWN_MAJORS:
        log.warning("TensorRT %s is newer than the %s.x this backend was written for; continuing, features are "
                    "detected as used", caps.version, KNOWN_MAJORS[-1])
    modules = TensorRTModules(trt, cuda, caps)
    log.info("tensorrt backend: %s", modules.describe())
    return modules


def _major(version: str) -> int:
    try:
        return int(version.split(".")[0])
    except ValueError:
        return 0


def make_logger(trt: Any) -> Any:
    """A tensorrt.ILogger that forwards to Python logging and remembers the recent errors,
    so a failed TensorRT call can be reported with TensorRT's own words."""

    severity = trt.ILogger.Severity
    errors = (severity.INTERNAL_ERROR, severity.ERROR)
    levels = {severity.INTERNAL_ERROR: logging.CRITICAL, severity.ERROR: logging.ERROR,
              severity.WARNING: logging.WARNING, severity.INFO: logging.DEBUG, severity.VERBOSE: logging.DEBUG}

    class CapturingLogger(trt.ILogger):
        def __init__(self) -> None:
            trt.ILogger.__init__(self)
            self.errors: list[str] = []

        def log(self, sev: Any, msg: str) -> None:
            if sev in errors:
                self.errors.append(str(msg))
                del self.errors[:-20]
            if sev != severity.VERBOSE:
                log.log(levels.get(sev, logging.INFO), "TensorRT: %s", msg)

        def take(self) -> str:
            """The errors logged since the last take(), joined; '' when none."""
            text, self.errors = "; ".join(self.errors), []
            return text

    return CapturingLogger()
