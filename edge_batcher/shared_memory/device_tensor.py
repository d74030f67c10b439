"""DeviceTensor: a request's input that lives in a CUDA shared memory region (cuda_regions.py),
named by its device address, device, datatype and shape instead of being copied to the host. It
travels where a request's numpy arrays do (InferRequest.inputs, the model's queue) and answers
what the checks before queueing read (dtype, shape, ndim, nbytes); its bytes are read only on an
engine worker thread, when the batch is assembled (scheduler/device_batch.py), while the request's
lease (lease.py) still holds the region open.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ..engines.cuda_api import CudaApi


class OnDevice(Protocol):
    """What reads a tensor's bytes needs (cuda_regions.CudaDevices): the API with a device's context pushed."""

    def on(self, device_id: int) -> AbstractContextManager[CudaApi]: ...


@dataclass(frozen=True, eq=False)
class DeviceTensor:
    ptr: int  # device address of the first byte
    device_id: int
    dtype: np.dtype
    shape: tuple[int, ...]
    devices: OnDevice  # pushes device_id's context around the copies that read it
    region: str  # the region's name, for messages

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize


def holds_device_tensor(inputs: Mapping[str, object]) -> bool:
    """Whether any of a request's inputs is in a CUDA region."""
    return any(isinstance(value, DeviceTensor) for value in inputs.values())
