"""A model as Triton's tools see it: its one version and its configuration in Triton's shape
(GET /v2/models/{m}[/versions/1]/config, gRPC ModelConfig).

Derived from what the daemon runs on, never kept on its own: model.toml's settings and the
tensors the loaded model declares. Triton's tools read it (perf_analyzer asks for it before its
first request); docs/api.md maps each field to its model.toml key. Dims leave out the batch
dimension, as Triton's do for a model with max_batch_size > 0. Both transports serve this dict:
HTTP as JSON, gRPC parsed into Triton's ModelConfig message, so the two cannot disagree.
"""

from __future__ import annotations

from typing import Any

from ..errors import ModelNotFound
from ..protocol.parameters import triton_priority
from ..runtime import Runtime
from ..servable import Servable

# Every model serves one version, the one its metadata lists (a reload replaces it in place).
MODEL_VERSION = "1"

# v2 tensor datatypes as Triton's model-config data types (BYTES is Triton's TYPE_STRING).
CONFIG_DATA_TYPES = {
    "BOOL": "TYPE_BOOL", "UINT8": "TYPE_UINT8", "UINT16": "TYPE_UINT16", "UINT32": "TYPE_UINT32",
    "UINT64": "TYPE_UINT64", "INT8": "TYPE_INT8", "INT16": "TYPE_INT16", "INT32": "TYPE_INT32",
    "INT64": "TYPE_INT64", "FP16": "TYPE_FP16", "FP32": "TYPE_FP32", "FP64": "TYPE_FP64",
    "BF16": "TYPE_BF16", "BYTES": "TYPE_STRING",
}  # fmt: skip

# edge-batcher backends with a Triton platform of the same meaning; others report only `backend`.
PLATFORMS = {"onnxruntime": "onnxruntime_onnx", "tensorrt": "tensorrt_plan"}

GPU_PROVIDERS = ("CUDAExecutionProvider", "TensorrtExecutionProvider")


def servable_for(runtime: Runtime, model: str, version: str = "") -> Servable:
    """The loaded model `model` at `version` ("" for the model's version): 404 for another
    version, as for an unknown model."""
    servable = runtime.runner(model)
    if version and version != MODEL_VERSION:
        raise ModelNotFound(f"model {model!r} has no version {version!r}; it serves version {MODEL_VERSION}")
    return servable


def model_config(servable: Servable) -> dict[str, Any]:
    """The servable's configuration as Triton's ModelConfig JSON."""
    c = servable.config
    b = c.batching
    max_batch_size = b.max_batch_size or max(b.preferred_batch_sizes)
    levels = b.priority_levels
    return {
        "name": servable.name,
        "platform": PLATFORMS.get(c.backend, ""),
        "backend": c.backend,
        "version_policy": {"latest": {"num_versions": 1}},
        "max_batch_size": max_batch_size,
        "input": [_tensor(spec) for spec in servable.inputs],
        "output": [_tensor(spec) for spec in servable.outputs],
        "dynamic_batching": {
            "preferred_batch_size": list(b.preferred_batch_sizes),
            "max_queue_delay_microseconds": round(b.max_queue_delay_ms * 1000),
            "preserve_ordering": False,
            "priority_levels": levels,
            "default_priority_level": triton_priority(b.default_priority, levels),
            "default_queue_policy": {
                "timeout_action": "REJECT",
                "default_timeout_microseconds": round(b.default_timeout_ms * 1000),
                "allow_timeout_override": True,
                "max_queue_size": b.queue_capacity,
            },
        },
        "instance_group": [{"name": servable.name, "kind": _instance_kind(c), "count": c.instances}],
        # what the engines do, not what model.toml asked: "auto" may have found graphs refused
        "optimization": {"cuda": {"graphs": servable.cuda_graphs}},
        "parameters": {
            key: {"string_value": str(value)}
            for key, value in (("description", c.description), ("labels", ",".join(c.labels)),
                               ("max_timeout_ms", b.max_timeout_ms))
            if value != ""
        },
    }


def _tensor(spec) -> dict[str, Any]:
    dims = list(spec.shape[1:])  # the batch dimension is max_batch_size's
    tensor = {"name": spec.name, "data_type": CONFIG_DATA_TYPES.get(spec.datatype, "TYPE_INVALID"), "dims": dims}
    if not dims:  # one value per row: Triton writes it as dims [1] reshaped to []
        tensor.update(dims=[1], reshape={"shape": []})
    return tensor


def _instance_kind(config) -> str:
    if config.backend == "tensorrt":
        return "KIND_GPU"
    if config.backend == "onnxruntime":
        providers = [p.name for p in config.onnxruntime.execution_providers]
        return "KIND_GPU" if any(p in GPU_PROVIDERS for p in providers) else "KIND_CPU"
    return "KIND_MODEL"  # services and remote models: the device is not theirs to name
