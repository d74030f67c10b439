"""Batch assembly when some requests' inputs live in CUDA shared memory (DeviceTensor), on the
engine instance's worker thread (the only place their bytes are read). Each request is copied
once: for an engine that takes device inputs (`Engine.device_inputs`, ONNX Runtime's CUDA EP)
into a device buffer on that device (device-to-device for a region, host-to-device for an
ordinary request): the engine's own for the batch's shape when it gives one (a CUDA graph's
input: `Engine.device_batch_buffers`), else one of the batch's own, freed after the run; handed
to the engine as a DeviceArray. For any
other engine, or a region on another device, straight into its rows of the host batch
(device-to-host). Padding rows copy the last real row, as batch.py's do. A sequence input, padded
on its sequence axis, is brought to the host first and then stacked by batch.py: two copies, the
one case that takes more than one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ..engines.base import DeviceArray
from ..errors import EngineError
from ..shared_memory.device_tensor import DeviceTensor
from . import batch as batching

Part = NDArray[Any] | DeviceTensor
Release = Callable[[], None]  # frees a batch's device buffer (its context pushed)


def has_device_part(parts: Sequence[object]) -> bool:
    return any(isinstance(part, DeviceTensor) for part in parts)


def assemble(parts: Sequence[Part], size: int, seq_axis: int | None, bucket: int, pad_value: float,
             any_length: bool, engine_device: int | None, target: int | None = None
             ) -> tuple[NDArray[Any] | DeviceArray, Release | None]:
    """The batch tensor, and what frees its device buffer once the engine has run (None on the host
    and for a `target`: the engine's own buffer for this batch shape, written in place)."""
    devices_of = {part.device_id for part in parts if isinstance(part, DeviceTensor)}
    if engine_device is not None and seq_axis is None and devices_of == {engine_device}:
        return _on_device(parts, size, engine_device, target)
    if seq_axis is not None:
        host = [to_host(part) if isinstance(part, DeviceTensor) else part for part in parts]
        return batching.stack(host, size, seq_axis, bucket, pad_value, any_length), None
    return _on_host(parts, size), None


def to_host(tensor: DeviceTensor) -> NDArray[Any]:
    out = np.empty(tensor.shape, dtype=tensor.dtype)
    with tensor.devices.on(tensor.device_id) as api:
        api.copy_dtoh(out, tensor.ptr)
    return out


def _row_shape(parts: Sequence[Part]) -> tuple[int, ...]:
    shapes = {tuple(part.shape[1:]) for part in parts}
    if len(shapes) != 1:
        raise EngineError(f"the batch's requests disagree on their inputs' shape beyond the batch dimension: "
                          f"{sorted(shapes)}")
    return shapes.pop()


def _on_host(parts: Sequence[Part], size: int) -> NDArray[Any]:
    out = np.empty((size, *_row_shape(parts)), dtype=parts[0].dtype)
    row = 0
    for part in parts:
        n = part.shape[0]
        if isinstance(part, DeviceTensor):
            with part.devices.on(part.device_id) as api:
                api.copy_dtoh(out[row:row + n], part.ptr)  # rows of a C-ordered array: contiguous
        else:
            out[row:row + n] = part
        row += n
    if row < size:
        out[row:] = out[row - 1]
    return out


def batch_shape(parts: Sequence[Part], size: int) -> tuple[tuple[int, ...], np.dtype[Any]]:
    """The shape and dtype of the batch `assemble` makes of `parts` (no sequence axis)."""
    return (size, *_row_shape(parts)), parts[0].dtype


def _on_device(parts: Sequence[Part], size: int, device_id: int, target: int | None
               ) -> tuple[DeviceArray, Release | None]:
    row_shape = _row_shape(parts)
    dtype = parts[0].dtype
    row_bytes = math.prod(row_shape) * dtype.itemsize
    nbytes = size * row_bytes
    devices = next(part.devices for part in parts if isinstance(part, DeviceTensor))
    with devices.on(device_id) as api:
        # Into the engine's buffer for this shape when it has one (counted in the memory plan,
        # measured at warm-up); else one allocation per batch, freed at once: a cache per shape
        # would save the cuMemAlloc but hold device memory the memory plan does not count.
        buffer = api.mem_alloc(max(nbytes, 1)) if target is None else None
        start = buffer.ptr if buffer is not None else target
        assert start is not None
        try:
            at = start
            for part in parts:
                if isinstance(part, DeviceTensor):
                    api.copy_dtod(at, part.ptr, part.nbytes)
                else:
                    api.copy_htod(at, np.ascontiguousarray(part))
                at += part.nbytes
            last = at - row_bytes
            while at < start + nbytes:
                api.copy_dtod(at, last, row_bytes)
                at += row_bytes
            # Device-to-device copies may return before they finish; the engine runs on its own
            # stream, so they must be done first.
            api.synchronize()
        except BaseException:
            if buffer is not None:
                buffer.free()
            raise

    def copy_to(dst: int) -> None:
        with devices.on(device_id) as api:
            api.copy_dtod(dst, start, nbytes)
            api.synchronize()

    batch = DeviceArray(start, device_id, dtype, (size, *row_shape), copy_to)
    if buffer is None:
        return batch, None

    def release() -> None:
        assert buffer is not None
        with devices.on(device_id):
            buffer.free()

    return batch, release
