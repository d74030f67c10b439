"""Sensor streams over MQTT: a [[mqtt.streams]] mapping compiled against its model into a
StreamRoute, which names the output topic of a source topic, decodes a plain payload (a JSON
number array, or raw little-endian rows) into the model's input, and encodes the result as JSON
(strict: an output holding NaN or Infinity is a 500 naming it, never a bare NaN). Pure functions
of the payload; the transport runs them on the event loop."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...config import StreamMapping
from ...errors import ConfigError, EdgeBatcherError, EngineError, InvalidInput
from ...protocol.tensor_encode import non_finite_count
from ...runtime import Runtime
from ...types import DATATYPE_TO_NUMPY, TensorSpec


@dataclass
class StreamRoute:
    """One [[mqtt.streams]] mapping, checked against the loaded model."""

    filter: str
    levels: list[str]
    model: str
    input: TensorSpec
    encoding: str
    output_template: str  # "" : <prefix>/streams/<model>/<source topic>
    labels: list[str]

    def wildcards(self, topic: str) -> list[str]:
        """The topic levels that the filter's '+' / '#' matched, in order ({1}, {2}, ...)."""
        parts = topic.split("/")
        out = []
        for i, level in enumerate(self.levels):
            if level == "+":
                out.append(parts[i])
            elif level == "#":
                out.append("/".join(parts[i:]))
                break
        return out

    def output_topic(self, topic: str, prefix: str) -> str:
        if not self.output_template:
            return f"{prefix}/streams/{self.model}/{topic}"
        return self.output_template.format("", *self.wildcards(topic))

    def result(self, topic: str, outputs: dict[str, np.ndarray], single: bool) -> bytes:
        """The JSON published on the output topic: the model's outputs (without the batch
        dimension for a one-row message) and class names where the stream has labels."""
        for name, out in outputs.items():
            bad = non_finite_count(out)
            if bad:
                raise EngineError(f"model {self.model!r}: output {name!r} holds {bad} NaN or Infinity values, "
                                  "which a JSON result cannot carry")
        if single:
            outputs = {name: out[0] for name, out in outputs.items()}
        result: dict[str, Any] = {
            "topic": topic,
            "model": self.model,
            "outputs": {name: _jsonable(out) for name, out in outputs.items()},
        }
        labels = _labels(outputs, self.labels)
        if labels:
            result["labels"] = labels
        return json.dumps(result, separators=(",", ":"), allow_nan=False).encode()

    def decode(self, payload: bytes, where: str) -> tuple[np.ndarray, bool]:
        """The payload as the input tensor with a batch dimension; True when it was one row
        (its outputs are then sent without the batch dimension)."""
        if not payload:
            raise InvalidInput(f"{where}: empty payload")
        if self.encoding == "raw":
            return self._decode_raw(payload, where)
        return self._decode_json(payload, where)

    def _decode_raw(self, payload: bytes, where: str) -> tuple[np.ndarray, bool]:
        spec = self.input
        dtype = DATATYPE_TO_NUMPY[spec.datatype]
        row_shape = list(spec.shape[1:])
        row_bytes = int(np.prod(row_shape, dtype=np.int64)) * dtype.itemsize
        if len(payload) % row_bytes:
            raise InvalidInput(
                f"{where}: raw payload of {len(payload)} bytes is not a whole number of rows: input "
                f"{spec.name!r} takes {row_shape} {spec.datatype} per row ({row_bytes} bytes, little-endian)"
            )
        rows = len(payload) // row_bytes
        if spec.datatype == "BOOL":
            array = np.frombuffer(payload, dtype=np.uint8) != 0
        else:  # a read-only view of the payload on little-endian hosts; a copy elsewhere
            array = np.frombuffer(payload, dtype=dtype.newbyteorder("<")).astype(dtype, copy=False)
        return array.reshape([rows, *row_shape]), rows == 1

    def _decode_json(self, payload: bytes, where: str) -> tuple[np.ndarray, bool]:
        spec = self.input
        try:
            data = json.loads(payload)
        except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError
            raise InvalidInput(f"{where}: payload is not JSON ({exc}); expected a JSON array of numbers") from None
        if not isinstance(data, list) or not data:
            raise InvalidInput(
                f"{where}: expected a JSON array of numbers (one row) or an array of rows, got {type(data).__name__}"
            )
        try:
            array = np.asarray(data)
        except (ValueError, TypeError, RecursionError):
            raise InvalidInput(f"{where}: rows have different lengths") from None
        if array.dtype.kind not in "iuf":  # bools, strings, objects, nulls
            raise InvalidInput(f"{where}: expected numbers, got {_json_kind(array)}")
        feature_rank = len(spec.shape) - 1
        if array.ndim == feature_rank:
            array, single = array[np.newaxis], True
        elif array.ndim == feature_rank + 1:
            single = False
        else:
            raise InvalidInput(
                f"{where}: array of shape {list(array.shape)} does not fit input {spec.name!r} of shape "
                f"{list(spec.shape)}: send one row of {list(spec.shape[1:])} or a list of such rows"
            )
        return _cast(array, spec, where), single


def _json_kind(array: np.ndarray) -> str:
    return {"b": "true/false", "U": "strings"}.get(array.dtype.kind, "non-numbers (null, objects or mixed values)")


def _cast(array: np.ndarray, spec: TensorSpec, where: str) -> np.ndarray:
    target = DATATYPE_TO_NUMPY[spec.datatype]
    if target.kind == "f":
        return array.astype(target)
    if target.kind == "b":
        if array.dtype.kind in "iu" and bool(np.all((array == 0) | (array == 1))):
            return array != 0
        raise InvalidInput(f"{where}: input {spec.name!r} is BOOL: send 0 or 1")
    if target.kind in "iu":
        if array.dtype.kind == "f" and not bool(np.all(np.isfinite(array) & (array == np.floor(array)))):
            raise InvalidInput(f"{where}: input {spec.name!r} is {spec.datatype}: send integers")
        info = np.iinfo(target)
        if array.size and (array.min() < info.min or array.max() > info.max):
            raise InvalidInput(f"{where}: values out of range [{info.min}, {info.max}] for {spec.datatype}")
        return array.astype(target)
    raise InvalidInput(f"{where}: input {spec.name!r} of datatype {spec.datatype} cannot be fed from a stream")


def _jsonable(array: np.ndarray) -> Any:
    if array.dtype.kind == "O":
        flat = [v.decode("utf-8", "replace") if isinstance(v, bytes) else v for v in array.reshape(-1).tolist()]
        return np.array(flat, dtype=object).reshape(array.shape).tolist()
    return array.tolist()


def compile_stream(m: StreamMapping, runtime: Runtime, where: str) -> StreamRoute:
    """A [[mqtt.streams]] mapping checked against its loaded model (ConfigError naming the key)."""
    try:
        runner = runtime.runner(m.model)
    except EdgeBatcherError as exc:
        raise ConfigError(f"{where} model: {exc.message}") from None
    specs = {spec.name: spec for spec in runner.inputs}
    if m.input and m.input not in specs:
        raise ConfigError(
            f"{where} input: model {m.model!r} has no input {m.input!r}; its inputs are {', '.join(specs)}"
        )
    if len(specs) != 1:  # every input is required, and a stream message fills exactly one
        raise ConfigError(f"{where} model: a stream fills one input, but {m.model!r} needs {', '.join(specs)}")
    (spec,) = specs.values()
    if spec.datatype == "BYTES":
        raise ConfigError(f"{where} model: input {spec.name!r} is BYTES; streams carry numbers")
    if m.encoding == "raw" and any(d < 0 for d in spec.shape[1:]):
        raise ConfigError(
            f"{where} encoding: raw needs a fixed row shape, but input {spec.name!r} is {list(spec.shape)}; use json"
        )
    labels = list(runner.config.labels)
    return StreamRoute(m.topic, m.topic.split("/"), m.model, spec, m.encoding, m.output_topic, labels)


def _labels(outputs: dict[str, np.ndarray], labels: list[str]) -> dict[str, Any]:
    """Class names for integer outputs holding one class index per row (argmax-style class_id)."""
    if not labels:
        return {}
    named: dict[str, Any] = {}
    for name, out in outputs.items():
        if out.dtype.kind not in "iu" or out.ndim > 1 or out.size == 0:
            continue
        if out.min() < 0 or out.max() >= len(labels):
            continue
        named[name] = labels[int(out)] if out.ndim == 0 else [labels[int(i)] for i in out]
    return named
