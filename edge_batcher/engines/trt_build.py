"""`edge-batcher build-engine`: ONNX -> TensorRT plan with one profile per preferred batch size.

Run it on the device that will serve the model: a plan only loads with the TensorRT version and
GPU it was built with. It writes <repository>/<model>/model.plan, model.plan.json (the build
record: TensorRT version, GPU, options) and model.toml (backend = "tensorrt", the preferred
sizes, and a [tensorrt] table with the build options, so the plan can be rebuilt the same way).

Two steps, so everything but the build itself is testable without TensorRT:
  1. request_from_args(): arguments -> a validated BuildRequest (pure: reads the ONNX model's
     input shapes with the onnx package and plans the profiles, no TensorRT);
  2. build_engine(): BuildRequest -> TensorRT builder -> files.

Reduced precision depends on what the installed TensorRT offers (tensorrt_capabilities(): it
looks for the API, it does not compare versions). TensorRT 10.x has the weak-typing builder
flags: --fp16/--int8 set BuilderFlag.FP16/INT8, and --calibration-cache feeds the INT8
calibrator. TensorRT 11.x removed them and builds strongly typed networks only, in the
precision the ONNX model states: --fp16 converts the FP32 model to FP16 first (onnx_fp16.py,
FP32 I/O kept; the converted model is written next to the plan), --int8 needs a model with
Q/DQ nodes, and a calibration cache cannot be used (the error says how to quantize instead).

CLI wiring: `add_arguments(parser)` + `run(args)`, or `build_engine_main(argv)` (tools/build_engine.py).
Exit codes: 0 built; 1 TensorRT failed to build; 2 bad arguments, TensorRT not installed, or a build this
TensorRT cannot do (e.g. --calibration-cache on 11.x).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ..config import ModelConfig, SequenceSettings, TensorOverride, load_model_config
from ..errors import ConfigError
from ..types import TensorSpec
from . import trt_profiles as tp
from .base import apply_overrides
from . import onnx_fp16
from .cuda_api import CudaApi, cuda_api_from, load_cuda_api
from .trt_api import INSTALL_HINT, TensorRTCapabilities, import_tensorrt_module, make_logger, tensorrt_capabilities
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

_ONNX_TYPES = {1: "FP32", 10: "FP16", 3: "INT8", 2: "UINT8", 6: "INT32", 7: "INT64", 9: "BOOL",
               4: "UINT16", 5: "INT16", 12: "UINT32", 13: "UINT64", 11: "FP64"}


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


# --------------------------------------------------------------------------- arguments


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The build-engine arguments, for `edge-batcher build-engine` and tools/build_engine.py."""
    p.add_argument("onnx", type=Path, help="the ONNX model (e.g. engines/vibration/model.onnx)")
    p.add_argument("--repository", type=Path, help="model repository to write into (default: the one holding the "
                   "ONNX model's directory, else ./engines)")
    p.add_argument("--model", help="name of the new model (default: <source model>-trt)")
    p.add_argument("--sizes", help="preferred batch sizes, comma-separated (default: the source model.toml's, else 2,4,8)")
    p.add_argument("--range", action="store_true", help="one profile 1..max instead of one per size "
                   "(faster build, smaller plan, kernels tuned for the largest size only)")
    p.add_argument("--fp16", action="store_true", help="FP16: TensorRT 10 gets BuilderFlag.FP16; TensorRT 11 "
                   "(strongly typed) gets the model converted to FP16 compute with FP32 inputs/outputs")
    p.add_argument("--int8", action="store_true", help="INT8 (FP16 too, for layers without INT8): from Q/DQ "
                   "nodes in the model, or on TensorRT 10 only from --calibration-cache")
    p.add_argument("--calibration-cache", type=Path, metavar="FILE",
                   help="INT8 calibration cache (TensorRT 10 only; from your own calibration data: edge-batcher "
                        "has none to give)")
    p.add_argument("--workspace-mb", type=int, default=0, help="builder workspace limit in MiB (default: TensorRT's)")
    p.add_argument("--dla-core", type=int, default=-1, metavar="N",
                   help="build for DLA core N (Orin NX / AGX Orin; needs --fp16 or --int8)")
    p.add_argument("--no-gpu-fallback", action="store_true",
                   help="with --dla-core: fail instead of running layers DLA cannot run on the GPU")
    p.add_argument("--timing-cache", type=Path, metavar="FILE",
                   help="load kernel timings from FILE if it exists and save them back (faster rebuilds)")
    p.add_argument("--force", action="store_true", help="overwrite an existing plan / model.toml")
    p.add_argument("--quiet", action="store_true", help="no build progress")


def _parse_sizes(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise ConfigError(f"--sizes: expected comma-separated integers like 2,4,8, got {text!r}") from None


def onnx_input_specs(path: Path) -> tuple[list[TensorSpec], bool]:
    """The graph inputs (initializers excluded) as TensorSpecs, and whether the graph has Q/DQ nodes."""
    import onnx  # noqa: PLC0415 - only the builder needs it

    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # onnx raises DecodeError and friends
        raise ConfigError(f"{path}: not a readable ONNX model: {exc}") from exc
    inits = {i.name for i in model.graph.initializer}
    specs = []
    for v in model.graph.input:
        if v.name in inits:
            continue
        tt = v.type.tensor_type
        dims = tuple(d.dim_value if d.HasField("dim_value") else -1 for d in tt.shape.dim)
        specs.append(TensorSpec(v.name, _ONNX_TYPES.get(tt.elem_type, f"onnx:{tt.elem_type}"), dims))
    qdq = any(n.op_type in ("QuantizeLinear", "DequantizeLinear") for n in model.graph.node)
    return specs, qdq


def request_from_args(args: argparse.Namespace) -> BuildRequest:
    """Validate the arguments into a BuildRequest; ConfigError says what is wrong."""
    onnx: Path = args.onnx
    if not onnx.is_file():
        raise ConfigError(f"{onnx}: ONNX model not found")
    source = load_model_config(onnx.parent) if (onnx.parent / "model.toml").is_file() else None
    if source is not None and source.backend == "tensorrt":
        source = None  # rebuilding from an ONNX file that sits next to a plan: nothing to inherit
    if args.repository is not None:
        repository = args.repository
    elif source is not None:
        repository = onnx.parent.parent
    else:
        repository = Path("engines")
    base_name = source.name if source is not None else (onnx.parent.name if onnx.stem == "model" else onnx.stem)
    model = args.model or f"{base_name}-trt"
    if not model.replace("-", "").replace("_", "").replace(".", "").isalnum():
        raise ConfigError(f"--model: {model!r} must use letters, digits, '-', '_' or '.'")
    if args.sizes:
        sizes = _parse_sizes(args.sizes)
    elif source is not None:
        sizes = list(source.batching.preferred_batch_sizes)
    else:
        sizes = [2, 4, 8]
    if not sizes or any(n <= 0 for n in sizes) or sorted(set(sizes)) != sizes:
        raise ConfigError(f"--sizes: expected ascending distinct positive sizes like 2,4,8, got {sizes}")
    precision = "int8" if args.int8 else "fp16" if args.fp16 else "fp32"
    if args.workspace_mb < 0:
        raise ConfigError(f"--workspace-mb: expected >= 0, got {args.workspace_mb}")
    if args.dla_core < -1:
        raise ConfigError(f"--dla-core: expected a DLA core number >= 0, got {args.dla_core}")
    if args.dla_core >= 0 and precision == "fp32":
        raise ConfigError("--dla-core needs --fp16 or --int8: DLA runs FP16 and INT8 only")
    if args.dla_core >= 0 and args.range:
        raise ConfigError("--dla-core cannot use --range: DLA has no dynamic shapes, so it needs one profile per size")
    if args.no_gpu_fallback and args.dla_core < 0:
        raise ConfigError("--no-gpu-fallback only applies with --dla-core")
    if args.calibration_cache is not None:
        if not args.int8:
            raise ConfigError("--calibration-cache only applies with --int8")
        if not args.calibration_cache.is_file():
            raise ConfigError(f"--calibration-cache: {args.calibration_cache} not found")
    if args.timing_cache is not None and not args.timing_cache.resolve().parent.is_dir():
        raise ConfigError(f"--timing-cache: directory {args.timing_cache.parent} does not exist")

    inputs, qdq = onnx_input_specs(onnx)
    if args.int8 and args.calibration_cache is None and not qdq:
        raise ConfigError(
            f"--int8 needs INT8 scales, and {onnx} has no Q/DQ nodes: either {quantize_hint(onnx)} (explicit "
            "quantization: the only way on TensorRT 11), or, on TensorRT 10 only, pass --calibration-cache FILE "
            "made by calibrating with your own representative data (edge-batcher ships none)"
        )
    for spec in inputs:
        if spec.datatype.startswith("onnx:"):
            raise ConfigError(f"{onnx}: input {spec.name!r} has ONNX element type {spec.datatype[5:]}, "
                              "which the tensorrt backend cannot serve")
    overrides: list[TensorOverride] = source.inputs if source is not None else []
    inputs = apply_overrides(inputs, overrides, "input", model)
    seq: SequenceSettings | None = source.sequence if source is not None else None
    profiles = tp.plan_profiles(
        inputs, sizes, mode="range" if args.range else "per_size",
        sequence_inputs=list(seq.inputs) if seq else (), sequence_axis=seq.axis if seq else 1,
        buckets=list(seq.buckets) if seq else (), model=model,
    )
    request = BuildRequest(
        onnx=onnx, repository=repository, model=model, sizes=sizes,
        profile_mode="range" if args.range else "per_size", precision=precision,
        calibration_cache=args.calibration_cache, workspace_mb=args.workspace_mb, dla_core=args.dla_core,
        gpu_fallback=not args.no_gpu_fallback, timing_cache=args.timing_cache, force=args.force,
        has_qdq=qdq, source=source, inputs=inputs, profiles=profiles,
    )
    _check_outputs(request)
    return request


def _check_outputs(request: BuildRequest) -> None:
    if request.force:
        return
    if request.plan_path.exists():
        raise ConfigError(f"{request.plan_path} exists; pass --force to replace it")
    toml = request.model_dir / "model.toml"
    if toml.exists():
        raise ConfigError(f"{toml} exists; pass --force to replace it (or choose another --model)")


# --------------------------------------------------------------------------- precision per TensorRT


def check_request(request: BuildRequest, caps: TensorRTCapabilities) -> None:
    """ConfigError when the installed TensorRT cannot build what was asked, saying what to do instead."""
    if request.calibration_cache is not None and not caps.int8_calibration:
        raise ConfigError(
            f"--calibration-cache: TensorRT {caps.version} has no INT8 calibration (TensorRT 11 removed the calibrator API). "
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
        f"# with TensorRT {info.get('tensorrt', '?')} for {info.get('gpu') or 'this GPU'}. The plan only loads with that",
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
        for name in ("max_queue_delay_ms", "priority_levels", "default_priority", "default_timeout_ms",
                     "max_timeout_ms", "queue_capacity"):
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


def make_progress_monitor(trt: Any, write: Callable[[str], None], max_depth: int = 1) -> Any:
    """An IProgressMonitor printing build phases (to max_depth) with their durations.

    Ctrl-C during a build arrives in a callback; answering False there makes TensorRT cancel
    the build cleanly instead of leaving it running in native code.
    """

    class Progress(trt.IProgressMonitor):
        def __init__(self) -> None:
            trt.IProgressMonitor.__init__(self)
            self.depth: dict[str, int] = {}
            self.started: dict[str, float] = {}
            self.cancelled = False

        def phase_start(self, phase_name: str, parent_phase: str | None, num_steps: int) -> None:
            try:
                depth = self.depth.get(parent_phase, -1) + 1 if parent_phase else 0
                self.depth[phase_name] = depth
                self.started[phase_name] = time.monotonic()
                if depth <= max_depth:
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
                if depth <= max_depth:
                    write(f"{'  ' * depth}{phase_name}: done in {seconds:.1f} s")
            except KeyboardInterrupt:
                self.cancelled = True

    return Progress()


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
                 write: Callable[[str], None] = print, progress: bool = True) -> BuildResult:
    """Build the plan with TensorRT and write plan, build record and model.toml.

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
        return _build(request, trt, cuda, caps, source, onnx, write, progress, t0)


def _build(request: BuildRequest, trt: Any, cuda: Any, caps: TensorRTCapabilities, source: str, onnx: Path,
           write: Callable[[str], None], progress: bool, t0: float) -> BuildResult:
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
    if source == "builder flags" and request.calibration_cache is not None and hasattr(config, "set_calibration_profile"):
        config.set_calibration_profile(trt_profiles[0])
    cache = None
    if request.timing_cache is not None:
        data = request.timing_cache.read_bytes() if request.timing_cache.is_file() else b""
        cache = config.create_timing_cache(data)
        config.set_timing_cache(cache, False)
    if progress and hasattr(trt, "IProgressMonitor"):
        config.progress_monitor = make_progress_monitor(trt, write)
    where = f", DLA core {request.dla_core}" if request.dla_core >= 0 else ""
    write(f"building {request.model}: {len(request.profiles)} profile(s) "
          f"({'; '.join(p.describe() for p in request.profiles)}), {request.precision.upper()}{where}")
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise BuildError(f"TensorRT could not build {request.model}: {logger.take() or 'no reason logged'}")
    plan = bytes(memoryview(serialized))
    seconds = time.monotonic() - t0

    request.model_dir.mkdir(parents=True, exist_ok=True)
    _write_atomic(request.plan_path, plan)
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
    write(f"wrote {request.plan_path} ({len(plan)} bytes) in {seconds:.1f} s, {toml.name}, {plan_info_path(request.plan_path).name}")
    return BuildResult(request.plan_path, plan_info_path(request.plan_path), toml, seconds, len(plan))


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


# --------------------------------------------------------------------------- entry points


def run(args: argparse.Namespace, trt_module: Any = None, cuda_module: Any = None) -> int:
    """`edge-batcher build-engine`: 0 built, 1 build failed, 2 bad arguments / no TensorRT."""
    try:
        request = request_from_args(args)
    except ConfigError as exc:
        print(f"edge-batcher build-engine: {exc}", file=sys.stderr)
        return 2
    trt = trt_module
    if trt is None:
        try:
            trt = import_tensorrt_module()  # only here: the rest of the CLI works without it
        except ImportError:
            print("edge-batcher build-engine: TensorRT is needed to build engines, and the tensorrt Python package "
                  f"is not installed. {INSTALL_HINT}. Build on the device that will serve the plan.", file=sys.stderr)
            return 2
    try:
        build_engine(request, trt, cuda_module, write=print, progress=not args.quiet)
    except ConfigError as exc:  # this TensorRT cannot build what was asked; the message says what to do
        print(f"edge-batcher build-engine: {exc}", file=sys.stderr)
        return 2
    except BuildError as exc:
        print(f"edge-batcher build-engine: {exc}", file=sys.stderr)
        return 1
    return 0


def make_parser(prog: str = "build_engine.py") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return parser


def build_engine_main(argv: list[str] | None = None, trt_module: Any = None, cuda_module: Any = None) -> int:
    """tools/build_engine.py: parse argv and run()."""
    return run(make_parser().parse_args(argv), trt_module, cuda_module)
