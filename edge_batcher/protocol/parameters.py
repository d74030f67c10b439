"""KServe v2 request parameters -> the core's InferRequest, the same for every transport.

HTTP `/infer`, Triton's generate extension and MQTT requests all carry `parameters`; the two the
core reads are `priority` (an integer) and a deadline, given as `timeout_ms` or, as Triton's
clients send it, `timeout` in microseconds. A malformed value is the client's mistake and raises
InvalidInput naming the parameter (a 400 at every transport's edge); the other parameters travel
untouched in `InferRequest.parameters` for the model (a rag or generator service) to read.
"""

from __future__ import annotations

import math
import reprlib
from typing import Any

from ..errors import InvalidInput
from ..types import InferRequest
from .v2 import DecodedRequest

# The deadline parameters, in order of preference, with their units per second.
TIMEOUT_PARAMETERS = (("timeout_ms", 1000.0), ("timeout", 1e6))


def to_infer_request(model: str, decoded: DecodedRequest) -> InferRequest:
    """A decoded v2 request as the core's request: inputs, id, requested outputs, priority and
    timeout (see priority_parameter and timeout_parameter)."""
    params = decoded.parameters or {}
    return InferRequest(
        model=model,
        inputs=decoded.inputs,
        id=decoded.id,
        priority=priority_parameter(params),
        timeout_s=timeout_parameter(params),
        outputs=[o.name for o in decoded.outputs] if decoded.outputs else None,
        parameters=params,
    )


def priority_parameter(params: dict[str, Any]) -> int | None:
    """`parameters.priority`: an integer (its range is the model's to check), None when absent."""
    priority = params.get("priority")
    if priority is not None and (isinstance(priority, bool) or not isinstance(priority, int)):
        raise InvalidInput(f"parameters.priority must be an integer, got {reprlib.repr(priority)}")
    return priority


def timeout_parameter(params: dict[str, Any]) -> float | None:
    """The request's timeout in seconds from `timeout_ms`, else Triton's `timeout` (microseconds);
    None when neither is given."""
    for name, units_per_second in TIMEOUT_PARAMETERS:
        if name in params:
            return _seconds(params[name], name, units_per_second)
    return None


def _seconds(value: Any, name: str, units_per_second: float) -> float:
    """Only a finite number >= 0 is a timeout: NaN would otherwise expire at once (a misleading
    504) and Infinity or an integer beyond float range mean nothing, so they are the client's
    mistake (400). 0 is a deadline that has already passed, which the model answers 504."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidInput(f"parameters.{name} must be a number, got {reprlib.repr(value)}")
    try:
        seconds = float(value) / units_per_second
    except OverflowError:  # an integer too large for a float
        seconds = math.inf
    if not math.isfinite(seconds) or seconds < 0:
        raise InvalidInput(f"parameters.{name} must be a finite number >= 0, got {reprlib.repr(value)}")
    return seconds
