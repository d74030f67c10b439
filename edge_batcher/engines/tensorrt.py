"""TensorRT backend: runs a serialized plan (model.plan) built for this device's GPU or DLA.

Why it looks the way it does:

* A plan only loads with the exact TensorRT version and GPU it was built with. Deserialization
  failure is therefore a configuration problem with a known fix (rebuild on the device), and
  the error says so, with the rebuild command and both versions where they are known.
* One execution context per engine object; the runner creates one engine object per instance
  and calls infer() from that instance's single worker thread, so nothing here is shared
  between threads. load() and close() run on other threads than infer(): every method that
  touches CUDA makes the device's primary context current for its duration (the context the
  CUDA runtime and TensorRT use), instead of relying on whatever thread state is left over.
* All memory is allocated once in load(): TensorRT's activation memory (USER_MANAGED, sized
  by the largest get_device_memory_size_for_profile_v2), and one device + one page-locked host
  buffer per I/O tensor, sized for the largest profile and shared by all profiles (one context
  runs one batch at a time). A batch allocates nothing, so a loaded engine cannot run out of
  memory halfway through serving, and memory_footprint() is exact rather than estimated.
* The batcher pads batches to the preferred sizes, and the plan has an optimization profile
  per preferred size (tools/build_engine.py), so each batch runs with kernels tuned for its
  exact shape. FP16/INT8 plans need nothing here: the I/O datatypes come from the engine.
* TensorRT 10.x (what JetPack ships) and 11.x (pip on desktop GPUs) both load: the runtime
  calls used here exist in both, and where they differ (the v1/v2 device-memory queries,
  context.device_memory vs set_device_memory) the code asks the object what it has instead of
  comparing version numbers. tensorrt_capabilities() does the same for the builder's side.
* CUDA goes through engines/cuda_api.py: cuda-python when installed, else pycuda.

`tensorrt` and the CUDA binding are imported in load(), never at import time, so a device
without them can still import this module (the registry's lazy backends). Tests pass
tests/fakes/fake_tensorrt.py's FakeTensorRT and a fake binding (FakeCuda for pycuda,
FakeCudaDriver for cuda-python) through the constructor.
"""

from __future__ import annotations

import json
import logging
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..config import ModelConfig, build_dataclass
from ..errors import ConfigError, EngineError, OutOfMemory
from ..types import DATATYPE_TO_NUMPY, TensorSpec
from . import trt_profiles as tp
from .base import apply_overrides
from .cuda_api import CudaApi, DeviceBuffer, HostBuffer, cuda_api_from, load_cuda_api

log = logging.getLogger(__name__)

PRECISIONS = ("fp32", "fp16", "int8")
INSTALL_HINT = (
    "on a Jetson, TensorRT and its Python bindings come with JetPack (apt install nvidia-jetpack / "
    "python3-libnvinfer): use a venv made with --system-site-packages and pip install 'edge-batcher[jetpack6]' "
    "(or [jetpack7]) for cuda-python; on a desktop GPU: pip install 'edge-batcher[tensorrt]' (TensorRT 10, CUDA 12) "
    "or 'edge-batcher[tensorrt-cu13]' (newest TensorRT, CUDA 13 driver); docs/tensorrt.md"
)
# The TensorRT generations this code was written and tested (against fakes) for.
KNOWN_MAJORS = (10, 11)


# --------------------------------------------------------------------------- settings


@dataclass
class TensorRTSettings:
    """[tensorrt] in model.toml: how the TensorRT backend runs the plan, and how it was built.

    build-engine writes the build fields, so a plan from another TensorRT version can be rebuilt
    with the same options (the load error prints that command).
    """

    device: int = 0  # CUDA device index (Jetsons have one: 0)
    dla_core: int = -1  # >= 0: run on this DLA core (plan built for DLA; Orin NX / AGX Orin only)
    # How model.plan was built (written by build-engine, used for the rebuild command):
    onnx: str = ""  # source ONNX model, relative to the model directory or absolute
    precision: str = "fp32"  # fp32 | fp16 | int8
    profiles: str = "per_size"  # per_size (one profile per preferred size) | range (one 1..max profile)
    workspace_mb: int = 0  # builder workspace limit; 0: TensorRT's default
    calibration_cache: str = ""  # INT8 calibration cache file (int8 without Q/DQ nodes)
    timing_cache: str = ""  # timing cache file loaded and saved by the builder
    gpu_fallback: bool = True  # with dla_core: layers DLA cannot run go to the GPU


def validate_tensorrt_settings(s: Any, where: str) -> None:
    """Checks for [tensorrt]; config.py's _validate_model can call this (errors name the key)."""
    if s.device < 0:
        raise ConfigError(f"{where}: [tensorrt] device: expected >= 0, got {s.device}")
    if s.dla_core < -1:
        raise ConfigError(f"{where}: [tensorrt] dla_core: expected -1 (GPU) or a DLA core >= 0, got {s.dla_core}")
    if s.precision not in PRECISIONS:
        raise ConfigError(f"{where}: [tensorrt] precision: expected one of {', '.join(PRECISIONS)}, got {s.precision!r}")
    if s.profiles not in tp.PROFILE_MODES:
        raise ConfigError(
            f"{where}: [tensorrt] profiles: expected one of {', '.join(tp.PROFILE_MODES)}, got {s.profiles!r}"
        )
    if s.dla_core >= 0 and s.precision == "fp32":
        raise ConfigError(f"{where}: [tensorrt] dla_core {s.dla_core} needs precision fp16 or int8 (DLA has no FP32)")
    if s.dla_core >= 0 and s.profiles != "per_size":
        raise ConfigError(f"{where}: [tensorrt] dla_core needs profiles = \"per_size\" (DLA has no dynamic shapes)")
    if s.workspace_mb < 0:
        raise ConfigError(f"{where}: [tensorrt] workspace_mb: expected >= 0, got {s.workspace_mb}")


def tensorrt_settings(config: ModelConfig) -> TensorRTSettings:
    """The model's [tensorrt] table as TensorRTSettings, validated (errors name file and key).

    config.py keeps backend tables as written (a dict); this backend owns their meaning.
    """
    raw = getattr(config, "tensorrt", None)
    if isinstance(raw, TensorRTSettings):
        return raw
    where = str(config.directory / "model.toml")
    settings = build_dataclass(TensorRTSettings, dict(raw or {}), f"{where}: [tensorrt]")
    validate_tensorrt_settings(settings, where)
    return settings


# --------------------------------------------------------------------------- plan metadata


def plan_info_path(plan: Path) -> Path:
    """The build record next to a plan: model.plan -> model.plan.json (written by build-engine)."""
    return plan.with_name(plan.name + ".json")


def read_plan_info(plan: Path) -> dict[str, Any] | None:
    """The build record of a plan, or None when there is none or it is unreadable.

    TensorRT keeps its own version inside the plan in a format it does not document, so the
    version a plan was built with is known only from this record.
    """
    try:
        info = json.loads(plan_info_path(plan).read_text())
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def rebuild_command(config: ModelConfig, settings: TensorRTSettings | None = None,
                    capabilities: "TensorRTCapabilities | None" = None) -> str:
    """The build-engine command line that rebuilds this model's plan with the same options, as far
    as the installed TensorRT (`capabilities`, when known) can build them: without INT8
    calibration (TensorRT 11) an INT8 calibration-cache build needs a Q/DQ model instead, and
    the command says so rather than repeat an option that build-engine would refuse."""
    s = settings or tensorrt_settings(config)
    calibration = bool(s.calibration_cache) and (capabilities is None or capabilities.int8_calibration)
    onnx = s.onnx or "<model.onnx>"
    if s.onnx and not Path(s.onnx).is_absolute():
        onnx = str(config.directory / s.onnx)
    args = [onnx, "--repository", str(config.directory.parent), "--model", config.name,
            "--sizes", ",".join(str(n) for n in config.batching.preferred_batch_sizes)]
    if s.profiles == "range":
        args.append("--range")
    if s.precision != "fp32":
        args.append(f"--{s.precision}")
    if calibration:
        args += ["--calibration-cache", s.calibration_cache]
    if s.dla_core >= 0:
        args += ["--dla-core", str(s.dla_core)]
        if not s.gpu_fallback:
            args.append("--no-gpu-fallback")
    if s.workspace_mb:
        args += ["--workspace-mb", str(s.workspace_mb)]
    if s.timing_cache:
        args += ["--timing-cache", s.timing_cache]
    args.append("--force")
    command = "edge-batcher build-engine " + shlex.join(args)
    if s.calibration_cache and not calibration:
        command += (f" (TensorRT {capabilities.version} has no INT8 calibration, so {s.calibration_cache} cannot be "
                    f"used: replace {onnx} with a Q/DQ-quantized ONNX model, e.g. from NVIDIA ModelOpt: python -m "
                    "modelopt.onnx.quantization --onnx_path MODEL --quantize_mode int8 --calibration_data DATA.npy)")
    return command


# --------------------------------------------------------------------------- module loading


def import_tensorrt_module() -> Any:
    """`import tensorrt`, refusing anything that is not TensorRT's Python package.

    A directory named tensorrt on sys.path (this project's tests/trt, when tests/ is on the
    path) imports as an empty namespace package; treat that as "not installed".
    """
    import tensorrt  # noqa: PLC0415 - lazily, see the module docstring

    if not hasattr(tensorrt, "Runtime"):
        where = list(getattr(tensorrt, "__path__", [])) or getattr(tensorrt, "__file__", "?")
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
        raise ConfigError(f"the tensorrt backend needs TensorRT and a CUDA Python binding ({exc}); {INSTALL_HINT}") from exc
    caps = tensorrt_capabilities(trt)
    if caps.major < 10:
        raise ConfigError(
            f"the tensorrt backend needs TensorRT >= 10 (JetPack 6.1 or newer); this device has TensorRT {caps.version}. "
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
        log.info(
            "model %s: TensorRT %s plan %s, %d profile(s), device memory %d B (activations) + %d B (I/O)%s",
            c.name, self.trt_version, path.name, len(self.profiles), max(self._activations),
            sum(b.nbytes for b in self._buffers.values()),
            f", DLA core {self.settings.dla_core}" if self.settings.dla_core >= 0 else "",
        )

    def _load(self, plan: bytes) -> None:
        c, trt, cuda, s = self.config, self._trt, self._cuda, self.settings
        self._logger = make_logger(trt)
        self._runtime = trt.Runtime(self._logger)
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

        # I/O tensors: names, modes, datatypes, shapes (-1 = dynamic) from the engine itself.
        specs_in, specs_out, datatypes = [], [], {}
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

        # Profiles as the plan has them, and whether they serve every preferred size / bucket.
        self.profiles = []
        static = {sp.name: sp.shape for sp in specs_in}
        for p in range(max(1, engine.num_optimization_profiles)):
            ranges = {}
            for name in self._input_names:
                lo, opt, hi = (tuple(int(d) for d in dims) for dims in engine.get_tensor_profile_shape(name, p))
                if len(lo) != len(static[name]) or min(lo + hi, default=0) < 0:
                    if min(static[name], default=0) < 0:
                        raise ConfigError(f"model {c.name!r}: the plan has no profile shapes for dynamic input {name!r}")
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
        self.inputs = apply_overrides(specs_in, c.inputs, "input", c.name)
        self.outputs = apply_overrides(specs_out, c.outputs, "output", c.name)

        # Memory, all of it now: TensorRT's activations, then the I/O buffers.
        self._weights = self._weights_bytes(len(plan))
        self._activations = [self._activation_bytes(p) for p in range(len(self.profiles))]
        context = engine.create_execution_context(trt.ExecutionContextAllocationStrategy.USER_MANAGED)
        if context is None:
            raise EngineError(f"model {c.name!r}: TensorRT could not create an execution context: "
                              f"{self._logger.take() or 'no reason given'}")
        self._context = context
        self._stream = cuda.stream()
        size = max(max(self._activations), 1)
        self._device_memory = cuda.mem_alloc(size)
        if hasattr(context, "set_device_memory"):  # TensorRT >= 10.1 (and 11): pointer and size
            context.set_device_memory(self._device_memory.ptr, size)
        else:  # TensorRT 10.0
            context.device_memory = self._device_memory.ptr

        # Output shapes per profile come from TensorRT's shape inference at the profile's max.
        self._io_per_profile = []
        for profile in self.profiles:
            self._select_profile(profile.index)
            shapes = {}
            for name in self._input_names:
                shapes[name] = profile.inputs[name].max
                self._check(context.set_input_shape(name, profile.inputs[name].max), f"set_input_shape({name})")
            for name in self._output_names:
                shape = tuple(int(d) for d in context.get_tensor_shape(name))
                if any(d < 0 for d in shape):
                    raise ConfigError(
                        f"model {c.name!r}: output {name!r} has a data-dependent shape {shape}; the tensorrt "
                        "backend needs output shapes that follow from the input shapes"
                    )
                shapes[name] = shape
            self._io_per_profile.append(tp.profile_buffer_bytes(shapes, datatypes))
        self._stream.synchronize()
        for name, nbytes in tp.shared_buffer_bytes(self._io_per_profile).items():
            datatype = datatypes[name]
            dtype = DATATYPE_TO_NUMPY[datatype]
            n = max(nbytes, dtype.itemsize)
            device = cuda.mem_alloc(n)
            try:
                pinned = cuda.pinned_empty(n // dtype.itemsize, dtype)
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

    def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self._context is None:
            raise EngineError(f"model {self.config.name!r}: infer() before load() or after close()")
        self._cuda_context.push()
        try:
            return self._infer(inputs)
        except EngineError:
            raise
        except Exception as exc:
            if _is_oom(exc, self._cuda):
                raise OutOfMemory(f"model {self.config.name!r}: out of memory: {exc}") from exc
            raise EngineError(f"model {self.config.name!r}: TensorRT failed: {exc}") from exc
        finally:
            self._cuda_context.pop()

    def _infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        c, cuda, context, stream = self.config, self._cuda, self._context, self._stream
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
        self._select_profile(profile)
        for name, array in arrays.items():
            buf = self._buffers[name]
            self._check(context.set_input_shape(name, array.shape), f"set_input_shape({name}, {list(array.shape)})")
            host = buf.host[: array.size].reshape(array.shape)
            np.copyto(host, array)
            cuda.copy_htod_async(buf.device, host, stream)
        out_views = {}
        for name in self._output_names:
            buf = self._buffers[name]
            shape = tuple(int(d) for d in context.get_tensor_shape(name))
            count = int(np.prod(shape, dtype=np.int64))
            if any(d < 0 for d in shape) or count * buf.dtype.itemsize > buf.nbytes:
                raise EngineError(f"model {c.name!r}: output {name!r} shape {shape} does not fit its buffer")
            out_views[name] = buf.host[:count].reshape(shape)
        for name, buf in self._buffers.items():
            self._check(context.set_tensor_address(name, buf.device.ptr), f"set_tensor_address({name})")
        self._check(context.execute_async_v3(stream.handle), "execute_async_v3")
        for name, view in out_views.items():
            cuda.copy_dtoh_async(view, self._buffers[name].device, stream)
        stream.synchronize()
        # Copies: the pinned buffers are reused by the next batch while the runner still splits these.
        return {name: view.copy() for name, view in out_views.items()}

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
