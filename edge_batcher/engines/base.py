"""The engine interface every backend implements.

An engine is one loaded instance of a model (one ONNX Runtime session, one TensorRT execution
context). It is created with its settings, loaded once, then `infer` is called from exactly one
dedicated worker thread with whole batches (batch dimension first, already padded to one of
the preferred sizes). It never sees the event loop.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np

from ..config import ModelConfig
from ..types import TensorSpec


@runtime_checkable
class Engine(Protocol):
    inputs: list[TensorSpec]  # after load(): names, datatypes, shapes (-1 = dynamic)
    outputs: list[TensorSpec]

    def __init__(self, config: ModelConfig) -> None: ...

    def load(self) -> None:
        """Load the model (blocking, may take long: called off the event loop)."""

    def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run one batch; every output has the batch dimension first."""

    def close(self) -> None:
        """Release the model's memory."""


def apply_overrides(specs: list[TensorSpec], overrides, kind: str, model: str) -> list[TensorSpec]:
    """Narrow specs read from the model file with model.toml's [[inputs]]/[[outputs]] entries."""
    from ..errors import ConfigError

    by_name = {s.name: s for s in specs}
    for o in overrides:
        if o.name not in by_name:
            raise ConfigError(
                f"model {model!r}: model.toml names {kind} {o.name!r}, but the model's {kind}s are "
                f"{', '.join(by_name)}"
            )
        spec = by_name[o.name]
        datatype, shape = spec.datatype, spec.shape
        if o.datatype:
            if o.datatype != spec.datatype:
                raise ConfigError(
                    f"model {model!r}: {kind} {o.name!r} is {spec.datatype} in the model file, "
                    f"model.toml says {o.datatype}"
                )
        if o.shape:
            if len(o.shape) != len(spec.shape) or any(
                m != -1 and m != n for m, n in zip(spec.shape, o.shape)
            ):
                raise ConfigError(
                    f"model {model!r}: {kind} {o.name!r} shape {list(o.shape)} in model.toml does not "
                    f"narrow the model's shape {list(spec.shape)}"
                )
            shape = tuple(o.shape)
        by_name[o.name] = TensorSpec(o.name, datatype, shape)
    return [by_name[s.name] for s in specs]
