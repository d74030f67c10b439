"""FakeCudaIpc: the client process of CUDA shared memory, played against a FakeCuda device.

NOT CUDA. What tritonclient.utils.cuda_shared_memory does in a real client (cudaMalloc a buffer,
cudaIpcGetMemHandle it, copy tensors in and out) done on the fake GPU the daemon's CudaApi sees:
export() allocates the client's device buffer and returns its 64-byte IPC handle, which the
daemon's registry opens through FakeCuda.IPCMemoryHandle (or FakeCudaDriver.cuIpcOpenMemHandle)
at an address of its own over the same bytes. One thing differs from CUDA: a real handle cannot be
opened in the process that exported it; here both sides live in the test's process.
"""

from __future__ import annotations

import base64
import itertools
from dataclasses import dataclass

import numpy as np

from tests.fakes.fake_cuda import FakeAllocation, FakeCuda

_serial = itertools.count(1)


@dataclass
class ExportedBuffer:
    """The client's device buffer and its IPC handle."""

    handle: bytes
    alloc: FakeAllocation

    @property
    def b64(self) -> str:
        """The handle as Triton's register body carries it (raw_handle.b64)."""
        return base64.b64encode(self.handle).decode()

    def put(self, array: np.ndarray, offset: int = 0) -> None:
        raw = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        self.alloc.data[offset:offset + raw.size] = raw

    def get(self, dtype, shape, offset: int = 0) -> np.ndarray:
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape)) * dtype.itemsize
        return self.alloc.data[offset:offset + nbytes].copy().view(dtype).reshape(shape)

    def free(self) -> None:
        """cudaFree in the client: the daemon's mapping, if still open, keeps reading these bytes."""
        self.alloc.live = False


class FakeCudaIpc:
    """Exports buffers of `gpu` as a client process would."""

    def __init__(self, gpu: FakeCuda):
        self.gpu = gpu

    def export(self, nbytes: int) -> ExportedBuffer:
        alloc = self.gpu._allocate(nbytes, "client")
        handle = b"FAKE-IPC" + next(_serial).to_bytes(8, "little") + bytes(48)  # 64 bytes, as cudaIpcMemHandle_t
        self.gpu.ipc_exports[handle] = alloc
        return ExportedBuffer(handle, alloc)
