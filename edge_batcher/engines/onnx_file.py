"""Whether a file is a whole ONNX model, found without parsing it (`serve --check`, and the
ONNX Runtime backend's load error).

An ONNX file is one protobuf ModelProto: a sequence of fields, each a tag and, for the large
ones (the graph, its initializers inside it), a length. Walking the top-level fields and
skipping their contents takes a few reads whatever the file's size, and finds what an operator
meets on day two: a copy cut short (the graph's length runs past the end of the file), a file of
another kind under the model's name (a TensorRT plan, an HTML error page, zeros). It does not
prove that the graph inside is valid: only loading it does.
"""

from __future__ import annotations

from pathlib import Path
from typing import BinaryIO

GRAPH_FIELD = 7  # ModelProto.graph
IR_VERSION_FIELD = 1  # ModelProto.ir_version
OPSET_IMPORT_FIELD = 8  # ModelProto.opset_import: which operator set versions the graph uses
MAX_FIELD = 1 << 29  # protobuf's largest field number
MAX_FIELDS = 1_000_000  # a real model has tens of top-level fields (opsets, metadata)


def onnx_file_problem(path: Path) -> str | None:
    """What keeps `path` from being a whole ONNX model, or None when its top level is one
    (an ir_version, a graph, an opset_import, every field within the file) or it is no `.onnx`
    file (ONNX Runtime's own .ort format, a TensorRT plan: not checked here). Raises OSError
    when it cannot be read."""
    if path.suffix != ".onnx":
        return None
    size = path.stat().st_size
    with path.open("rb") as f:
        return _walk(f, size)


def _walk(f: BinaryIO, size: int) -> str | None:
    seen: set[int] = set()
    for _ in range(MAX_FIELDS):
        at = f.tell()
        if at == size:
            break
        tag = _varint(f)
        if tag is None:
            return f"it ends inside a field's tag at byte {at:,}"
        field, wire = tag >> 3, tag & 7
        if not 1 <= field < MAX_FIELD:
            return f"byte {at:,} is not a protobuf field (field number {field}): not an ONNX model"
        if wire == 0:
            if _varint(f) is None:
                return f"it ends inside field {field} at byte {at:,}"
        elif wire in (1, 5):
            f.seek(8 if wire == 1 else 4, 1)
        elif wire == 2:
            length = _varint(f)
            if length is None:
                return f"it ends inside field {field}'s length at byte {at:,}"
            left = size - f.tell()
            if length > left:
                what = "the graph" if field == GRAPH_FIELD else f"field {field}"
                return (f"{what} at byte {at:,} claims {length:,} bytes, {max(left, 0):,} are left: "
                        "a copy cut short?")
            f.seek(length, 1)
        else:  # groups (3, 4) are not in ONNX's schema; 6 and 7 are not protobuf
            return f"byte {at:,} holds a protobuf wire type {wire} that ONNX never uses: not an ONNX model"
        if f.tell() > size:
            return f"it ends inside field {field} at byte {at:,}"
        seen.add(field)
    else:
        return f"more than {MAX_FIELDS:,} top-level fields: not an ONNX model"
    if GRAPH_FIELD not in seen:
        return "it holds no graph: not an ONNX model"
    if IR_VERSION_FIELD not in seen:
        return "it holds no ir_version: not an ONNX model"
    if OPSET_IMPORT_FIELD not in seen:  # written after the graph by onnx's serializer: a copy cut short there
        return "it holds no opset_import after its graph: a copy cut short?"
    return None


def _varint(f: BinaryIO) -> int | None:
    """The base-128 integer at the file's position, or None at the end of the file (or after
    10 bytes, more than a 64-bit value takes)."""
    value = shift = 0
    for _ in range(10):
        byte = f.read(1)
        if not byte:
            return None
        value |= (byte[0] & 0x7F) << shift
        if not byte[0] & 0x80:
            return value
        shift += 7
    return None
