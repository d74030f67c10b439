"""numpy arrays -> the entries of a v2 message's ``inputs``/``outputs`` list, and binary chunks.

Each tensor becomes JSON ``data`` or a chunk of the binary extension (in header order), as
the caller asks; a BYTES tensor that is not valid utf-8 always goes binary. A floating-point
tensor holding NaN or Infinity cannot be JSON (strict parsers refuse the JavaScript tokens, and
null would hide the value): it is refused with InvalidInput naming it, and travels only binary.
protocol/v2.py calls :func:`encode_tensors` for requests and responses alike.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ..errors import InvalidInput
from ..types import DATATYPE_TO_NUMPY, datatype_of_dtype
from .binary_extension import encode_utf8, pack_bytes_elements

# Up to this many values, a JSON tensor's finiteness is checked on its Python list (one C-level
# sum, ~10 ns a value) rather than with numpy (~2-10 us a call, whatever the size).
SUMMED_IN_PYTHON = 512


def encode_tensors(
    tensors: dict[str, NDArray[Any]],
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
        array = value if type(value) is np.ndarray else np.asarray(value)
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
                chunk = pack_bytes_elements(items)
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
            data = array.reshape(-1).tolist()
            bad = non_finite_count(array, data)
            if bad:
                ask = "send it binary" if kind == "input" else "ask for it binary (binary_data_output)"
                raise InvalidInput(f"{where} holds {bad} NaN or Infinity values, which JSON cannot carry: {ask}")
            entry["data"] = data
        entries.append(entry)
    return entries, chunks


def non_finite_count(array: NDArray[Any], values: list[Any] | None = None) -> int:
    """How many NaN and +-Infinity values a floating-point array holds (0 for other datatypes).
    `values`: the array as a flat list, when the caller has it: for a small array, summing it
    in Python is a fraction of a microsecond, while two numpy calls cost ~10 us on a busy event
    loop (docs/benchmarks.md); a sum is finite unless some value is not, or it overflowed."""
    if array.dtype.kind != "f":
        return 0
    if values is not None and len(values) <= SUMMED_IN_PYTHON and math.isfinite(sum(values)):
        return 0
    finite = np.isfinite(array)
    return 0 if finite.all() else finite.size - int(np.count_nonzero(finite))


def _datatype(array: NDArray[Any], where: str) -> str:
    dtype = array.dtype
    if dtype.kind in "biuf" and not dtype.isnative:
        dtype = dtype.newbyteorder("=")  # e.g. '>f4' is still FP32
    try:
        return datatype_of_dtype(dtype)
    except InvalidInput as e:
        raise InvalidInput(f"{where}: {e.message}") from None


def _bytes_items(array: NDArray[Any], where: str) -> list[bytes]:
    """The elements of a BYTES tensor (object array of bytes/str, or numpy S/U array)."""
    items: list[bytes] = []
    for value in array.reshape(-1).tolist():
        if isinstance(value, (bytes, bytearray)):
            items.append(bytes(value))
        elif isinstance(value, str):
            items.append(encode_utf8(value, where))
        else:
            raise InvalidInput(
                f"{where}: BYTES elements must be bytes or str, got {type(value).__name__}"
            )
    return items

