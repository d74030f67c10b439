"""Triton's shared memory RPCs on the gRPC API, on the daemon's one registry (HTTP's too):
SystemSharedMemoryRegister/Unregister/Status as HTTP's /v2/systemsharedmemory (an empty name
unregisters every region or lists them all), and the CUDA ones answering as HTTP's
/v2/cudasharedmemory does here: register refused (INVALID_ARGUMENT: it needs a discrete CUDA
GPU; system shared memory is the zero-copy path on a Jetson), status empty, unregister a no-op.
"""

from __future__ import annotations

from typing import Any

from ...errors import InvalidInput
from ...shared_memory.regions import RegionRegistry
from ..http_shared_memory import CUDA_REFUSED
from . import grpc_service_pb2 as pb
from .edge import Method


def shared_memory_rpcs(registry: RegionRegistry) -> dict[str, tuple[Method, Any]]:
    """The RPCs by name, as GrpcServer registers them: (method, request type)."""

    async def register(request: pb.SystemSharedMemoryRegisterRequest, context) -> Any:
        registry.register(request.name, request.key, request.offset, request.byte_size)
        return pb.SystemSharedMemoryRegisterResponse()

    async def unregister(request: pb.SystemSharedMemoryUnregisterRequest, context) -> Any:
        registry.unregister(request.name or None)
        return pb.SystemSharedMemoryUnregisterResponse()

    async def status(request: pb.SystemSharedMemoryStatusRequest, context) -> Any:
        response = pb.SystemSharedMemoryStatusResponse()
        for region in registry.status(request.name or None):
            response.regions[str(region["name"])].CopyFrom(
                pb.SystemSharedMemoryStatusResponse.RegionStatus(**region))  # type: ignore[arg-type]
        return response

    async def cuda_register(request: pb.CudaSharedMemoryRegisterRequest, context) -> Any:
        raise InvalidInput(CUDA_REFUSED)

    async def cuda_unregister(request: pb.CudaSharedMemoryUnregisterRequest, context) -> Any:
        return pb.CudaSharedMemoryUnregisterResponse()

    async def cuda_status(request: pb.CudaSharedMemoryStatusRequest, context) -> Any:
        if request.name:
            raise InvalidInput(f"no CUDA shared memory region {request.name!r} is registered "
                               f"(none can be: {CUDA_REFUSED})")
        return pb.CudaSharedMemoryStatusResponse()

    return {
        "SystemSharedMemoryRegister": (register, pb.SystemSharedMemoryRegisterRequest),
        "SystemSharedMemoryUnregister": (unregister, pb.SystemSharedMemoryUnregisterRequest),
        "SystemSharedMemoryStatus": (status, pb.SystemSharedMemoryStatusRequest),
        "CudaSharedMemoryRegister": (cuda_register, pb.CudaSharedMemoryRegisterRequest),
        "CudaSharedMemoryUnregister": (cuda_unregister, pb.CudaSharedMemoryUnregisterRequest),
        "CudaSharedMemoryStatus": (cuda_status, pb.CudaSharedMemoryStatusRequest),
    }
