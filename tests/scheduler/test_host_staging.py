"""Host batches assembled in the engine's own staging (Engine.host_batch_buffers): the executor
writes a batch straight into the arrays the engine gives for its shape, padding and sequence
padding included, and a fresh array for a shape it gives none for; ONNX Runtime's bound shapes
get page-locked staging through the CUDA API (ort_graphs.PinnedStaging, run here over FakeCuda
on the CPU provider: NOT a GPU, the fake's "page-locked" arrays are ordinary memory it keeps a
list of). TensorRT's side: tests/trt/test_trt_engine.py."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from edge_batcher.engines.cuda_api import cuda_api_from
from edge_batcher.engines.ort_graphs import BoundSession, PinnedStaging
from edge_batcher.scheduler.batch import stack, stack_shape
from edge_batcher.scheduler.execute import BatchExecutor
from edge_batcher.types import TensorSpec
from tests.fakes.fake_cuda import FakeCuda
from tests.fakes.fake_cuda_bindings import fake_cuda_module
from tests.scheduler.test_device_batch import _executor_batch as executor_batch


def test_a_batch_written_into_given_staging_equals_a_fresh_one():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.full((1, 3), 9, dtype=np.float32)
    staging = np.full((4, 3), -7, dtype=np.float32)  # an earlier batch's leftovers
    assert stack([a, b], 4, None, 0, 0.0, out=staging) is staging
    np.testing.assert_array_equal(staging, stack([a, b], 4, None, 0, 0.0))
    # one part of the full size is copied in too: the staging is what the engine reads
    whole = np.ones((4, 3), dtype=np.float32)
    assert stack([whole], 4, None, 0, 0.0, out=staging) is staging and (staging == 1).all()


def test_a_sequence_batch_written_into_staging_is_padded_over_the_leftovers():
    short = np.array([[1, 2]], dtype=np.int64)
    long_ = np.array([[3, 4, 5]], dtype=np.int64)
    staging = np.full((3, 4), 99, dtype=np.int64)
    assert stack_shape([short, long_], 3, 1, 4) == ((3, 4), np.dtype(np.int64))
    out = stack([short, long_], 3, 1, 4, -1, out=staging)
    assert out is staging and out.tolist() == [[1, 2, -1, -1], [3, 4, 5, -1], [3, 4, 5, -1]]


def test_stack_shape_is_the_batch_shape_or_none_when_the_parts_disagree():
    x = np.zeros((1, 2, 3), np.float32)
    assert stack_shape([x, x], 4, None, 0) == ((4, 2, 3), np.dtype(np.float32))
    assert stack_shape([x, np.zeros((1, 2, 4), np.float32)], 4, None, 0) is None
    assert stack_shape([x, np.zeros((1, 2, 3), np.float64)], 4, None, 0) is None
    # with any_length, the sequence axis is only padded to the longest member
    assert stack_shape([np.zeros((1, 5), np.int64)], 2, 1, 16, any_length=True) == ((2, 5), np.dtype(np.int64))


class StagingEngine:
    """An engine with staging for batches of 4 x 2 x 3 float32 (as ONNX Runtime's engine has for
    each warmed-up shape): it records what it was handed and sums rows."""

    inputs = outputs = []
    accepts_any_length = False
    device_inputs = None
    device_batch_buffers = None

    def __init__(self):
        self.staging = np.full((4, 2, 3), -1, dtype=np.float32)
        self.asked: list[dict] = []
        self.seen: list[np.ndarray] = []

    def host_batch_buffers(self, shapes):
        self.asked.append(shapes)
        return {"x": self.staging} if shapes == {"x": ((4, 2, 3), np.dtype(np.float32))} else None

    def infer(self, inputs):
        x = inputs["x"]
        self.seen.append(x)
        return {"y": x.reshape(x.shape[0], -1).sum(axis=1)}


def rows(n: int, start: float) -> np.ndarray:
    return (np.arange(n * 6, dtype=np.float32) + start).reshape(n, 2, 3)


def test_the_executor_assembles_a_host_batch_in_the_engines_staging():
    engine = StagingEngine()
    execute = BatchExecutor("m", [engine], [TensorSpec("x", "FP32", (-1, 2, 3))], lambda name: None, 0.0, ["y"])
    a, b = rows(1, 0), rows(2, 50)
    results, _, _ = execute(executor_batch([a, b], 4))
    assert engine.seen[0] is engine.staging and engine.asked == [{"x": ((4, 2, 3), np.dtype(np.float32))}]
    np.testing.assert_array_equal(engine.staging, np.concatenate([a, b, b[-1:]]))  # padded with the last row
    assert [r["y"].tolist() for r in results] == [[a.sum()], [b[0].sum(), b[1].sum()]]
    # the next batch of that shape overwrites it; one of a shape without staging gets its own array
    c = rows(4, 100)
    results, _, _ = execute(executor_batch([c], 4))
    assert engine.seen[1] is engine.staging and results[0]["y"].tolist() == c.reshape(4, -1).sum(axis=1).tolist()
    results, _, _ = execute(executor_batch([a, a], 2))
    assert engine.seen[2] is not engine.staging and results[1]["y"].tolist() == [a.sum()]
    np.testing.assert_array_equal(engine.staging, c)  # untouched by the batch of 2


@pytest.fixture(params=["pycuda", "cuda-python"])
def gpu_api(request):
    gpu = FakeCuda()
    return gpu, cuda_api_from(fake_cuda_module(request.param, gpu))


def test_bound_shapes_get_page_locked_staging_that_runs_as_a_plainexecutor_batch(model_repo, gpu_api):
    gpu, api = gpu_api
    session = ort.InferenceSession(str(model_repo / "vibration" / "model.onnx"), providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    api.init()
    staging = PinnedStaging(api, 0)
    bound = BoundSession(session, "cpu", graphs=False, staging=staging)
    rng = np.random.default_rng(3)
    assert bound.host_buffers_for({name: ((4, 256), np.dtype(np.float32))}) is None  # not bound yet
    bound.run({name: np.zeros((4, 256), np.float32)})  # warm-up binds the shape
    buffers = bound.host_buffers_for({name: ((4, 256), np.dtype(np.float32))})
    assert buffers is not None and buffers[name].shape == (4, 256)
    assert gpu._is_pinned(buffers[name]) and staging.nbytes == 4 * 256 * 4
    assert bound.host_buffers_for({name: ((4, 256), np.dtype(np.float64))}) is None
    for _ in range(3):
        x = rng.standard_normal((4, 256)).astype(np.float32)
        buffers[name][...] = x
        got = bound.run({name: buffers[name]})
        for value, want in zip(got, session.run(None, {name: x}), strict=True):
            np.testing.assert_allclose(value, want, rtol=1e-6)
    staging.close()
    assert staging.nbytes == 0



def test_a_shape_whose_staging_cannot_be_had_still_runs_from_pageable_memory(model_repo, caplog):
    session = ort.InferenceSession(str(model_repo / "vibration" / "model.onnx"), providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name

    def exhausted(shape, dtype):
        raise RuntimeError("cuMemAllocHost failed: CUDA_ERROR_OUT_OF_MEMORY")

    bound = BoundSession(session, "cpu", graphs=False, staging=exhausted)
    x = np.random.default_rng(4).standard_normal((2, 256)).astype(np.float32)
    with caplog.at_level("WARNING"):
        got = bound.run({name: x})
    assert "no page-locked staging" in caplog.text and "CUDA_ERROR_OUT_OF_MEMORY" in caplog.text
    assert bound.host_buffers_for({name: ((2, 256), np.dtype(np.float32))}) is None
    for value, want in zip(got, session.run(None, {name: x}), strict=True):
        np.testing.assert_allclose(value, want, rtol=1e-6)
