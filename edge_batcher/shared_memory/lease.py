"""One request's use of shared memory regions: inputs read as views of the mappings (no copy:
the batch assembly's concatenation is the one copy, or none for a batch of one), requested
outputs written into the regions they name. Every region the request touches is held until the
lease ends, so an unregister meanwhile cannot unmap memory a batch still reads.

Parameters, as Triton's: `shared_memory_region`, `shared_memory_byte_size` (required) and
`shared_memory_offset` (default 0), on an input instead of its data, on a requested output to
have it written there; the response then lists that output without data.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import InvalidInput
from ..protocol.tensor_decode import from_binary
from ..protocol.tensor_encode import encode_tensors
from ..protocol.v2 import RequestedOutput
from ..types import DATATYPE_TO_NUMPY
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

    region: Region
    offset: int
    byte_size: int


class Lease:
    """Use as `with Lease(registry) as lease:` around decoding, inference and the response."""

    def __init__(self, registry: RegionRegistry):
        self._registry = registry
        self._held: list[Region] = []

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        held, self._held = self._held, []
        for region in held:
            self._registry.release(region)

    def _locate(self, params: dict[str, Any], where: str) -> tuple[Region, int, int]:
        offset = _count(params.get(OFFSET, 0), OFFSET, where)
        size = _count(params.get(BYTE_SIZE), BYTE_SIZE, where)
        region = self._registry.acquire(params[REGION], where)
        self._held.append(region)
        return region, offset, size

    def read_input(self, datatype: str, shape: list[int], params: dict[str, Any], where: str) -> np.ndarray:
        """The input a region holds, as a read-only view of the mapping (InvalidInput when the
        region is unknown, out of range or not the size of `shape` x `datatype`)."""
        region, offset, size = self._locate(params, where)
        if datatype != "BYTES":
            expected = math.prod(shape) * DATATYPE_TO_NUMPY[datatype].itemsize
            if size != expected:
                raise InvalidInput(f"{where}: {BYTE_SIZE} {size} does not match shape {shape} of {datatype} "
                                   f"({expected} bytes)")
        return from_binary(region.view(offset, size, where).toreadonly(), datatype, shape, where)

    def output_targets(self, requested: list[RequestedOutput] | None) -> dict[str, Target]:
        """The requested outputs that go into regions, checked before the model runs."""
        targets: dict[str, Target] = {}
        for out in requested or ():
            if names_region(out.parameters):
                where = f"output {out.name!r}"
                region, offset, size = self._locate(out.parameters, where)
                region.view(offset, size, where)  # in range now, or refused before running the model
                targets[out.name] = Target(region, offset, size)
        return targets

    async def write_outputs(self, outputs: dict[str, np.ndarray], targets: dict[str, Target]
                            ) -> tuple[dict[str, np.ndarray], list[dict[str, Any]]]:
        """Write the outputs that have a target into it; returns the outputs left to send and the
        response entries (name, datatype, shape, no data) of those written."""
        if not targets:
            return outputs, []
        chosen = {name: array for name, array in outputs.items() if name in targets}
        if sum(a.nbytes for a in chosen.values()) > WRITE_OFF_LOOP_BYTES:
            entries = await asyncio.get_running_loop().run_in_executor(None, _write, chosen, targets)
        else:
            entries = _write(chosen, targets)
        return {n: a for n, a in outputs.items() if n not in targets}, entries


def _count(value: Any, what: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        required = f" ({BYTE_SIZE} is required with {REGION})" if value is None else ""
        raise InvalidInput(f"{where}: {what} must be an integer >= 0, got {value!r}{required}")
    return value


def _write(outputs: dict[str, np.ndarray], targets: dict[str, Target]) -> list[dict[str, Any]]:
    entries, chunks = encode_tensors(outputs, "output", all_binary=True, binary_names=None)
    for entry, chunk in zip(entries, chunks, strict=True):
        target = targets[entry["name"]]
        where = f"output {entry['name']!r}"
        if len(chunk) > target.byte_size:
            raise InvalidInput(f"{where} is {len(chunk)} bytes, more than its {BYTE_SIZE} {target.byte_size}")
        target.region.view(target.offset, len(chunk), where)[:] = chunk
        entry["parameters"] = {REGION: target.region.name, BYTE_SIZE: len(chunk)}
        if target.offset:
            entry["parameters"][OFFSET] = target.offset
    return entries
