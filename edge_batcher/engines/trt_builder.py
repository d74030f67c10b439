"""TensorRT build steps: a validated BuildRequest -> TensorRT builder -> plan, build record, model.toml.

It writes <repository>/<model>/model.plan, model.plan.json (the build record: TensorRT version,
GPU, options) and model.toml (backend = "tensorrt", the preferred sizes, and a [tensorrt] table
with the build options, so the plan can be rebuilt the same way). Reduced precision depends on
what the installed TensorRT offers (tensorrt_capabilities(): it looks for the API, it does not
compare versions): TensorRT 10.x gets the weak-typing builder flags (--fp16/--int8, and the INT8
calibrator fed from a calibration cache); TensorRT 11.x builds strongly typed networks only, so
--fp16 converts the FP32 model to FP16 first (onnx_fp16.py, FP32 I/O kept; the converted model
is written next to the plan), --int8 needs Q/DQ nodes, and a calibration cache cannot be used.
The command and its argument checks are engines/trt_build.py.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TextIO

from ..config import ModelConfig
from ..durable import fsync_dir
from ..errors import ConfigError, StorageError
from ..progress import Progress
from ..types import TensorSpec
from . import onnx_fp16
from . import trt_profiles as tp
from .cuda_api import CudaApi, cuda_api_from, load_cuda_api
from .trt_api import TensorRTCapabilities, make_logger, tensorrt_capabilities
from .trt_settings import TensorRTSettings, plan_info_path

PLAN_FILE = "model.plan"
FP16_ONNX_FILE = "model.fp16.onnx"  # the --fp16 conversion for a strongly typed TensorRT, next to the plan
QUANTIZE_HINT = (
    "quantize the model to a Q/DQ ONNX model with your own calibration data, e.g. with NVIDIA ModelOpt "
    "(pip install nvidia-modelopt; python -m modelopt.onnx.quantization --onnx_path {onnx} --quantize_mode int8 "
    "--calibration_data calib.npy --output_path {quant}), and build that model with --int8"
)


def quantize_hint(onnx: Path) -> str:
    return QUANTIZE_HINT.format(onnx=onnx, quant=onnx.with_name(onnx.stem + ".quant.onnx"))


class BuildError(Exception):
    """TensorRT could not build the plan (its reason is in the message)."""


@dataclass
class BuildRequest:
    """Everything a build needs, validated; no TensorRT involved in making one."""

    onnx: Path
    repository: Path
    model: str
    sizes: list[int]
    profile_mode: str = "per_size"
    precision: str = "fp32"
    calibration_cache: Path | None = None
    workspace_mb: int = 0
    dla_core: int = -1
    gpu_fallback: bool = True
    timing_cache: Path | None = None
    force: bool = False
    has_qdq: bool = False  # the ONNX model has QuantizeLinear/DequantizeLinear nodes
    source: ModelConfig | None = None  # the model.toml next to the ONNX file, if any
    inputs: list[TensorSpec] = field(default_factory=list)
    profiles: list[tp.Profile] = field(default_factory=list)

    @property
    def model_dir(self) -> Path:
        return self.repository / self.model

    @property
    def plan_path(self) -> Path:
        return self.model_dir / PLAN_FILE

    def settings(self) -> TensorRTSettings:
        """The [tensorrt] table written next to the plan."""
        return TensorRTSettings(
            device=0,
            dla_core=self.dla_core,
            onnx=_relative(self.onnx, self.model_dir),
            precision=self.precision,
            profiles=self.profile_mode,
            workspace_mb=self.workspace_mb,
            calibration_cache=str(self.calibration_cache.resolve()) if self.calibration_cache else "",
            timing_cache=str(self.timing_cache.resolve()) if self.timing_cache else "",
            gpu_fallback=self.gpu_fallback,
        )


def _relative(path: Path, start: Path) -> str:
    try:
        return os.path.relpath(path.resolve(), start.resolve())
    except ValueError:  # another drive (Windows): keep it absolute
        return str(path.resolve())


# --------------------------------------------------------------------------- precision per TensorRT


def check_request(request: BuildRequest, caps: TensorRTCapabilities) -> None:
    """ConfigError when the installed TensorRT cannot build what was asked, saying what to do instead."""
    if request.calibration_cache is not None and not caps.int8_calibration:
        raise ConfigError(
            f"--calibration-cache: TensorRT {caps.version} has no INT8 calibration "
            "(TensorRT 11 removed the calibrator API). "
            f"Instead, {quantize_hint(request.onnx)}; or build on TensorRT 10.x (JetPack 6/7 ship it)"
        )
    if request.precision == "int8" and caps.strongly_typed_only and not request.has_qdq:
        raise ConfigError(
            f"--int8: TensorRT {caps.version} builds strongly typed networks only, so INT8 must come from Q/DQ nodes "
            f"in the model, and {request.onnx} has none: {quantize_hint(request.onnx)}"
        )


def precision_source(request: BuildRequest, caps: TensorRTCapabilities) -> str:
    """How the plan gets its precision: "builder flags" (10.x), "FP16 conversion", "Q/DQ nodes" or "model"."""
    if request.precision == "fp32":
        return "model"
    if caps.precision_flags:
        return "builder flags"
    return "Q/DQ nodes" if request.precision == "int8" else "FP16 conversion"


# --------------------------------------------------------------------------- model.toml


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (str, Path)):
        return json.dumps(str(value), ensure_ascii=False)  # JSON string escapes are valid TOML
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} to TOML")


def model_toml(request: BuildRequest, info: dict[str, Any]) -> str:
    """The model.toml of the built model (inherits the source model.toml's batching and labels)."""
    src = request.source
    lines = [
        f"# Built by edge-batcher build-engine from {request.onnx} on {info.get('built_at', '?')}",
        f"# with TensorRT {info.get('tensorrt', '?')} for {info.get('gpu') or 'this GPU'}. "
        "The plan only loads with that",
        "# TensorRT version on that GPU model: after a JetPack upgrade, rebuild it with the same options",
        "# (the daemon's load error prints the command).",
        'backend = "tensorrt"',
        f"model_file = {_toml_value(PLAN_FILE)}",
        f"instances = {src.instances if src else 1}",
    ]
    if src and src.description:
        lines.append(f"description = {_toml_value(src.description + ' (TensorRT ' + request.precision.upper() + ')')}")
    if src and src.labels:
        lines.append(f"labels = {_toml_value(src.labels)}")
    lines += ["", "[batching]", f"preferred_batch_sizes = {_toml_value(request.sizes)}"]
    if src:
        b = src.batching
        for name in ("max_queue_delay_ms", "dispatch_when_idle", "priority_levels", "default_priority",
                     "default_timeout_ms", "max_timeout_ms", "queue_capacity"):
            lines.append(f"{name} = {_toml_value(getattr(b, name))}")
    if src and src.sequence:
        s = src.sequence
        lines += ["", "[sequence]", f"inputs = {_toml_value(s.inputs)}", f"axis = {s.axis}",
                  f"buckets = {_toml_value(s.buckets)}", f"pad_value = {_toml_value(s.pad_value)}"]
    for kind, overrides in (("inputs", src.inputs if src else []), ("outputs", src.outputs if src else [])):
        for o in overrides:
            lines += ["", f"[[{kind}]]", f"name = {_toml_value(o.name)}"]
            if o.datatype:
                lines.append(f"datatype = {_toml_value(o.datatype)}")
            if o.shape:
                lines.append(f"shape = {_toml_value(o.shape)}")
    lines += ["", "[tensorrt]"]
    for f in dataclasses.fields(TensorRTSettings):
        lines.append(f"{f.name} = {_toml_value(getattr(request.settings(), f.name))}")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- TensorRT


def make_progress_monitor(trt: Any, write: Callable[[str], None], max_depth: int = 1,
                          bar: TextIO | None = None) -> Any:
    """An IProgressMonitor showing the build phases (to max_depth) with their durations.

    Without ``bar`` every phase start and end is a line through ``write`` (logs, CI). With
    ``bar`` (a terminal) each top-level phase is a progress bar on it (progress.py) whose steps
    are the sub-phases, and only the top-level phase's end is a line. Ctrl-C during a build
    arrives in a callback; answering False there makes TensorRT cancel the build cleanly
    instead of leaving it running in native code.
    """

    class Monitor(trt.IProgressMonitor):
        def __init__(self) -> None:
            trt.IProgressMonitor.__init__(self)
            self.depth: dict[str, int] = {}
            self.started: dict[str, float] = {}
            self.bars: dict[str, Progress] = {}
            self.cancelled = False

        def phase_start(self, phase_name: str, parent_phase: str | None, num_steps: int) -> None:
            try:
                depth = self.depth.get(parent_phase, -1) + 1 if parent_phase else 0
                self.depth[phase_name] = depth
                self.started[phase_name] = time.monotonic()
                if bar is not None:
                    if depth == 0:
                        self.bars[phase_name] = Progress(phase_name, num_steps, bar)
                    elif depth == 1 and parent_phase in self.bars:
                        self.bars[parent_phase].step(f"{parent_phase}: {phase_name}")
                elif depth <= max_depth:
                    write(f"{'  ' * depth}{phase_name} ({num_steps} step{'s' if num_steps != 1 else ''})")
            except KeyboardInterrupt:
                self.cancelled = True

        def step_complete(self, phase_name: str, step: int) -> bool:
            try:
                return not self.cancelled
            except KeyboardInterrupt:  # pragma: no cover - timing dependent
                self.cancelled = True
                return False

        def phase_finish(self, phase_name: str) -> None:
            try:
                depth = self.depth.pop(phase_name, 0)
                seconds = time.monotonic() - self.started.pop(phase_name, time.monotonic())
                if phase_name in self.bars:
                    self.bars.pop(phase_name).close()
                if depth <= (0 if bar is not None else max_depth):
                    write(f"{'  ' * depth}{phase_name}: done in {seconds:.1f} s")
            except KeyboardInterrupt:
                self.cancelled = True

    return Monitor()


def _cache_calibrator(trt: Any, cache: bytes) -> Any:
    """An INT8 calibrator that only replays a calibration cache (it has no data of its own)."""

    class CacheCalibrator(trt.IInt8EntropyCalibrator2):
        def __init__(self) -> None:
            trt.IInt8EntropyCalibrator2.__init__(self)

        def get_batch_size(self) -> int:
            return 1

        def get_batch(self, names: list[str]) -> None:
            return None  # no calibration data: the cache must cover every tensor

        def read_calibration_cache(self) -> bytes:
            return cache

        def write_calibration_cache(self, cache: bytes) -> None:
            pass

    return CacheCalibrator()


def device_info(cuda: Any = None, root: Path = Path("/")) -> dict[str, Any]:
    """GPU name, compute capability and L4T release for the build record; {} parts when unknown."""
    info: dict[str, Any] = {}
    try:
        api: CudaApi = load_cuda_api() if cuda is None else cuda_api_from(cuda)
        api.init()
        info["gpu"] = api.device_name(0)
        major, minor = api.compute_capability(0)
        info["compute_capability"] = f"{major}.{minor}"
        info["cuda_binding"] = api.name
    except Exception:  # no CUDA binding / no GPU: the record just has less in it
        pass
    try:
        line = (root / "etc" / "nv_tegra_release").read_text().splitlines()[0]
        info["l4t"] = line.strip()
    except (OSError, IndexError):
        pass
    return info


@dataclass
class BuildResult:
    plan: Path
    info: Path
    toml: Path
    seconds: float
    plan_bytes: int


def build_engine(request: BuildRequest, trt: Any, cuda: Any = None,
                 write: Callable[[str], None] = print, progress: bool = True,
                 bar: TextIO | None = None) -> BuildResult:
    """Build the plan with TensorRT and write plan, build record and model.toml.

    Progress (unless ``progress`` is False): the build phases as lines through ``write``, or a
    bar on ``bar`` when given (a terminal; see make_progress_monitor).

    Raises ConfigError when this TensorRT cannot build what was asked (check_request) or the
    FP16 conversion a strongly typed TensorRT needs is not possible; BuildError when TensorRT fails.
    """
    t0 = time.monotonic()
    caps = tensorrt_capabilities(trt)
    check_request(request, caps)
    source = precision_source(request, caps)
    with tempfile.TemporaryDirectory(prefix="eb-build-") as scratch:
        onnx = request.onnx
        if source == "FP16 conversion":  # converted in scratch space: a failed build leaves nothing behind
            onnx = Path(scratch) / FP16_ONNX_FILE
            counts = onnx_fp16.convert_to_fp16(request.onnx, onnx)
            write(f"TensorRT {caps.version} is strongly typed: converted {request.onnx} to FP16 compute with FP32 "
                  f"inputs/outputs ({counts['initializers']} initializers, {counts['io_casts']} I/O casts)")
        return _build(request, trt, cuda, caps, source, onnx, write, progress, bar, t0)


def _build(request: BuildRequest, trt: Any, cuda: Any, caps: TensorRTCapabilities, source: str, onnx: Path,
           write: Callable[[str], None], progress: bool, bar: TextIO | None, t0: float) -> BuildResult:
    logger = make_logger(trt)
    builder = trt.Builder(logger)
    network_flags = 0  # explicit batch is the only mode since TensorRT 10 (its flag is gone in 11)
    if caps.strongly_typed_only and caps.strongly_typed_flag:
        network_flags |= 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    network = builder.create_network(network_flags)
    if network is None:
        raise BuildError(f"TensorRT could not create a network: {logger.take() or 'no reason logged'}")
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx)):
        errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
        raise BuildError(f"TensorRT cannot parse {onnx}: {'; '.join(errors) or logger.take()}")
    config = builder.create_builder_config()
    if request.workspace_mb:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, request.workspace_mb << 20)
    if source == "builder flags":  # weak typing (10.x): allow reduced-precision kernels
        config.set_flag(trt.BuilderFlag.FP16)
        if request.precision == "int8":
            config.set_flag(trt.BuilderFlag.INT8)
            if request.calibration_cache is not None:
                config.int8_calibrator = _cache_calibrator(trt, request.calibration_cache.read_bytes())
    if request.dla_core >= 0:
        config.default_device_type = trt.DeviceType.DLA
        config.DLA_core = request.dla_core
        if request.gpu_fallback and hasattr(trt.BuilderFlag, "GPU_FALLBACK"):
            config.set_flag(trt.BuilderFlag.GPU_FALLBACK)
    trt_profiles = []
    for profile in request.profiles:
        op = builder.create_optimization_profile()
        for name, r in profile.inputs.items():
            op.set_shape(name, r.min, r.opt, r.max)
        config.add_optimization_profile(op)
        trt_profiles.append(op)
    if (source == "builder flags" and request.calibration_cache is not None
            and hasattr(config, "set_calibration_profile")):
        config.set_calibration_profile(trt_profiles[0])
    cache: Any = None  # TensorRT's ITimingCache, with request.timing_cache
    if request.timing_cache is not None:
        data = request.timing_cache.read_bytes() if request.timing_cache.is_file() else b""
        cache = config.create_timing_cache(data)
        config.set_timing_cache(cache, False)
    if progress and hasattr(trt, "IProgressMonitor"):
        config.progress_monitor = make_progress_monitor(trt, write, bar=bar)
    where = f", DLA core {request.dla_core}" if request.dla_core >= 0 else ""
    write(f"building {request.model}: {len(request.profiles)} profile(s) "
          f"({'; '.join(p.describe() for p in request.profiles)}), {request.precision.upper()}{where}")
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise BuildError(f"TensorRT could not build {request.model}: {logger.take() or 'no reason logged'}")
    plan = bytes(memoryview(serialized))
    seconds = time.monotonic() - t0

    created = not request.model_dir.exists()
    request.model_dir.mkdir(parents=True, exist_ok=True)
    try:
        _write_atomic(request.plan_path, plan)
    except StorageError:
        if created:  # nothing of this build stays in the repository (an empty model directory)
            request.model_dir.rmdir()
        raise
    if onnx != request.onnx:  # keep the converted model the plan was built from, next to it
        built_from = request.model_dir / FP16_ONNX_FILE
        _write_atomic(built_from, onnx.read_bytes())
        onnx = built_from
    if request.timing_cache is not None:
        timing = config.get_timing_cache() or cache
        _write_atomic(request.timing_cache, bytes(memoryview(timing.serialize())))
    info = {
        "tensorrt": str(getattr(trt, "__version__", "?")),
        **device_info(cuda),
        "built_at": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "onnx": str(request.onnx.resolve()),
        "onnx_sha256": hashlib.sha256(request.onnx.read_bytes()).hexdigest(),
        "precision": request.precision,
        "precision_from": source,
        "onnx_built": str(onnx.resolve()),
        "tensorrt_capabilities": caps.describe(),
        "dla_core": request.dla_core,
        "profiles": [{name: {"min": list(r.min), "opt": list(r.opt), "max": list(r.max)}
                      for name, r in p.inputs.items()} for p in request.profiles],
        "build_seconds": round(seconds, 2),
        "fake": bool(getattr(trt, "IS_FAKE", False)),
    }
    _write_atomic(plan_info_path(request.plan_path), (json.dumps(info, indent=2) + "\n").encode())
    toml = request.model_dir / "model.toml"
    _write_atomic(toml, model_toml(request, info).encode())
    write(f"wrote {request.plan_path} ({len(plan)} bytes) in {seconds:.1f} s, {toml.name}, "
          f"{plan_info_path(request.plan_path).name}")
    return BuildResult(request.plan_path, plan_info_path(request.plan_path), toml, seconds, len(plan))


def _write_atomic(path: Path, data: bytes) -> None:
    """Replace `path` with `data` whole: on disk before the rename, so that power lost on a
    device right after a build leaves the old file or the new one, never an empty plan."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
    except BaseException as exc:  # a full disk: the part written must not keep the room, nor the old file go
        tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise StorageError.of(f"could not write {path}", exc, "any file there before is as it was") from exc
        raise
    os.replace(tmp, path)
    fsync_dir(path.parent)
