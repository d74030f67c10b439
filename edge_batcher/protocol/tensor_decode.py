"""Tensors of a v2 message's ``inputs``/``outputs`` list -> numpy arrays, each entry checked.

Both encodings are decoded here: JSON ``data`` (flat, or nested exactly as the shape; numbers
converted to the declared datatype without silently changing a value) and binary chunks of the
binary extension (zero-copy where possible). Every malformed entry raises InvalidInput naming the tensor;
protocol/v2.py calls :func:`decode_tensors` for requests and responses alike.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ..errors import InvalidInput
from ..types import DATATYPE_TO_NUMPY
from .binary_extension import HEADER_LENGTH, encode_utf8, object_array, unpack_bytes_elements
from .preview import preview

# numpy's limit on dimensions (NPY_MAXDIMS): 32 before numpy 2.0, 64 since.
MAX_DIMS = 64 if np.lib.NumpyVersion(np.__version__) >= "2.0.0" else 32
# numpy refuses arrays whose byte size, counting every non-zero dimension, overflows intp (even
# when a 0 dimension makes them empty); 16 bytes covers the widest element we create.
MAX_ELEMENTS = np.iinfo(np.intp).max // 16
# Reads a tensor that lives in a shared memory region instead of the body: an input that names
# one (shared_memory/lease.py), an output the server wrote into one (client_shared_memory.py):
# (name, datatype, shape, parameters, where) -> the array.
RegionReader = Callable[[str, str, list[int], dict[str, Any], str], NDArray[Any]]
# JSON data is flat (row-major) or nested exactly as its shape; anything else is refused so.
FLAT_OR_AS_SHAPE = "send it flat or nested as the shape"


def decode_tensors(
    entries: Any, kind: str, binary: memoryview, has_header_length: bool, regions: RegionReader | None = None
) -> dict[str, NDArray[Any]]:
    """Decode the ``inputs`` (or ``outputs``) list, taking binary tensors from ``binary`` and
    those that name a shared memory region from ``regions`` (refused where there is none)."""
    if not isinstance(entries, list):
        raise InvalidInput(f"'{kind}s' must be a list")

    # First pass: validate every entry and account for the binary part as a whole, so that
    # a short or over-long body is reported as such rather than as a per-tensor error.
    parsed: list[tuple[str, str, list[int], int | None, Any]] = []
    in_regions: dict[str, dict[str, Any]] = {}
    seen: set[str] = set()
    for entry in entries:
        if not isinstance(entry, dict):
            raise InvalidInput(
                f"each of '{kind}s' must be a JSON object, got {preview.repr(entry)}"
            )
        name = entry.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidInput(f"{kind} without a name")
        where = f"{kind} {preview.repr(name)}"
        if name in seen:
            raise InvalidInput(f"{where} appears twice")
        seen.add(name)

        datatype = entry.get("datatype")
        if datatype is None:
            raise InvalidInput(f"{where} has no datatype")
        if not isinstance(datatype, str) or datatype not in DATATYPE_TO_NUMPY:
            raise InvalidInput(
                f"{where}: unknown datatype {preview.repr(datatype)}; expected one of "
                f"{', '.join(DATATYPE_TO_NUMPY)}"
            )
        shape = check_shape(entry.get("shape"), where)

        params = entry.get("parameters") or {}
        if not isinstance(params, dict):
            raise InvalidInput(f"{where}: parameters must be a JSON object")
        size = params.get("binary_data_size")
        has_data = "data" in entry
        if "shared_memory_region" in params:
            if has_data or size is not None:
                raise InvalidInput(f"{where} names a shared memory region and also carries data")
            if regions is None:
                raise InvalidInput(f"{where}: shared memory regions are not served on this transport")
            in_regions[name] = params
        elif kind == "output" and regions is not None and size is None and not has_data:
            in_regions[name] = params  # written into the region the request named: listed without data
        elif size is not None:
            if isinstance(size, bool) or not isinstance(size, int) or size < 0:
                raise InvalidInput(
                    f"{where}: binary_data_size must be a non-negative integer, "
                    f"got {preview.repr(size)}"
                )
            if has_data:
                raise InvalidInput(f"{where} has both data and binary_data_size")
            if not has_header_length:
                raise InvalidInput(
                    f"{where} has binary_data_size but the message has no {HEADER_LENGTH}"
                )
        elif not has_data:
            raise InvalidInput(f"{where} has neither data nor binary_data_size")
        parsed.append((name, datatype, shape, size, entry.get("data")))

    needed = sum(p[3] for p in parsed if p[3] is not None)
    if needed > len(binary):
        raise InvalidInput(f"binary body is {needed - len(binary)} bytes short")
    if needed < len(binary):
        raise InvalidInput(
            f"binary body has {len(binary) - needed} bytes left over after the last "
            f"binary tensor"
        )

    tensors: dict[str, NDArray[Any]] = {}
    offset = 0
    for name, datatype, shape, size, data in parsed:
        where = f"{kind} {preview.repr(name)}"
        if name in in_regions:
            assert regions is not None
            tensors[name] = regions(name, datatype, shape, in_regions[name], where)
        elif size is None:
            tensors[name] = _from_json(data, datatype, shape, where)
        else:
            tensors[name] = from_binary(binary[offset : offset + size], datatype, shape, where)
            offset += size
    return tensors


def check_shape(shape: Any, where: str) -> list[int]:
    if not isinstance(shape, list) or any(
        isinstance(d, bool) or not isinstance(d, int) for d in shape
    ):
        raise InvalidInput(f"{where}: shape must be a list of integers, got {preview.repr(shape)}")
    if len(shape) > MAX_DIMS:
        raise InvalidInput(
            f"{where}: shape has {len(shape)} dimensions, more than the {MAX_DIMS} supported"
        )
    if any(d < 0 for d in shape):
        raise InvalidInput(f"{where}: shape {preview.repr(shape)} has a negative dimension")
    if math.prod(d for d in shape if d) > MAX_ELEMENTS:
        raise InvalidInput(
            f"{where}: shape {preview.repr(shape)} is too large (its non-zero dimensions "
            f"multiply to more than {MAX_ELEMENTS})"
        )
    return shape


def from_binary(buf: memoryview, datatype: str, shape: list[int], where: str) -> NDArray[Any]:
    """A binary tensor's bytes as an array, zero-copy where the datatype, byte order and
    alignment allow (binary extension chunks, gRPC raw contents, shared memory regions)."""
    count = math.prod(shape)
    if datatype == "BYTES":
        return unpack_bytes_elements(buf, shape, count, where)
    dtype = DATATYPE_TO_NUMPY[datatype]
    expected = count * dtype.itemsize
    if len(buf) != expected:
        raise InvalidInput(
            f"{where}: binary_data_size {len(buf)} does not match shape {shape} of "
            f"{datatype} ({expected} bytes)"
        )
    if datatype == "BOOL":
        # Any non-zero byte is true; comparing also yields a proper (writable) bool array.
        nonzero: NDArray[Any] = np.frombuffer(buf, dtype=np.uint8) != 0
        return nonzero.reshape(shape)
    array = np.frombuffer(buf, dtype=dtype.newbyteorder("<"))
    if not array.dtype.isnative or not array.flags.aligned:
        array = array.astype(dtype)  # big-endian host or unaligned offset: one copy
    return array.reshape(shape)


def _from_json(data: Any, datatype: str, shape: list[int], where: str) -> NDArray[Any]:
    if not isinstance(data, list):
        raise InvalidInput(f"{where}: data must be a list, got {type(data).__name__}")
    count = math.prod(shape)
    if datatype == "BYTES":
        if any(isinstance(item, list) for item in data):
            items = _nested_strings(data, shape, where)
        else:
            items = [_string(item, where) for item in data]
            if len(items) != count:
                raise InvalidInput(
                    f"{where}: shape {shape} needs {count} elements, data has {len(items)}"
                )
        return object_array(items, shape)

    try:
        array = np.asarray(data)
    except (ValueError, TypeError, OverflowError, RecursionError):
        raise InvalidInput(
            f"{where}: data is not a regular nested list (ragged rows or nested too deeply)"
        ) from None
    if array.size != count:
        raise InvalidInput(f"{where}: shape {shape} needs {count} elements, data has {array.size}")
    if array.ndim > 1 and list(array.shape) != shape:
        raise InvalidInput(
            f"{where}: data is nested as {list(array.shape)}, not as shape {shape}; {FLAT_OR_AS_SHAPE}"
        )
    return _numbers_from_json(data, array, datatype, where).reshape(shape)


# Below this magnitude every integer is exact in float64.
_FLOAT_EXACT = 2.0**53


def _numbers_from_json(data: list[Any], array: NDArray[Any], datatype: str, where: str) -> NDArray[Any]:
    """Convert the parsed JSON numbers to ``datatype``, refusing to silently change values.

    ``np.asarray`` picks int64, uint64 or float64 for JSON numbers, and float64 (lossy!) for
    integers beyond int64 mixed with others; those rare cases take an exact element-wise path.
    """
    target = DATATYPE_TO_NUMPY[datatype]
    if array.size == 0:
        return array.astype(target)  # np.asarray([]) is float64: nothing to check
    kind = array.dtype.kind
    if kind not in "biufO":
        raise InvalidInput(f"{where}: data for {datatype} are not numbers")

    if datatype == "BOOL":
        if kind == "b":
            return array
        if kind in "iu" and bool(np.all((array == 0) | (array == 1))):
            nonzero: NDArray[Any] = array != 0  # 0/1 are accepted as false/true
            return nonzero
        raise InvalidInput(f"{where}: data for BOOL must be true/false")
    if kind == "b":
        raise InvalidInput(f"{where}: data for {datatype} are not numbers (got true/false)")

    if target.kind == "f":
        if kind == "O":  # e.g. integers too large for uint64: still numbers
            try:
                array = np.array(_exact_numbers(data, datatype, where), dtype=np.float64)
            except OverflowError:  # an integer beyond float64's range: no float holds it
                raise InvalidInput(
                    f"{where}: data for {datatype} has an integer too large for any "
                    f"floating-point number (beyond {np.finfo(np.float64).max:.3g})"
                ) from None
        # Any other number converts; FP16/FP32 may round or overflow to inf, as in Triton
        # (documented above, so numpy's overflow warning would only be noise in the log).
        with np.errstate(over="ignore"):
            return array.astype(target)

    info = np.iinfo(target)
    if kind == "O" or (kind == "f" and bool(np.any(np.abs(array) >= _FLOAT_EXACT))):
        values = _exact_numbers(data, datatype, where)
        if any(isinstance(v, float) and not v.is_integer() for v in values):
            raise InvalidInput(f"{where}: data for {datatype} are not integers")
        exact = [int(v) for v in values]
        _check_range(min(exact), max(exact), info, datatype, where)
        return np.array(exact, dtype=target)
    if kind == "f" and not bool(np.all(array == np.floor(array))):  # also false for NaN
        raise InvalidInput(f"{where}: data for {datatype} are not integers")
    # Exact: integer arrays, or floats below 2**53 in magnitude.
    _check_range(int(array.min()), int(array.max()), info, datatype, where)
    return array.astype(target)


def _check_range(low: int, high: int, info: np.iinfo[Any], datatype: str, where: str) -> None:
    if low < info.min or high > info.max:
        raise InvalidInput(
            f"{where}: data for {datatype} are out of range [{info.min}, {info.max}]"
        )


def _exact_numbers(data: list[Any], datatype: str, where: str) -> list[int | float]:
    """The JSON elements as the Python numbers they were parsed to (slow path, only for
    unusual data; ``data`` is known to be a regular nested list)."""
    values: list[int | float] = np.array(data, dtype=object).reshape(-1).tolist()
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise InvalidInput(f"{where}: data for {datatype} are not numbers")
    return values


def _string(item: Any, where: str) -> bytes:
    if not isinstance(item, str):
        raise InvalidInput(f"{where}: data for BYTES must be strings, got {type(item).__name__}")
    return encode_utf8(item, where)


def _nested_strings(data: list[Any], shape: list[int], where: str) -> list[bytes]:
    """The strings of `data` nested exactly as `shape` (row-major), else InvalidInput saying
    where it is not. The walk goes no deeper than the shape (at most MAX_DIMS levels), however
    deep the data is nested."""
    out: list[bytes] = []
    if not shape:
        raise InvalidInput(f"{where}: data is nested, but shape [] holds one string: send it as [\"...\"]")

    def walk(level: list[Any], depth: int) -> None:
        if depth == len(shape):
            raise InvalidInput(f"{where}: data is nested deeper than shape {shape}; {FLAT_OR_AS_SHAPE}")
        if len(level) != shape[depth]:
            raise InvalidInput(f"{where}: data is not nested as shape {shape}: a list at depth {depth} has "
                               f"{len(level)} elements, the shape {shape[depth]}; {FLAT_OR_AS_SHAPE}")
        last = depth == len(shape) - 1
        for item in level:
            if isinstance(item, list):
                walk(item, depth + 1)
            elif last or not isinstance(item, str):
                out.append(_string(item, where))  # raises for anything but a string
            else:
                raise InvalidInput(f"{where}: data is not nested as shape {shape}: a string at depth {depth}, "
                                   f"above the shape's last dimension; {FLAT_OR_AS_SHAPE}")

    walk(data, 0)
    return out

