"""KServe v2 (Open Inference Protocol) codec: numpy tensors <-> HTTP request/response bodies.

Shared by the HTTP server, the Python clients and the offload client, so the wire format is
defined once. Two encodings are supported, and may be mixed within one message:

* JSON tensors: ``{"name", "shape", "datatype", "data"}`` with ``data`` flat or nested
  (row-major); BYTES elements are JSON strings (utf-8).
* Triton's binary tensor extension: the body is a JSON header followed by the raw
  little-endian bytes of every tensor whose ``parameters.binary_data_size`` is set, in the
  order those tensors appear in the header. The header's length travels in the HTTP header
  ``Inference-Header-Content-Length`` (``header_length`` here; ``None`` means the whole body
  is JSON). BYTES elements are a 4-byte little-endian length followed by the bytes; BOOL is
  one byte per element.

Every malformed body raises :class:`~edge_batcher.errors.InvalidInput` whose message names
the problem (and the tensor), so the HTTP layer can return it verbatim as a 400.

Decoded numeric arrays have native byte order and exactly the declared shape. Binary tensors
are decoded zero-copy where possible (a read-only view into the body), so they may not be
writable; copy them if you need to write in place.

Non-finite floats: JSON has no NaN/Infinity, but like Triton (and Python's ``json``) we emit
the JavaScript tokens ``NaN``, ``Infinity`` and ``-Infinity`` rather than fail or silently
change values, and accept them on input. Clients that need strict JSON should ask for binary
outputs, which carry every float exactly. Floats beyond FP16/FP32 range become +-inf, as in
Triton; a JSON *integer* beyond float64's range (about 1.8e308) is refused, since no float
holds it.

Limits that numpy imposes are checked up front, so that they are reported as bad input rather
than crash: at most :data:`MAX_DIMS` dimensions, and a shape whose non-zero dimensions multiply
to more than :data:`MAX_ELEMENTS` is refused even when another dimension is 0.
"""

from __future__ import annotations

import json
import math
import reprlib
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import InvalidInput
from ..types import DATATYPE_TO_NUMPY, datatype_of

HEADER_LENGTH = "Inference-Header-Content-Length"
BINARY_CONTENT_TYPE = "application/octet-stream"
JSON_CONTENT_TYPE = "application/json"

_LENGTH_PREFIX = struct.Struct("<I")

# numpy's limit on dimensions (NPY_MAXDIMS): 32 before numpy 2.0, 64 since.
MAX_DIMS = 64 if np.lib.NumpyVersion(np.__version__) >= "2.0.0" else 32
# numpy refuses arrays whose byte size, counting every non-zero dimension, overflows intp (even
# when a 0 dimension makes them empty); 16 bytes covers the widest element we create.
MAX_ELEMENTS = np.iinfo(np.intp).max // 16

# Error messages quote what the client sent: bounded in length and depth, however large it is.
_preview = reprlib.Repr()
_preview.maxlevel = 3
_preview.maxlist = _preview.maxdict = 8
_preview.maxstring = _preview.maxother = 60


# --------------------------------------------------------------------------- data types


@dataclass
class RequestedOutput:
    """One entry of the request's ``outputs`` list."""

    name: str
    binary: bool | None  # parameters.binary_data; None: not specified (use the default)


@dataclass
class DecodedRequest:
    id: str | None
    inputs: dict[str, np.ndarray]
    parameters: dict[str, Any]
    outputs: list[RequestedOutput] | None  # None when the request names no outputs
    binary_output_default: bool  # from parameters.binary_data_output


@dataclass
class DecodedResponse:
    model_name: str
    model_version: str | None
    id: str | None
    outputs: dict[str, np.ndarray]
    parameters: dict[str, Any]


# --------------------------------------------------------------------------- public API


def parse_header_length(value: str | None) -> int | None:
    """Parse the ``Inference-Header-Content-Length`` HTTP header value (None when absent)."""
    if value is None:
        return None
    try:
        length = int(value.strip())
    except ValueError:
        raise InvalidInput(f"{HEADER_LENGTH} {value!r} is not an integer") from None
    if length < 0:
        raise InvalidInput(f"{HEADER_LENGTH} {length} is negative")
    return length


def decode_request(body: bytes, header_length: int | None = None) -> DecodedRequest:
    """Decode an inference request body (JSON, or JSON header + binary tensors)."""
    header, binary = _split_body(body, header_length)
    if not isinstance(header, dict):
        raise InvalidInput("request body must be a JSON object")

    request_id = _optional_str(header, "id", "request")
    parameters = _optional_dict(header, "parameters", "request")
    binary_default = parameters.get("binary_data_output", False)
    if not isinstance(binary_default, bool):
        raise InvalidInput(
            f"request parameter 'binary_data_output' must be true or false, "
            f"got {_preview.repr(binary_default)}"
        )

    entries = header.get("inputs")
    if entries is None or (isinstance(entries, list) and not entries):
        raise InvalidInput("request has no inputs")
    inputs = _decode_tensors(entries, "input", binary, header_length is not None)

    return DecodedRequest(
        id=request_id,
        inputs=inputs,
        parameters=parameters,
        outputs=_decode_requested_outputs(header.get("outputs")),
        binary_output_default=binary_default,
    )


def encode_request(
    inputs: dict[str, np.ndarray],
    *,
    id: str | None = None,
    parameters: dict | None = None,
    outputs: list[str] | None = None,
    binary_inputs: bool = True,
    binary_outputs: bool = True,
) -> tuple[bytes, int | None]:
    """Encode an inference request; returns (body, header_length or None when pure JSON).

    With ``outputs=None`` every output is requested and ``binary_outputs`` becomes the request
    parameter ``binary_data_output``; with named outputs it is set on each of them.
    """
    if not isinstance(inputs, dict) or not inputs:
        raise InvalidInput("request has no inputs")
    params = dict(parameters or {})
    header: dict[str, Any] = {}
    if id is not None:
        header["id"] = id
    if outputs is None:
        if binary_outputs:
            params["binary_data_output"] = True
    if params:
        header["parameters"] = params
    tensors, chunks = _encode_tensors(inputs, "input", binary_inputs, binary_names=None)
    header["inputs"] = tensors
    if outputs is not None:
        header["outputs"] = [
            {"name": name, "parameters": {"binary_data": bool(binary_outputs)}}
            for name in outputs
        ]
    return _join_body(header, chunks, "request")


def decode_response(body: bytes, header_length: int | None = None) -> DecodedResponse:
    """Decode an inference response body (JSON, or JSON header + binary tensors)."""
    header, binary = _split_body(body, header_length)
    if not isinstance(header, dict):
        raise InvalidInput("response body must be a JSON object")
    model_name = header.get("model_name")
    if not isinstance(model_name, str):
        raise InvalidInput("response has no model_name")
    entries = header.get("outputs")
    if entries is None:
        raise InvalidInput("response has no outputs")
    return DecodedResponse(
        model_name=model_name,
        model_version=_optional_str(header, "model_version", "response"),
        id=_optional_str(header, "id", "response"),
        outputs=_decode_tensors(entries, "output", binary, header_length is not None),
        parameters=_optional_dict(header, "parameters", "response"),
    )


def encode_response(
    model_name: str,
    id: str | None,
    outputs: dict[str, np.ndarray],
    *,
    binary: set[str] | frozenset[str] = frozenset(),
    parameters: dict | None = None,
    model_version: str | None = None,
) -> tuple[bytes, int | None]:
    """Encode an inference response; outputs named in ``binary`` use the binary extension.

    Returns (body, header_length or None when pure JSON). A BYTES output that is not valid
    utf-8 cannot be a JSON string, so it is sent binary even when not named in ``binary``
    (the alternative, failing a request that the model already ran, helps nobody).
    """
    header: dict[str, Any] = {"model_name": model_name}
    if model_version is not None:
        header["model_version"] = model_version
    if id is not None:
        header["id"] = id
    if parameters:
        header["parameters"] = dict(parameters)
    tensors, chunks = _encode_tensors(outputs, "output", False, binary_names=binary)
    header["outputs"] = tensors
    return _join_body(header, chunks, "response")


def binary_outputs_for(req: DecodedRequest, available: list[str]) -> set[str]:
    """Names of the outputs (among ``available``) that the response should carry binary.

    A per-output ``binary_data`` wins over the request's ``binary_data_output`` default.
    Requested names that are not in ``available`` are ignored here: checking that requested
    outputs exist is the server's job, not the codec's.
    """
    if req.outputs is None:
        return set(available) if req.binary_output_default else set()
    present = set(available)
    chosen: set[str] = set()
    for out in req.outputs:
        wants = req.binary_output_default if out.binary is None else out.binary
        if wants and out.name in present:
            chosen.add(out.name)
    return chosen


# --------------------------------------------------------------------------- body framing


def _split_body(body: bytes, header_length: int | None) -> tuple[Any, memoryview]:
    """Parse the JSON header; return it and the binary part that follows (maybe empty)."""
    if not isinstance(body, (bytes, bytearray, memoryview)):
        raise InvalidInput(f"body must be bytes, got {type(body).__name__}")
    view = memoryview(body).cast("B")
    if header_length is None:
        header_bytes: bytes | bytearray = body if not isinstance(body, memoryview) else bytes(body)
        binary = view[len(view):]
    else:
        if isinstance(header_length, bool) or not isinstance(header_length, int):
            raise InvalidInput(f"{HEADER_LENGTH} {header_length!r} is not an integer")
        if header_length < 0:
            raise InvalidInput(f"{HEADER_LENGTH} {header_length} is negative")
        if header_length > len(view):
            raise InvalidInput(
                f"{HEADER_LENGTH} {header_length} is larger than the body ({len(view)} bytes)"
            )
        header_bytes = bytes(view[:header_length])
        binary = view[header_length:]
    try:
        header = json.loads(header_bytes)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError
        raise InvalidInput(f"body is not valid JSON: {e}") from None
    return header, binary


def _optional_str(header: dict[str, Any], key: str, what: str) -> str | None:
    value = header.get(key)
    if value is not None and not isinstance(value, str):
        raise InvalidInput(f"{what} '{key}' must be a string, got {_preview.repr(value)}")
    return value


def _optional_dict(header: dict[str, Any], key: str, what: str) -> dict[str, Any]:
    value = header.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidInput(f"{what} '{key}' must be a JSON object, got {_preview.repr(value)}")
    return value


def _join_body(
    header: dict[str, Any], chunks: list[bytes], what: str
) -> tuple[bytes, int | None]:
    try:
        # allow_nan: see the module docstring on non-finite floats.
        header_bytes = json.dumps(header, separators=(",", ":"), allow_nan=True).encode()
    except (TypeError, ValueError) as e:  # e.g. parameters that are not JSON-serialisable
        raise InvalidInput(f"{what} cannot be encoded as JSON: {e}") from None
    if not chunks:
        return header_bytes, None
    return b"".join([header_bytes, *chunks]), len(header_bytes)


# --------------------------------------------------------------------------- decoding


def _decode_tensors(
    entries: Any, kind: str, binary: memoryview, has_header_length: bool
) -> dict[str, np.ndarray]:
    """Decode the ``inputs`` (or ``outputs``) list, taking binary tensors from ``binary``."""
    if not isinstance(entries, list):
        raise InvalidInput(f"'{kind}s' must be a list")

    # First pass: validate every entry and account for the binary part as a whole, so that
    # a short or over-long body is reported as such rather than as a per-tensor error.
    parsed: list[tuple[str, str, list[int], int | None, Any]] = []
    seen: set[str] = set()
    for entry in entries:
        if not isinstance(entry, dict):
            raise InvalidInput(
                f"each of '{kind}s' must be a JSON object, got {_preview.repr(entry)}"
            )
        name = entry.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidInput(f"{kind} without a name")
        where = f"{kind} {_preview.repr(name)}"
        if name in seen:
            raise InvalidInput(f"{where} appears twice")
        seen.add(name)

        datatype = entry.get("datatype")
        if datatype is None:
            raise InvalidInput(f"{where} has no datatype")
        if not isinstance(datatype, str) or datatype not in DATATYPE_TO_NUMPY:
            raise InvalidInput(
                f"{where}: unknown datatype {_preview.repr(datatype)}; expected one of "
                f"{', '.join(DATATYPE_TO_NUMPY)}"
            )
        shape = _check_shape(entry.get("shape"), where)

        params = entry.get("parameters") or {}
        if not isinstance(params, dict):
            raise InvalidInput(f"{where}: parameters must be a JSON object")
        size = params.get("binary_data_size")
        has_data = "data" in entry
        if size is not None:
            if isinstance(size, bool) or not isinstance(size, int) or size < 0:
                raise InvalidInput(
                    f"{where}: binary_data_size must be a non-negative integer, "
                    f"got {_preview.repr(size)}"
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

    tensors: dict[str, np.ndarray] = {}
    offset = 0
    for name, datatype, shape, size, data in parsed:
        where = f"{kind} {_preview.repr(name)}"
        if size is None:
            tensors[name] = _from_json(data, datatype, shape, where)
        else:
            tensors[name] = _from_binary(binary[offset : offset + size], datatype, shape, where)
            offset += size
    return tensors


def _check_shape(shape: Any, where: str) -> list[int]:
    if not isinstance(shape, list) or any(
        isinstance(d, bool) or not isinstance(d, int) for d in shape
    ):
        raise InvalidInput(f"{where}: shape must be a list of integers, got {_preview.repr(shape)}")
    if len(shape) > MAX_DIMS:
        raise InvalidInput(
            f"{where}: shape has {len(shape)} dimensions, more than the {MAX_DIMS} supported"
        )
    if any(d < 0 for d in shape):
        raise InvalidInput(f"{where}: shape {_preview.repr(shape)} has a negative dimension")
    if math.prod(d for d in shape if d) > MAX_ELEMENTS:
        raise InvalidInput(
            f"{where}: shape {_preview.repr(shape)} is too large (its non-zero dimensions "
            f"multiply to more than {MAX_ELEMENTS})"
        )
    return shape


def _decode_requested_outputs(entries: Any) -> list[RequestedOutput] | None:
    if entries is None:
        return None
    if not isinstance(entries, list):
        raise InvalidInput("'outputs' must be a list")
    if not entries:  # an empty list names no outputs: same as leaving it out
        return None
    result: list[RequestedOutput] = []
    seen: set[str] = set()
    for entry in entries:
        if not isinstance(entry, dict):
            raise InvalidInput(
                f"each of 'outputs' must be a JSON object, got {_preview.repr(entry)}"
            )
        name = entry.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidInput("requested output without a name")
        if name in seen:
            raise InvalidInput(f"requested output {_preview.repr(name)} appears twice")
        seen.add(name)
        params = entry.get("parameters") or {}
        if not isinstance(params, dict):
            raise InvalidInput(
                f"requested output {_preview.repr(name)}: parameters must be a JSON object"
            )
        binary = params.get("binary_data")
        if binary is not None and not isinstance(binary, bool):
            raise InvalidInput(
                f"requested output {_preview.repr(name)}: binary_data must be true or false, "
                f"got {_preview.repr(binary)}"
            )
        result.append(RequestedOutput(name=name, binary=binary))
    return result


def _from_binary(buf: memoryview, datatype: str, shape: list[int], where: str) -> np.ndarray:
    count = math.prod(shape)
    if datatype == "BYTES":
        return _bytes_from_binary(buf, shape, count, where)
    dtype = DATATYPE_TO_NUMPY[datatype]
    expected = count * dtype.itemsize
    if len(buf) != expected:
        raise InvalidInput(
            f"{where}: binary_data_size {len(buf)} does not match shape {shape} of "
            f"{datatype} ({expected} bytes)"
        )
    if datatype == "BOOL":
        # Any non-zero byte is true; comparing also yields a proper (writable) bool array.
        return (np.frombuffer(buf, dtype=np.uint8) != 0).reshape(shape)
    array = np.frombuffer(buf, dtype=dtype.newbyteorder("<"))
    if not array.dtype.isnative or not array.flags.aligned:
        array = array.astype(dtype)  # big-endian host or unaligned offset: one copy
    return array.reshape(shape)


def _bytes_from_binary(buf: memoryview, shape: list[int], count: int, where: str) -> np.ndarray:
    items: list[bytes] = []
    offset, end = 0, len(buf)
    while offset < end:
        if offset + 4 > end:
            raise InvalidInput(
                f"{where}: BYTES element {len(items)} is cut off inside its 4-byte length"
            )
        (length,) = _LENGTH_PREFIX.unpack_from(buf, offset)
        offset += 4
        if length > end - offset:
            raise InvalidInput(
                f"{where}: BYTES element {len(items)} claims {length} bytes but only "
                f"{end - offset} remain"
            )
        items.append(bytes(buf[offset : offset + length]))
        offset += length
    if len(items) != count:
        raise InvalidInput(
            f"{where}: shape {shape} needs {count} elements, binary data has {len(items)}"
        )
    return _object_array(items, shape)


def _from_json(data: Any, datatype: str, shape: list[int], where: str) -> np.ndarray:
    if not isinstance(data, list):
        raise InvalidInput(f"{where}: data must be a list, got {type(data).__name__}")
    count = math.prod(shape)
    if datatype == "BYTES":
        items: list[bytes] = []
        try:
            _flatten_strings(data, items, where)
        except RecursionError:
            raise InvalidInput(f"{where}: data is nested too deeply") from None
        if len(items) != count:
            raise InvalidInput(
                f"{where}: shape {shape} needs {count} elements, data has {len(items)}"
            )
        return _object_array(items, shape)

    try:
        array = np.asarray(data)
    except (ValueError, TypeError, OverflowError, RecursionError):
        raise InvalidInput(
            f"{where}: data is not a regular nested list (ragged rows or nested too deeply)"
        ) from None
    if array.size != count:
        raise InvalidInput(f"{where}: shape {shape} needs {count} elements, data has {array.size}")
    return _numbers_from_json(data, array, datatype, where).reshape(shape)


# Below this magnitude every integer is exact in float64.
_FLOAT_EXACT = 2.0**53


def _numbers_from_json(data: list, array: np.ndarray, datatype: str, where: str) -> np.ndarray:
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
            return array != 0  # 0/1 are accepted as false/true
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


def _check_range(low: int, high: int, info: np.iinfo, datatype: str, where: str) -> None:
    if low < info.min or high > info.max:
        raise InvalidInput(
            f"{where}: data for {datatype} are out of range [{info.min}, {info.max}]"
        )


def _exact_numbers(data: list, datatype: str, where: str) -> list[int | float]:
    """The JSON elements as the Python numbers they were parsed to (slow path, only for
    unusual data; ``data`` is known to be a regular nested list)."""
    values = np.array(data, dtype=object).reshape(-1).tolist()
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise InvalidInput(f"{where}: data for {datatype} are not numbers")
    return values


def _flatten_strings(data: list, out: list[bytes], where: str) -> None:
    for item in data:
        if isinstance(item, str):
            out.append(_utf8(item, where))
        elif isinstance(item, list):
            _flatten_strings(item, out, where)
        else:
            raise InvalidInput(
                f"{where}: data for BYTES must be strings, got {type(item).__name__}"
            )


def _utf8(text: str, where: str) -> bytes:
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates, e.g. a JSON "\ud800" escape
        raise InvalidInput(
            f"{where}: BYTES element {_preview.repr(text)} is not valid unicode"
        ) from None


def _object_array(items: list[bytes], shape: list[int]) -> np.ndarray:
    # Filled element-wise: np.array(items, dtype=object) would turn equal-length bytes
    # into a fixed-width array or nest lists.
    array = np.empty(len(items), dtype=object)
    array[:] = items
    return array.reshape(shape)


# --------------------------------------------------------------------------- encoding


def _encode_tensors(
    tensors: dict[str, np.ndarray],
    kind: str,
    all_binary: bool,
    binary_names: set[str] | frozenset[str] | None,
) -> tuple[list[dict[str, Any]], list[bytes]]:
    """Build the header entries and the binary chunks (in header order)."""
    if not isinstance(tensors, dict):
        raise InvalidInput(f"{kind}s must be a dict of name -> array")
    entries: list[dict[str, Any]] = []
    chunks: list[bytes] = []
    for name, value in tensors.items():
        where = f"{kind} {name!r}"
        if not isinstance(name, str) or not name:
            raise InvalidInput(f"{kind} names must be non-empty strings, got {name!r}")
        array = np.asarray(value)
        datatype = _datatype(array, where)
        entry: dict[str, Any] = {"name": name, "shape": list(array.shape), "datatype": datatype}
        binary = all_binary or (binary_names is not None and name in binary_names)

        if datatype == "BYTES":
            items = _bytes_items(array, where)
            strings = None
            if not binary:
                try:
                    strings = [b.decode("utf-8") for b in items]
                except UnicodeDecodeError:
                    strings = None  # not representable as JSON strings: send it binary
            if strings is not None:
                entry["data"] = strings
            else:
                chunk = b"".join(
                    part for b in items for part in (_LENGTH_PREFIX.pack(len(b)), b)
                )
                entry["parameters"] = {"binary_data_size": len(chunk)}
                chunks.append(chunk)
        elif binary:
            if datatype == "BOOL":
                chunk = array.astype(np.bool_, copy=False).tobytes()  # 1 byte 0/1 each
            else:
                little = DATATYPE_TO_NUMPY[datatype].newbyteorder("<")
                chunk = array.astype(little, copy=False).tobytes()
            entry["parameters"] = {"binary_data_size": len(chunk)}
            chunks.append(chunk)
        else:
            entry["data"] = array.reshape(-1).tolist()
        entries.append(entry)
    return entries, chunks


def _datatype(array: np.ndarray, where: str) -> str:
    dtype = array.dtype
    if dtype.kind in "biuf" and not dtype.isnative:
        dtype = dtype.newbyteorder("=")  # e.g. '>f4' is still FP32
    try:
        return datatype_of(np.empty(0, dtype=dtype))
    except InvalidInput as e:
        raise InvalidInput(f"{where}: {e.message}") from None


def _bytes_items(array: np.ndarray, where: str) -> list[bytes]:
    """The elements of a BYTES tensor (object array of bytes/str, or numpy S/U array)."""
    items: list[bytes] = []
    for value in array.reshape(-1).tolist():
        if isinstance(value, (bytes, bytearray)):
            items.append(bytes(value))
        elif isinstance(value, str):
            items.append(_utf8(value, where))
        else:
            raise InvalidInput(
                f"{where}: BYTES elements must be bytes or str, got {type(value).__name__}"
            )
    return items
