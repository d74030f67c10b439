"""ONNX Runtime backend with a configurable execution-provider chain.

The chain in model.toml is tried in order (e.g. TensorrtExecutionProvider, CUDAExecutionProvider,
then CPUExecutionProvider); providers this onnxruntime build does not have are skipped with a
warning, so one model.toml serves a Jetson with onnxruntime-gpu and a laptop with plain
onnxruntime. CPU is always appended last as ONNX Runtime's own fallback.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

import numpy as np

from ..config import ModelConfig
from ..errors import ConfigError, EngineError, OutOfMemory
from ..types import TensorSpec
from .base import DEVICE_PROVIDERS, BuffersHook, DeviceArray, Engine, HostBuffersHook, apply_overrides
from .cuda_api import load_cuda_api
from .onnx_file import onnx_file_problem
from .ort_graphs import BoundSession, PinnedStaging, graph_ids_missing, outside_graphs

log = logging.getLogger(__name__)

# onnxruntime type strings -> v2 datatypes
_ORT_TYPES = {
    "tensor(bool)": "BOOL", "tensor(uint8)": "UINT8", "tensor(uint16)": "UINT16",
    "tensor(uint32)": "UINT32", "tensor(uint64)": "UINT64", "tensor(int8)": "INT8",
    "tensor(int16)": "INT16", "tensor(int32)": "INT32", "tensor(int64)": "INT64",
    "tensor(float16)": "FP16", "tensor(float)": "FP32", "tensor(double)": "FP64",
    "tensor(string)": "BYTES",
}  # fmt: skip

_OPT_LEVELS = {"disable": "ORT_DISABLE_ALL", "basic": "ORT_ENABLE_BASIC",
               "extended": "ORT_ENABLE_EXTENDED", "all": "ORT_ENABLE_ALL"}  # fmt: skip

# Distributions that all install the one `onnxruntime` import package; PyPI's CPU build is a
# dependency of edge-batcher, the others are what a device adds (NVIDIA's JetPack wheel is
# onnxruntime-gpu).
ACCELERATED_BUILDS = ("onnxruntime-gpu", "onnxruntime-openvino", "onnxruntime-directml", "onnxruntime-qnn")


def shadowed_build() -> tuple[str, Path] | None:
    """(name, site directory) of an accelerated onnxruntime build installed next to PyPI's CPU
    `onnxruntime`, or None. Both write the same files and the one installed last wins, so
    pip installing edge-batcher after NVIDIA's onnxruntime-gpu silently replaces the GPU
    build (or, in another site directory, shadows it). The fix: uninstall `onnxruntime`."""
    from importlib import metadata

    try:
        metadata.distribution("onnxruntime")
    except metadata.PackageNotFoundError:
        return None
    for name in ACCELERATED_BUILDS:
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        return name, Path(str(dist.locate_file("")))
    return None


def provider_options(provider: str, options: dict, device_memory_limit: int | None) -> dict[str, str]:
    """model.toml's options for one execution provider, as strings. The CUDA EP's arena is set
    explicitly unless model.toml says otherwise: it grows by what is requested, not to the next
    power of two, so device memory measured at warm-up is what batches need (docs/memory.md),
    and never past `device_memory_limit`, so overgrowing fails as out-of-memory."""
    result = {k: str(v) for k, v in options.items()}
    if provider == "CUDAExecutionProvider":
        result.setdefault("arena_extend_strategy", "kSameAsRequested")
        if device_memory_limit is not None:
            result.setdefault("gpu_mem_limit", str(int(device_memory_limit)))
    return result


def without_graphs(chain: list[tuple[str, dict]], one_shape: bool = False) -> list[tuple[str, dict]]:
    """The provider chain for a session that runs without CUDA graphs. The CUDA EP then searches
    cuDNN's convolution algorithms heuristically unless model.toml says otherwise, or the model
    only ever runs `one_shape`: its `Conv` keeps the plan of the last input shape only, so every
    change of batch size plans again, and ONNX Runtime's default exhaustive search times every
    algorithm each time (vision on an H200, sizes alternating: 21-34 ms a batch exhaustive,
    3.9-5.7 heuristic; one size repeated: 0.30-1.24 and 0.74-1.56 ms, so the heuristic wins once
    more than ~1% of batches change size; docs/benchmarks.md, "Batch sizes that alternate").
    Inside a graph the plan is made once per shape at warm-up: the exhaustive search stays."""
    result = []
    for name, options in chain:
        options = {k: v for k, v in options.items() if k != "enable_cuda_graph"}
        if name == "CUDAExecutionProvider" and not one_shape:
            options.setdefault("cudnn_conv_algo_search", "HEURISTIC")
        result.append((name, options))
    return result


def uses_memory_pattern(providers: list[str]) -> bool:
    """Whether a session on these providers keeps ONNX Runtime's memory pattern (on by default).
    Off with the CUDA EP: the pattern, planned on a shape's first run, is allocated as one more
    block from the second run on, and an arena never gives memory back, so it held twice the
    memory for nothing (encoder at 64 x 128 on an H200: 434 MiB held with it, 248 without, and
    1.73 vs 1.53 ms a batch; docs/memory.md, "Device memory")."""
    return "CUDAExecutionProvider" not in providers


@functools.cache
def set_up_runtime() -> None:
    """Import ONNX Runtime and open one session of a model it ships (mul_1.onnx), once per
    process: importing it (~35 MiB resident here) and its first session's one-time setup (its
    environment and kernel registries: +10.5 MiB, against +0.7 for each session after) happen
    here, before a model's load is measured, and not in the first model's figure (which the
    budget would give back, and the process keep, when that model is unloaded: vibration
    loaded first measured 11.5 MiB, 1.4 after another model). Blocking."""
    import onnxruntime as ort

    try:
        from onnxruntime.datasets import get_example

        ort.InferenceSession(get_example("mul_1.onnx"), providers=["CPUExecutionProvider"])
    except Exception as exc:  # noqa: BLE001 - a build without its examples: the first model carries it
        log.debug("onnxruntime's one-time setup before the first model: %s", exc)


class OnnxRuntimeEngine(Engine):
    def __init__(self, config: ModelConfig):
        set_up_runtime()  # before the load: ONNX Runtime's own memory is not the model's

        self.config = config
        self.session: Any = None  # an onnxruntime.InferenceSession once loaded
        self.cpu_arena = True  # ONNX Runtime's CPU memory arena (its default)
        self.providers: list[str] = []
        self.inputs: list[TensorSpec] = []
        self.outputs: list[TensorSpec] = []
        # The CUDA EP's arena cap in bytes; set from the memory budget before load() (memory/device.py).
        self.device_memory_limit: int | None = None
        self.bound: BoundSession | None = None  # CUDA graphs per batch shape (ort_graphs.py), when in use
        self.staging: PinnedStaging | None = None  # the bound shapes' page-locked host batches
        self.device_inputs: int | None = None  # the CUDA EP's device once loaded on it (base.py)
        self._chain: list[tuple[str, dict]] = []  # the providers and their options, as opened

    @property
    def cuda_graphs(self) -> bool:
        return self.bound is not None

    @property
    def device_batch_buffers(self) -> BuffersHook | None:
        return self.bound.buffers_for if self.bound is not None else None

    @property
    def host_batch_buffers(self) -> HostBuffersHook | None:
        return self.bound.host_buffers_for if self.bound is not None and self.bound.staging is not None else None

    @property
    def _one_shape(self) -> bool:
        """Whether every batch has the same shape: one preferred size, no sequence buckets."""
        return len(self.config.batching.preferred_batch_sizes) == 1 and self.config.sequence is None

    def load(self) -> None:
        import onnxruntime as ort  # lazily: importing it costs time and memory

        settings = self.config.onnxruntime
        path = self.config.model_path
        if not path.exists():
            raise ConfigError(f"model {self.config.name!r}: model file {path} not found")
        available = set(ort.get_available_providers())
        chain: list[tuple[str, dict]] = []
        for ep in settings.execution_providers:
            if ep.name in available:
                chain.append((ep.name, provider_options(ep.name, ep.options, self.device_memory_limit)))
            else:
                shadowed = shadowed_build()
                hint = (f"; {shadowed[0]} is installed too (in {shadowed[1]}) but the CPU build "
                        "`onnxruntime` is in effect: pip uninstall onnxruntime, then reinstall "
                        f"{shadowed[0]} if it shared that directory") if shadowed else ""
                log.warning(
                    "model %s: execution provider %s is not in this onnxruntime build (%s); skipping it%s",
                    self.config.name, ep.name, ", ".join(sorted(available)), hint,
                )
        if not any(name == "CPUExecutionProvider" for name, _ in chain):
            chain.append(("CPUExecutionProvider", {}))
        graphs = settings.cuda_graphs != "off" and chain[0][0] == "CUDAExecutionProvider"
        if graphs:
            chain[0] = (chain[0][0], {**chain[0][1], "enable_cuda_graph": "1"})
        self._chain = chain if graphs else without_graphs(chain, self._one_shape)
        too_old = graph_ids_missing(ort.__version__) if graphs else None
        if too_old:
            graphs = False
            self._graphs_refused(too_old)
        try:
            self._open_session(ort, path, self._chain)
        except ConfigError as exc:
            if not graphs or "graph capture" not in str(exc).lower():  # ONNX Runtime's words for a refusal
                raise
            graphs = False
            self._open_session(ort, path, self._graphs_refused(f"ONNX Runtime cannot capture it: {exc}", exc))
        if self.providers[0] == "CUDAExecutionProvider":  # its device: the EP's device_id option (default 0)
            self.device_inputs = int(dict(self._chain)["CUDAExecutionProvider"].get("device_id", 0))
            if graphs:
                self.staging = self._pinned_staging(self.device_inputs) if settings.pinned_inputs else None
                self.bound = BoundSession(self.session, "cuda", graphs=True, staging=self.staging)
        self.inputs = apply_overrides(
            [_spec(i) for i in self.session.get_inputs()], self.config.inputs, "input", self.config.name
        )
        self.outputs = apply_overrides(
            [_spec(o) for o in self.session.get_outputs()], self.config.outputs, "output", self.config.name
        )
        # Only the CPU takes batches padded to their longest member. On a device every shape is a
        # bucket's, warmed up and measured: a new length could grow the CUDA arena or load other
        # kernels past the memory plan (docs/memory.md), and the TensorRT EP builds an engine per
        # new shape.
        self.accepts_any_length = (self.providers[0] not in DEVICE_PROVIDERS
                                   and _sequence_dim_is_dynamic(self.session.get_inputs(), self.config.sequence))
        log.info("model %s: onnxruntime session on %s%s%s", self.config.name, ", ".join(self.providers),
                 " with CUDA graphs per batch shape" if self.bound else "",
                 " and page-locked input staging" if self.bound and self.staging else "")

    def _pinned_staging(self, device_id: int) -> PinnedStaging | None:
        """Page-locked host arrays for the bound shapes' host batches, or None without a CUDA
        Python binding (then ONNX Runtime copies them from pageable memory, as before)."""
        try:
            api = load_cuda_api()
            api.init()
            return PinnedStaging(api, device_id)
        except Exception as exc:  # ImportError, CudaError, or pycuda's own errors
            log.info("model %s: host batches reach the device from pageable memory (no page-locked "
                     "staging: %s)", self.config.name, exc)
            return None

    def _open_session(self, ort: Any, path: Path, chain: list[tuple[str, dict]]) -> None:
        settings = self.config.onnxruntime
        options = ort.SessionOptions()
        options.enable_mem_pattern = uses_memory_pattern([name for name, _ in chain])
        options.enable_cpu_mem_arena = self.cpu_arena
        options.intra_op_num_threads = settings.intra_op_threads
        options.inter_op_num_threads = settings.inter_op_threads
        spinning = "1" if settings.allow_spinning else "0"
        options.add_session_config_entry("session.intra_op.allow_spinning", spinning)
        options.add_session_config_entry("session.inter_op.allow_spinning", spinning)
        options.graph_optimization_level = getattr(
            ort.GraphOptimizationLevel, _OPT_LEVELS[settings.graph_optimization_level]
        )
        try:
            self.session = ort.InferenceSession(
                str(path),
                sess_options=options,
                providers=[name for name, _ in chain],
                provider_options=[opts for _, opts in chain],
            )
        except Exception as exc:  # onnxruntime raises its own exception types
            why = _file_problem(path)  # "Protobuf parsing failed" says less than what is wrong with the file
            raise ConfigError(f"model {self.config.name!r}: onnxruntime cannot load {path}: {exc}"
                              + (f" (the file is not a whole ONNX model: {why})" if why else "")) from exc
        self.providers = self.session.get_providers()

    def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        assert self.session is not None, "infer() before load()"
        try:
            on_device = any(isinstance(value, DeviceArray) for value in inputs.values())
            if on_device and (self.bound is None or not self.bound.knows(inputs)):
                values = self._run_device_inputs(inputs)
            elif self.bound is not None:  # a device batch too: in (or copied into) the shape's buffers
                try:
                    values = self.bound.run(inputs)
                except Exception as exc:
                    if "graph capture" not in str(exc).lower():  # ONNX Runtime's words for a refusal
                        raise
                    values = self._without_graphs(exc, inputs)
            else:
                values = self.session.run(None, inputs)
        except (ConfigError, EngineError):
            raise
        except Exception as exc:
            raise self._failure(exc) from exc
        return {spec.name: value for spec, value in zip(self.outputs, values)}

    def reopen_without_cpu_arena(self) -> None:
        """Open the loaded model's session again with ONNX Runtime's CPU arena off. Blocking."""
        import onnxruntime as ort

        self.cpu_arena = False
        self.session = None
        self._open_session(ort, self.config.model_path, self._chain)

    def run_binding(self, binding: Any) -> None:
        """Run with inputs and outputs the caller bound (session.io_binding()): the decoder's
        KV cache bound in place as both past and present. Errors as infer()'s."""
        assert self.session is not None, "run_binding() before load()"
        try:
            self.session.run_with_iobinding(binding)
        except Exception as exc:
            raise self._failure(exc) from exc

    def _failure(self, exc: Exception) -> EngineError:
        text = str(exc)
        if "out of memory" in text.lower() or "failed to allocate" in text.lower():
            return OutOfMemory(f"model {self.config.name!r}: out of memory: {text}")
        return EngineError(f"model {self.config.name!r}: onnxruntime failed: {text}")

    def _run_device_inputs(self, inputs: dict[str, Any]) -> list[np.ndarray]:
        """One run with the device batches bound where they are (IOBinding, no copy) and the
        others from the host; outputs come back to the host, where the batch is cut per request.
        Only without CUDA graphs, or for a shape warm-up did not bind: with graphs a device batch
        is assembled in (or copied into) its shape's buffers and replays the graph (BoundShape.run,
        Engine.device_batch_buffers). Outside a graph every change of batch size makes ONNX
        Runtime's CUDA Conv plan again: 21 ms a batch on the vision model on an H200 with the
        exhaustive search, 3.9 ms with the heuristic one sessions without graphs now default to
        (without_graphs), against 0.2 ms a batch in a graph (docs/benchmarks.md, "Batch sizes
        that alternate")."""
        binding = self.session.io_binding()
        for name, value in inputs.items():
            if isinstance(value, DeviceArray):
                # element_type as ONNX Runtime's examples give it: the numpy scalar type (np.float32)
                binding.bind_input(name, "cuda", value.device_id, value.dtype.type, list(value.shape), value.ptr)
            else:
                binding.bind_cpu_input(name, np.ascontiguousarray(value))
        for spec in self.outputs:
            binding.bind_output(spec.name, "cpu")
        self.session.run_with_iobinding(binding, outside_graphs())
        return list(binding.copy_outputs_to_cpu())

    def infer_without_graphs(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """A plain session.run, no bound buffers or graph: the reference `edge-batcher bench`
        measures graphs against (the same session, so the same kernels and memory)."""
        assert self.session is not None, "infer() before load()"
        values = self.session.run(None, inputs, outside_graphs())
        return {spec.name: value for spec, value in zip(self.outputs, values)}

    def _without_graphs(self, exc: Exception, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
        """ONNX Runtime refused to capture this model on its first batch: the session is opened
        again without graphs (or the refusal is an error, see _graphs_refused)."""
        import onnxruntime as ort

        self._open_session(ort, self.config.model_path,
                           self._graphs_refused(f"ONNX Runtime cannot capture it: {exc}", exc))
        return self.session.run(None, inputs)

    def _graphs_refused(self, why: str, cause: Exception | None = None) -> list[tuple[str, dict]]:
        """No CUDA graphs for this model, for `why`: an onnxruntime too old for one graph per shape,
        or ONNX Runtime refusing to capture it (a node off the device, a control-flow node, a
        dynamic shape) at session creation or at the first batch. With cuda_graphs = "on" that is
        the model's configuration error; with "auto" the providers without graphs are returned
        (and kept for any reopening), and the log says why."""
        if self.config.onnxruntime.cuda_graphs == "on":
            raise ConfigError(f"model {self.config.name!r}: [onnxruntime] cuda_graphs = \"on\" but {why}") from cause
        log.warning("model %s: no CUDA graphs (%s); serving without them "
                    "([onnxruntime] cuda_graphs = \"off\" skips the attempt)", self.config.name, why)
        self.bound = None  # its staging is freed by close(): the batch being refused may be in it
        self._chain = without_graphs(self._chain, self._one_shape)
        return self._chain

    def close(self) -> None:
        self.session = None
        self.bound = None
        if self.staging is not None:
            self.staging.close()
            self.staging = None


def _sequence_dim_is_dynamic(nodes, sequence) -> bool:
    """Whether every [sequence] input has a symbolic or unknown length in the model file: then
    ONNX Runtime runs any width and a batch need only be padded to its longest member."""
    if sequence is None:
        return False
    shapes = {node.name: node.shape for node in nodes}
    for name in sequence.inputs:
        shape = shapes.get(name)
        if shape is None or len(shape) <= sequence.axis:
            return False
        dim = shape[sequence.axis]
        if isinstance(dim, int) and dim >= 0:
            return False
    return True


def _spec(node) -> TensorSpec:
    datatype = _ORT_TYPES.get(node.type)
    if datatype is None:
        raise ConfigError(f"tensor {node.name!r} has type {node.type}, which the v2 protocol cannot carry")
    shape = tuple(d if isinstance(d, int) and d >= 0 else -1 for d in node.shape)
    return TensorSpec(node.name, datatype, shape)


def _file_problem(path: Path) -> str | None:
    try:
        return onnx_file_problem(path)
    except OSError:
        return None
