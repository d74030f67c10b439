"""The registry of CUDA shared memory regions: a name -> a client's device buffer opened once from
its CUDA IPC handle (cuIpcOpenMemHandle) in the primary context of the device it lives on, with the
rules of the system shared memory registry (regions.py): bounded count and bytes ([server]
shm_max_regions / shm_max_bytes, counted for CUDA regions by themselves), one namespace with the
system regions (as in Triton, a request names a region without saying which kind), and reference
counts so that an unregister while a request reads the region closes the IPC mapping only when the
last request using it ends and its last user is gone (an input's DeviceTensor, an output's
writer: a request whose client went away leaves its batch running; the batch may still read or
write the region). Where CUDA IPC cannot work,
registration is refused with the reason: no CUDA binding or driver, a device_id this machine does
not have, or an integrated GPU (a Jetson), whose GPU reads system shared memory directly. Every
method that calls CUDA blocks: transports call them on a thread, never on the event loop.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

from ..engines.cuda_api import IPC_HANDLE_SIZE, CudaApi, DeviceContext, IpcMemory, load_cuda_api
from ..errors import InvalidInput
from .named_regions import NamedRegions, RegionLimits, check_name
from .regions import RegionRegistry

log = logging.getLogger(__name__)

INTEGRATED_REFUSED = ("CUDA IPC is not available on integrated GPUs; use system shared memory, which the GPU "
                      "reads directly on unified memory")
USE_SYSTEM = "use system shared memory (/v2/systemsharedmemory) instead"


class CudaDevices:
    """The CUDA driver as CUDA shared memory uses it: loaded on first use (a daemon no client asks
    for CUDA shared memory never imports a binding), each device's primary context retained once
    (the context ONNX Runtime's CUDA EP and TensorRT run in, so an address opened here is theirs
    too) and pushed around each block of calls by `on(device_id)`. Blocking throughout."""

    def __init__(self, loader: Callable[[], CudaApi] = load_cuda_api):
        self._loader = loader
        self._api: CudaApi | None = None
        self._unavailable: str | None = None  # why CUDA cannot be used here, once known
        self._contexts: dict[int, DeviceContext] = {}
        self._lock = threading.Lock()

    def api(self) -> CudaApi:
        """The initialised CudaApi, or InvalidInput saying why there is none."""
        with self._lock:
            if self._api is None and self._unavailable is None:
                try:
                    api = self._loader()
                    api.init()
                    count = api.device_count()
                except Exception as exc:  # ImportError (no binding), CudaError (no driver/device), a binding's own
                    self._unavailable = f"CUDA is not available to this daemon ({exc})"
                else:
                    if count == 0:
                        self._unavailable = "this machine has no CUDA device"
                    else:
                        self._api = api
            if self._api is None:
                raise InvalidInput(f"CUDA shared memory needs a discrete CUDA GPU: {self._unavailable}; {USE_SYSTEM}")
            return self._api

    def check(self, device_id: int) -> None:
        """InvalidInput unless `device_id` names a discrete CUDA device of this machine."""
        api = self.api()
        count = api.device_count()
        if not 0 <= device_id < count:
            raise InvalidInput(f"device_id {device_id} is not a CUDA device of this machine: it has {count} "
                               f"(device_id 0..{count - 1})")
        if api.is_integrated(device_id):
            raise InvalidInput(f"{INTEGRATED_REFUSED} (device {device_id}: {api.device_name(device_id)})")

    @contextmanager
    def on(self, device_id: int) -> Iterator[CudaApi]:
        """The api with `device_id`'s primary context current on this thread for the block."""
        api = self.api()
        with self._lock:
            context = self._contexts.get(device_id)
            if context is None:
                context = self._contexts[device_id] = api.open_device(device_id)
        context.push()
        try:
            yield api
        finally:
            context.pop()

    def close(self) -> None:
        with self._lock:
            contexts, self._contexts = list(self._contexts.values()), {}
        for context in contexts:
            context.release()


class CudaRegion:
    """One registered region: the device buffer opened from its handle, byte_size bytes of it."""

    def __init__(self, name: str, device_id: int, byte_size: int, memory: IpcMemory):
        self.name, self.device_id, self.byte_size = name, device_id, byte_size
        self.memory = memory
        self.users = 0  # requests holding it now
        self.tensors = 0  # its users still alive (DeviceTensors, DeviceOutputs: queued or in a batch)
        self.registered = True

    @property
    def unused(self) -> bool:
        return self.users == 0 and self.tensors == 0 and not self.registered

    def address(self, offset: int, byte_size: int, where: str) -> int:
        """The device address of byte_size bytes at `offset` in the region (InvalidInput when out of range)."""
        if offset < 0 or byte_size < 0 or offset + byte_size > self.byte_size:
            raise InvalidInput(f"{where}: shared_memory_offset {offset} + shared_memory_byte_size {byte_size} "
                               f"is beyond CUDA region {self.name!r} ({self.byte_size} bytes)")
        return self.memory.ptr + offset

    def status(self) -> dict[str, object]:
        return {"name": self.name, "device_id": self.device_id, "byte_size": self.byte_size}


class CudaRegionRegistry(NamedRegions[CudaRegion]):
    """The daemon's CUDA regions by name; used from the event loop (acquire, release, status) and
    from threads (register, unregister, close: they call CUDA)."""

    kind = "CUDA shared memory"
    holding = "open"

    def __init__(self, limits: RegionLimits | None = None, devices: CudaDevices | None = None,
                 other_names: Callable[[str], bool] = lambda name: False):
        super().__init__(limits, other_names)
        self.devices = devices or CudaDevices()
        # A region unregistered while requests held it is closed when the last lets go: on the
        # event loop, where CUDA must not run, so the close goes to this thread.
        self._closer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cuda-shm-close")

    def register(self, name: str, raw_handle: bytes, device_id: int, byte_size: int) -> None:
        """Open the handle on `device_id` and keep it as `name` (blocking: call it on a thread)."""
        check_name(name)
        where = f"CUDA shared memory region {name!r}"
        for what, value in (("device_id", device_id), ("byte_size", byte_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidInput(f"{where}: {what} must be an integer >= 0, got {value!r}")
        if byte_size == 0:
            raise InvalidInput(f"{where}: byte_size must be > 0")
        if not isinstance(raw_handle, bytes) or len(raw_handle) != IPC_HANDLE_SIZE:
            size = len(raw_handle) if isinstance(raw_handle, bytes) else type(raw_handle).__name__
            raise InvalidInput(f"{where}: raw_handle must be the {IPC_HANDLE_SIZE} bytes of a cudaIpcMemHandle_t "
                               f"(cudaIpcGetMemHandle), got {size}")
        with self._lock:
            self._check_room(name, byte_size)
        self.devices.check(device_id)
        try:
            with self.devices.on(device_id) as api:
                memory = api.ipc_open(raw_handle)
        except InvalidInput:
            raise
        except Exception as exc:  # CudaError, a binding's own: the handle is not one this device can open
            raise InvalidInput(f"{where}: cannot open the CUDA IPC handle on device {device_id} ({exc}); it must "
                               "come from cudaIpcGetMemHandle in a live process on this machine, for memory "
                               f"on device {device_id}") from None
        self._add(CudaRegion(name, device_id, byte_size, memory))
        log.debug("registered CUDA shared memory region %r (device %d, %d bytes)", name, device_id, byte_size)

    def close(self) -> None:
        """At shutdown, after the drain: every mapping closed, the contexts released. Blocking."""
        self.unregister(None)
        self._closer.shutdown(wait=True)
        self.devices.close()

    def track(self, region: CudaRegion, user: object) -> None:
        """Keep `region` open while `user` lives (an input's DeviceTensor, an output's writer,
        lease.DeviceOutputs): the request's lease may end (its client gone) while its batch
        still reads or writes the region on a worker thread."""
        with self._lock:
            region.tensors += 1
        finalizer = weakref.finalize(user, self._untrack, region)
        finalizer.atexit = False  # at interpreter exit the process's mappings go with it: no CUDA then

    def _untrack(self, region: CudaRegion) -> None:
        with self._lock:
            region.tensors -= 1
            close = region.unused
        if close:
            self._close_unused(region)

    def _close_unused(self, region: CudaRegion) -> None:
        """Close on the registry's thread: the last user may let go on the event loop."""
        try:
            self._closer.submit(self._close, region)
        except RuntimeError:  # after close(): no loop to keep free any more
            self._close(region)

    def _close(self, region: CudaRegion) -> None:
        try:
            with self.devices.on(region.device_id):
                region.memory.close()
        except Exception:  # the client's process died, the device was reset: nothing left to close
            log.warning("CUDA shared memory region %r: closing its IPC mapping failed", region.name, exc_info=True)


def link_namespaces(system: RegionRegistry, cuda: CudaRegionRegistry) -> None:
    """One namespace for both kinds, as in Triton: each registry refuses a name the other holds."""
    system.other_names = cuda.__contains__
    cuda.other_names = system.__contains__

