"""A model that runs only on offload peers: nothing of it is loaded on this device.

For a model too big for the device (an LLM on a 4 GB Jetson) that a nearby edge server serves:
`backend = "remote"` in its model.toml, and no model file. With no file to read them from, its
inputs and outputs are declared in model.toml (`[[inputs]]` / `[[outputs]]`, each with
`datatype` and the whole `shape`, batch dimension first, -1 for a dynamic dimension). The daemon
checks requests against them, queues and batches them as for any model, and sends every batch
to a peer (`[offload]`, docs/offload.md); the runtime refuses to start such a model without
offload peers, and its runner never calls `infer`.
"""

from __future__ import annotations

import numpy as np

from ..config import ModelConfig, TensorOverride
from ..errors import ConfigError, EngineError
from ..types import DATATYPE_TO_NUMPY, TensorSpec
from .base import Engine


class RemoteEngine(Engine):
    runs_locally = False  # the runner starts no worker, warms nothing up, plans only peer batches

    def __init__(self, config: ModelConfig) -> None:
        self.config = config
        self.inputs: list[TensorSpec] = []
        self.outputs: list[TensorSpec] = []

    def load(self) -> None:
        where = f"{self.config.directory / 'model.toml'}"
        self.inputs = _declared(self.config.inputs, "inputs", where)
        self.outputs = _declared(self.config.outputs, "outputs", where)

    def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        raise EngineError(f"model {self.config.name!r} runs on offload peers only; it has no engine on this device")

    def close(self) -> None:
        pass


def _declared(entries: list[TensorOverride], table: str, where: str) -> list[TensorSpec]:
    if not entries:
        raise ConfigError(
            f"{where}: backend \"remote\" has no model file to read {table} from: declare each one as "
            f"[[{table}]] with name, datatype and shape (batch dimension first, -1 for dynamic)"
        )
    specs = []
    for entry in entries:
        if entry.datatype not in DATATYPE_TO_NUMPY:
            raise ConfigError(
                f"{where}: [[{table}]] {entry.name!r}: datatype: expected one of "
                f"{', '.join(DATATYPE_TO_NUMPY)}, got {entry.datatype!r}"
            )
        if not entry.shape or any(d == 0 or d < -1 for d in entry.shape):
            raise ConfigError(
                f"{where}: [[{table}]] {entry.name!r}: shape: expected the whole shape, batch dimension "
                f"first, with positive sizes or -1 for dynamic (e.g. [-1, 256]), got {entry.shape}"
            )
        specs.append(TensorSpec(entry.name, entry.datatype, tuple(entry.shape)))
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ConfigError(f"{where}: [[{table}]] names a tensor twice: {names}")
    return specs
