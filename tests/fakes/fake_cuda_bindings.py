"""FakeCudaDriver: an honest stand-in for cuda-python's `cuda.bindings.driver`, in tests.

NOT CUDA. It is the same fake GPU as tests/fakes/fake_cuda.py's FakeCuda (numpy "device"
memory, thread-local context stacks, streams that run their work at synchronize), seen through
cuda-python's driver API instead of pycuda's: every function returns a tuple whose first item
is a CUresult, and errors are codes, not exceptions. So FakeTensorRT runs on memory and
streams made through either binding.

Same names, argument orders and result tuples as cuda.bindings.driver for the calls
edge_batcher/engines/cuda_api.py makes (tests/trt/test_cuda_api.py checks the names against
the real module where cuda-python is installed). Enforced as the driver does: calls that need a
context fail with CUDA_ERROR_INVALID_CONTEXT when none is current on the thread, calls before
cuInit with CUDA_ERROR_NOT_INITIALIZED, allocations beyond the fake device's memory with
CUDA_ERROR_OUT_OF_MEMORY. Stricter than the driver: the host side of an async copy must be
memory from cuMemAllocHost (the driver also takes pageable memory, silently synchronously).
Stream capture records the work enqueued on the stream (each operation already bound to its
addresses and shapes, as a captured kernel is) instead of running it; a launched graph enqueues
that work again; synchronizing a capturing stream fails as the driver's does.
"""

from __future__ import annotations

import ctypes
import enum
from typing import Any

import numpy as np

from tests.fakes.fake_cuda import CudaLogicError, CudaMemoryError, FakeContext, FakeCuda, IpcMapping


class CUresult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_OUT_OF_MEMORY = 2
    CUDA_ERROR_NOT_INITIALIZED = 3
    CUDA_ERROR_NO_DEVICE = 100
    CUDA_ERROR_INVALID_DEVICE = 101
    CUDA_ERROR_INVALID_CONTEXT = 201
    CUDA_ERROR_INVALID_HANDLE = 400
    CUDA_ERROR_ILLEGAL_STATE = 401
    CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED = 900


class CUdevice_attribute(enum.IntEnum):  # noqa: N801 - cuda-python's name
    CU_DEVICE_ATTRIBUTE_INTEGRATED = 18
    CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75
    CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76


class CUipcMem_flags(enum.IntEnum):  # noqa: N801
    CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1


class CUipcMemHandle:
    """cuda-python's CUipcMemHandle before cuda-bindings 13: its 64 bytes in `reserved` (and at getPtr())."""

    def __init__(self) -> None:
        self._struct = ctypes.create_string_buffer(64)

    def getPtr(self) -> int:  # noqa: N802 - cuda-python's name
        return ctypes.addressof(self._struct)

    @property
    def reserved(self) -> bytes:
        return self._struct.raw

    @reserved.setter
    def reserved(self, value: bytes) -> None:
        if len(value) != 64:
            raise ValueError("CUipcMemHandle.reserved takes 64 bytes")
        ctypes.memmove(self._struct, value, 64)


class CUipcMemHandle13:
    """cuda-bindings 13's CUipcMemHandle: no `reserved`, only getPtr() to the struct's 64 bytes."""

    def __init__(self) -> None:
        self._struct = ctypes.create_string_buffer(64)

    def getPtr(self) -> int:  # noqa: N802
        return ctypes.addressof(self._struct)


class CUstream_flags(enum.IntEnum):  # noqa: N801
    CU_STREAM_DEFAULT = 0
    CU_STREAM_NON_BLOCKING = 1


class CUstreamCaptureMode(enum.IntEnum):  # noqa: N801
    CU_STREAM_CAPTURE_MODE_GLOBAL = 0
    CU_STREAM_CAPTURE_MODE_THREAD_LOCAL = 1
    CU_STREAM_CAPTURE_MODE_RELAXED = 2


class _Handle:
    """cuda-python's handle types: int() gives the address / handle."""

    def __init__(self, value: int, obj: Any = None):
        self._value = int(value)
        self.obj = obj

    def __int__(self) -> int:
        return self._value

    def getPtr(self) -> int:  # noqa: N802 - cuda-python's name
        return self._value


class CUdevice(_Handle):
    pass


class CUdeviceptr(_Handle):
    pass


class CUstream(_Handle):
    pass


class CUcontext(_Handle):
    pass


class CUgraph(_Handle):
    pass


class CUgraphExec(_Handle):
    pass


_OK = CUresult.CUDA_SUCCESS


class FakeCudaDriver:
    """The cuda.bindings.driver functions edge-batcher calls, over a FakeCuda device."""

    IS_FAKE = True
    CUresult = CUresult
    CUdevice_attribute = CUdevice_attribute
    CUstream_flags = CUstream_flags
    CUipcMem_flags = CUipcMem_flags
    CUipcMemHandle = CUipcMemHandle
    CUdevice = CUdevice
    CUdeviceptr = CUdeviceptr
    CUstream = CUstream
    CUcontext = CUcontext
    CUstreamCaptureMode = CUstreamCaptureMode

    def __init__(self, gpu: FakeCuda):
        self.gpu = gpu
        self._host: dict[int, np.ndarray] = {}  # cuMemAllocHost address -> its bytes
        self._ipc: dict[int, IpcMapping] = {}  # cuIpcOpenMemHandle address -> its mapping
        self.counters = {"cuMemAlloc": 0, "cuMemAllocHost": 0, "cuMemFree": 0, "cuMemFreeHost": 0,
                         "cuStreamBeginCapture": 0, "cuGraphLaunch": 0}
        # Graphs as the work their capture recorded (each op bound to its addresses and shapes
        # when it was enqueued, as a captured kernel is); executables are copies of them.
        self._graphs: dict[int, list] = {}
        self._executables: dict[int, list] = {}
        self._next_graph = 0x6000

    # ------------------------------------------------------------------ errors

    def _code(self, exc: Exception) -> CUresult:
        text = str(exc)
        if isinstance(exc, CudaMemoryError):
            return CUresult.CUDA_ERROR_OUT_OF_MEMORY
        if "cuInit" in text:
            return CUresult.CUDA_ERROR_NOT_INITIALIZED
        if "context" in text:
            return CUresult.CUDA_ERROR_INVALID_CONTEXT
        if "ordinal" in text:
            return CUresult.CUDA_ERROR_INVALID_DEVICE
        return CUresult.CUDA_ERROR_INVALID_VALUE

    def _run(self, fn, *wrap):
        """(CUSUCCESS, *results of fn) or (the error's code, None...) for FakeCuda's exceptions."""
        try:
            out = fn()
        except (CudaLogicError, CudaMemoryError) as exc:
            return (self._code(exc),) + (None,) * len(wrap)
        if not wrap:
            return (_OK,)
        out = out if isinstance(out, tuple) else (out,)
        return (_OK, *out)

    def cuGetErrorName(self, error: CUresult):  # noqa: N802
        return _OK, CUresult(int(error)).name.encode()

    # ------------------------------------------------------------------ devices and contexts

    def cuInit(self, flags: int):  # noqa: N802
        self.gpu.init(flags)
        return (_OK,)

    def cuDriverGetVersion(self):  # noqa: N802
        return _OK, self.gpu.driver_version

    def cuDeviceGetCount(self):  # noqa: N802
        return self._run(lambda: self.gpu.Device.count(), 1)

    def cuDeviceGet(self, ordinal: int):  # noqa: N802
        return self._run(lambda: CUdevice(ordinal, self.gpu.get_device(ordinal)), 1)

    def cuDeviceGetName(self, length: int, dev: CUdevice):  # noqa: N802
        return _OK, dev.obj.name().encode()[: length - 1]

    def cuDeviceGetAttribute(self, attrib: CUdevice_attribute, dev: CUdevice):  # noqa: N802
        if attrib == CUdevice_attribute.CU_DEVICE_ATTRIBUTE_INTEGRATED:
            return _OK, int(self.gpu.integrated)
        major, minor = dev.obj.compute_capability()
        if attrib == CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR:
            return _OK, major
        if attrib == CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR:
            return _OK, minor
        return CUresult.CUDA_ERROR_INVALID_VALUE, None

    def cuDevicePrimaryCtxRetain(self, dev: CUdevice):  # noqa: N802
        context = dev.obj.retain_primary_context()
        return _OK, CUcontext(id(context), context)

    def cuDevicePrimaryCtxRelease(self, dev: CUdevice):  # noqa: N802
        if self.gpu.primary_retained <= 0:
            return (CUresult.CUDA_ERROR_INVALID_CONTEXT,)
        self.gpu.primary_retained -= 1
        return (_OK,)

    def cuCtxPushCurrent(self, ctx: CUcontext):  # noqa: N802
        context: FakeContext = ctx.obj
        return self._run(context.push)

    def cuCtxPopCurrent(self):  # noqa: N802
        stack = self.gpu._stack()
        if not stack:
            return CUresult.CUDA_ERROR_INVALID_CONTEXT, None
        context = stack.pop()
        return _OK, CUcontext(id(context), context)

    # ------------------------------------------------------------------ memory

    def cuMemAlloc(self, bytesize: int):  # noqa: N802
        def alloc():
            self.gpu.require_context("cuMemAlloc")
            self.counters["cuMemAlloc"] += 1
            return CUdeviceptr(self.gpu._allocate(bytesize, "user").ptr)
        return self._run(alloc, 1)

    def cuMemFree(self, dptr: CUdeviceptr):  # noqa: N802
        alloc = self.gpu.allocations.get(int(dptr))
        if alloc is None or not alloc.live:
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)
        alloc.live = False
        self.counters["cuMemFree"] += 1
        self.gpu.counters["free"] += 1
        return (_OK,)

    def cuMemAllocHost(self, bytesize: int):  # noqa: N802
        def alloc():
            self.gpu.require_context("cuMemHostAlloc")
            data = np.zeros(int(bytesize), dtype=np.uint8)
            address = data.__array_interface__["data"][0]
            self._host[address] = data
            self.gpu._pinned.append((address, address + data.nbytes))
            self.counters["cuMemAllocHost"] += 1
            self.gpu.counters["pagelocked_empty"] += 1
            return address
        return self._run(alloc, 1)

    def cuMemFreeHost(self, p: int):  # noqa: N802
        data = self._host.pop(int(p), None)
        if data is None:
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)
        self.gpu._pinned.remove((int(p), int(p) + data.nbytes))
        self.counters["cuMemFreeHost"] += 1
        return (_OK,)

    def _host_view(self, address: int, nbytes: int) -> np.ndarray | None:
        for start, data in self._host.items():
            if start <= address and address + nbytes <= start + data.nbytes:
                return data[address - start: address - start + nbytes]
        return None

    def cuMemGetInfo(self):  # noqa: N802
        return self._run(self.gpu.mem_get_info, 1, 2)

    # ------------------------------------------------------------------ streams and copies

    def cuStreamCreate(self, Flags: int):  # noqa: N802, N803
        return self._run(lambda: CUstream(self.gpu.Stream().handle), 1)

    def _stream(self, stream: CUstream):
        return self.gpu.stream_by_handle(int(stream))

    def cuStreamSynchronize(self, hStream: CUstream):  # noqa: N802, N803
        s = self._stream(hStream)
        if s is None:
            return (CUresult.CUDA_ERROR_INVALID_HANDLE,)
        return self._run(s.synchronize)

    def cuStreamDestroy(self, hStream: CUstream):  # noqa: N802, N803
        if self.gpu.streams.pop(int(hStream), None) is None:
            return (CUresult.CUDA_ERROR_INVALID_HANDLE,)
        return (_OK,)

    def _copy(self, what: str, host: int, device: int, nbytes: int, stream: CUstream, to_device: bool):
        try:
            self.gpu.require_context(what)
            self.gpu.lookup(int(device), int(nbytes))
        except CudaLogicError as exc:
            return (self._code(exc),)
        view = self._host_view(int(host), int(nbytes))
        if view is None:
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)  # FakeCudaDriver: host memory must come from cuMemAllocHost
        s = self._stream(stream)
        if s is None:
            return (CUresult.CUDA_ERROR_INVALID_HANDLE,)
        key = "memcpy_htod" if to_device else "memcpy_dtoh"
        self.gpu.counters[key] += 1
        if to_device:
            s.enqueue(lambda: self.gpu.write(int(device), view))
        else:
            s.enqueue(lambda: view.__setitem__(slice(None), self.gpu.read(int(device), int(nbytes))))
        return (_OK,)

    def cuMemcpyHtoDAsync(self, dstDevice, srcHost, ByteCount: int, hStream):  # noqa: N802, N803
        return self._copy("cuMemcpyHtoDAsync", srcHost, dstDevice, ByteCount, hStream, True)

    def cuMemcpyDtoHAsync(self, dstHost, srcDevice, ByteCount: int, hStream):  # noqa: N802, N803
        return self._copy("cuMemcpyDtoHAsync", dstHost, srcDevice, ByteCount, hStream, False)

    # ------------------------------------------------------------------ CUDA IPC and synchronous copies

    def cuIpcOpenMemHandle(self, handle: CUipcMemHandle, Flags: int):  # noqa: N802, N803
        def open_():
            mapping = self.gpu.IPCMemoryHandle(ctypes.string_at(handle.getPtr(), 64), int(Flags))
            self._ipc[int(mapping)] = mapping
            return CUdeviceptr(int(mapping))
        return self._run(open_, 1)

    def cuIpcCloseMemHandle(self, dptr: CUdeviceptr):  # noqa: N802
        mapping = self._ipc.pop(int(dptr), None)
        if mapping is None:
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)
        return self._run(mapping.close)

    def cuCtxSynchronize(self):  # noqa: N802
        return self._run(lambda: self.gpu.require_context("cuCtxSynchronize"))

    def cuMemcpyDtoD(self, dstDevice, srcDevice, ByteCount: int):  # noqa: N802, N803
        return self._run(lambda: self.gpu.memcpy_dtod(int(dstDevice), int(srcDevice), int(ByteCount)))

    def cuMemcpyDtoH(self, dstHost: int, srcDevice, ByteCount: int):  # noqa: N802, N803
        def copy():  # a real memcpy into the host address, as the driver does (pageable memory allowed)
            self.gpu.require_context("cuMemcpyDtoH")
            data = self.gpu.read(int(srcDevice), int(ByteCount))
            ctypes.memmove(int(dstHost), data.ctypes.data, int(ByteCount))
            self.gpu.counters["memcpy_dtoh"] += 1
        return self._run(copy)

    def cuMemcpyHtoD(self, dstDevice, srcHost: int, ByteCount: int):  # noqa: N802, N803
        def copy():
            self.gpu.require_context("cuMemcpyHtoD")
            data = np.empty(int(ByteCount), dtype=np.uint8)
            ctypes.memmove(data.ctypes.data, int(srcHost), int(ByteCount))
            self.gpu.write(int(dstDevice), data)
            self.gpu.counters["memcpy_htod"] += 1
        return self._run(copy)


    # ------------------------------------------------------------------ graphs

    def cuStreamBeginCapture(self, hStream, mode):  # noqa: N802, N803
        s = self._stream(hStream)
        if s is None:
            return (CUresult.CUDA_ERROR_INVALID_HANDLE,)
        if s.capture is not None:
            return (CUresult.CUDA_ERROR_ILLEGAL_STATE,)
        self.counters["cuStreamBeginCapture"] += 1
        s.capture = []
        return (_OK,)

    def cuStreamEndCapture(self, hStream):  # noqa: N802, N803
        s = self._stream(hStream)
        if s is None:
            return CUresult.CUDA_ERROR_INVALID_HANDLE, None
        if s.capture is None:
            return CUresult.CUDA_ERROR_ILLEGAL_STATE, None
        ops, s.capture = s.capture, None
        self._next_graph += 1
        self._graphs[self._next_graph] = ops
        return _OK, CUgraph(self._next_graph)

    def cuGraphInstantiate(self, hGraph, flags: int):  # noqa: N802, N803
        ops = self._graphs.get(int(hGraph))
        if ops is None:
            return CUresult.CUDA_ERROR_INVALID_HANDLE, None
        self._next_graph += 1
        self._executables[self._next_graph] = list(ops)
        return _OK, CUgraphExec(self._next_graph)

    def cuGraphLaunch(self, hGraphExec, hStream):  # noqa: N802, N803
        ops, s = self._executables.get(int(hGraphExec)), self._stream(hStream)
        if ops is None or s is None:
            return (CUresult.CUDA_ERROR_INVALID_HANDLE,)
        self.counters["cuGraphLaunch"] += 1
        for op in ops:
            s.enqueue(op)
        return (_OK,)

    def cuGraphDestroy(self, hGraph):  # noqa: N802, N803
        return (_OK,) if self._graphs.pop(int(hGraph), None) is not None else (CUresult.CUDA_ERROR_INVALID_HANDLE,)

    def cuGraphExecDestroy(self, hGraphExec):  # noqa: N802, N803
        if self._executables.pop(int(hGraphExec), None) is None:
            return (CUresult.CUDA_ERROR_INVALID_HANDLE,)
        return (_OK,)

    @property
    def live_graphs(self) -> int:
        """Graphs and executables not destroyed yet (a test checks that close() frees them)."""
        return len(self._graphs) + len(self._executables)


def fake_cuda_module(binding: str, gpu: FakeCuda) -> Any:
    """The fake binding module named "pycuda" (FakeCuda itself) or "cuda-python" (FakeCudaDriver)."""
    return gpu if binding == "pycuda" else FakeCudaDriver(gpu)
