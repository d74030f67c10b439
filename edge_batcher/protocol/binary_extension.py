"""Triton's binary tensor extension: the HTTP header and content types, and BYTES elements.

A message that carries binary tensors is a JSON header followed by the raw bytes of those
tensors; the header's length travels in the ``Inference-Header-Content-Length`` HTTP header.
A BYTES element is a 4-byte little-endian length followed by its bytes, in the binary part;
in JSON it is a utf-8 string. protocol/v2.py (the codec) is the only user besides the
transports, which take the header and content-type names from there.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ..errors import InvalidInput
from .preview import preview

HEADER_LENGTH = "Inference-Header-Content-Length"
BINARY_CONTENT_TYPE = "application/octet-stream"
JSON_CONTENT_TYPE = "application/json"

LENGTH_PREFIX = struct.Struct("<I")


def pack_bytes_elements(items: list[bytes]) -> bytes:
    """BYTES elements as the binary extension carries them: each a 4-byte length, then its bytes."""
    return b"".join(part for b in items for part in (LENGTH_PREFIX.pack(len(b)), b))


def unpack_bytes_elements(buf: memoryview, shape: list[int], count: int, where: str) -> NDArray[Any]:
    """The BYTES tensor of ``shape`` (``count`` elements) framed in ``buf``."""
    items: list[bytes] = []
    offset, end = 0, len(buf)
    while offset < end:
        if offset + 4 > end:
            raise InvalidInput(
                f"{where}: BYTES element {len(items)} is cut off inside its 4-byte length"
            )
        (length,) = LENGTH_PREFIX.unpack_from(buf, offset)
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
    return object_array(items, shape)


def encode_utf8(text: str, where: str) -> bytes:
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates, e.g. a JSON "\ud800" escape
        raise InvalidInput(
            f"{where}: BYTES element {preview.repr(text)} is not valid unicode"
        ) from None


def object_array(items: list[bytes], shape: list[int]) -> NDArray[Any]:
    # Filled element-wise: np.array(items, dtype=object) would turn equal-length bytes
    # into a fixed-width array or nest lists.
    array = np.empty(len(items), dtype=object)
    array[:] = items
    return array.reshape(shape)

