"""Property-based fuzzing of the KServe v2 decoder (and of the request parameters /infer reads).

The property is the transports' promise: whatever a client sends, decoding ends in a value or
in an EdgeBatcherError with a 4xx status, never in another exception (which the HTTP edge would
answer 500). Requests are built from strategies that are mostly well-formed, so that the
decoder's deep paths are reached, with every field liable to be replaced by junk: huge,
negative and too many dimensions, wrong datatypes, data of the wrong kind, nested junk,
integers far beyond any datatype, NaN and infinities, binary tensors with wrong sizes, random
header lengths and truncated or padded binary parts. Examples are capped to keep CI fast.
"""

from __future__ import annotations

import json
import math
import struct

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edge_batcher.errors import EdgeBatcherError
from edge_batcher.protocol import v2
from edge_batcher.protocol.parameters import to_infer_request
from edge_batcher.types import DATATYPE_TO_NUMPY

DATATYPES = list(DATATYPE_TO_NUMPY)

FUZZ = settings(
    max_examples=150,
    deadline=None,  # CI machines are slow and shared; the property is not about speed
    database=None,  # no examples kept between runs (.hypothesis/ is a self-ignored cache)
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# --------------------------------------------------------------------------- JSON values

huge_ints = st.sampled_from([2**31, 2**53 + 1, 2**63, 2**64, 2**70, -(2**70), 10**309, -(10**400)])
numbers = st.one_of(
    st.integers(-300, 300),
    st.integers(),
    huge_ints,
    st.floats(allow_nan=True, allow_infinity=True),
)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    numbers,
    st.text(max_size=8),
    st.sampled_from(["\ud800", "FP32", ""]),  # a lone surrogate survives json.dumps as \ud800
)
junk = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=12,
)


# Hypothesis draws boundary values (0, a bound) far more often than others, and st.one_of
# merges equal branches, so odds are set by a uniform pick from a list.
_RARELY = st.sampled_from([False] * 15 + [True])


def maybe(strategy, junk_strategy=junk):
    """Usually (15 times in 16) a value from `strategy`, else junk in its place: rare enough
    that most examples get past the first checks into the decoder's deeper paths."""
    return _RARELY.flatmap(lambda rare: junk_strategy if rare else strategy)


def now_and_then(draw) -> bool:
    return draw(_RARELY)


dimension = maybe(
    st.integers(0, 4),
    st.one_of(st.integers(-3, -1), st.sampled_from([2**31, 2**62, 2**63, 2**64, 2**70, 10**30])),
)
shapes = maybe(
    st.lists(dimension, max_size=4),
    st.one_of(
        # Around numpy's 64-dimension limit, with few elements (so that the data can match).
        st.lists(maybe(st.just(1), st.sampled_from([0, 2])), min_size=60, max_size=70),
        # Empty, yet with dimensions beyond what numpy can allocate.
        st.lists(st.sampled_from([0, 2**40, 2**62, 2**64]), min_size=2, max_size=3),
        junk,
    ),
)
datatypes = maybe(st.sampled_from(DATATYPES), st.one_of(st.sampled_from(["FP31", "fp32", ""]), junk))


def element(datatype) -> st.SearchStrategy:
    """A JSON element of the right kind for the datatype (sometimes junk)."""
    if datatype == "BYTES":
        right = st.text(max_size=6)
    elif datatype == "BOOL":
        right = st.booleans()
    elif isinstance(datatype, str) and datatype.startswith("FP"):
        right = st.floats(allow_nan=True, allow_infinity=True, width=64)
    else:
        right = st.integers(-(2**64), 2**64)
    return maybe(right, maybe(huge_ints, st.one_of(numbers, scalars)))


def nest(flat: list, shape) -> list:
    """`flat` as the row-major nested list of `shape` (when it can be)."""
    if not isinstance(shape, list) or not 2 <= len(shape) <= 4 or not all(
        isinstance(d, int) and 0 < d <= 4 for d in shape
    ) or math.prod(shape) != len(flat):
        return flat
    for d in reversed(shape[1:]):
        flat = [flat[i : i + d] for i in range(0, len(flat), d)]
    return flat


# --------------------------------------------------------------------------- binary payloads


def element_count(draw, shape) -> int:
    """How many elements to send: the shape's own count when it is small, else a few."""
    if isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape):
        count = math.prod(shape)
        if count <= 48:
            return count
    return draw(st.integers(0, 5))


def binary_payload(draw, datatype, shape) -> bytes:
    """Bytes for a binary tensor: usually the right size for the shape, sometimes not."""
    count = element_count(draw, shape)
    if datatype == "BYTES":
        parts = []
        for _ in range(count):
            item = draw(st.binary(max_size=5))
            length = draw(maybe(st.just(len(item)), st.integers(0, 2**32 - 1)))
            parts.append(struct.pack("<I", length) + item)
        return b"".join(parts)
    known = isinstance(datatype, str) and datatype in DATATYPE_TO_NUMPY
    itemsize = DATATYPE_TO_NUMPY[datatype].itemsize if known else 4
    size = draw(maybe(st.just(count * itemsize), st.integers(0, 40)))
    return draw(st.binary(min_size=size, max_size=size))


@st.composite
def tensors(draw, name: str, binary_allowed: bool):
    """One header entry, and its binary payload (None when it carries JSON data)."""
    datatype = draw(datatypes)
    shape = draw(shapes)
    entry = {"name": draw(maybe(st.just(name), st.one_of(st.just("x0"), junk))),
             "datatype": datatype, "shape": shape}
    if now_and_then(draw):
        del entry[draw(st.sampled_from(["name", "datatype", "shape"]))]
    if binary_allowed and draw(st.booleans()):
        payload = binary_payload(draw, datatype, shape)
        size = draw(maybe(st.just(len(payload)), st.one_of(st.integers(0, 2**70), junk)))
        entry["parameters"] = {"binary_data_size": size}
        return entry, payload
    count = max(0, element_count(draw, shape) + draw(maybe(st.just(0), st.sampled_from([1, -1]))))
    flat = draw(st.lists(element(datatype), min_size=count, max_size=count))
    entry["data"] = draw(maybe(st.just(nest(flat, shape))))
    if now_and_then(draw):
        entry["parameters"] = draw(junk)
    return entry, None


@st.composite
def bodies(draw, tensor_list: str = "inputs"):
    """(body, header_length) of a request as an HTTP or MQTT client could send it or, with
    tensor_list="outputs", of a response as an offload peer could."""
    binary = draw(st.booleans())
    count = draw(st.integers(0 if now_and_then(draw) else 1, 3))
    entries = [draw(tensors(f"x{i}", binary)) for i in range(count)]
    header = {tensor_list: [e for e, _ in entries]}
    if now_and_then(draw):
        header[tensor_list] = draw(junk)
    if tensor_list == "outputs":
        header["model_name"] = draw(maybe(st.just("m")))
        header["model_version"] = draw(maybe(st.none()))
    if draw(st.booleans()):
        header["id"] = draw(maybe(st.text(max_size=6)))
    if draw(st.booleans()):
        header["parameters"] = draw(maybe(st.fixed_dictionaries({}, optional={
            "binary_data_output": maybe(st.booleans()),
            "timeout_ms": numbers,
            "timeout": numbers,
            "priority": maybe(st.integers(-2, 3)),
        })))
    if tensor_list == "inputs" and draw(st.booleans()):
        output = st.fixed_dictionaries({"name": maybe(st.sampled_from(["a", "b"]))}, optional={
            "parameters": maybe(st.fixed_dictionaries({"binary_data": maybe(st.booleans())}))})
        header["outputs"] = draw(maybe(st.lists(output, max_size=3)))
    header_bytes = json.dumps(header, allow_nan=True).encode()
    if not binary:
        return header_bytes, None
    body = header_bytes + b"".join(p for _, p in entries if p is not None)
    cut = draw(st.sampled_from(["none"] * 4 + ["truncate", "pad"]))
    if cut == "truncate":
        body = body[: draw(st.integers(0, len(body)))]
    elif cut == "pad":
        body += draw(st.binary(min_size=1, max_size=8))
    header_length = draw(maybe(st.just(len(header_bytes)), st.integers(-5, len(body) + 5)))
    return body, header_length


def assert_value_or_client_error(decode, body: bytes, header_length: int | None):
    """Run `decode`; return its value, or None for a 4xx EdgeBatcherError. Anything else fails."""
    try:
        return decode(body, header_length)
    except EdgeBatcherError as e:
        assert 400 <= e.status < 500, f"{type(e).__name__} {e.status}: {e}"
        assert e.message
        return None


# --------------------------------------------------------------------------- properties


@FUZZ
@given(bodies())
def test_decoding_a_request_is_a_value_or_a_4xx(case) -> None:
    body, header_length = case
    decoded = assert_value_or_client_error(v2.decode_request, body, header_length)
    if decoded is None:
        return
    header = json.loads(body if header_length is None else body[:header_length])
    declared = {e["name"]: e for e in header["inputs"]}
    assert set(decoded.inputs) == set(declared)
    for name, array in decoded.inputs.items():
        assert isinstance(array, np.ndarray)
        assert list(array.shape) == declared[name]["shape"]
        assert array.dtype == DATATYPE_TO_NUMPY[declared[name]["datatype"]]
    # The parameters /infer (HTTP and MQTT) reads: a value or a 4xx too.
    try:
        request = to_infer_request("m", decoded)
    except EdgeBatcherError as e:
        assert 400 <= e.status < 500 and "parameters." in e.message
    else:
        assert request.timeout_s is None or (math.isfinite(request.timeout_s) and request.timeout_s >= 0)


@FUZZ
@given(bodies("outputs"))
def test_decoding_a_response_is_a_value_or_a_4xx(case) -> None:
    """The offload client decodes a peer's answers with the same code."""
    body, header_length = case
    decoded = assert_value_or_client_error(v2.decode_response, body, header_length)
    if decoded is not None:
        assert all(isinstance(a, np.ndarray) for a in decoded.outputs.values())


@FUZZ
@given(st.binary(max_size=200), st.one_of(st.none(), st.integers(-3, 210)))
def test_arbitrary_bytes_are_a_value_or_a_4xx(body: bytes, header_length: int | None) -> None:
    assert_value_or_client_error(v2.decode_request, body, header_length)
    assert_value_or_client_error(v2.decode_response, body, header_length)


@FUZZ
@given(st.one_of(st.none(), st.text(max_size=12), st.sampled_from(["9" * 5000, "-0", " 7 ", "\u0663"])))
def test_header_length_header_is_an_integer_or_a_4xx(value) -> None:
    try:
        length = v2.parse_header_length(value)
    except EdgeBatcherError as e:
        assert e.status == 400
    else:
        assert length is None or length >= 0
