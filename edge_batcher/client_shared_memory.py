"""System shared memory for edge-batcher's Python client (client.py): a region this process
creates under /dev/shm and maps (`SharedMemoryRegion`), inputs placed in it (`RegionInput`),
outputs the daemon writes into it (`RegionOutput`), and the request body and response reading
that name them instead of carrying data (Triton's parameters, as tritonclient sends them)::

    with SharedMemoryRegion("cam0", "/cam0_frames", frame.nbytes + 64) as region, Client() as c:
        c.register_region(region)
        out = c.infer("vision", {"frames": region.put(frame)},
                      output_regions={"label": region.output(offset=frame.nbytes, byte_size=8)})
        c.unregister_region(region.name)

Outputs read from a region are views of it: copy them before the region is written again.
"""

from __future__ import annotations

import math
import mmap
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import InvalidInput
from .protocol import json_text
from .protocol.tensor_decode import RegionReader, from_binary
from .protocol.tensor_encode import encode_tensors
from .types import DATATYPE_TO_NUMPY, datatype_of

SHM_DIR = "/dev/shm"


class SharedMemoryRegion:
    """A POSIX shm object of `byte_size` bytes (created, mode 0600, unless `create=False`),
    mapped in this process; `name` is what the daemon will know it by."""

    def __init__(self, name: str, key: str, byte_size: int, *, create: bool = True):
        self.name, self.key, self.byte_size = name, key, byte_size
        self._path = os.path.join(SHM_DIR, key.lstrip("/"))
        self._created = create
        fd = os.open(self._path, os.O_RDWR | os.O_CLOEXEC | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                os.ftruncate(fd, byte_size)
            self._map = mmap.mmap(fd, byte_size)
        finally:
            os.close(fd)  # the mapping keeps its own

    def put(self, array: np.ndarray, offset: int = 0) -> RegionInput:
        """Copy `array` into the region at `offset`; the input that names it."""
        array = np.ascontiguousarray(array)
        if offset + array.nbytes > self.byte_size:
            raise ValueError(f"{array.nbytes} bytes at offset {offset} do not fit region {self.name!r} "
                             f"({self.byte_size} bytes)")
        np.frombuffer(self._map, np.uint8, array.nbytes, offset)[:] = array.reshape(-1).view(np.uint8)
        return RegionInput(self.name, datatype_of(array), list(array.shape), offset, array.nbytes)

    def output(self, offset: int = 0, byte_size: int | None = None) -> RegionOutput:
        """A place for an output: `byte_size` bytes at `offset` (default: the rest of the region)."""
        return RegionOutput(self, offset, self.byte_size - offset if byte_size is None else byte_size)

    def view(self, offset: int, byte_size: int) -> memoryview:
        return memoryview(self._map)[offset:offset + byte_size]

    def close(self) -> None:
        """Unmap it (or, while outputs read from it are alive, once they are gone), and remove
        the shm object if this process created it."""
        try:
            self._map.close()
        except BufferError:  # views of it are still in use: the mapping lives as long as they do
            pass
        if self._created:
            os.unlink(self._path)

    def __enter__(self) -> SharedMemoryRegion:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class RegionInput:
    """An input whose data lie in a registered region."""

    region: str
    datatype: str
    shape: list[int]
    offset: int
    byte_size: int


@dataclass(frozen=True)
class RegionOutput:
    """Where the daemon should write a requested output."""

    region: SharedMemoryRegion
    offset: int
    byte_size: int


def _placement(region: str, offset: int, byte_size: int) -> dict[str, Any]:
    return {"shared_memory_region": region, "shared_memory_offset": offset, "shared_memory_byte_size": byte_size}


def encode_request(inputs: dict[str, np.ndarray | RegionInput], output_regions: dict[str, RegionOutput], *,
                   outputs: list[str] | None, id: str | None, parameters: dict[str, Any] | None,
                   binary: bool) -> tuple[bytes, int | None]:
    """An infer request body whose RegionInput inputs and `output_regions` outputs name their
    regions; the other inputs travel as client.py's do. Returns (body, header length or None)."""
    arrays = {n: v for n, v in inputs.items() if not isinstance(v, RegionInput)}
    entries, chunks = encode_tensors(arrays, "input", binary, binary_names=None)
    for name, where in inputs.items():
        if isinstance(where, RegionInput):
            entries.append({"name": name, "datatype": where.datatype, "shape": where.shape,
                            "parameters": _placement(where.region, where.offset, where.byte_size)})
    header: dict[str, Any] = {"inputs": entries}
    if id is not None:
        header["id"] = id
    if parameters:
        header["parameters"] = parameters
    wanted = list(dict.fromkeys([*(outputs or []), *output_regions]))
    if wanted:
        header["outputs"] = [
            {"name": n, "parameters": _placement(output_regions[n].region.name, output_regions[n].offset,
                                                  output_regions[n].byte_size)}
            if n in output_regions else {"name": n, "parameters": {"binary_data": binary}}
            for n in wanted
        ]
    elif binary:
        header["parameters"] = {**header.get("parameters", {}), "binary_data_output": True}
    header_bytes = json_text.dumps(header)
    if not chunks:
        return header_bytes, None
    return b"".join([header_bytes, *chunks]), len(header_bytes)


def output_reader(output_regions: dict[str, RegionOutput]) -> RegionReader:
    """Reads the outputs the daemon wrote into this process's regions (views of them). The
    response lists such an output by name, datatype and shape alone (as Triton's does): where it
    went is what this request asked, its size what the shape says (BYTES: its length prefixes)."""

    def read(name: str, datatype: str, shape: list[int], params: dict[str, Any], where: str) -> np.ndarray:
        target = output_regions.get(name)
        if target is None:
            raise InvalidInput(f"{where} came without data, and this request named no region for it")
        view = target.region.view(target.offset, target.byte_size)
        count = math.prod(shape)
        if datatype == "BYTES":
            size = _bytes_extent(view, count, where)
        else:
            size = count * DATATYPE_TO_NUMPY[datatype].itemsize
        if size > target.byte_size:
            raise InvalidInput(f"{where}: shape {shape} of {datatype} needs {size} bytes, more than the "
                               f"{target.byte_size} its region place holds")
        return from_binary(view[:size], datatype, shape, where)

    return read


def _bytes_extent(view: memoryview, count: int, where: str) -> int:
    """The bytes that `count` length-prefixed BYTES elements take at the start of `view`."""
    offset = 0
    for i in range(count):
        if offset + 4 > len(view):
            raise InvalidInput(f"{where}: BYTES element {i} is cut off inside its 4-byte length")
        offset += 4 + int.from_bytes(view[offset:offset + 4], "little")
    return offset
