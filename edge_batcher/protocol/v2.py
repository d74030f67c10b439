"""KServe v2 (Open Inference Protocol) codec: numpy tensors <-> HTTP request/response bodies.

Shared by the HTTP server, the Python clients and the offload client, so the wire format is
defined once. Two encodings are supported, and may be mixed within one message:

* JSON tensors: ``{"name", "shape", "datatype", "data"}`` with ``data`` flat (row-major) or
  nested exactly as the shape (any other nesting is refused); BYTES elements are JSON strings
  (utf-8).
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

Non-finite floats: JSON has no NaN/Infinity, and what this codec writes is always strict JSON:
a floating-point tensor holding one is refused as JSON ``data`` (InvalidInput naming it; in a
response, :func:`encode_response` raises EngineError naming the model, a 500) and travels only
in the binary extension, which carries every float exactly. On input the JavaScript tokens
``NaN``, ``Infinity`` and ``-Infinity`` are still read (Python's ``json`` and tritonclient
write them); whether a model takes them is the model's input check (scheduler/validate.py:
refused unless its model.toml sets allow_non_finite_inputs). Floats beyond FP16/FP32 range
become +-inf, as in Triton (and are then refused by that same check); a JSON *integer* beyond
float64's range (about 1.8e308) is refused, since no float holds it.

Limits that numpy imposes are checked up front, so that they are reported as bad input rather
than crash: at most :data:`MAX_DIMS` dimensions, and a shape whose non-zero dimensions multiply
to more than :data:`MAX_ELEMENTS` is refused even when another dimension is 0.

This module is the codec's public face (message framing, request/response fields); the tensor
lists are decoded in protocol/tensor_decode.py and encoded in protocol/tensor_encode.py, and
the binary extension's names and BYTES framing live in protocol/binary_extension.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from numpy.typing import NDArray

from ..errors import EngineError, InvalidInput
from . import json_text
from .binary_extension import BINARY_CONTENT_TYPE, HEADER_LENGTH, JSON_CONTENT_TYPE
from .preview import preview
from .tensor_decode import MAX_DIMS, MAX_ELEMENTS, RegionReader, decode_tensors
from .tensor_encode import encode_tensors

__all__ = [
    "BINARY_CONTENT_TYPE", "HEADER_LENGTH", "JSON_CONTENT_TYPE", "MAX_DIMS", "MAX_ELEMENTS",
    "DecodedRequest", "DecodedResponse", "RequestedOutput",
    "binary_outputs_for", "decode_request", "decode_response", "encode_request", "encode_response",
    "parse_header_length",
]

# --------------------------------------------------------------------------- data types


@dataclass
class RequestedOutput:
    """One entry of the request's ``outputs`` list."""

    name: str
    binary: bool | None  # parameters.binary_data; None: not specified (use the default)
    parameters: dict[str, Any] = field(default_factory=dict)  # its shared_memory_* parameters, if any


@dataclass
class DecodedRequest:
    id: str | None
    inputs: dict[str, NDArray[Any]]
    parameters: dict[str, Any]
    outputs: list[RequestedOutput] | None  # None when the request names no outputs
    binary_output_default: bool  # from parameters.binary_data_output


@dataclass
class DecodedResponse:
    model_name: str
    model_version: str | None
    id: str | None
    outputs: dict[str, NDArray[Any]]
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


def decode_request(body: bytes | bytearray, header_length: int | None = None,
                   regions: RegionReader | None = None) -> DecodedRequest:
    """Decode an inference request body (JSON, or JSON header + binary tensors); inputs that name
    a shared memory region are read by ``regions`` (refused when None)."""
    header, binary = _split_body(body, header_length)
    if not isinstance(header, dict):
        raise InvalidInput("request body must be a JSON object")

    request_id = _optional_str(header, "id", "request")
    parameters = _optional_dict(header, "parameters", "request")
    binary_default = parameters.get("binary_data_output", False)
    if not isinstance(binary_default, bool):
        raise InvalidInput(
            f"request parameter 'binary_data_output' must be true or false, "
            f"got {preview.repr(binary_default)}"
        )

    entries = header.get("inputs")
    if entries is None or (isinstance(entries, list) and not entries):
        raise InvalidInput("request has no inputs")
    inputs = decode_tensors(entries, "input", binary, header_length is not None, regions)

    return DecodedRequest(
        id=request_id,
        inputs=inputs,
        parameters=parameters,
        outputs=_decode_requested_outputs(header.get("outputs")),
        binary_output_default=binary_default,
    )


def encode_request(
    inputs: dict[str, NDArray[Any]],
    *,
    id: str | None = None,
    parameters: dict[str, Any] | None = None,
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
    tensors, chunks = encode_tensors(inputs, "input", binary_inputs, binary_names=None)
    header["inputs"] = tensors
    if outputs is not None:
        header["outputs"] = [
            {"name": name, "parameters": {"binary_data": bool(binary_outputs)}}
            for name in outputs
        ]
    return _join_body(header, chunks, "request")


def decode_response(body: bytes, header_length: int | None = None,
                    regions: RegionReader | None = None) -> DecodedResponse:
    """Decode an inference response body (JSON, or JSON header + binary tensors); outputs the
    server wrote into a shared memory region are read by ``regions`` (refused when None)."""
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
        outputs=decode_tensors(entries, "output", binary, header_length is not None, regions),
        parameters=_optional_dict(header, "parameters", "response"),
    )


def encode_response(
    model_name: str,
    id: str | None,
    outputs: dict[str, NDArray[Any]],
    *,
    binary: set[str] | frozenset[str] = frozenset(),
    parameters: dict[str, Any] | None = None,
    model_version: str | None = None,
    without_data: list[dict[str, Any]] | None = None,
) -> tuple[bytes, int | None]:
    """Encode an inference response; outputs named in ``binary`` use the binary extension,
    ``without_data`` entries (outputs written into shared memory) are listed as they are.

    Returns (body, header_length or None when pure JSON). A BYTES output that is not valid
    utf-8 cannot be a JSON string, so it is sent binary even when not named in ``binary``
    (the alternative, failing a request that the model already ran, helps nobody). A float
    output holding NaN or Infinity, asked for as JSON, is not sent binary unasked: a JSON
    client would take the binary body for garbage, and such values usually mean the model
    failed. EngineError (500) names the model and the output instead: a response that cannot
    be encoded is never the client's mistake.
    """
    header: dict[str, Any] = {"model_name": model_name}
    if model_version is not None:
        header["model_version"] = model_version
    if id is not None:
        header["id"] = id
    if parameters:
        header["parameters"] = dict(parameters)
    try:
        tensors, chunks = encode_tensors(outputs, "output", False, binary_names=binary)
        header["outputs"] = [*tensors, *(without_data or [])]
        return _join_body(header, chunks, "response")
    except InvalidInput as e:
        raise EngineError(f"model {model_name!r}: its response cannot be sent: {e.message}") from None


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


def _split_body(body: bytes | bytearray, header_length: int | None) -> tuple[Any, memoryview]:
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
        header = json_text.loads(header_bytes)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError
        raise InvalidInput(f"body is not valid JSON: {e}") from None
    return header, binary


def _optional_str(header: dict[str, Any], key: str, what: str) -> str | None:
    value = header.get(key)
    if value is not None and not isinstance(value, str):
        raise InvalidInput(f"{what} '{key}' must be a string, got {preview.repr(value)}")
    return value


def _optional_dict(header: dict[str, Any], key: str, what: str) -> dict[str, Any]:
    value = header.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidInput(f"{what} '{key}' must be a JSON object, got {preview.repr(value)}")
    return value


def _join_body(
    header: dict[str, Any], chunks: list[bytes], what: str
) -> tuple[bytes, int | None]:
    try:
        header_bytes = json_text.dumps(header)
    except (TypeError, ValueError) as e:  # parameters that are not JSON-serialisable, or NaN in them
        raise InvalidInput(f"{what} cannot be encoded as JSON: {e}") from None
    if not chunks:
        return header_bytes, None
    return b"".join([header_bytes, *chunks]), len(header_bytes)


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
                f"each of 'outputs' must be a JSON object, got {preview.repr(entry)}"
            )
        name = entry.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidInput("requested output without a name")
        if name in seen:
            raise InvalidInput(f"requested output {preview.repr(name)} appears twice")
        seen.add(name)
        params = entry.get("parameters") or {}
        if not isinstance(params, dict):
            raise InvalidInput(
                f"requested output {preview.repr(name)}: parameters must be a JSON object"
            )
        binary = params.get("binary_data")
        if binary is not None and not isinstance(binary, bool):
            raise InvalidInput(
                f"requested output {preview.repr(name)}: binary_data must be true or false, "
                f"got {preview.repr(binary)}"
            )
        shm = {k: v for k, v in params.items() if k.startswith("shared_memory_")}
        result.append(RequestedOutput(name=name, binary=binary, parameters=shm))
    return result

