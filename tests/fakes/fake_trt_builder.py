"""The fake TensorRT builder: IBuilder, IBuilderConfig, INetworkDefinition and the ONNX parser.

build_serialized_network checks profiles against the network's inputs, decides precision as
TensorRT 10.x (weak typing, builder flags) or 11.x (strongly typed: the ONNX model's own FP16
tensors or Q/DQ nodes) would, drives an IProgressMonitor, fills the timing cache, and writes a
fake plan: JSON with the ONNX model, the profiles and synthetic activation sizes, which
fake_trt_runtime.py deserializes.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from tests.fakes.fake_trt_types import (
    FAKE_PLAN_MAGIC,
    ONNX_TO_TRT,
    REMOVED_IN_11,
    TRT_TO_NUMPY,
    BuilderFlag,
    DataType,
    DeviceType,
    Generational,
    IInt8Calibrator,
    ILogger,
    IProgressMonitor,
    MemoryPoolType,
    Severity,
    check_logger,
    log_to,
)  # fmt: skip

if TYPE_CHECKING:
    from tests.fakes.fake_tensorrt import FakeTensorRT


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

    def combine(self, input_cache: _TimingCache, ignore_mismatch: bool) -> bool:
        self.entries = sorted(set(self.entries) | set(input_cache.entries))
        return True


class _BuilderConfig(Generational):
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


class FakeOnnxParser:
    _trt: FakeTensorRT

    def __init__(self, network: _Network, logger: ILogger):
        check_logger(logger)
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
                dtype = ONNX_TO_TRT.get(tt.elem_type)
                if dtype is None:
                    self._errors.append(_ParserError(
                        f"FakeTensorRT OnnxParser: {v.name}: unsupported element type {tt.elem_type}"))
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


class FakeBuilder(Generational):
    _trt: FakeTensorRT
    _removed = REMOVED_IN_11["IBuilder"]

    def __init__(self, logger: ILogger):
        check_logger(logger)
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
        log_to(self.logger, Severity.ERROR, f"FakeTensorRT IBuilder::buildSerializedNetwork: {msg}")
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
                        return self._error(
                            f"profile {index}: {t.name!r} min {lo} opt {opt} max {hi} is invalid for {t.shape}")
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
                log_to(self.logger, Severity.WARNING, "FakeTensorRT: no DLA available, all layers fall back to the GPU")
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
            elems = sum(math.prod(ranges[name][2]) * np.dtype(TRT_TO_NUMPY[by_name[name].dtype]).itemsize
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
