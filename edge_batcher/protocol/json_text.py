"""JSON for the v2 codec: orjson where it gives what `json` gives, Python's `json` elsewhere.

A v2 JSON request is mostly numbers, and the standard library parses a 256-float tensor in
~80 us against orjson's ~7 us (measured on the 2-core VM; it was a third of the Unix socket's
CPU per request, issue 20). The two differ in two ways, and `loads` keeps `json`'s behaviour
in both, so what is accepted, what is refused and every error message stay as they were:

* orjson refuses what strict JSON does not allow and `json` accepts (NaN/Infinity tokens,
  which module v2 accepts on input; UTF-16 bodies; a BOM): those documents are parsed again
  by `json`, as are all invalid ones, so the error messages are `json`'s.
* orjson turns integers beyond 64 bits into floats, where `json` keeps them exact (and the v2
  decoder refuses them out of range). A body with an integer of 19 or more digits therefore
  goes to `json`: a run of 19 digits not after a '.' (a fraction's digits: 0.0012345678901234567
  has 19, and float32 readings are full of such) nor after an exponent's 'e'; finding one costs
  ~9 us for a 256-float tensor.

Writing: what is written is always strict JSON. orjson writes NaN and Infinity as null, which
would change a value unseen, so an answer holding a null is written again by `json`, which
refuses non-finite floats (ValueError; tensor_encode.py names the tensor first); as is anything
orjson refuses (integers beyond 64 bits, keys that are not strings). Otherwise the text differs
only in spelling (`1e-5` for `1e-05`, UTF-8 for `\\u` escapes), never in value.
"""

from __future__ import annotations

import json
from typing import Any

import orjson

# b"0".."9" -> b"0"; b"." and b"e"/b"E" -> b"." (what may precede a number's non-integer digits); others -> b" "
_NUMBER_SHAPES = bytes(48 if 48 <= i <= 57 else 46 if i in b".eE" else 32 for i in range(256))
_LONG_INTEGER = b" " + b"0" * 19  # an integer that can leave 64 bits (-9223372036854775809), after a delimiter


# A larger document is searched for long integers a slice at a time: one call over 16 MiB holds
# the GIL for ~25 ms on the 2-core VM, and the event loop waits that long for a decode that runs
# on a worker thread so as not to hold it up (transports/v2_decode.py).
SCAN_SLICE = 1024 * 1024


def loads(data: bytes | bytearray) -> Any:
    """`json.loads(data)`, faster for the documents orjson reads the same way; raises what `json` raises."""
    if _has_long_integer(data):
        return json.loads(data)
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return json.loads(data)


def _has_long_integer(data: bytes | bytearray, slice_bytes: int = SCAN_SLICE) -> bool:
    """Whether a run of 19 or more digits stands where an integer may: at the start or after a
    delimiter (not after '.', 'e' or 'E')."""
    if len(data) <= slice_bytes:
        shapes = data.translate(_NUMBER_SHAPES)
        return _LONG_INTEGER in shapes or shapes.startswith(_LONG_INTEGER[1:])
    if data[:len(_LONG_INTEGER)].translate(_NUMBER_SHAPES).startswith(_LONG_INTEGER[1:]):
        return True
    overlap = len(_LONG_INTEGER) - 1  # a run that straddles two slices is seen whole in the second
    for start in range(0, len(data), slice_bytes):
        if _LONG_INTEGER in data[max(0, start - overlap):start + slice_bytes].translate(_NUMBER_SHAPES):
            return True
    return False


def dumps(obj: Any) -> bytes:
    """`json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()`, or orjson's equivalent
    where that holds the same values; raises what `json` raises (TypeError, ValueError for NaN
    and Infinity)."""
    try:
        text = orjson.dumps(obj)
    except orjson.JSONEncodeError:
        text = b"null"
    if b"null" not in text:
        return text
    return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()
