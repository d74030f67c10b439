"""KServe v2 codec: round-trips for every datatype, both encodings, and every malformed case."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from edge_batcher.errors import EngineError, InvalidInput
from edge_batcher.protocol.tensor_encode import SUMMED_IN_PYTHON
from edge_batcher.protocol.v2 import (
    BINARY_CONTENT_TYPE,
    HEADER_LENGTH,
    MAX_DIMS,
    MAX_ELEMENTS,
    DecodedRequest,
    RequestedOutput,
    binary_outputs_for,
    decode_request,
    decode_response,
    encode_request,
    encode_response,
    parse_header_length,
)
from edge_batcher.types import DATATYPE_TO_NUMPY

DATATYPES = list(DATATYPE_TO_NUMPY)


def sample(datatype: str, shape: tuple[int, ...] = (2, 3), *, finite: bool = False) -> np.ndarray:
    """A tensor of `shape` whose values exercise the datatype's range (extremes, and NaN and inf
    unless `finite`: JSON cannot carry those)."""
    n = int(np.prod(shape))
    dtype = DATATYPE_TO_NUMPY[datatype]
    if datatype == "BYTES":
        pool = [b"", b"a", "h\u00e9llo \u2603 \U0001f600".encode(), b"with\x00nul", b"x" * 300]
        values = np.empty(n, dtype=object)
        values[:] = [pool[i % len(pool)] for i in range(n)]
        return values.reshape(shape)
    if datatype == "BOOL":
        return (np.arange(n) % 3 == 0).reshape(shape)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        pool = np.array([info.min, info.max, 0, 1, info.max // 3], dtype=dtype)
    else:
        info = np.finfo(dtype)
        pool = np.array([info.min, info.max, -0.5, 1.25] + ([] if finite else [np.nan, np.inf, -np.inf]), dtype=dtype)
    return np.resize(pool, n).reshape(shape)


def assert_same(actual: np.ndarray, expected: np.ndarray) -> None:
    assert actual.shape == expected.shape
    assert actual.dtype == expected.dtype
    assert actual.dtype.isnative
    if expected.dtype == object:
        assert actual.tolist() == expected.tolist()
        assert all(type(v) is bytes for v in actual.reshape(-1))
    else:
        np.testing.assert_array_equal(actual, expected)  # NaNs in the same places are equal


# --------------------------------------------------------------------------- round-trips


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
@pytest.mark.parametrize("datatype", DATATYPES)
@pytest.mark.parametrize("shape", [(2, 3), (7,), (1, 2, 2, 2), (), (0,), (3, 0, 2)])
def test_request_round_trip(datatype: str, binary: bool, shape: tuple[int, ...]) -> None:
    tensor = sample(datatype, shape, finite=not binary)
    body, header_length = encode_request(
        {"x": tensor}, id="r1", binary_inputs=binary, binary_outputs=binary
    )
    assert (header_length is not None) == binary
    req = decode_request(body, header_length)
    assert req.id == "r1"
    assert list(req.inputs) == ["x"]
    assert_same(req.inputs["x"], tensor)
    assert req.outputs is None
    assert req.binary_output_default is binary


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
@pytest.mark.parametrize("datatype", DATATYPES)
@pytest.mark.parametrize("shape", [(2, 3), (4,), (), (0, 5)])
def test_response_round_trip(datatype: str, binary: bool, shape: tuple[int, ...]) -> None:
    tensor = sample(datatype, shape, finite=not binary)
    body, header_length = encode_response(
        "model-a",
        "r7",
        {"y": tensor, "other": np.arange(3, dtype=np.int32)},
        binary={"y"} if binary else set(),
        parameters={"batch_size": 4},
        model_version="2",
    )
    assert (header_length is not None) == binary
    resp = decode_response(body, header_length)
    assert resp.model_name == "model-a"
    assert resp.model_version == "2"
    assert resp.id == "r7"
    assert resp.parameters == {"batch_size": 4}
    assert list(resp.outputs) == ["y", "other"]
    assert_same(resp.outputs["y"], tensor)
    assert_same(resp.outputs["other"], np.arange(3, dtype=np.int32))


def test_response_without_optional_fields() -> None:
    body, header_length = encode_response("m", None, {"y": np.ones(2, np.float32)})
    assert header_length is None
    doc = json.loads(body)
    assert doc == {
        "model_name": "m",
        "outputs": [{"name": "y", "shape": [2], "datatype": "FP32", "data": [1.0, 1.0]}],
    }
    resp = decode_response(body)
    assert resp.id is None and resp.model_version is None and resp.parameters == {}


def test_binary_layout_is_little_endian_and_in_header_order() -> None:
    a = np.array([1, 2], dtype=np.int32)
    b = np.array([1.5], dtype=np.float64)
    body, header_length = encode_request({"a": a, "b": b}, binary_outputs=False)
    header = json.loads(body[:header_length])
    assert [i["parameters"]["binary_data_size"] for i in header["inputs"]] == [8, 8]
    assert body[header_length:] == struct.pack("<ii", 1, 2) + struct.pack("<d", 1.5)
    assert "parameters" not in header  # binary_outputs=False: no binary_data_output


def test_big_endian_arrays_are_encoded_little_endian() -> None:
    tensor = np.array([[1.5, -2.0]], dtype=">f4")
    body, header_length = encode_request({"x": tensor})
    assert json.loads(body[:header_length])["inputs"][0]["datatype"] == "FP32"
    assert body[header_length:] == struct.pack("<ff", 1.5, -2.0)
    decoded = decode_request(body, header_length).inputs["x"]
    assert decoded.dtype == np.float32 and decoded.dtype.isnative
    np.testing.assert_array_equal(decoded, tensor)


def test_decoded_binary_tensor_at_unaligned_offset() -> None:
    # A header of odd length puts the FP64 tensor at an unaligned offset: still exact.
    tensor = np.array([np.pi, -1e300, 5e-324])
    for request_id in ("o", "od", "odd"):
        body, header_length = encode_request({"x": tensor}, id=request_id)
        assert header_length is not None
        if header_length % 8:
            break
    assert header_length % 8 != 0
    decoded = decode_request(body, header_length).inputs["x"]
    assert decoded.flags.aligned
    assert_same(decoded, tensor)


def test_str_and_fixed_width_arrays_are_bytes() -> None:
    for tensor in (np.array(["a", "\u00fc"]), np.array([b"a", b"bc"]), np.array(["a", "b"], object)):
        for binary in (True, False):
            body, hl = encode_request({"s": tensor}, binary_inputs=binary)
            got = decode_request(body, hl).inputs["s"]
            assert got.dtype == object
            assert got.tolist() == [v.encode() if isinstance(v, str) else v for v in tensor.tolist()]


def test_fp16_given_as_json_numbers() -> None:
    body = json.dumps(
        {"inputs": [{"name": "h", "shape": [3], "datatype": "FP16", "data": [0.5, 65504, -1]}]}
    ).encode()
    got = decode_request(body).inputs["h"]
    assert got.dtype == np.float16
    assert got.tolist() == [0.5, 65504.0, -1.0]


# --------------------------------------------------------------------------- JSON specifics


def test_nested_json_data_is_row_major() -> None:
    body = json.dumps(
        {
            "inputs": [
                {"name": "n", "shape": [2, 3], "datatype": "INT32", "data": [[1, 2, 3], [4, 5, 6]]},
                {"name": "f", "shape": [2, 3], "datatype": "INT32", "data": [1, 2, 3, 4, 5, 6]},
                {"name": "s", "shape": [2, 1], "datatype": "BYTES", "data": [["a"], ["b"]]},
            ]
        }
    ).encode()
    req = decode_request(body)
    expected = np.arange(1, 7, dtype=np.int32).reshape(2, 3)
    assert_same(req.inputs["n"], expected)
    assert_same(req.inputs["f"], expected)
    assert req.inputs["s"].tolist() == [[b"a"], [b"b"]]


def test_json_unicode_bytes_round_trip() -> None:
    text = ["", "caf\u00e9", "\u6f22\u5b57", "\U0001f680", 'quote " and \\']
    body = json.dumps(
        {"inputs": [{"name": "s", "shape": [5], "datatype": "BYTES", "data": text}]}
    ).encode()
    got = decode_request(body).inputs["s"]
    assert got.tolist() == [t.encode() for t in text]
    out, hl = encode_response("m", None, {"s": got})
    assert hl is None
    assert json.loads(out)["outputs"][0]["data"] == text


def test_non_utf8_bytes_are_sent_binary_even_in_json_mode() -> None:
    tensor = np.array([b"\xff\xfe", b"ok"], dtype=object)
    body, hl = encode_response("m", None, {"s": tensor, "n": np.zeros(1, np.int8)})
    assert hl is not None
    header = json.loads(body[:hl])
    assert header["outputs"][0]["parameters"] == {"binary_data_size": 12}
    assert header["outputs"][1]["data"] == [0]
    assert decode_response(body, hl).outputs["s"].tolist() == [b"\xff\xfe", b"ok"]

    body, hl = encode_request({"s": tensor}, binary_inputs=False, binary_outputs=False)
    assert hl is not None
    assert decode_request(body, hl).inputs["s"].tolist() == [b"\xff\xfe", b"ok"]


def test_non_finite_floats_are_never_written_as_json_and_travel_binary() -> None:
    """Issue 31 row 11: replies carried bare NaN, which strict JSON parsers refuse."""
    y = np.array([np.nan, np.inf, -np.inf, 1.0], np.float32)
    with pytest.raises(EngineError) as info:
        encode_response("m", None, {"y": y, "ok": np.ones(2, np.float32)})
    assert info.value.status == 500 and str(info.value) == (
        "model 'm': its response cannot be sent: output 'y' holds 3 NaN or Infinity values, "
        "which JSON cannot carry: ask for it binary (binary_data_output)")
    with pytest.raises(InvalidInput, match="input 'x' holds 1 NaN or Infinity values, which JSON cannot carry: "
                                           "send it binary"):
        encode_request({"x": np.array([1.0, np.nan])}, binary_inputs=False)
    with pytest.raises(EngineError, match="response cannot be encoded as JSON: Out of range float"):
        encode_response("m", None, {"ok": np.ones(2, np.float32)}, parameters={"score": float("nan")})
    body, hl = encode_response("m", None, {"y": y}, binary={"y"})
    got = decode_response(body, hl).outputs["y"]
    assert np.isnan(got[0]) and got[1] == np.inf and got[2] == -np.inf and got[3] == 1.0


@pytest.mark.parametrize("size", [1, SUMMED_IN_PYTHON, SUMMED_IN_PYTHON + 1, 5000])
def test_the_finite_check_of_json_outputs_holds_on_either_side_of_the_python_sum(size: int) -> None:
    """Small outputs are checked by summing their JSON list, larger ones with numpy: a NaN or an
    Infinity anywhere is refused on both paths; finite values whose sum overflows are sent."""
    for bad in (np.nan, np.inf, -np.inf):
        y = np.ones(size, np.float64)
        y[size // 2] = bad
        with pytest.raises(EngineError, match="output 'y' holds 1 NaN or Infinity values"):
            encode_response("m", None, {"y": y})
    huge = np.full(size, np.finfo(np.float64).max)  # finite, but two of them sum to inf
    body, _ = encode_response("m", None, {"y": huge})
    assert decode_response(body).outputs["y"].tolist() == huge.tolist()


def test_the_javascript_tokens_other_writers_send_are_still_read() -> None:
    """Python's json and tritonclient write NaN/Infinity tokens: read, and left to the model's check."""
    body = b'{"model_name": "m", "outputs": [{"name": "y", "shape": [3], "datatype": "FP32", ' \
           b'"data": [NaN, Infinity, -Infinity]}]}'
    got = decode_response(body).outputs["y"]
    assert np.isnan(got[0]) and got[1] == np.inf and got[2] == -np.inf


def test_json_integers_and_bools() -> None:
    def one(datatype: str, data: list) -> np.ndarray:
        body = json.dumps(
            {"inputs": [{"name": "x", "shape": [len(data)], "datatype": datatype, "data": data}]}
        ).encode()
        return decode_request(body).inputs["x"]

    assert one("INT64", [-(2**63), 2**63 - 1]).tolist() == [-(2**63), 2**63 - 1]
    assert one("UINT64", [0, 2**64 - 1]).tolist() == [0, 2**64 - 1]
    assert one("INT8", [1.0, -128.0]).tolist() == [1, -128]  # integral floats are fine
    assert one("BOOL", [True, False]).tolist() == [True, False]
    assert one("BOOL", [1, 0]).tolist() == [True, False]
    assert one("FP32", [1, 2.5]).tolist() == [1.0, 2.5]
    # Python ints beyond int64 mixed with others: numpy alone would go through float64.
    assert one("UINT64", [2**64 - 1, 1, 2.0]).tolist() == [2**64 - 1, 1, 2]
    assert one("UINT64", [2**64 - 1, 1e19]).tolist() == [2**64 - 1, 10**19]
    assert one("FP64", [2**70, 1]).tolist() == [2.0**70, 1.0]


# --------------------------------------------------------------------------- binary specifics


def test_binary_bytes_with_empty_and_non_utf8_elements() -> None:
    elements = [b"", b"\x00\xff\x80", b"", "\u00e9".encode(), b"\xc3"]
    chunk = b"".join(struct.pack("<I", len(e)) + e for e in elements)
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "s",
                    "shape": [5],
                    "datatype": "BYTES",
                    "parameters": {"binary_data_size": len(chunk)},
                }
            ]
        }
    ).encode()
    got = decode_request(header + chunk, len(header)).inputs["s"]
    assert got.tolist() == elements

    tensor = np.empty(5, dtype=object)
    tensor[:] = elements
    body, hl = encode_request({"s": tensor})
    assert body[hl:] == chunk


def test_binary_bool_is_one_byte_per_element() -> None:
    tensor = np.array([[True, False, True]])
    body, hl = encode_request({"b": tensor})
    assert body[hl:] == b"\x01\x00\x01"
    header = body[:hl]
    # Any non-zero byte reads as true.
    assert decode_request(header + b"\x02\x00\xff", hl).inputs["b"].tolist() == [[True, False, True]]


def test_mixed_binary_and_json_inputs() -> None:
    raw_a = np.array([1.0, 2.0], dtype="<f4").tobytes()
    raw_c = struct.pack("<I", 2) + b"hi"
    header = json.dumps(
        {
            "id": "mixed",
            "inputs": [
                {"name": "a", "shape": [2], "datatype": "FP32", "parameters": {"binary_data_size": 8}},
                {"name": "b", "shape": [1, 2], "datatype": "INT16", "data": [[7, -7]]},
                {"name": "c", "shape": [1], "datatype": "BYTES", "parameters": {"binary_data_size": 6}},
                {"name": "d", "shape": [1], "datatype": "BYTES", "data": ["json"], "parameters": {}},
            ],
        }
    ).encode()
    req = decode_request(header + raw_a + raw_c, len(header))
    assert req.id == "mixed"
    assert_same(req.inputs["a"], np.array([1.0, 2.0], np.float32))
    assert_same(req.inputs["b"], np.array([[7, -7]], np.int16))
    assert req.inputs["c"].tolist() == [b"hi"]
    assert req.inputs["d"].tolist() == [b"json"]


def test_header_length_equal_to_body_means_no_binary_tensors() -> None:
    body, _ = encode_request({"x": np.ones(2)}, binary_inputs=False)
    req = decode_request(body, len(body))
    assert_same(req.inputs["x"], np.ones(2))


# --------------------------------------------------------------------------- requested outputs


def test_requested_outputs_in_encoded_request() -> None:
    body, hl = encode_request({"x": np.ones(1)}, outputs=["a", "b"], binary_outputs=True)
    req = decode_request(body, hl)
    assert req.outputs == [RequestedOutput("a", True), RequestedOutput("b", True)]
    assert req.binary_output_default is False

    body, hl = encode_request({"x": np.ones(1)}, outputs=["a"], binary_outputs=False,
                              parameters={"priority": 2})
    req = decode_request(body, hl)
    assert req.outputs == [RequestedOutput("a", False)]
    assert req.parameters == {"priority": 2}


def test_encode_request_does_not_modify_parameters() -> None:
    params = {"timeout_ms": 50}
    encode_request({"x": np.ones(1)}, parameters=params)
    assert params == {"timeout_ms": 50}


def _request_with(outputs: list | None, parameters: dict | None = None) -> DecodedRequest:
    doc: dict = {"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}]}
    if outputs is not None:
        doc["outputs"] = outputs
    if parameters is not None:
        doc["parameters"] = parameters
    return decode_request(json.dumps(doc).encode())


def test_binary_outputs_for() -> None:
    available = ["a", "b", "c"]
    assert binary_outputs_for(_request_with(None), available) == set()
    req = _request_with(None, {"binary_data_output": True})
    assert req.binary_output_default is True
    assert binary_outputs_for(req, available) == {"a", "b", "c"}

    outputs = [
        {"name": "a"},
        {"name": "b", "parameters": {"binary_data": False}},
        {"name": "c", "parameters": {"binary_data": True}},
    ]
    req = _request_with(outputs)
    assert req.outputs == [
        RequestedOutput("a", None), RequestedOutput("b", False), RequestedOutput("c", True)
    ]
    assert binary_outputs_for(req, available) == {"c"}
    req = _request_with(outputs, {"binary_data_output": True})
    assert binary_outputs_for(req, available) == {"a", "c"}  # per-output setting wins
    assert binary_outputs_for(req, ["a"]) == {"a"}  # unknown names are the server's business
    assert _request_with([]).outputs is None


# --------------------------------------------------------------------------- interop


def test_decodes_a_request_as_tritonclient_http_sends_it() -> None:
    """Byte-for-byte what tritonclient.http.InferenceServerClient.infer() sends for
    InferInput("INPUT0", [1, 4], "FP32").set_data_from_numpy(x) (binary_data=True by default),
    InferInput("TEXT", [2], "BYTES").set_data_from_numpy(s), one InferRequestedOutput
    ("OUTPUT0", binary_data=True), request_id="42", priority=0 (omitted).
    tritonclient serialises with json.dumps defaults (", " and ": " separators) and appends
    the tensors' raw bytes; Inference-Header-Content-Length is the JSON length."""
    x = np.array([[0.5, -1.0, 3.25, 1e-3]], dtype=np.float32)
    text_bytes = struct.pack("<I", 5) + b"hello" + struct.pack("<I", 3) + b"\xe2\x98\x83"
    infer_request = {
        "id": "42",
        "inputs": [
            {"name": "INPUT0", "shape": [1, 4], "datatype": "FP32",
             "parameters": {"binary_data_size": 16}},
            {"name": "TEXT", "shape": [2], "datatype": "BYTES",
             "parameters": {"binary_data_size": len(text_bytes)}},
        ],
        "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": True}}],
    }
    request_json = json.dumps(infer_request)
    body = struct.pack(
        f"{len(request_json)}s{16 + len(text_bytes)}s",
        request_json.encode(),
        x.tobytes() + text_bytes,
    )
    header_length = parse_header_length(str(len(request_json)))

    req = decode_request(body, header_length)
    assert req.id == "42"
    assert_same(req.inputs["INPUT0"], x)
    assert req.inputs["TEXT"].tolist() == [b"hello", "\u2603".encode()]
    assert req.outputs == [RequestedOutput("OUTPUT0", True)]
    assert binary_outputs_for(req, ["OUTPUT0", "OUTPUT1"]) == {"OUTPUT0"}

    # And the response as tritonclient's InferResult reads it: JSON header, then raw bytes.
    out, hl = encode_response("simple", "42", {"OUTPUT0": x * 2}, binary={"OUTPUT0"})
    header = json.loads(out[:hl])
    assert header["outputs"] == [
        {"name": "OUTPUT0", "shape": [1, 4], "datatype": "FP32",
         "parameters": {"binary_data_size": 16}}
    ]
    assert np.frombuffer(out[hl:], dtype="<f4").tolist() == (x * 2).reshape(-1).tolist()


def test_constants() -> None:
    assert HEADER_LENGTH == "Inference-Header-Content-Length"
    assert BINARY_CONTENT_TYPE == "application/octet-stream"


# --------------------------------------------------------------------------- malformed input


def _json_body(inputs: list, **extra) -> bytes:
    return json.dumps({"inputs": inputs, **extra}).encode()


def _binary_body(inputs: list, payload: bytes) -> tuple[bytes, int]:
    header = json.dumps({"inputs": inputs}).encode()
    return header + payload, len(header)


def _nested(value, levels: int) -> list:
    for _ in range(levels):
        value = [value]
    return value


def _fp32(name: str = "x", shape: list | None = None, **fields) -> dict:
    return {"name": name, "shape": shape if shape is not None else [2], "datatype": "FP32", **fields}


@pytest.mark.parametrize(
    "body, words",
    [
        (b"{not json", "body is not valid JSON"),
        (b"\xff\xfe\x00", "body is not valid JSON"),
        (b"[" * 100000 + b"]" * 100000, "body is not valid JSON"),
        (b"[1, 2]", "request body must be a JSON object"),
        (b"{}", "request has no inputs"),
        (_json_body([]), "request has no inputs"),
        (b'{"inputs": {"name": "x"}}', "'inputs' must be a list"),
        (_json_body([5]), "each of 'inputs' must be a JSON object"),
        (_json_body([{"shape": [1], "datatype": "FP32", "data": [1]}]), "input without a name"),
        (_json_body([_fp32(data=[1, 2]), _fp32(data=[3, 4])]), "input 'x' appears twice"),
        (_json_body([{"name": "x", "shape": [1], "data": [1]}]), "input 'x' has no datatype"),
        (_json_body([{**_fp32(data=[1, 2]), "datatype": "FP31"}]),
         "input 'x': unknown datatype 'FP31'"),
        (_json_body([_fp32(shape=[2, -1], data=[1, 2])]),
         "input 'x': shape [2, -1] has a negative dimension"),
        (_json_body([_fp32(shape="2", data=[1, 2])]), "input 'x': shape must be a list of integers"),
        (_json_body([_fp32(shape=[2.0], data=[1, 2])]),
         "input 'x': shape must be a list of integers"),
        (_json_body([_fp32(shape=[True], data=[1])]), "input 'x': shape must be a list of integers"),
        (_json_body([{"name": "x", "datatype": "FP32", "data": [1]}]),
         "input 'x': shape must be a list of integers"),
        (_json_body([_fp32()]), "input 'x' has neither data nor binary_data_size"),
        (_json_body([_fp32("signal", shape=[2, 256], data=[0.0] * 500)]),
         "input 'signal': shape [2, 256] needs 512 elements, data has 500"),
        (_json_body([_fp32(data=[[1, 2], [3]])]), "input 'x': data is not a regular nested list"),
        # Issue 31 row 16: data nested otherwise than its shape was flattened and accepted.
        (_json_body([{"name": "x", "shape": [1], "datatype": "BYTES", "data": _nested("a", 100)}]),
         "input 'x': data is nested deeper than shape [1]; send it flat or nested as the shape"),
        (_json_body([{"name": "x", "shape": [], "datatype": "BYTES", "data": [["a"]]}]),
         "input 'x': data is nested, but shape [] holds one string"),
        (_json_body([{"name": "x", "shape": [2, 1], "datatype": "BYTES", "data": [["a", "b"], ["c"]]}]),
         "input 'x': data is not nested as shape [2, 1]: a list at depth 1 has 2 elements, the shape 1"),
        (_json_body([{"name": "x", "shape": [2, 2], "datatype": "BYTES", "data": [["a", "b"], "c", "d"]}]),
         "input 'x': data is not nested as shape [2, 2]: a list at depth 0 has 3 elements, the shape 2"),
        (_json_body([{"name": "x", "shape": [2, 2], "datatype": "BYTES", "data": [["a", "b"], "c"]}]),
         "input 'x': data is not nested as shape [2, 2]: a string at depth 0, above the shape's last"),
        (_json_body([{"name": "x", "shape": [2, 1], "datatype": "BYTES", "data": [["a"], [3]]}]),
         "input 'x': data for BYTES must be strings, got int"),
        (_json_body([_fp32(shape=[1], data=_nested(1.0, 30))]),
         "input 'x': data is nested as [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, "
         "1, 1, 1, 1, 1], not as shape [1]"),
        (_json_body([_fp32(shape=[1], data=_nested(1.0, 100))]), "input 'x': data is not a regular nested list"),
        (_json_body([{"name": "x", "shape": [2, 3], "datatype": "INT32", "data": [[1, 2], [3, 4], [5, 6]]}]),
         "input 'x': data is nested as [3, 2], not as shape [2, 3]; send it flat or nested as the shape"),
        (_json_body([_fp32(data=["a", "b"])]), "input 'x': data for FP32 are not numbers"),
        (_json_body([_fp32(data=[1, None])]), "input 'x': data for FP32 are not numbers"),
        (_json_body([_fp32(data=[True, False])]), "input 'x': data for FP32 are not numbers"),
        (_json_body([_fp32(data=[{"a": 1}, 2])]), "input 'x': data for FP32 are not numbers"),
        (_json_body([_fp32(data=3)]), "input 'x': data must be a list"),
        (_json_body([{"name": "x", "shape": [2], "datatype": "INT32", "data": [1.5, 2]}]),
         "input 'x': data for INT32 are not integers"),
        (_json_body([{"name": "x", "shape": [1], "datatype": "INT32", "data": [1e400]}]),
         "input 'x': data for INT32 are not integers"),
        (_json_body([{"name": "x", "shape": [2], "datatype": "UINT8", "data": [1, 256]}]),
         "input 'x': data for UINT8 are out of range [0, 255]"),
        (_json_body([{"name": "x", "shape": [1], "datatype": "UINT32", "data": [-1]}]),
         "input 'x': data for UINT32 are out of range"),
        (_json_body([{"name": "x", "shape": [2], "datatype": "INT64", "data": [-1, 2**63]}]),
         "input 'x': data for INT64 are out of range"),
        (_json_body([{"name": "x", "shape": [1], "datatype": "UINT64", "data": [2**64]}]),
         "input 'x': data for UINT64 are out of range"),
        (_json_body([{"name": "x", "shape": [2], "datatype": "UINT64", "data": [2**64 - 1, 0.5]}]),
         "input 'x': data for UINT64 are not integers"),
        (_json_body([{"name": "x", "shape": [2], "datatype": "UINT64", "data": [2**64 - 1, -1]}]),
         "input 'x': data for UINT64 are out of range"),
        (_json_body([{"name": "x", "shape": [2], "datatype": "UINT64", "data": [2**64 - 1, "1"]}]),
         "input 'x': data for UINT64 are not numbers"),
        (_json_body([{"name": "x", "shape": [1], "datatype": "INT16", "data": [float("nan")]}]),
         "input 'x': data for INT16 are not integers"),
        (_json_body([{"name": "x", "shape": [1], "datatype": "INT8", "data": [128.0]}]),
         "input 'x': data for INT8 are out of range [-128, 127]"),
        (_json_body([{"name": "x", "shape": [2], "datatype": "BOOL", "data": [1, 2]}]),
         "input 'x': data for BOOL must be true/false"),
        (_json_body([{"name": "x", "shape": [2], "datatype": "BYTES", "data": ["a", 1]}]),
         "input 'x': data for BYTES must be strings, got int"),
        (_json_body([{"name": "x", "shape": [3], "datatype": "BYTES", "data": ["a", "b"]}]),
         "input 'x': shape [3] needs 3 elements, data has 2"),
        (b'{"inputs": [{"name": "x", "shape": [1], "datatype": "BYTES", "data": ["\\ud800"]}]}',
         "input 'x': BYTES element '\\ud800' is not valid unicode"),
        (_json_body([_fp32(data=[1, 2], parameters=[1])]),
         "input 'x': parameters must be a JSON object"),
        (_json_body([_fp32(data=[1, 2], parameters={"binary_data_size": 8})]),
         "input 'x' has both data and binary_data_size"),
        (_json_body([_fp32(parameters={"binary_data_size": 8})]),
         "input 'x' has binary_data_size but the message has no Inference-Header-Content-Length"),
        (_json_body([_fp32(data=[1, 2])], id=5), "request 'id' must be a string"),
        (_json_body([_fp32(data=[1, 2])], parameters=[]), "request 'parameters' must be a JSON object"),
        (_json_body([_fp32(data=[1, 2])], parameters={"binary_data_output": "yes"}),
         "request parameter 'binary_data_output' must be true or false"),
        (_json_body([_fp32(data=[1, 2])], outputs={"name": "y"}), "'outputs' must be a list"),
        (_json_body([_fp32(data=[1, 2])], outputs=[{"name": "y"}, {"name": "y"}]),
         "requested output 'y' appears twice"),
        (_json_body([_fp32(data=[1, 2])], outputs=[{}]), "requested output without a name"),
        (_json_body([_fp32(data=[1, 2])], outputs=["y"]), "each of 'outputs' must be a JSON object"),
        (_json_body([_fp32(data=[1, 2])], outputs=[{"name": "y", "parameters": {"binary_data": 1}}]),
         "requested output 'y': binary_data must be true or false"),
    ],
)
def test_malformed_json_requests(body: bytes, words: str) -> None:
    with pytest.raises(InvalidInput) as info:
        decode_request(body)
    assert words in info.value.message
    assert info.value.status == 400


def test_malformed_binary_requests() -> None:
    def fails(body: bytes, header_length: int, words: str) -> None:
        with pytest.raises(InvalidInput) as info:
            decode_request(body, header_length)
        assert words in info.value.message, info.value.message

    size = {"binary_data_size": 12}
    body, hl = _binary_body([_fp32(shape=[2, 2], parameters=size)], b"\x00" * 12)
    fails(body, hl, "input 'x': binary_data_size 12 does not match shape [2, 2] of FP32 (16 bytes)")

    body, hl = _binary_body([_fp32(shape=[4], parameters={"binary_data_size": 16})], b"\x00" * 8)
    fails(body, hl, "binary body is 8 bytes short")

    body, hl = _binary_body([_fp32(shape=[2], parameters={"binary_data_size": 8})], b"\x00" * 11)
    fails(body, hl, "binary body has 3 bytes left over")

    fails(b"{}" + b"\x00" * 98, 900,
          "Inference-Header-Content-Length 900 is larger than the body (100 bytes)")
    fails(b"{}", -1, "Inference-Header-Content-Length -1 is negative")

    for bad in (-4, 1.5, "8", True):
        body, hl = _binary_body([_fp32(parameters={"binary_data_size": bad})], b"")
        fails(body, hl, "input 'x': binary_data_size must be a non-negative integer")

    bytes_input = {"name": "s", "shape": [2], "datatype": "BYTES"}
    payload = struct.pack("<I", 1) + b"a"
    body, hl = _binary_body([{**bytes_input, "parameters": {"binary_data_size": 5}}], payload)
    fails(body, hl, "input 's': shape [2] needs 2 elements, binary data has 1")

    payload = struct.pack("<I", 10) + b"abc"
    body, hl = _binary_body([{**bytes_input, "parameters": {"binary_data_size": 7}}], payload)
    fails(body, hl, "input 's': BYTES element 0 claims 10 bytes but only 3 remain")

    payload = struct.pack("<I", 1) + b"a" + b"\x01\x00"
    body, hl = _binary_body([{**bytes_input, "parameters": {"binary_data_size": 7}}], payload)
    fails(body, hl, "input 's': BYTES element 1 is cut off inside its 4-byte length")

    # The binary part of a body with a bad header is never reached.
    fails(b"{bad" + b"\x00" * 4, 4, "body is not valid JSON")


def test_parse_header_length() -> None:
    assert parse_header_length(None) is None
    assert parse_header_length(" 120 ") == 120
    with pytest.raises(InvalidInput, match="Inference-Header-Content-Length 'abc' is not an integer"):
        parse_header_length("abc")
    with pytest.raises(InvalidInput, match="is negative"):
        parse_header_length("-3")


_BINARY_RESPONSE_HEADER = json.dumps(
    {"model_name": "m", "outputs": [_fp32("y", [1], parameters={"binary_data_size": 4})]}
).encode()


@pytest.mark.parametrize(
    "body, header_length, words",
    [
        (b"nope", None, "body is not valid JSON"),
        (b"[]", None, "response body must be a JSON object"),
        (b'{"outputs": []}', None, "response has no model_name"),
        (b'{"model_name": "m"}', None, "response has no outputs"),
        (b'{"model_name": "m", "model_version": 1, "outputs": []}', None,
         "response 'model_version' must be a string"),
        (b'{"model_name": "m", "outputs": [{"name": "y", "shape": [1], "datatype": "FP32"}]}',
         None, "output 'y' has neither data nor binary_data_size"),
        (_BINARY_RESPONSE_HEADER + b"\x00\x00", len(_BINARY_RESPONSE_HEADER),
         "binary body is 2 bytes short"),
    ],
)
def test_malformed_responses(body: bytes, header_length: int | None, words: str) -> None:
    with pytest.raises(InvalidInput) as info:
        decode_response(body, header_length)
    assert words in info.value.message


def test_encoding_errors_are_invalid_input() -> None:
    with pytest.raises(InvalidInput, match="request has no inputs"):
        encode_request({})
    with pytest.raises(InvalidInput, match="input 'c': numpy dtype complex128 has no KServe v2"):
        encode_request({"c": np.ones(2, dtype=np.complex128)})
    with pytest.raises(InvalidInput, match="BYTES elements must be bytes or str, got int"):
        encode_request({"s": np.array([b"a", 3], dtype=object)})
    with pytest.raises(InvalidInput, match="request cannot be encoded as JSON"):
        encode_request({"x": np.ones(1)}, parameters={"bad": object()})
    with pytest.raises(EngineError, match="model 'm': its response cannot be sent: output 's': BYTES element"):
        encode_response("m", None, {"s": np.array(["\ud800"], dtype=object)})


# --------------------------------------------------------------------------- limits (issue 14)
# Each of these crashed the decoder (OverflowError, numpy ValueError: HTTP 500) before.


@pytest.mark.parametrize(
    "entry, words",
    [
        ({"name": "x", "shape": [1], "datatype": "FP32", "data": [10**400]},
         "input 'x': data for FP32 has an integer too large for any floating-point number"),
        ({"name": "x", "shape": [2], "datatype": "FP64", "data": [1.5, -(10**309)]},
         "input 'x': data for FP64 has an integer too large for any floating-point number"),
        ({"name": "x", "shape": [1], "datatype": "INT32", "data": [2**70]},
         "input 'x': data for INT32 are out of range"),
        ({"name": "x", "shape": [2], "datatype": "INT8", "data": [1.0, 10**400]},
         "input 'x': data for INT8 are out of range"),
        ({"name": "x", "shape": [1] * 65, "datatype": "FP32", "data": [1]},
         f"input 'x': shape has 65 dimensions, more than the {MAX_DIMS} supported"),
        ({"name": "x", "shape": [1] * 65, "datatype": "BYTES", "data": ["a"]},
         "input 'x': shape has 65 dimensions"),
        ({"name": "x", "shape": [2**64, 0], "datatype": "FP32", "data": []},
         "input 'x': shape [18446744073709551616, 0] is too large"),
        ({"name": "x", "shape": [2**62, 4, 0], "datatype": "BYTES", "data": []},
         "is too large (its non-zero dimensions multiply to more than"),
    ],
    ids=["fp32-1e400", "fp64-neg-1e309", "int32-2**70", "int8-1e400", "65-dims", "65-dims-bytes",
         "2**64-by-0", "2**64-elements-by-0-bytes"],
)
def test_values_and_shapes_beyond_numpy_limits_are_invalid_input(entry: dict, words: str) -> None:
    with pytest.raises(InvalidInput) as info:
        decode_request(_json_body([entry]))
    assert words in info.value.message
    assert info.value.status == 400


def test_shapes_at_numpy_limits_still_decode() -> None:
    deep = decode_request(_json_body([_fp32(shape=[1] * MAX_DIMS, data=[2.5])])).inputs["x"]
    assert deep.shape == (1,) * MAX_DIMS and deep.reshape(-1).tolist() == [2.5]
    for datatype in DATATYPES:
        entry = {"name": "x", "shape": [MAX_ELEMENTS, 0], "datatype": datatype, "data": []}
        assert decode_request(_json_body([entry])).inputs["x"].shape == (MAX_ELEMENTS, 0)
        del entry["data"]
        body, hl = _binary_body([{**entry, "parameters": {"binary_data_size": 0}}], b"")
        assert decode_request(body, hl).inputs["x"].shape == (MAX_ELEMENTS, 0)


def test_huge_shape_in_a_binary_tensor_is_invalid_input() -> None:
    body, hl = _binary_body([_fp32(shape=[1] * 70, parameters={"binary_data_size": 4})], b"\0" * 4)
    with pytest.raises(InvalidInput, match="input 'x': shape has 70 dimensions"):
        decode_request(body, hl)
    body, hl = _binary_body([_fp32(shape=[2**63, 0], parameters={"binary_data_size": 0})], b"")
    with pytest.raises(InvalidInput, match="input 'x': shape .* is too large"):
        decode_request(body, hl)


def test_fp16_and_fp32_overflow_to_infinity_as_documented() -> None:
    entry = {"name": "x", "shape": [3], "datatype": "FP16", "data": [1e39, -(2**70), 1.0]}
    assert decode_request(_json_body([entry])).inputs["x"].tolist() == [np.inf, -np.inf, 1.0]


def test_error_messages_quote_a_bounded_part_of_huge_values() -> None:
    with pytest.raises(InvalidInput) as info:
        decode_request(_json_body([_fp32(name="n" * 100_000, shape=["1"] * 100_000, data=[1])]))
    assert "shape must be a list of integers" in info.value.message
    assert len(info.value.message) < 400
