"""FakeCuda: an honest stand-in for `pycuda.driver` in tests, over numpy "device" memory.

NOT CUDA. Allocations, page-locked host buffers, streams, primary contexts and async copies
behave as the TensorRT backend, the builder and the memory probe expect, with the checks real
CUDA makes cheaply: calls that need a context raise LogicError when none is current on the
calling thread, mem_alloc beyond the device's memory raises MemoryError, and copies must use
page-locked host memory. Streams are asynchronous: copies and executions queue and run at
synchronize(), so reading an output early sees stale data, as on a GPU. CUDA IPC (what CUDA
shared memory registers) is here too: an IPC handle names an allocation another "process" exported
(fake_cuda_ipc.py's FakeCudaIpc plays that client), IPCMemoryHandle maps it at an address of its
own over the same bytes, and the synchronous copies are real memcpy. `integrated=True` makes the
device report CU_DEVICE_ATTRIBUTE_INTEGRATED = 1, as a Jetson does. fake_cuda_bindings.py puts
cuda-python's driver API over the same fake device; fake_tensorrt.py explains the family.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

ALIGN = 256  # allocation granularity of the fake device


class CudaError(Exception):
    """pycuda.driver.Error"""


class CudaMemoryError(CudaError):
    """pycuda.driver.MemoryError"""


class CudaLogicError(CudaError):
    """pycuda.driver.LogicError"""


class CudaLaunchError(CudaError):
    """pycuda.driver.LaunchError"""


class CudaRuntimeError(CudaError):
    """pycuda.driver.RuntimeError"""


@dataclass
class FakeAllocation:
    ptr: int
    size: int
    data: np.ndarray  # uint8
    owner: str  # "user" (mem_alloc), "tensorrt" (a STATIC context's own memory), "client" (an IPC
    # exporter's), "ipc" (an opened IPC handle: the exporter's bytes at another address, not counted twice)
    live: bool = True


class _DeviceAttribute:
    """pycuda.driver.device_attribute (the one attribute the code reads beyond the capability)."""

    INTEGRATED = 18  # CU_DEVICE_ATTRIBUTE_INTEGRATED


class _IpcMemFlags:
    """pycuda.driver.ipc_mem_flags"""

    LAZY_ENABLE_PEER_ACCESS = 1


class FakeCuda:
    """The pycuda.driver surface the backend uses, over numpy "device" memory."""

    IS_FAKE = True
    Error = CudaError
    MemoryError = CudaMemoryError
    LogicError = CudaLogicError
    LaunchError = CudaLaunchError
    RuntimeError = CudaRuntimeError
    device_attribute = _DeviceAttribute
    ipc_mem_flags = _IpcMemFlags

    def __init__(self, total_memory: int = 8 << 30, device_name: str = "FakeCuda device (not a GPU)",
                 compute_capability: tuple[int, int] = (8, 7), device_count: int = 1, integrated: bool = False):
        self.total_memory = int(total_memory)
        self.device_name = device_name
        self.compute_capability = compute_capability
        self.device_count = device_count
        self.integrated = integrated
        self.ipc_exports: dict[bytes, FakeAllocation] = {}  # IPC handle -> the exporter's allocation
        self.initialized = False
        self.allocations: dict[int, FakeAllocation] = {}
        self._next_ptr = 1 << 20
        self._pinned: list[tuple[int, int]] = []
        self._tls = threading.local()
        self._lock = threading.Lock()
        self.streams: dict[int, FakeStream] = {}
        self._next_stream = 0x5000
        # Counters a test can read to check behaviour ("no allocation per batch").
        self.counters = {"mem_alloc": 0, "pagelocked_empty": 0, "memcpy_htod": 0, "memcpy_dtoh": 0, "free": 0,
                         "memcpy_dtod": 0, "ipc_open": 0, "ipc_close": 0}
        self.primary_retained = 0
        self.driver_version = 12060  # cuDriverGetVersion: CUDA 12.6, as JetPack 6.2
        fake = self

        class Context:
            """pycuda.driver.Context: only the static pop() is used on the class."""

            @staticmethod
            def pop() -> None:
                stack = fake._stack()
                if not stack:
                    raise CudaLogicError("cuCtxPopCurrent failed: invalid device context")
                stack.pop()

            @staticmethod
            def synchronize() -> None:  # the fake's synchronous copies are done when they return
                fake.require_context("cuCtxSynchronize")

            @staticmethod
            def get_current():
                stack = fake._stack()
                return stack[-1] if stack else None

        self.Context = Context

    # ------------------------------------------------------------------ context handling

    def _stack(self) -> list:
        if not hasattr(self._tls, "stack"):
            self._tls.stack = []
        return self._tls.stack

    def require_context(self, what: str) -> None:
        if not self.initialized:
            raise CudaLogicError(f"{what} failed: cuInit has not been called")
        if not self._stack():
            raise CudaLogicError(f"{what} failed: invalid device context (no CUDA context is current on this thread)")

    def init(self, flags: int = 0) -> None:
        self.initialized = True

    @property
    def Device(self) -> _DeviceClass:  # noqa: N802 - pycuda's name: Device(i), Device.count()
        return _DeviceClass(self)

    def get_device(self, index: int) -> FakeDevice:
        if not self.initialized:
            raise CudaLogicError("cuDeviceGet failed: cuInit has not been called")
        if not 0 <= index < self.device_count:
            raise CudaLogicError(f"cuDeviceGet failed: invalid device ordinal {index}")
        return FakeDevice(self, index)

    def get_driver_version(self) -> int:
        return self.driver_version

    # ------------------------------------------------------------------ memory

    def _allocate(self, nbytes: int, owner: str) -> FakeAllocation:
        nbytes = int(nbytes)
        if nbytes <= 0:
            raise CudaLogicError("cuMemAlloc failed: invalid argument (size 0)")
        with self._lock:
            if self.used_memory() + nbytes > self.total_memory:
                raise CudaMemoryError("cuMemAlloc failed: out of memory")
            ptr = self._next_ptr
            self._next_ptr += (nbytes + ALIGN - 1) // ALIGN * ALIGN + ALIGN
            alloc = FakeAllocation(ptr, nbytes, np.zeros(nbytes, dtype=np.uint8), owner)
            self.allocations[ptr] = alloc
        return alloc

    def used_memory(self) -> int:
        return sum(a.size for a in self.allocations.values() if a.live and a.owner != "ipc")

    def open_ipc_mappings(self) -> int:
        """IPC handles opened and not closed yet (a test checks that unregister and shutdown close them)."""
        return sum(1 for a in self.allocations.values() if a.live and a.owner == "ipc")

    def mem_alloc(self, nbytes: int) -> DeviceAllocation:
        self.require_context("cuMemAlloc")
        self.counters["mem_alloc"] += 1
        return DeviceAllocation(self, self._allocate(nbytes, "user"))

    def mem_get_info(self) -> tuple[int, int]:
        self.require_context("cuMemGetInfo")
        return self.total_memory - self.used_memory(), self.total_memory

    def pagelocked_empty(self, shape, dtype, order: str = "C", mem_flags: int = 0) -> np.ndarray:
        self.require_context("cuMemHostAlloc")
        self.counters["pagelocked_empty"] += 1
        array = np.empty(shape, dtype=dtype, order=order)
        start = array.__array_interface__["data"][0]
        self._pinned.append((start, start + max(array.nbytes, 1)))
        return array

    def _is_pinned(self, array: np.ndarray) -> bool:
        start = array.__array_interface__["data"][0]
        end = start + array.nbytes
        return any(lo <= start and end <= hi for lo, hi in self._pinned)

    def lookup(self, ptr: int, nbytes: int) -> tuple[FakeAllocation, int]:
        """The live allocation holding [ptr, ptr + nbytes) and the offset into it."""
        ptr = int(ptr)
        for alloc in self.allocations.values():
            if alloc.live and alloc.ptr <= ptr < alloc.ptr + alloc.size:
                offset = ptr - alloc.ptr
                if offset + nbytes > alloc.size:
                    raise CudaLogicError(
                        f"access of {nbytes} bytes at 0x{ptr:x} overruns its allocation of {alloc.size} bytes"
                    )
                return alloc, offset
        raise CudaLogicError(f"0x{ptr:x} is not device memory (freed or never allocated)")

    def read(self, ptr: int, nbytes: int) -> np.ndarray:
        alloc, off = self.lookup(ptr, nbytes)
        return alloc.data[off:off + nbytes].copy()

    def write(self, ptr: int, data: np.ndarray) -> None:
        raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        alloc, off = self.lookup(ptr, raw.size)
        alloc.data[off:off + raw.size] = raw

    # ------------------------------------------------------------------ copies and streams

    def Stream(self, flags: int = 0) -> FakeStream:  # noqa: N802 - pycuda's name
        self.require_context("cuStreamCreate")
        with self._lock:
            handle = self._next_stream
            self._next_stream += 1
        stream = FakeStream(self, handle)
        self.streams[handle] = stream
        return stream

    def memcpy_htod_async(self, dest, src: np.ndarray, stream: FakeStream | None = None) -> None:
        self.require_context("cuMemcpyHtoDAsync")
        if not isinstance(src, np.ndarray) or not src.flags.c_contiguous:
            raise CudaLogicError("memcpy_htod_async: source must be a C-contiguous numpy array")
        if not self._is_pinned(src):
            raise CudaLogicError(
                "memcpy_htod_async: source is pageable host memory (FakeCuda requires page-locked buffers)")
        ptr, nbytes = int(dest), src.nbytes
        self.lookup(ptr, nbytes)  # fail at enqueue time for a bad pointer, as the driver does
        self.counters["memcpy_htod"] += 1
        # Read the host buffer when the stream runs, not now: that is what an async copy does.
        self._enqueue(stream, lambda: self.write(ptr, src))

    def memcpy_dtoh_async(self, dest: np.ndarray, src, stream: FakeStream | None = None) -> None:
        self.require_context("cuMemcpyDtoHAsync")
        if not isinstance(dest, np.ndarray) or not dest.flags.c_contiguous:
            raise CudaLogicError("memcpy_dtoh_async: destination must be a C-contiguous numpy array")
        if not self._is_pinned(dest):
            raise CudaLogicError(
                "memcpy_dtoh_async: destination is pageable host memory (FakeCuda requires page-locked buffers)")
        ptr, nbytes = int(src), dest.nbytes
        self.lookup(ptr, nbytes)
        self.counters["memcpy_dtoh"] += 1

        def copy() -> None:
            dest.reshape(-1).view(np.uint8)[:] = self.read(ptr, nbytes)

        self._enqueue(stream, copy)

    def _enqueue(self, stream: FakeStream | None, op) -> None:
        if stream is None:
            op()
        else:
            stream.enqueue(op)

    def stream_by_handle(self, handle: int) -> FakeStream | None:
        return self.streams.get(int(handle))

    # ------------------------------------------------------------------ CUDA IPC and synchronous copies

    def IPCMemoryHandle(self, handle: bytes, flags: int = 1) -> IpcMapping:  # noqa: N802 - pycuda's name
        """cuIpcOpenMemHandle: the exporter's allocation mapped at a new address of this "process"."""
        self.require_context("cuIpcOpenMemHandle")
        exported = self.ipc_exports.get(bytes(handle))
        if len(bytes(handle)) != 64 or exported is None or not exported.live:
            raise CudaLogicError("cuIpcOpenMemHandle failed: invalid argument (not an IPC handle of a live allocation)")
        with self._lock:
            ptr = self._next_ptr
            self._next_ptr += (exported.size + ALIGN - 1) // ALIGN * ALIGN + ALIGN
            alias = FakeAllocation(ptr, exported.size, exported.data, "ipc")  # the same bytes, not a copy
            self.allocations[ptr] = alias
        self.counters["ipc_open"] += 1
        return IpcMapping(self, alias)

    def memcpy_dtod(self, dest, src, size: int) -> None:
        self.require_context("cuMemcpyDtoD")
        data = self.read(int(src), int(size))
        self.write(int(dest), data)
        self.counters["memcpy_dtod"] += 1

    def memcpy_dtoh(self, dest: np.ndarray, src) -> None:
        self.require_context("cuMemcpyDtoH")
        if not isinstance(dest, np.ndarray) or not dest.flags.c_contiguous:
            raise CudaLogicError("memcpy_dtoh: destination must be a C-contiguous numpy array")
        dest.reshape(-1).view(np.uint8)[:] = self.read(int(src), dest.nbytes)
        self.counters["memcpy_dtoh"] += 1

    def memcpy_htod(self, dest, src: np.ndarray) -> None:
        self.require_context("cuMemcpyHtoD")
        if not isinstance(src, np.ndarray) or not src.flags.c_contiguous:
            raise CudaLogicError("memcpy_htod: source must be a C-contiguous numpy array")
        self.write(int(dest), src)
        self.counters["memcpy_htod"] += 1


class _DevicePointer:
    """What pycuda's device memory objects share: int() is the device address."""

    def __init__(self, cuda: FakeCuda, alloc: FakeAllocation):
        self._cuda = cuda
        self._alloc = alloc

    def __int__(self) -> int:
        return self._alloc.ptr

    __index__ = __int__


class IpcMapping(_DevicePointer):
    """pycuda.driver.IPCMemoryHandle: close() is cuIpcCloseMemHandle (a second close fails)."""

    def close(self) -> None:
        self._cuda.require_context("cuIpcCloseMemHandle")
        if not self._alloc.live:
            raise CudaLogicError("cuIpcCloseMemHandle failed: invalid value (already closed)")
        self._alloc.live = False
        self._cuda.counters["ipc_close"] += 1


class _DeviceClass:
    """pycuda.driver.Device: called with an ordinal, or count() (a static method in pycuda)."""

    def __init__(self, cuda: FakeCuda):
        self._cuda = cuda

    def __call__(self, index: int) -> FakeDevice:
        return self._cuda.get_device(index)

    def count(self) -> int:
        if not self._cuda.initialized:
            raise CudaLogicError("cuDeviceGetCount failed: cuInit has not been called")
        return self._cuda.device_count


class DeviceAllocation(_DevicePointer):
    """pycuda.driver.DeviceAllocation: free() returns it (idempotent)."""

    def free(self) -> None:
        if self._alloc.live:
            self._alloc.live = False
            self._cuda.counters["free"] += 1


class FakeStream:
    """pycuda.driver.Stream: work queues here and runs at synchronize()."""

    def __init__(self, cuda: FakeCuda, handle: int):
        self._cuda = cuda
        self.handle = handle
        self.pending: list = []
        self.capture: list | None = None  # while capturing (cuda-python's cuStreamBeginCapture): recorded, not run

    def enqueue(self, op) -> None:
        (self.pending if self.capture is None else self.capture).append(op)

    def synchronize(self) -> None:
        self._cuda.require_context("cuStreamSynchronize")
        if self.capture is not None:
            raise CudaLogicError("cuStreamSynchronize: the stream is capturing a graph "
                                 "(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED)")
        ops, self.pending = self.pending, []
        for op in ops:
            op()

    def is_done(self) -> bool:
        return not self.pending


class FakeDevice:
    def __init__(self, cuda: FakeCuda, index: int):
        self._cuda = cuda
        self.index = index

    def name(self) -> str:
        return self._cuda.device_name

    def compute_capability(self) -> tuple[int, int]:
        return self._cuda.compute_capability

    def get_attribute(self, attribute: int) -> int:
        if attribute == _DeviceAttribute.INTEGRATED:
            return int(self._cuda.integrated)
        raise CudaLogicError(f"cuDeviceGetAttribute: FakeCuda does not know attribute {attribute}")

    def total_memory(self) -> int:
        return self._cuda.total_memory

    def retain_primary_context(self) -> FakeContext:
        self._cuda.primary_retained += 1
        return FakeContext(self._cuda, self)


class FakeContext:
    """A retained primary context: push() makes it current on this thread, detach() releases it."""

    def __init__(self, cuda: FakeCuda, device: FakeDevice):
        self._cuda = cuda
        self.device = device
        self.detached = False

    def push(self) -> None:
        if self.detached:
            raise CudaLogicError("cuCtxPushCurrent failed: context was released")
        self._cuda._stack().append(self)

    def pop(self) -> None:
        self._cuda.Context.pop()

    def detach(self) -> None:
        if not self.detached:
            self.detached = True
            self._cuda.primary_retained -= 1
