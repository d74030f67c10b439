"""Triton's shared memory RPCs on the gRPC API, on the daemon's registries (HTTP's too):
SystemSharedMemoryRegister/Unregister/Status as HTTP's /v2/systemsharedmemory, and
CudaSharedMemoryRegister/Unregister/Status as HTTP's /v2/cudasharedmemory (raw_handle carries the
cudaIpcMemHandle_t's 64 bytes as they are, not base64); an empty name unregisters every region or
lists them all. CUDA registration and unregistration open and close IPC mappings: on a thread.
"""

from __future__ import annotations

import asyncio
from typing import Any

from ...shared_memory.cuda_regions import CudaRegionRegistry
from ...shared_memory.regions import RegionRegistry
from . import grpc_service_pb2 as pb
from .edge import Method


def shared_memory_rpcs(registry: RegionRegistry, cuda: CudaRegionRegistry) -> dict[str, tuple[Method, Any]]:
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
        await asyncio.get_running_loop().run_in_executor(
            None, cuda.register, request.name, bytes(request.raw_handle), request.device_id, request.byte_size)
        return pb.CudaSharedMemoryRegisterResponse()

    async def cuda_unregister(request: pb.CudaSharedMemoryUnregisterRequest, context) -> Any:
        await asyncio.get_running_loop().run_in_executor(None, cuda.unregister, request.name or None)
        return pb.CudaSharedMemoryUnregisterResponse()

    async def cuda_status(request: pb.CudaSharedMemoryStatusRequest, context) -> Any:
        response = pb.CudaSharedMemoryStatusResponse()
        for region in cuda.status(request.name or None):
            response.regions[str(region["name"])].CopyFrom(
                pb.CudaSharedMemoryStatusResponse.RegionStatus(**region))  # type: ignore[arg-type]
        return response

    return {
        "SystemSharedMemoryRegister": (register, pb.SystemSharedMemoryRegisterRequest),
        "SystemSharedMemoryUnregister": (unregister, pb.SystemSharedMemoryUnregisterRequest),
        "SystemSharedMemoryStatus": (status, pb.SystemSharedMemoryStatusRequest),
        "CudaSharedMemoryRegister": (cuda_register, pb.CudaSharedMemoryRegisterRequest),
        "CudaSharedMemoryUnregister": (cuda_unregister, pb.CudaSharedMemoryUnregisterRequest),
        "CudaSharedMemoryStatus": (cuda_status, pb.CudaSharedMemoryStatusRequest),
    }
