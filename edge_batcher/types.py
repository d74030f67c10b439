"""Value types shared by every layer: tensor specs, datatypes, requests and responses."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import InvalidInput

# KServe v2 datatype name <-> numpy dtype. BYTES tensors are numpy object arrays of `bytes`.
DATATYPE_TO_NUMPY: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
    "BYTES": np.dtype(np.object_),
}
NUMPY_TO_DATATYPE: dict[np.dtype, str] = {v: k for k, v in DATATYPE_TO_NUMPY.items()}


def numpy_dtype(datatype: str) -> np.dtype:
    try:
        return DATATYPE_TO_NUMPY[datatype]
    except KeyError:
        raise InvalidInput(
            f"unknown datatype {datatype!r}; expected one of {', '.join(DATATYPE_TO_NUMPY)}"
        ) from None


def datatype_of(array: np.ndarray) -> str:
    """The v2 datatype name of a numpy array (str/bytes arrays count as BYTES)."""
    return datatype_of_dtype(array.dtype)


def datatype_of_dtype(dtype: np.dtype) -> str:
    """The v2 datatype name of a numpy dtype (str/bytes count as BYTES)."""
    if dtype.kind in ("O", "S", "U"):
        return "BYTES"
    try:
        return NUMPY_TO_DATATYPE[dtype]
    except KeyError:
        raise InvalidInput(f"numpy dtype {dtype} has no KServe v2 datatype") from None


@dataclass(frozen=True)
class TensorSpec:
    """Name, v2 datatype and shape of a model input or output; -1 marks a dynamic dimension.

    shape includes the batch dimension first for batched models.
    """

    name: str
    datatype: str
    shape: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "datatype": self.datatype, "shape": list(self.shape)}


@dataclass
class InferRequest:
    """One inference request as the core sees it, whatever transport it came from.

    inputs hold one request's tensors *with* the batch dimension (usually 1, may be more:
    a request of n rows takes n slots of a batch).
    """

    model: str
    inputs: dict[str, np.ndarray]
    id: str | None = None
    priority: int | None = None  # None: the model's default priority
    timeout_s: float | None = None  # None: the model's default timeout
    outputs: list[str] | None = None  # None: every output
    parameters: dict[str, Any] = field(default_factory=dict)
    # Called on the engine's worker thread with this request's outputs once its batch has run,
    # before the answer goes to the event loop: writes outputs into device memory where the
    # device's work already happens (shared_memory/lease.py: DeviceOutputs). An error it raises
    # answers this request alone. Not called when a peer runs the request.
    finish_outputs: Callable[[dict[str, np.ndarray]], None] | None = None


@dataclass
class InferResponse:
    model: str
    id: str | None
    outputs: dict[str, np.ndarray]
    parameters: dict[str, Any] = field(default_factory=dict)
