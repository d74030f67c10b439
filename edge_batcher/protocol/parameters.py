"""KServe v2 request parameters -> the core's InferRequest, the same for every transport.

HTTP `/infer`, Triton's generate extension, gRPC and MQTT requests all carry `parameters`; the two
the core reads are `priority` and a deadline, given as `timeout_ms` or, as Triton's clients send
it, `timeout` in microseconds. `priority` is on Triton's scale (1 is the highest, 0 or absent the
model's default level) and is mapped here onto the scheduler's levels (0..levels-1, higher first),
so every transport means the same by it. A malformed value is the client's mistake and raises
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


def to_infer_request(model: str, decoded: DecodedRequest, priority_levels: int = 1) -> InferRequest:
    """A decoded v2 request as the core's request: inputs, id, requested outputs, priority (for a
    model with `priority_levels` levels) and timeout (see priority_parameter, timeout_parameter)."""
    params = decoded.parameters or {}
    return InferRequest(
        model=model,
        inputs=decoded.inputs,
        id=decoded.id,
        priority=priority_parameter(params, priority_levels),
        timeout_s=timeout_parameter(params),
        outputs=[o.name for o in decoded.outputs] if decoded.outputs else None,
        parameters=params,
    )


def priority_parameter(params: dict[str, Any], priority_levels: int = 1) -> int | None:
    """`parameters.priority` on Triton's scale as the scheduler's level; None (the model's
    default level) when absent or 0."""
    priority = params.get("priority")
    if priority is not None and (isinstance(priority, bool) or not isinstance(priority, int)):
        raise InvalidInput(f"parameters.priority must be an integer, got {reprlib.repr(priority)}")
    return scheduler_level(priority, priority_levels)


def scheduler_level(triton_priority: int | None, priority_levels: int) -> int | None:
    """Triton's priority (1 = highest .. priority_levels = lowest; 0 or None = the model's default
    level) as the scheduler's level (priority_levels-1 = highest .. 0 = lowest; None = default).
    Triton quietly gives a priority beyond the model's levels the default level; here it is the
    client's mistake (400), as a misspelt urgency should not pass unnoticed."""
    if triton_priority is None or triton_priority == 0:
        return None
    if not 1 <= triton_priority <= priority_levels:
        raise InvalidInput(
            f"parameters.priority {triton_priority} is out of range: "
            f"the model has priority levels 1..{priority_levels} "
            f"(1 is the highest; 0 or none: the model's default level)")
    return priority_levels - triton_priority


def triton_priority(level: int, priority_levels: int) -> int:
    """The scheduler's level as Triton's priority (the inverse of scheduler_level)."""
    return priority_levels - level


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
