"""Input checks of one model: a request's tensors against the model's inputs, before it queues.

`RequestValidator` is built once per model from its input specs and [sequence] settings; on the
event loop it checks each request's names, datatypes, ranks, fixed dimensions, batch dimension
and sequence length, and maps a length to its bucket. That floating-point inputs hold no NaN or
Infinity (unless the model allows them; not for inputs in CUDA shared memory, whose bytes only
the engine's thread reads) is `non_finite`'s answer: checked here per request, or, where the
batch carries the client's tensors as they came, by the worker once per batch (execute.py), off
the loop. Every failure is an InvalidInput naming the input and what the model expects (the
transports answer it as a 400).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ..config import BatchingSettings, SequenceSettings
from ..errors import DeadlineExceeded, InvalidInput
from ..shared_memory.device_tensor import DeviceTensor
from ..types import DATATYPE_TO_NUMPY, InferRequest, TensorSpec


@dataclass(frozen=True, slots=True)
class InputCheck:
    """What one model input requires of a request's tensor."""

    spec: TensorSpec
    dtype: np.dtype[Any]
    rank: int
    seq_axis: int | None  # the sequence axis of a [sequence] input, else None
    fixed: tuple[tuple[int, int], ...]  # (axis, size) that must match exactly


class RequestValidator:
    def __init__(self, model: str, inputs: list[TensorSpec], outputs: list[TensorSpec],
                 sequence: SequenceSettings | None, *, allow_non_finite: bool = False,
                 batching: BatchingSettings | None = None) -> None:
        self.model = model
        self.sequence = sequence
        b = batching or BatchingSettings()
        self._default_priority = b.default_priority
        self._priority_levels = b.priority_levels
        self._batching = b
        self._input_names = [spec.name for spec in inputs]
        self._output_names = [spec.name for spec in outputs]
        self.checks = [self._check_of(spec) for spec in inputs]
        # The inputs that must hold finite numbers: the floating-point ones, unless the model allows any.
        self.finite_inputs: tuple[str, ...] = () if allow_non_finite else tuple(
            check.spec.name for check in self.checks if check.dtype.kind == "f")

    def priority(self, request: InferRequest) -> int:
        """The request's priority level, its model's default when it names none."""
        priority = self._default_priority if request.priority is None else request.priority
        if not 0 <= priority < self._priority_levels:
            raise InvalidInput(
                f"priority {priority} is out of range: model {self.model!r} has levels 0..{self._priority_levels - 1}"
            )
        return priority

    def timeout_s(self, request: InferRequest) -> float:
        """The request's timeout in seconds: its own up to the model's max_timeout_ms, else the default."""
        return timeout_within(request.timeout_s, self._batching)

    def seq_axis(self, name: str) -> int | None:
        seq = self.sequence
        return seq.axis if seq is not None and name in seq.inputs else None

    def _check_of(self, spec: TensorSpec) -> InputCheck:
        seq_axis = self.seq_axis(spec.name)
        fixed = tuple((axis, d) for axis, d in enumerate(spec.shape) if axis > 0 and d != -1 and axis != seq_axis)
        return InputCheck(spec, DATATYPE_TO_NUMPY[spec.datatype], len(spec.shape), seq_axis, fixed)

    def validate(self, request: InferRequest, *, check_length: bool = True,
                 check_finite: bool = True) -> tuple[dict[str, NDArray[Any]], int, int]:
        """(inputs, rows, sequence length) of a valid request; raises InvalidInput otherwise.
        check_length=False leaves the length to be checked after the engine's prepare hook;
        check_finite=False leaves NaN and Infinity to `non_finite`, called later."""
        given = request.inputs
        model = self.model
        if request.outputs is not None:
            for name in request.outputs:
                if name not in self._output_names:
                    raise InvalidInput(
                        f"model {model!r} has no output {name!r}; its outputs are {', '.join(self._output_names)}"
                    )
        rows = None
        seq_len = 0
        inputs = {}
        for check in self.checks:
            spec = check.spec
            name = spec.name
            array = given.get(name)
            if array is None:
                self._check_input_names(given)  # a misspelt name explains a missing input best
                raise InvalidInput(f"missing input {name!r} for model {model!r}")
            dtype = check.dtype
            if array.dtype != dtype and not (dtype.kind == "O" and array.dtype.kind in "OSU"):
                got = "BYTES" if array.dtype.kind in "OSU" else v2_name(array.dtype)
                raise InvalidInput(f"input {name!r}: datatype {got}, model {model!r} expects {spec.datatype}")
            shape = array.shape
            if len(shape) != check.rank:
                raise InvalidInput(
                    f"input {name!r}: shape {list(shape)} has {len(shape)} dimensions, "
                    f"model {model!r} expects {check.rank} like {shape_text(spec.shape)}"
                )
            for axis, want in check.fixed:
                if shape[axis] != want:
                    raise InvalidInput(
                        f"input {name!r}: shape {list(shape)} does not match {shape_text(spec.shape)} "
                        f"(dimension {axis} must be {want})"
                    )
            if rows is None:
                rows = shape[0]
            elif shape[0] != rows:
                raise InvalidInput(
                    f"inputs disagree on the batch dimension: {name!r} has {shape[0]} rows, others {rows}"
                )
            if check.seq_axis is not None:
                length = shape[check.seq_axis]
                if seq_len and length != seq_len:
                    raise InvalidInput(f"sequence inputs disagree on length: {name!r} has {length}, others {seq_len}")
                seq_len = length
            inputs[name] = array
        if len(given) != len(inputs):
            self._check_input_names(given)
        if not rows:
            raise InvalidInput("inputs have 0 rows: nothing to infer")
        if check_length:
            self.check_seq_len(seq_len)
        if check_finite:
            error = self.non_finite(inputs)
            if error is not None:
                raise error
        return inputs, rows, seq_len

    def non_finite(self, inputs: dict[str, Any]) -> InvalidInput | None:
        """The error for a request whose (validated) floating-point inputs hold NaN or Infinity,
        or None. Input-sized work (~2 ms for 16 MB of FP32), and a numpy call costs ~10 us on
        a busy event loop even for 256 values: runner.py has the worker run it per batch."""
        for name in self.finite_inputs:
            array = inputs[name]
            if isinstance(array, DeviceTensor):
                continue
            finite = np.isfinite(array)
            if not finite.all():
                return self._non_finite_error(name, array, finite)
        return None

    def batch_is_finite(self, batch: dict[str, Any]) -> bool:
        """Whether an assembled batch's floating-point inputs are all finite, in one numpy call
        each (the worker's check, execute.py); False also for a batch assembled on a device
        (CUDA shared memory), whose requests' host parts `non_finite` then checks one by one."""
        for name in self.finite_inputs:
            value = batch[name]
            if not isinstance(value, np.ndarray) or not np.isfinite(value).all():
                return False
        return True

    def _non_finite_error(self, name: str, array: NDArray[Any], finite: NDArray[np.bool_]) -> InvalidInput:
        bad = finite.size - int(np.count_nonzero(finite))
        first = [int(i) for i in np.unravel_index(int(np.argmin(finite)), array.shape)]
        largest = np.finfo(array.dtype).max  # a JSON number beyond it was read as Infinity
        return InvalidInput(
            f"input {name!r}: {bad} of {array.size} values are NaN or Infinity (or beyond "
            f"{v2_name(array.dtype)}'s range, +-{largest:.4g}; the first at {first}); "
            f"model {self.model!r} takes finite numbers only (a broken sensor sends these): "
            "allow_non_finite_inputs = true in its model.toml accepts them"
        )

    def _check_input_names(self, given: dict[str, NDArray[Any]]) -> None:
        for given_name in given:
            if given_name not in self._input_names:
                raise InvalidInput(
                    f"model {self.model!r} has no input {given_name!r}; its inputs are {', '.join(self._input_names)}"
                )

    def check_seq_len(self, seq_len: int) -> None:
        if self.sequence is not None:
            longest = self.sequence.buckets[-1]
            if seq_len == 0 or seq_len > longest:
                raise InvalidInput(
                    f"sequence length {seq_len} is outside 1..{longest} (the largest bucket) of model {self.model!r}"
                )

    def bucket(self, seq_len: int) -> int:
        """The length bucket a (checked) sequence length batches in; 0 without [sequence]."""
        if self.sequence is None:
            return 0
        for boundary in self.sequence.buckets:
            if seq_len <= boundary:
                return boundary
        raise AssertionError("check_seq_len rejects lengths beyond the largest bucket")


def timeout_within(timeout_s: float | None, batching: BatchingSettings) -> float:
    """A request's timeout in seconds: its own up to the model's max_timeout_ms, else the model's
    default_timeout_ms; DeadlineExceeded when it has already passed. The one rule for engine
    models, generators and the rag service."""
    timeout = batching.default_timeout_ms / 1000.0 if timeout_s is None else timeout_s
    if timeout <= 0:
        raise DeadlineExceeded(f"request timeout {timeout * 1000:.1f} ms has already passed")
    return min(timeout, batching.max_timeout_ms / 1000.0)


def v2_name(dtype: np.dtype[Any]) -> str:
    for name, d in DATATYPE_TO_NUMPY.items():
        if d == dtype:
            return name
    return str(dtype)


def shape_text(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join("batch" if i == 0 else ("-1" if d < 0 else str(d)) for i, d in enumerate(shape)) + "]"
