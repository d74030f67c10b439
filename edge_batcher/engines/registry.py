"""Backends by name, imported lazily so a device without TensorRT or onnxruntime-gpu starts.

model.toml's `backend` is one of the names below, or "package.module:Class" for a backend of
your own that implements engines.base.Engine.
"""

from __future__ import annotations

import importlib

from ..config import ModelConfig
from ..errors import ConfigError
from .base import Engine

BACKENDS = {
    "onnxruntime": "edge_batcher.engines.onnxruntime:OnnxRuntimeEngine",
    "tensorrt": "edge_batcher.engines.tensorrt:TensorRTEngine",
}


def engine_class(backend: str) -> type[Engine]:
    target = BACKENDS.get(backend, backend)
    module_name, sep, attr = target.partition(":")
    if not sep:
        raise ConfigError(
            f"unknown backend {backend!r}: expected one of {', '.join(BACKENDS)} or 'module:Class'"
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
    return engine_class(config.backend)(config)
