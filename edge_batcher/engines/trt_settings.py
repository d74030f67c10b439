"""The [tensorrt] table of model.toml and a plan's build record: TensorRTSettings (validated,
errors name file and key), model.plan.json next to the plan, and the build-engine command that
rebuilds a plan with the options it was built with. Pure (no tensorrt import); used by the
backend (tensorrt.py) and the builder (trt_build.py); docs/tensorrt.md describes the keys.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config import ModelConfig, build_dataclass
from ..errors import ConfigError
from . import trt_profiles as tp

if TYPE_CHECKING:
    from .trt_api import TensorRTCapabilities

PRECISIONS = ("fp32", "fp16", "int8")


@dataclass
class TensorRTSettings:
    """[tensorrt] in model.toml: how the TensorRT backend runs the plan, and how it was built.

    build-engine writes the build fields, so a plan from another TensorRT version can be rebuilt
    with the same options (the load error prints that command).
    """

    device: int = 0  # CUDA device index (Jetsons have one: 0)
    dla_core: int = -1  # >= 0: run on this DLA core (plan built for DLA; Orin NX / AGX Orin only)
    cuda_graphs: str = "auto"  # auto | on | off: replay each batch shape as a captured CUDA graph (trt_graphs.py)
    # How model.plan was built (written by build-engine, used for the rebuild command):
    onnx: str = ""  # source ONNX model, relative to the model directory or absolute
    precision: str = "fp32"  # fp32 | fp16 | int8
    profiles: str = "per_size"  # per_size (one profile per preferred size) | range (one 1..max profile)
    workspace_mb: int = 0  # builder workspace limit; 0: TensorRT's default
    calibration_cache: str = ""  # INT8 calibration cache file (int8 without Q/DQ nodes)
    timing_cache: str = ""  # timing cache file loaded and saved by the builder
    gpu_fallback: bool = True  # with dla_core: layers DLA cannot run go to the GPU


def validate_tensorrt_settings(s: Any, where: str) -> None:
    """Checks for [tensorrt]; model_config.py's _validate_model can call this (errors name the key)."""
    if s.device < 0:
        raise ConfigError(f"{where}: [tensorrt] device: expected >= 0, got {s.device}")
    if s.dla_core < -1:
        raise ConfigError(f"{where}: [tensorrt] dla_core: expected -1 (GPU) or a DLA core >= 0, got {s.dla_core}")
    if s.cuda_graphs not in ("auto", "on", "off"):
        raise ConfigError(f"{where}: [tensorrt] cuda_graphs: expected auto, on or off, got {s.cuda_graphs!r}")
    if s.precision not in PRECISIONS:
        raise ConfigError(
            f"{where}: [tensorrt] precision: expected one of {', '.join(PRECISIONS)}, got {s.precision!r}"
        )
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
                    capabilities: TensorRTCapabilities | None = None) -> str:
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
    if s.calibration_cache and not calibration and capabilities is not None:  # known, or calibration held
        command += (f" (TensorRT {capabilities.version} has no INT8 calibration, so {s.calibration_cache} cannot be "
                    f"used: replace {onnx} with a Q/DQ-quantized ONNX model, e.g. from NVIDIA ModelOpt: python -m "
                    "modelopt.onnx.quantization --onnx_path MODEL --quantize_mode int8 --calibration_data DATA.npy)")
    return command
