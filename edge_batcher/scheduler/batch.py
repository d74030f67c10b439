"""Batch assembly and slicing as pure numpy functions: requests' tensors into one padded batch,
the engine's outputs back into one slice per request.

Runs on an engine instance's worker thread (scheduler/worker.py); nothing here touches the
event loop, the queue or the engine. Strict sizes (scheduler/policy.py) mean a batch is padded
up to the size the engine was built and warmed for: padding rows copy the last real row,
always a valid input; a sequence input is padded on its sequence axis to the bucket length,
or, for an engine that accepts any length (`Engine.accepts_any_length`, ONNX Runtime with a
dynamic sequence dimension), only to the batch's longest member rounded up to
ANY_LENGTH_MULTIPLE: the bucket stays the scheduling key, only the padded width shrinks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ..errors import EngineError
from ..types import DATATYPE_TO_NUMPY, TensorSpec

# Width granularity for engines that accept any length. 1 (no rounding): on the 90 technician
# questions batched by bucket it gives 1.20 padded/real tokens against 1.26 for multiples of 4
# or 8, and ONNX Runtime runs any width at the same cost per token (docs/rag.md, "Padding").
ANY_LENGTH_MULTIPLE = 1
# One batch's outputs cut per request, in batch order (None: the request took no place in it).
Outputs = list[dict[str, NDArray[Any]] | None]


def padded_width(parts: Sequence[NDArray[Any]], seq_axis: int, bucket: int, any_length: bool) -> int:
    """The sequence width of a batch: the bucket, or with `any_length` the longest part rounded
    up to ANY_LENGTH_MULTIPLE (never beyond the bucket)."""
    if not any_length:
        return bucket
    longest: int = max(part.shape[seq_axis] for part in parts)
    return min(bucket, -(-longest // ANY_LENGTH_MULTIPLE) * ANY_LENGTH_MULTIPLE)


def stack_shape(parts: Sequence[NDArray[Any]], size: int, seq_axis: int | None, bucket: int,
                any_length: bool = False) -> tuple[tuple[int, ...], np.dtype[Any]] | None:
    """The shape and dtype of the batch `stack` makes of `parts`, or None when they disagree
    beyond the batch and sequence axes (stack's concatenation then says how)."""
    first = parts[0]

    def fixed(part: NDArray[Any]) -> tuple[int, ...]:
        return tuple(d for axis, d in enumerate(part.shape) if axis not in (0, seq_axis))

    if any(part.dtype != first.dtype or part.ndim != first.ndim or fixed(part) != fixed(first) for part in parts):
        return None
    shape = [size, *first.shape[1:]]
    if seq_axis is not None:
        shape[seq_axis] = padded_width(parts, seq_axis, bucket, any_length)
    return tuple(shape), first.dtype


def stack(parts: Sequence[NDArray[Any]], size: int, seq_axis: int | None, bucket: int, pad_value: float,
          any_length: bool = False, out: NDArray[Any] | None = None) -> NDArray[Any]:
    """One batch tensor of `size` rows: the parts, padded on the sequence axis to the bucket (or
    with `any_length` to padded_width), then padding rows (copies of the last real row: always a
    valid input) up to size. Written into `out` when given (the engine's staging for this shape,
    Engine.host_batch_buffers: exactly stack_shape's shape and dtype), else into a new array."""
    if seq_axis is None and out is None:
        rows = sum(part.shape[0] for part in parts)
        if rows < size:
            parts = [*parts, np.repeat(parts[-1][-1:], size - rows, axis=0)]
        return parts[0] if len(parts) == 1 else np.concatenate(parts)
    first = parts[0]
    if out is None:
        shape = list(first.shape)
        assert seq_axis is not None
        shape[seq_axis] = padded_width(parts, seq_axis, bucket, any_length)
        shape[0] = size
        out = np.empty(shape, dtype=first.dtype)
    if seq_axis is not None:
        out.fill(pad_value if first.dtype != object else b"")
    row = 0
    for part in parts:
        n = part.shape[0]
        if seq_axis is None:
            out[row:row + n] = part
        else:
            index = [slice(row, row + n)] + [slice(None)] * (part.ndim - 1)
            index[seq_axis] = slice(0, part.shape[seq_axis])
            out[tuple(index)] = part
        row += n
    if row < size:
        out[row:] = out[row - 1]
    return out


def zeros(spec: TensorSpec, size: int, seq_axis: int | None, bucket: int) -> NDArray[Any]:
    """A batch of `size` zero rows for `spec` (warm-up): dynamic dimensions of 1, the sequence
    axis at the bucket length."""
    shape = [size] + [(bucket if axis == seq_axis else (d if d > 0 else 1))
                      for axis, d in enumerate(spec.shape) if axis > 0]
    dtype = DATATYPE_TO_NUMPY[spec.datatype]
    if dtype.kind == "O":
        return np.full(shape, b"", dtype=object)
    return np.zeros(shape, dtype=dtype)


def split_rows(outputs: Mapping[str, NDArray[Any]], rows: Sequence[int | None]) -> Outputs:
    """The outputs of one batch cut into one dict per request, in batch order. A request with
    None rows took no place in the batch (it expired before the run) and gets None."""
    named = list(outputs.items())
    results: Outputs = []
    offset = 0
    for n in rows:
        if n is None:
            results.append(None)
            continue
        end = offset + n
        results.append({name: value[offset:end] for name, value in named})
        offset = end
    return results


def check_outputs(outputs: Mapping[str, object], names: Sequence[str], rows: int, model: str) -> None:
    """An engine (a user's own backend, say) that returns too little must fail its batch with a
    clear error, not hand out empty slices or leave requests unanswered."""
    for name in names:
        value = outputs.get(name)
        if value is None:
            raise EngineError(
                f"model {model!r}: the engine returned no output {name!r} "
                f"(it returned {', '.join(map(repr, outputs)) or 'none'})"
            )
        if getattr(value, "ndim", 0) == 0 or value.shape[0] < rows:  # type: ignore[attr-defined]
            raise EngineError(
                f"model {model!r}: the engine's output {name!r} has shape {list(getattr(value, 'shape', ()))}, "
                f"fewer than the batch's {rows} rows"
            )
