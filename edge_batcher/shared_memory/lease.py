"""One request's use of shared memory regions, system or CUDA: inputs read as views of a system
region's mapping (no copy: the batch assembly's concatenation is the one copy, or none for a batch
of one) or as DeviceTensors naming a CUDA region's device memory (copied once, on the engine's
worker thread: scheduler/device_batch.py), requested outputs written into the regions they name
(into a CUDA region on the engine's worker thread too, when the batch has run: DeviceOutputs).
Every region the request touches is held until the lease ends, so an unregister meanwhile cannot
unmap memory a batch still reads.

Parameters, as Triton's: `shared_memory_region`, `shared_memory_byte_size` (required) and
`shared_memory_offset` (default 0), on an input instead of its data, on a requested output to
have it written there; the response then lists that output by name, datatype and shape alone.
System and CUDA regions share one namespace, so a name says which registry holds it.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from ..errors import InvalidInput
from ..protocol.tensor_decode import from_binary
from ..protocol.tensor_encode import encode_tensors
from ..protocol.v2 import RequestedOutput
from ..types import DATATYPE_TO_NUMPY
from .cuda_regions import CudaRegion, CudaRegionRegistry
from .device_tensor import DeviceTensor
from .regions import Region, RegionRegistry

REGION = "shared_memory_region"
OFFSET = "shared_memory_offset"
BYTE_SIZE = "shared_memory_byte_size"
# Writing outputs larger than this would hold the event loop: do it on a thread.
WRITE_OFF_LOOP_BYTES = 256 * 1024


def names_region(parameters: dict[str, Any]) -> bool:
    return REGION in parameters


@dataclass
class Target:
    """Where a requested output goes."""

    region: Region | CudaRegion
    offset: int
    byte_size: int


class DeviceOutputs:
    """A request's outputs that go into CUDA regions, written on the engine's worker thread once
    its batch has run (InferRequest.finish_outputs): the thread that already works on the device,
    so a request costs no hop to the loop's thread pool and back, and its copy does not contend
    there with the copies of other requests (on an H200 under perf_analyzer the pool's copies
    were half of its threads' samples). The regions stay open while it lives, as an input's do."""

    def __init__(self, targets: dict[str, Target], cuda: CudaRegionRegistry):
        self.targets = targets
        self.cuda = cuda
        self.entries: list[dict[str, Any]] = []  # the response's entries of those written
        for target in targets.values():
            cuda.track(cast(CudaRegion, target.region), self)

    def __call__(self, outputs: dict[str, np.ndarray]) -> None:
        chosen = {name: array for name, array in outputs.items() if name in self.targets}
        self.entries = _write(chosen, self.targets, self.cuda)


class Lease:
    """Use as `with Lease(registry, cuda_registry) as lease:` around decoding, inference and the response."""

    def __init__(self, registry: RegionRegistry, cuda: CudaRegionRegistry | None = None):
        self._registry = registry
        self._cuda = cuda
        self._held: list[Region | CudaRegion] = []
        self._device_outputs: DeviceOutputs | None = None

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        held, self._held = self._held, []
        for region in held:
            if isinstance(region, CudaRegion):
                assert self._cuda is not None  # held only when acquired from it
                self._cuda.release(region)
            else:
                self._registry.release(region)

    def _locate(self, params: dict[str, Any], where: str) -> tuple[Region | CudaRegion, int, int]:
        offset = _count(params.get(OFFSET, 0), OFFSET, where)
        size = _count(params.get(BYTE_SIZE), BYTE_SIZE, where)
        name = params[REGION]
        if not isinstance(name, str):
            raise InvalidInput(f"{where}: {REGION} must be a string, got {name!r}")
        region: Region | CudaRegion | None = self._registry.acquire(name, where)
        if region is None and self._cuda is not None:
            region = self._cuda.acquire(name, where)
        if region is None:
            raise InvalidInput(f"{where}: no shared memory region {name!r} is registered")
        self._held.append(region)
        return region, offset, size

    def read_input(self, name: str, datatype: str, shape: list[int], params: dict[str, Any], where: str
                   ) -> np.ndarray:
        """The input a region holds: a read-only view of a system region's mapping, or a
        DeviceTensor naming a CUDA region's memory (InvalidInput when the region is unknown, out of
        range or not the size of `shape` x `datatype`)."""
        region, offset, size = self._locate(params, where)
        if isinstance(region, CudaRegion) and datatype == "BYTES":
            raise InvalidInput(f"{where}: BYTES inputs are not read from CUDA shared memory here (their "
                               "elements are length-prefixed, parsed on the host); use system shared memory")
        if datatype != "BYTES":
            expected = math.prod(shape) * DATATYPE_TO_NUMPY[datatype].itemsize
            if size != expected:
                raise InvalidInput(f"{where}: {BYTE_SIZE} {size} does not match shape {shape} of {datatype} "
                                   f"({expected} bytes)")
        if isinstance(region, CudaRegion):
            assert self._cuda is not None
            tensor = DeviceTensor(region.address(offset, size, where), region.device_id, DATATYPE_TO_NUMPY[datatype],
                                  tuple(shape), self._cuda.devices, region.name)
            self._cuda.track(region, tensor)
            return cast("np.ndarray", tensor)  # travels where arrays do; readers check for DeviceTensor
        return from_binary(region.view(offset, size, where).toreadonly(), datatype, shape, where)

    def output_targets(self, requested: list[RequestedOutput] | None) -> dict[str, Target]:
        """The requested outputs that go into regions, checked before the model runs."""
        targets: dict[str, Target] = {}
        for out in requested or ():
            if names_region(out.parameters):
                where = f"output {out.name!r}"
                region, offset, size = self._locate(out.parameters, where)
                if isinstance(region, CudaRegion):
                    region.address(offset, size, where)  # in range now, or refused before running the model
                else:
                    region.view(offset, size, where)
                targets[out.name] = Target(region, offset, size)
        return targets

    def device_outputs(self, targets: dict[str, Target]) -> DeviceOutputs | None:
        """The writer of the outputs that go into CUDA regions, for the request's finish_outputs,
        or None when none does; write_outputs then leaves alone what it wrote."""
        on_device = {name: t for name, t in targets.items() if isinstance(t.region, CudaRegion)}
        if not on_device:
            return None
        assert self._cuda is not None  # a CUDA region was acquired from it
        self._device_outputs = DeviceOutputs(on_device, self._cuda)
        return self._device_outputs

    async def write_outputs(self, outputs: dict[str, np.ndarray], targets: dict[str, Target]
                            ) -> tuple[dict[str, np.ndarray], list[dict[str, Any]]]:
        """Write the outputs that have a target into it, except those the engine's thread wrote
        (device_outputs); returns the outputs left to send and the response entries (name,
        datatype, shape, no data) of those written. Into a CUDA region the write is a
        host-to-device copy, here on a thread (CUDA never runs on the event loop): when a peer
        ran the request."""
        if not targets:
            return outputs, []
        written = self._device_outputs.entries if self._device_outputs is not None else []
        done = {entry["name"] for entry in written}
        chosen = {name: array for name, array in outputs.items() if name in targets and name not in done}
        to_device = any(isinstance(targets[name].region, CudaRegion) for name in chosen)
        if not chosen:
            entries = []
        elif to_device or sum(a.nbytes for a in chosen.values()) > WRITE_OFF_LOOP_BYTES:
            entries = await asyncio.get_running_loop().run_in_executor(None, _write, chosen, targets, self._cuda)
        else:
            entries = _write(chosen, targets, self._cuda)
        return {n: a for n, a in outputs.items() if n not in targets}, written + entries


def _count(value: Any, what: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        required = f" ({BYTE_SIZE} is required with {REGION})" if value is None else ""
        raise InvalidInput(f"{where}: {what} must be an integer >= 0, got {value!r}{required}")
    return value


def _write(outputs: dict[str, np.ndarray], targets: dict[str, Target], cuda: CudaRegionRegistry | None
           ) -> list[dict[str, Any]]:
    entries, chunks = encode_tensors(outputs, "output", all_binary=True, binary_names=None)
    for entry, chunk in zip(entries, chunks, strict=True):
        target = targets[entry["name"]]
        where = f"output {entry['name']!r}"
        if len(chunk) > target.byte_size:
            raise InvalidInput(f"{where} is {len(chunk)} bytes, more than its {BYTE_SIZE} {target.byte_size}")
        region = target.region
        if isinstance(region, CudaRegion):
            assert cuda is not None
            address = region.address(target.offset, len(chunk), where)
            with cuda.devices.on(region.device_id) as api:
                api.copy_htod(address, np.frombuffer(chunk, dtype=np.uint8))
        else:
            region.view(target.offset, len(chunk), where)[:] = chunk
        # As Triton: name, datatype and shape only (its C++ client, perf_analyzer included, reads
        # binary_data_size from any output that has parameters).
        entry.pop("parameters", None)
    return entries
