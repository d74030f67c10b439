"""Batch assembly and slicing (scheduler/batch.py): pure numpy, no engine, no event loop."""

from __future__ import annotations

import numpy as np
import pytest

from edge_batcher.errors import EngineError
from edge_batcher.scheduler.batch import check_outputs, split_rows, stack, zeros
from edge_batcher.types import TensorSpec


def test_fixed_shape_parts_are_padded_with_copies_of_the_last_real_row():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.full((1, 3), 9, dtype=np.float32)
    out = stack([a, b], 4, None, 0, 0.0)
    assert out.shape == (4, 3)
    np.testing.assert_array_equal(out[:3], np.concatenate([a, b]))
    np.testing.assert_array_equal(out[3], b[0])


def test_one_part_of_the_full_size_is_passed_through_uncopied():
    a = np.ones((4, 2), dtype=np.int64)
    assert stack([a], 4, None, 0, 0) is a


def test_sequence_parts_are_padded_to_the_bucket_with_the_pad_value():
    short = np.array([[1, 2]], dtype=np.int64)
    long_ = np.array([[3, 4, 5]], dtype=np.int64)
    out = stack([short, long_], 3, 1, 4, -1)
    assert out.tolist() == [[1, 2, -1, -1], [3, 4, 5, -1], [3, 4, 5, -1]]


def test_text_sequences_pad_with_empty_bytes():
    out = stack([np.array([[b"a"]], dtype=object)], 2, 1, 2, 0)
    assert out.tolist() == [[b"a", b""], [b"a", b""]]


def test_zeros_use_one_for_dynamic_dimensions_and_the_bucket_on_the_sequence_axis():
    spec = TensorSpec("ids", "INT64", (-1, -1, 8))
    out = zeros(spec, 4, 1, 16)
    assert out.shape == (4, 16, 8) and out.dtype == np.int64 and not out.any()
    assert zeros(TensorSpec("t", "BYTES", (-1,)), 2, None, 0).tolist() == [b"", b""]


def test_split_rows_cuts_per_request_and_skips_the_expired():
    outputs = {"y": np.arange(5), "z": np.arange(5) * 10}
    parts = split_rows(outputs, [2, None, 1, 2])
    assert parts[1] is None
    assert [p["y"].tolist() for p in (parts[0], parts[2], parts[3])] == [[0, 1], [2], [3, 4]]
    assert parts[3]["z"].tolist() == [30, 40]


def test_check_outputs_names_a_missing_output_and_a_short_one():
    with pytest.raises(EngineError, match="no output 'y'"):
        check_outputs({"z": np.zeros(4)}, ["y"], 4, "m")
    with pytest.raises(EngineError, match="fewer than the batch's 4 rows"):
        check_outputs({"y": np.zeros(3)}, ["y"], 4, "m")
    with pytest.raises(EngineError, match=r"shape \[\]"):
        check_outputs({"y": np.float32(1.0)}, ["y"], 1, "m")
    check_outputs({"y": np.zeros((4, 2))}, ["y"], 4, "m")  # enough rows: no error


def test_any_length_pads_only_to_the_longest_member_never_beyond_the_bucket(monkeypatch):
    import edge_batcher.scheduler.batch as batching

    short = np.array([[1, 2]], dtype=np.int64)
    long_ = np.array([[3, 4, 5]], dtype=np.int64)
    out = stack([short, long_], 3, 1, 16, 0, any_length=True)
    assert out.tolist() == [[1, 2, 0], [3, 4, 5], [3, 4, 5]]
    assert stack([short, long_], 3, 1, 16, 0).shape == (3, 16)  # engines on buckets: unchanged
    monkeypatch.setattr(batching, "ANY_LENGTH_MULTIPLE", 4)
    assert stack([short, long_], 2, 1, 16, 0, any_length=True).shape == (2, 4)
    monkeypatch.setattr(batching, "ANY_LENGTH_MULTIPLE", 8)
    assert stack([short, long_], 2, 1, 6, 0, any_length=True).shape == (2, 6)  # rounding stops at the bucket
