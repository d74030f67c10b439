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
    cls = _import(BACKENDS.get(backend, backend), backend)
    # Only a class implementing the Engine protocol is ever called: "os:system" names a function
    # that would otherwise run with the model's config as its argument.
    missing = [m for m in ENGINE_METHODS if not callable(getattr(cls, m, None))]
    if not isinstance(cls, type) or missing:
        raise ConfigError(
            f"backend {backend!r} is not an engine class: expected a class with "
            f"{', '.join(ENGINE_METHODS)} (engines/base.py:Engine), got {_kind(cls)}"
            + (f" without {', '.join(missing)}" if isinstance(cls, type) else "")
        )
    return cls


ENGINE_METHODS = ("load", "infer", "close")


def _kind(obj: object) -> str:
    if isinstance(obj, type):
        return f"class {obj.__module__}.{obj.__qualname__}"
    return f"{type(obj).__name__} {getattr(obj, '__module__', None) or '?'}.{getattr(obj, '__qualname__', obj)!s}"


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
    try:
        cls = engine_class(config.backend)
    except ConfigError as exc:
        raise ConfigError(f"{config.directory / 'model.toml'}: {exc.message}") from exc
    return with_hook_defaults(cls(config))
