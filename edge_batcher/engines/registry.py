"""Backends by name, imported lazily so a device without TensorRT or onnxruntime-gpu starts.

model.toml's `backend` is one of the names below, or "package.module:Class" for a backend of
your own that implements engines.base.Engine. Two kinds of model have no engine: services
(SERVICES) and models served by offload peers only (backend "remote", offload/remote_model.py).
"""

from __future__ import annotations

import importlib

from ..config import ModelConfig
from ..errors import ConfigError
from .base import Engine, with_hook_defaults

BACKENDS = {
    "onnxruntime": "edge_batcher.engines.onnxruntime:OnnxRuntimeEngine",
    "tensorrt": "edge_batcher.engines.tensorrt:TensorRTEngine",
}

REMOTE = "remote"  # served by offload peers only: offload/remote_model.py's RemoteModel, no engine


# Services are models that are not one engine: pipelines over other models (RAG) and
# schedulers of their own (iteration-level generation). Built as cls(config, runtime) after
# every engine model is loaded; they implement servable.Servable, as runners do.
SERVICES = {
    "rag": "edge_batcher.rag.pipeline:RagService",
    "generator": "edge_batcher.rag.generate:GenerationService",
}


def is_service(backend: str) -> bool:
    return backend in SERVICES


def service_class(backend: str):
    return _import(SERVICES[backend], backend)


def engine_class(backend: str) -> type[Engine]:
    if backend == REMOTE:
        raise ConfigError(f"backend {REMOTE!r} has no engine on this device: the model runs on offload peers only")
    return _import(BACKENDS.get(backend, backend), backend)


def _import(target: str, backend: str):
    module_name, sep, attr = target.partition(":")
    if not sep:
        raise ConfigError(
            f"unknown backend {backend!r}: expected one of "
            f"{', '.join([*BACKENDS, REMOTE, *SERVICES])} or 'module:Class'"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"backend {backend!r} cannot be imported on this device: {exc}") from exc
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ConfigError(f"backend {backend!r}: {module_name} has no {attr}") from None


def create_engine(config: ModelConfig) -> Engine:
    """An engine instance for `config`, with the optional hooks it does not define defaulted."""
    return with_hook_defaults(engine_class(config.backend)(config))
