"""`edge-batcher build-engine`: ONNX -> TensorRT plan with one profile per preferred batch size.

Run it on the device that will serve the model: a plan only loads with the TensorRT version and
GPU it was built with. Two steps, so everything but the build itself is testable without TensorRT:
  1. request_from_args() (here): arguments -> a validated BuildRequest (pure: reads the ONNX
     model's input shapes with the onnx package and plans the profiles, no TensorRT);
  2. build_engine() (engines/trt_builder.py): BuildRequest -> TensorRT builder -> files.

CLI wiring: `add_arguments(parser)` + `run(args)`, or `build_engine_main(argv)` (tools/build_engine.py).
Exit codes: 0 built; 1 TensorRT failed to build; 2 bad arguments, TensorRT not installed, or a build this
TensorRT cannot do (e.g. --calibration-cache on 11.x).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ..config import SequenceSettings, TensorOverride, load_model_config
from ..errors import ConfigError, StorageError
from ..progress import is_terminal
from ..types import TensorSpec
from . import trt_profiles as tp
from .base import apply_overrides
from .trt_api import INSTALL_HINT, import_tensorrt_module
from .trt_builder import FP16_ONNX_FILE, BuildError, BuildRequest, BuildResult, build_engine, quantize_hint

# The build steps are used through this module by the CLI, tools/ and tests.
__all__ = ["FP16_ONNX_FILE", "BuildError", "BuildRequest", "BuildResult", "add_arguments", "build_engine",
           "build_engine_main", "make_parser", "onnx_input_specs", "request_from_args", "run"]

_ONNX_TYPES = {1: "FP32", 10: "FP16", 3: "INT8", 2: "UINT8", 6: "INT32", 7: "INT64", 9: "BOOL",
               4: "UINT16", 5: "INT16", 12: "UINT32", 13: "UINT64", 11: "FP64"}


# --------------------------------------------------------------------------- arguments


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The build-engine arguments, for `edge-batcher build-engine` and tools/build_engine.py."""
    p.add_argument("onnx", type=Path, help="the ONNX model (e.g. engines/vibration/model.onnx)")
    p.add_argument("--repository", type=Path, help="model repository to write into (default: the one holding the "
                   "ONNX model's directory, else ./engines)")
    p.add_argument("--model", help="name of the new model (default: <source model>-trt)")
    p.add_argument("--sizes",
                   help="preferred batch sizes, comma-separated (default: the source model.toml's, else 2,4,8)")
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
        # On a terminal the phases are a bar; in a log or CI, one line each.
        bar = sys.stdout if is_terminal(sys.stdout) else None
        build_engine(request, trt, cuda_module, write=print, progress=not args.quiet, bar=bar)
    except ConfigError as exc:  # this TensorRT cannot build what was asked; the message says what to do
        print(f"edge-batcher build-engine: {exc}", file=sys.stderr)
        return 2
    except (BuildError, StorageError) as exc:  # StorageError: a full or read-only disk for the plan
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
