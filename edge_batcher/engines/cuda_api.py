"""The little CUDA the TensorRT backend and the CUDA memory probe need, over either Python binding.

Two bindings are in use: NVIDIA's cuda-python (`cuda.bindings.driver`, what TensorRT's own
samples use since TensorRT 10; wheels for x86-64 and aarch64) and pycuda (compiled on the
device; many Jetson setups already have it). Both reach the same CUDA driver, so one small
interface covers what edge-batcher does with them: the device's primary context (retained,
pushed and popped around every call, the context the CUDA runtime and TensorRT share), device
buffers, page-locked host buffers, streams, asynchronous copies, free/total memory, CUDA
graphs captured from a stream (cuda-python only: pycuda has no stream capture), and for
CUDA shared memory (shared_memory/cuda_regions.py) IPC handles opened and closed,
synchronous copies and whether a device is integrated (a Jetson: no CUDA IPC).
`load_cuda_api()` picks cuda-python when it imports and pycuda otherwise
(EDGE_BATCHER_CUDA_BINDING=pycuda|cuda-python forces one); `cuda_api_from()` wraps a module or
fake a caller passes in (tests pass tests/fakes' FakeCuda and FakeCudaDriver).

It lives under engines/ because buffers and streams are the engine's concern; the probe only
borrows device selection and mem_get_info. Nothing is imported at import time.
"""

from __future__ import annotations

import ctypes
import os
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

BINDING_ENV = "EDGE_BATCHER_CUDA_BINDING"
BINDINGS = ("cuda-python", "pycuda")
INSTALL_HINT = ("pip install cuda-bindings with the major version of the device's CUDA (wheels for x86-64 and "
                "aarch64): 'edge-batcher[jetpack6]' (CUDA 12), 'edge-batcher[jetpack7]' (CUDA 13), or pycuda "
                "(compiled on the device): 'edge-batcher[pycuda]'")


class CudaError(RuntimeError):
    """A CUDA call failed; `code` is the driver's error name (e.g. CUDA_ERROR_OUT_OF_MEMORY) when known."""

    def __init__(self, message: str, code: str = ""):
        super().__init__(message)
        self.code = code


@dataclass
class DeviceBuffer:
    """Device memory: `ptr` is the address TensorRT wants; free() returns it (idempotent)."""

    ptr: int
    nbytes: int
    _free: Callable[[], None]
    freed: bool = False

    def __int__(self) -> int:
        return self.ptr

    def free(self) -> None:
        if not self.freed:
            self.freed = True
            self._free()


@dataclass
class HostBuffer:
    """Page-locked host memory seen as a flat numpy array; free() returns it (idempotent)."""

    array: np.ndarray
    _free: Callable[[], None]
    freed: bool = False

    def free(self) -> None:
        if not self.freed:
            self.freed = True
            self._free()


@dataclass
class Stream:
    """A CUDA stream: `handle` is the integer TensorRT's execute_async_v3 takes."""

    handle: int
    raw: Any
    _sync: Callable[[], None]
    _close: Callable[[], None]

    def synchronize(self) -> None:
        self._sync()

    def close(self) -> None:
        self._close()


@dataclass
class CudaGraph:
    """An instantiated CUDA graph: launch(stream) replays the captured work on `stream` (the same
    device addresses, the same shapes); destroy() frees it (idempotent)."""

    _launch: Callable[[Stream], None]
    _destroy: Callable[[], None]
    destroyed: bool = False

    def launch(self, stream: Stream) -> None:
        self._launch(stream)

    def destroy(self) -> None:
        if not self.destroyed:
            self.destroyed = True
            self._destroy()


# cudaIpcMemHandle_t / CUipcMemHandle: an opaque 64 bytes (CU_IPC_HANDLE_SIZE)
IPC_HANDLE_SIZE = 64


@dataclass
class IpcMemory:
    """Another process's device memory opened from its IPC handle: `ptr` is its address in this
    process; close() unmaps it (idempotent). The exporter's allocation stays theirs."""

    ptr: int
    _close: Callable[[], None]
    closed: bool = False

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._close()


class DeviceContext:
    """A retained primary context of one device: push() makes it current on this thread, pop()
    undoes that, release() drops the reference (after the last pop)."""

    def __init__(self, push: Callable[[], None], pop: Callable[[], None], release: Callable[[], None]):
        self._push, self._pop, self._release = push, pop, release
        self.released = False

    def push(self) -> None:
        self._push()

    def pop(self) -> None:
        self._pop()

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._release()


class CudaApi(ABC):
    """What both bindings provide; see the module docstring. Calls that touch memory, streams or
    mem_get_info need a pushed DeviceContext on the calling thread, as in CUDA itself. Abstract:
    a binding that lacks one of these cannot be instantiated."""

    name = "?"
    can_capture = False  # whether capture() works (cuda-python: yes; pycuda has no stream capture)

    @abstractmethod
    def init(self) -> None: ...

    @abstractmethod
    def device_count(self) -> int: ...

    @abstractmethod
    def device_name(self, index: int) -> str: ...

    @abstractmethod
    def compute_capability(self, index: int) -> tuple[int, int]: ...

    @abstractmethod
    def driver_version(self) -> int:  # e.g. 12060 for CUDA 12.6
        ...

    @abstractmethod
    def open_device(self, index: int) -> DeviceContext: ...

    @abstractmethod
    def mem_alloc(self, nbytes: int) -> DeviceBuffer: ...

    @abstractmethod
    def pinned_empty(self, count: int, dtype: Any) -> HostBuffer: ...

    @abstractmethod
    def stream(self) -> Stream: ...

    @abstractmethod
    def copy_htod_async(self, dst: DeviceBuffer, src: np.ndarray, stream: Stream) -> None: ...

    @abstractmethod
    def copy_dtoh_async(self, dst: np.ndarray, src: DeviceBuffer, stream: Stream) -> None: ...

    @abstractmethod
    def mem_get_info(self) -> tuple[int, int]:  # (free, total) bytes
        ...

    def capture(self, stream: Stream, enqueue: Callable[[], None]) -> CudaGraph:
        """What `enqueue` puts on `stream`, captured (not run) as an instantiated graph. CudaError
        (code NOT_SUPPORTED) where the binding cannot capture; the stream is usable afterwards
        whatever `enqueue` raised."""
        raise CudaError(f"{self.name} cannot capture CUDA graphs (stream capture needs cuda-python: "
                        "pip install cuda-bindings)", "NOT_SUPPORTED")

    # CUDA shared memory: the calls below need the device's context pushed, as above. The copies
    # are synchronous (the null stream): a region is another process's, and the batch that reads
    # it must see the bytes before the engine runs; pageable host memory is fine for them.

    @abstractmethod
    def is_integrated(self, index: int) -> bool:  # CU_DEVICE_ATTRIBUTE_INTEGRATED: a Jetson's iGPU
        ...

    @abstractmethod
    def ipc_open(self, handle: bytes) -> IpcMemory: ...

    @abstractmethod
    def copy_dtod(self, dst: int, src: int, nbytes: int) -> None: ...

    @abstractmethod
    def copy_dtoh(self, dst: np.ndarray, src: int) -> None:  # dst: C-contiguous, its nbytes copied
        ...

    @abstractmethod
    def copy_htod(self, dst: int, src: np.ndarray) -> None:  # src: C-contiguous
        ...

    @abstractmethod
    def synchronize(self) -> None:  # the current context's work done (device-to-device copies return early)
        ...

    def is_out_of_memory(self, exc: BaseException) -> bool:
        if isinstance(exc, CudaError) and exc.code == "CUDA_ERROR_OUT_OF_MEMORY":
            return True
        return isinstance(exc, MemoryError) or "out of memory" in str(exc).lower()

    def describe(self) -> str:
        try:
            v = self.driver_version()
            return f"{self.name} (CUDA driver {v // 1000}.{v % 1000 // 10})"
        except Exception:  # before init / no driver: the name alone
            return self.name


# --------------------------------------------------------------------------- cuda-python


class CudaPythonApi(CudaApi):
    """cuda-python's driver API (`cuda.bindings.driver`): every call returns (CUresult, values...)."""

    name = "cuda-python"
    can_capture = True

    def __init__(self, driver: Any):
        self.d = driver
        self._devices: dict[int, Any] = {}

    def _call(self, what: str, result: tuple) -> Any:
        err, *values = result
        if int(err) != 0:
            code = getattr(err, "name", "") or str(err)
            try:
                named = self.d.cuGetErrorName(err)
                if int(named[0]) == 0 and named[1]:
                    code = named[1].decode() if isinstance(named[1], bytes) else str(named[1])
            except Exception:  # the name is a nicety
                pass
            raise CudaError(f"{what} failed: {code}", code)
        if not values:
            return None
        return values[0] if len(values) == 1 else tuple(values)

    def init(self) -> None:
        try:
            self._call("cuInit", self.d.cuInit(0))
        except CudaError:
            raise
        except Exception as exc:  # no driver library: cuda.pathfinder raises its own error
            raise CudaError(f"cuInit failed: {exc}", "CUDA_ERROR_NO_DEVICE") from exc

    def _device(self, index: int) -> Any:
        if index not in self._devices:
            self._devices[index] = self._call("cuDeviceGet", self.d.cuDeviceGet(index))
        return self._devices[index]

    def device_count(self) -> int:
        return int(self._call("cuDeviceGetCount", self.d.cuDeviceGetCount()))

    def device_name(self, index: int) -> str:
        raw = self._call("cuDeviceGetName", self.d.cuDeviceGetName(256, self._device(index)))
        return (raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)).split("\x00", 1)[0]

    def compute_capability(self, index: int) -> tuple[int, int]:
        attr = self.d.CUdevice_attribute
        dev = self._device(index)
        major = self._call("cuDeviceGetAttribute", self.d.cuDeviceGetAttribute(
            attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev))
        minor = self._call("cuDeviceGetAttribute", self.d.cuDeviceGetAttribute(
            attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev))
        return int(major), int(minor)

    def driver_version(self) -> int:
        return int(self._call("cuDriverGetVersion", self.d.cuDriverGetVersion()))

    def open_device(self, index: int) -> DeviceContext:
        dev = self._device(index)
        ctx = self._call("cuDevicePrimaryCtxRetain", self.d.cuDevicePrimaryCtxRetain(dev))
        return DeviceContext(
            push=lambda: self._call("cuCtxPushCurrent", self.d.cuCtxPushCurrent(ctx)),
            pop=lambda: self._call("cuCtxPopCurrent", self.d.cuCtxPopCurrent()),
            release=lambda: self._call("cuDevicePrimaryCtxRelease", self.d.cuDevicePrimaryCtxRelease(dev)),
        )

    def mem_alloc(self, nbytes: int) -> DeviceBuffer:
        ptr = self._call("cuMemAlloc", self.d.cuMemAlloc(int(nbytes)))
        return DeviceBuffer(int(ptr), int(nbytes), lambda: self._call("cuMemFree", self.d.cuMemFree(ptr)))

    def pinned_empty(self, count: int, dtype: Any) -> HostBuffer:
        dtype = np.dtype(dtype)
        nbytes = max(int(count) * dtype.itemsize, 1)
        address = int(self._call("cuMemAllocHost", self.d.cuMemAllocHost(nbytes)))
        raw = (ctypes.c_uint8 * nbytes).from_address(address)
        array = np.frombuffer(raw, dtype=np.uint8, count=int(count) * dtype.itemsize).view(dtype)
        return HostBuffer(array, lambda: self._call("cuMemFreeHost", self.d.cuMemFreeHost(address)))

    def stream(self) -> Stream:
        raw = self._call("cuStreamCreate", self.d.cuStreamCreate(int(self.d.CUstream_flags.CU_STREAM_NON_BLOCKING)))
        return Stream(int(raw), raw, lambda: self._call("cuStreamSynchronize", self.d.cuStreamSynchronize(raw)),
                      lambda: self._call("cuStreamDestroy", self.d.cuStreamDestroy(raw)))

    def copy_htod_async(self, dst: DeviceBuffer, src: np.ndarray, stream: Stream) -> None:
        self._call("cuMemcpyHtoDAsync", self.d.cuMemcpyHtoDAsync(
            dst.ptr, src.__array_interface__["data"][0], src.nbytes, stream.raw))

    def copy_dtoh_async(self, dst: np.ndarray, src: DeviceBuffer, stream: Stream) -> None:
        self._call("cuMemcpyDtoHAsync", self.d.cuMemcpyDtoHAsync(
            dst.__array_interface__["data"][0], src.ptr, dst.nbytes, stream.raw))

    def mem_get_info(self) -> tuple[int, int]:
        free, total = self._call("cuMemGetInfo", self.d.cuMemGetInfo())
        return int(free), int(total)

    def capture(self, stream: Stream, enqueue: Callable[[], None]) -> CudaGraph:
        # thread-local: other threads' CUDA calls (another engine's) neither join nor break the capture
        mode = self.d.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
        self._call("cuStreamBeginCapture", self.d.cuStreamBeginCapture(stream.raw, mode))
        try:
            enqueue()
        except BaseException:
            err, graph = self.d.cuStreamEndCapture(stream.raw)  # ended whatever happened: the stream stays usable
            if int(err) == 0 and graph is not None:
                self.d.cuGraphDestroy(graph)
            raise
        graph = self._call("cuStreamEndCapture", self.d.cuStreamEndCapture(stream.raw))
        try:
            executable = self._call("cuGraphInstantiate", self.d.cuGraphInstantiate(graph, 0))
        finally:
            self._call("cuGraphDestroy", self.d.cuGraphDestroy(graph))  # the executable keeps what it needs
        return CudaGraph(
            lambda on: self._call("cuGraphLaunch", self.d.cuGraphLaunch(executable, on.raw)),
            lambda: self._call("cuGraphExecDestroy", self.d.cuGraphExecDestroy(executable)))

    def is_integrated(self, index: int) -> bool:
        attr = self.d.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_INTEGRATED
        return bool(self._call("cuDeviceGetAttribute", self.d.cuDeviceGetAttribute(attr, self._device(index))))

    def ipc_open(self, handle: bytes) -> IpcMemory:
        raw = self.d.CUipcMemHandle()
        if hasattr(raw, "reserved"):
            raw.reserved = bytes(handle)
        else:  # cuda-bindings 13 dropped `reserved`: the struct's 64 bytes are at getPtr()
            ctypes.memmove(raw.getPtr(), bytes(handle), IPC_HANDLE_SIZE)
        flags = self.d.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
        ptr = self._call("cuIpcOpenMemHandle", self.d.cuIpcOpenMemHandle(raw, flags))
        return IpcMemory(int(ptr), lambda: self._call("cuIpcCloseMemHandle", self.d.cuIpcCloseMemHandle(ptr)))

    def copy_dtod(self, dst: int, src: int, nbytes: int) -> None:
        self._call("cuMemcpyDtoD", self.d.cuMemcpyDtoD(dst, src, nbytes))

    def copy_dtoh(self, dst: np.ndarray, src: int) -> None:
        self._call("cuMemcpyDtoH", self.d.cuMemcpyDtoH(dst.__array_interface__["data"][0], src, dst.nbytes))

    def copy_htod(self, dst: int, src: np.ndarray) -> None:
        self._call("cuMemcpyHtoD", self.d.cuMemcpyHtoD(dst, src.__array_interface__["data"][0], src.nbytes))

    def synchronize(self) -> None:
        self._call("cuCtxSynchronize", self.d.cuCtxSynchronize())


# --------------------------------------------------------------------------- pycuda


class PycudaApi(CudaApi):
    """pycuda.driver: raises its own exceptions, and frees page-locked arrays when collected."""

    name = "pycuda"

    def __init__(self, driver: Any):
        self.d = driver

    def init(self) -> None:
        self.d.init()

    def device_count(self) -> int:
        return int(self.d.Device.count())

    def device_name(self, index: int) -> str:
        return str(self.d.Device(index).name())

    def compute_capability(self, index: int) -> tuple[int, int]:
        major, minor = self.d.Device(index).compute_capability()
        return int(major), int(minor)

    def driver_version(self) -> int:
        return int(self.d.get_driver_version())

    def open_device(self, index: int) -> DeviceContext:
        ctx = self.d.Device(index).retain_primary_context()
        return DeviceContext(push=ctx.push, pop=self.d.Context.pop, release=ctx.detach)

    def mem_alloc(self, nbytes: int) -> DeviceBuffer:
        alloc = self.d.mem_alloc(int(nbytes))
        return DeviceBuffer(int(alloc), int(nbytes), alloc.free)

    def pinned_empty(self, count: int, dtype: Any) -> HostBuffer:
        array = self.d.pagelocked_empty(int(count), np.dtype(dtype))
        base: Any = getattr(array, "base", None)
        return HostBuffer(array, base.free if hasattr(base, "free") else (lambda: None))

    def stream(self) -> Stream:
        raw = self.d.Stream()
        return Stream(int(raw.handle), raw, raw.synchronize, lambda: None)

    def copy_htod_async(self, dst: DeviceBuffer, src: np.ndarray, stream: Stream) -> None:
        self.d.memcpy_htod_async(dst.ptr, src, stream.raw)

    def copy_dtoh_async(self, dst: np.ndarray, src: DeviceBuffer, stream: Stream) -> None:
        self.d.memcpy_dtoh_async(dst, src.ptr, stream.raw)

    def mem_get_info(self) -> tuple[int, int]:
        free, total = self.d.mem_get_info()
        return int(free), int(total)

    def is_integrated(self, index: int) -> bool:
        return bool(self.d.Device(index).get_attribute(self.d.device_attribute.INTEGRATED))

    def ipc_open(self, handle: bytes) -> IpcMemory:
        opened = self.d.IPCMemoryHandle(bytes(handle), self.d.ipc_mem_flags.LAZY_ENABLE_PEER_ACCESS)
        return IpcMemory(int(opened), opened.close)

    def copy_dtod(self, dst: int, src: int, nbytes: int) -> None:
        self.d.memcpy_dtod(dst, src, nbytes)

    def copy_dtoh(self, dst: np.ndarray, src: int) -> None:
        self.d.memcpy_dtoh(dst, src)

    def copy_htod(self, dst: int, src: np.ndarray) -> None:
        self.d.memcpy_htod(dst, src)

    def synchronize(self) -> None:
        self.d.Context.synchronize()

    def is_out_of_memory(self, exc: BaseException) -> bool:
        oom = getattr(self.d, "MemoryError", None)
        return (isinstance(oom, type) and isinstance(exc, oom)) or super().is_out_of_memory(exc)


# --------------------------------------------------------------------------- choosing one


def cuda_api_from(module: Any) -> CudaApi:
    """A CudaApi over a given binding module (or fake), or the CudaApi itself."""
    if isinstance(module, CudaApi):
        return module
    if hasattr(module, "cuMemAlloc"):
        return CudaPythonApi(module)
    if hasattr(module, "mem_alloc"):
        return PycudaApi(module)
    raise TypeError(f"{module!r} is neither cuda.bindings.driver nor pycuda.driver")


def load_cuda_api(prefer: str | None = None) -> CudaApi:
    """The installed binding: cuda-python when it imports, else pycuda; ImportError naming both.

    `prefer` (or $EDGE_BATCHER_CUDA_BINDING) = "cuda-python" | "pycuda" takes only that one.
    """
    choice = prefer or os.environ.get(BINDING_ENV, "") or None
    if choice is not None and choice not in BINDINGS:
        raise ImportError(f"{BINDING_ENV}={choice!r}: expected one of {', '.join(BINDINGS)}")
    errors = []
    for name in ([choice] if choice else list(BINDINGS)):
        try:
            if name == "cuda-python":
                from cuda.bindings import driver  # noqa: PLC0415

                return CudaPythonApi(driver)
            import pycuda.driver as driver  # noqa: PLC0415

            return PycudaApi(driver)
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
    raise ImportError(f"no CUDA Python binding ({'; '.join(errors)}); {INSTALL_HINT}")
