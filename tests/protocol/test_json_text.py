"""protocol/json_text.loads must behave exactly like json.loads: same values, same errors."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edge_batcher.protocol import json_text

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=6), inner, max_size=6),
    max_leaves=40,
)


def same(a, b) -> bool:
    """Equal, with NaN equal to NaN and ints never equal to floats (1 vs 1.0 would hide a change)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


@settings(max_examples=300, deadline=None)
@given(json_values)
def test_any_document_python_writes_parses_as_json_parses_it(value):
    body = json.dumps(value).encode()
    assert same(json_text.loads(body), json.loads(body))


@pytest.mark.parametrize("text", [
    "18446744073709551616", "-9223372036854775809", "[1, -9223372036854775809]",  # beyond 64 bits: exact
    "NaN", "[Infinity, -Infinity]", "1e400", '"\\ud800"',  # json's extensions and lone surrogates
])
def test_values_orjson_would_change_or_refuse_come_out_as_json_gives_them(text):
    assert same(json_text.loads(text.encode()), json.loads(text))


@pytest.mark.parametrize("body", [b"[1,2,]", b"1 2", b"{", b'"\x01"', b"\xff", b""])
def test_invalid_documents_raise_jsons_error(body):
    with pytest.raises(ValueError) as expected:
        json.loads(body)
    with pytest.raises(ValueError) as got:
        json_text.loads(body)
    assert type(got.value) is type(expected.value) and str(got.value) == str(expected.value)


def test_a_utf16_body_is_read_as_json_reads_it():
    body = json.dumps({"inputs": []}).encode("utf-16")
    assert json_text.loads(body) == {"inputs": []}


def written_as_json_writes(value) -> bytes:
    return json.dumps(value, separators=(",", ":"), allow_nan=False).encode()


@settings(max_examples=300, deadline=None)
@given(json_values)
def test_what_dumps_writes_reads_back_as_the_value_json_would_have_written(value):
    try:
        expected = json.loads(written_as_json_writes(value))
    except ValueError:  # NaN or Infinity somewhere: strict JSON has no way to write it
        with pytest.raises(ValueError, match="Out of range float values are not JSON compliant"):
            json_text.dumps(value)
    else:
        assert same(json.loads(json_text.dumps(value)), expected)


@pytest.mark.parametrize("value", [
    [2**64], {1: "a"}, {"a": None},  # orjson refuses these, or has a null of its own
])
def test_values_orjson_would_write_differently_are_written_by_json(value):
    assert json_text.dumps(value) == written_as_json_writes(value)


@pytest.mark.parametrize("value", [[float("nan"), 1.0], {"x": float("inf")}, [float("-inf")]])
def test_nan_and_infinity_are_refused_where_orjson_would_write_null(value):
    """Issue 31 row 11: what the daemon writes is strict JSON; a NaN never becomes a quiet null."""
    with pytest.raises(ValueError, match="Out of range float values are not JSON compliant"):
        json_text.dumps(value)


@pytest.mark.parametrize("value", [{"a": object()}, [b"bytes"], {(1, 2): 3}])
def test_what_json_cannot_write_raises_jsons_error(value):
    with pytest.raises(TypeError):
        json_text.dumps(value)


@pytest.mark.parametrize("text, by_json", [
    (b'{"data": [0.0012345678901234567, -0.00012345678901234567]}', False),  # fractions: 19 and 20 digits
    (b'{"data": [1.2345678901234567e-05, 0.12345678901234567]}', False),
    (b'{"data": [1, 12345678901234567890]}', True),  # an integer beyond 64 bits
    (b'{"data": -98765432109876543210}', True),
    (b'12345678901234567890', True),
])  # fmt: skip
def test_only_integers_that_may_leave_64_bits_take_the_slow_parser(text, by_json, monkeypatch):
    """A float32 reading such as 0.0012345678901234567 has a run of 19 digits: it must not send
    the whole body to `json` (4x slower), only a long integer must."""
    calls = []
    slow = json.loads
    monkeypatch.setattr(json_text.json, "loads", lambda data: calls.append(data) or slow(data))
    assert same(json_text.loads(text), slow(text))
    assert bool(calls) is by_json


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(st.sampled_from([b"0", b"7", b" ", b",", b".", b"e", b"-", b"[", b"1234567890123456789"]),
                       max_size=60),
       slice_bytes=st.sampled_from([8, 19, 20, 33]))
def test_a_large_document_is_searched_a_slice_at_a_time_as_if_whole(pieces, slice_bytes):
    """Above SCAN_SLICE the search for long integers goes slice by slice (so that the GIL changes
    hands between them); a run across two slices, or at the very start, is found as in one pass."""
    data = b"".join(pieces)
    shapes = data.translate(json_text._NUMBER_SHAPES)
    whole = json_text._LONG_INTEGER in shapes or shapes.startswith(json_text._LONG_INTEGER[1:])
    assert json_text._has_long_integer(data, slice_bytes) is whole
    assert json_text._has_long_integer(bytearray(data), slice_bytes) is whole
