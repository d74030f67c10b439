"""Batch assembly with inputs in CUDA shared memory (scheduler/device_batch.py) over FakeCuda: one
copy per request, into the host batch (device-to-host) for an engine without device inputs, into
a device buffer of the batch (device-to-device, host-to-device for an ordinary request) for one
with them; padding rows; a region on another device; sequence inputs; the buffer freed after the
run, also when the engine fails (BatchExecutor with an engine that takes device inputs). NOT a
GPU: the fake's copies are real memcpy of its host-backed "device" memory."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from edge_batcher.engines.base import DeviceArray
from edge_batcher.engines.cuda_api import cuda_api_from
from edge_batcher.errors import EngineError
from edge_batcher.scheduler import device_batch
from edge_batcher.scheduler.execute import BatchExecutor, LocalBatch
from edge_batcher.scheduler.policy import BatchPlan, Reason
from edge_batcher.scheduler.queues import Pending
from edge_batcher.shared_memory.cuda_regions import CudaDevices
from edge_batcher.shared_memory.device_tensor import DeviceTensor
from edge_batcher.types import InferRequest, TensorSpec
from tests.fakes.fake_cuda import FakeCuda
from tests.fakes.fake_cuda_bindings import fake_cuda_module
from tests.fakes.fake_cuda_ipc import FakeCudaIpc


@pytest.fixture(params=["pycuda", "cuda-python"])
def gpu_and_devices(request):
    gpu = FakeCuda(device_count=2)
    devices = CudaDevices(lambda: cuda_api_from(fake_cuda_module(request.param, gpu)))
    yield gpu, devices
    devices.close()


def in_region(gpu: FakeCuda, devices: CudaDevices, array: np.ndarray, device_id: int = 0) -> DeviceTensor:
    """`array` in a client's exported buffer, opened as the registry would: a DeviceTensor on it."""
    client = FakeCudaIpc(gpu).export(array.nbytes)
    client.put(array)
    with devices.on(device_id) as api:
        memory = api.ipc_open(client.handle)
    return DeviceTensor(memory.ptr, device_id, array.dtype, array.shape, devices, "r")


def rows(n: int, start: int) -> np.ndarray:
    return np.arange(start, start + n * 6, dtype=np.float32).reshape(n, 2, 3)


def read_device(gpu: FakeCuda, array: DeviceArray) -> np.ndarray:
    nbytes = int(np.prod(array.shape)) * array.dtype.itemsize
    return gpu.read(array.ptr, nbytes).view(array.dtype).reshape(array.shape)


def test_host_engine_one_device_to_host_copy_per_request_then_padding(gpu_and_devices):
    gpu, devices = gpu_and_devices
    a, b, c = rows(1, 0), rows(1, 100), rows(2, 200)
    parts = [in_region(gpu, devices, a), b, in_region(gpu, devices, c)]
    before = dict(gpu.counters)
    batch, release = device_batch.assemble(parts, 8, None, 0, 0.0, False, engine_device=None)
    assert release is None and isinstance(batch, np.ndarray)
    expected = np.concatenate([a, b, c] + [c[-1:]] * 4)
    np.testing.assert_array_equal(batch, expected)
    assert gpu.counters["memcpy_dtoh"] - before["memcpy_dtoh"] == 2  # one per request in a region
    assert gpu.counters["memcpy_dtod"] == before["memcpy_dtod"]


def test_device_engine_one_copy_per_request_into_a_device_buffer_freed_by_release(gpu_and_devices):
    gpu, devices = gpu_and_devices
    a, b, c = rows(1, 0), rows(1, 100), rows(2, 200)
    parts = [in_region(gpu, devices, a), b, in_region(gpu, devices, c)]
    used, before = gpu.used_memory(), dict(gpu.counters)
    batch, release = device_batch.assemble(parts, 8, None, 0, 0.0, False, engine_device=0)
    assert isinstance(batch, DeviceArray) and batch.shape == (8, 2, 3) and batch.device_id == 0
    np.testing.assert_array_equal(read_device(gpu, batch), np.concatenate([a, b, c] + [c[-1:]] * 4))
    counts = {k: gpu.counters[k] - before[k] for k in ("memcpy_dtod", "memcpy_htod", "memcpy_dtoh")}
    # 2 requests device-to-device, 1 host-to-device, 4 padding rows device-to-device, nothing to the host
    assert counts == {"memcpy_dtod": 2 + 4, "memcpy_htod": 1, "memcpy_dtoh": 0}
    assert gpu.used_memory() == used + 8 * 24  # one buffer, the batch's
    # copy_to: the engine's bound buffer of that shape gets the batch in one device-to-device copy
    with devices.on(0) as api:
        bound = api.mem_alloc(8 * 24)
    copies = gpu.counters["memcpy_dtod"]
    batch.copy_to(bound.ptr)
    assert gpu.counters["memcpy_dtod"] == copies + 1
    np.testing.assert_array_equal(gpu.read(bound.ptr, 8 * 24).view(np.float32).reshape(8, 2, 3),
                                  read_device(gpu, batch))
    with devices.on(0):
        bound.free()
    assert release is not None
    release()
    assert gpu.used_memory() == used


def test_a_batch_is_assembled_in_place_in_the_engines_buffer_when_it_gives_one(gpu_and_devices):
    """A CUDA graph's input buffer as the target: the same copies, no allocation, nothing to free."""
    gpu, devices = gpu_and_devices
    a, b, c = rows(1, 0), rows(1, 100), rows(2, 200)
    parts = [in_region(gpu, devices, a), b, in_region(gpu, devices, c)]
    with devices.on(0) as api:
        graph_input = api.mem_alloc(8 * 24)
    used, before = gpu.used_memory(), dict(gpu.counters)
    assert device_batch.batch_shape(parts, 8) == ((8, 2, 3), np.dtype(np.float32))
    batch, release = device_batch.assemble(parts, 8, None, 0, 0.0, False, engine_device=0, target=graph_input.ptr)
    assert release is None and isinstance(batch, DeviceArray) and batch.ptr == graph_input.ptr
    np.testing.assert_array_equal(read_device(gpu, batch), np.concatenate([a, b, c] + [c[-1:]] * 4))
    counts = {k: gpu.counters[k] - before[k] for k in ("memcpy_dtod", "memcpy_htod", "memcpy_dtoh")}
    assert counts == {"memcpy_dtod": 2 + 4, "memcpy_htod": 1, "memcpy_dtoh": 0}
    assert gpu.used_memory() == used
    with devices.on(0):
        graph_input.free()


def test_a_region_on_another_device_than_the_engine_takes_the_host_path(gpu_and_devices):
    gpu, devices = gpu_and_devices
    a = rows(2, 0)
    batch, release = device_batch.assemble([in_region(gpu, devices, a, device_id=1)], 2, None, 0, 0.0, False,
                                           engine_device=0)
    assert release is None and isinstance(batch, np.ndarray)
    np.testing.assert_array_equal(batch, a)


def test_a_sequence_input_comes_to_the_host_and_is_padded_on_its_axis(gpu_and_devices):
    gpu, devices = gpu_and_devices
    short = np.array([[1, 2]], np.int64)
    long = np.array([[3, 4, 5, 6]], np.int64)
    batch, release = device_batch.assemble([in_region(gpu, devices, short), long], 2, 1, 8, 0.0, False,
                                           engine_device=0)
    assert release is None
    np.testing.assert_array_equal(batch, [[1, 2, 0, 0, 0, 0, 0, 0], [3, 4, 5, 6, 0, 0, 0, 0]])


def test_requests_that_disagree_on_their_row_shape_fail_the_batch_clearly(gpu_and_devices):
    gpu, devices = gpu_and_devices
    with pytest.raises(EngineError, match="disagree on their inputs' shape"):
        device_batch.assemble([in_region(gpu, devices, rows(1, 0)), np.zeros((1, 3, 3), np.float32)], 2, None, 0,
                              0.0, False, engine_device=None)


class DeviceInputEngine:
    """An engine that takes device inputs on device 0, as ONNX Runtime's CUDA EP does: it reads
    the DeviceArray through the fake GPU (what IOBinding would hand the kernels) and sums rows."""

    inputs = outputs = []
    accepts_any_length = False
    device_inputs = 0
    device_batch_buffers = None

    def __init__(self, gpu: FakeCuda, fail: bool = False):
        self.gpu, self.fail = gpu, fail
        self.seen: list[object] = []

    def infer(self, inputs):
        x = inputs["x"]
        self.seen.append(x)
        if self.fail:
            raise RuntimeError("engine failed")
        return {"y": read_device(self.gpu, x).reshape(x.shape[0], -1).sum(axis=1)}


def _executor_batch(parts, size):
    loop = asyncio.new_event_loop()
    far = time.monotonic() + 60
    requests = [Pending(0, 0.0, far, part.shape[0], request=InferRequest("m", {"x": part}), inputs={"x": part},
                        future=loop.create_future()) for part in parts]
    loop.close()
    return LocalBatch(BatchPlan(requests, sum(p.shape[0] for p in parts), size, 0, Reason.FULL), 0, 0, 0.0, True)


@pytest.mark.parametrize("fail", [False, True])
def test_the_executor_hands_a_device_engine_its_device_batch_and_frees_it_after_the_run(gpu_and_devices, fail):
    gpu, devices = gpu_and_devices
    a, b = rows(1, 0), rows(1, 50)
    parts = [in_region(gpu, devices, a), in_region(gpu, devices, b)]
    engine = DeviceInputEngine(gpu, fail)
    execute = BatchExecutor("m", [engine], [TensorSpec("x", "FP32", (-1, 2, 3))], lambda name: None, 0.0, ["y"])
    used = gpu.used_memory()
    if fail:
        with pytest.raises(RuntimeError, match="engine failed"):
            execute(_executor_batch(parts, 4))
    else:
        results, _, _ = execute(_executor_batch(parts, 4))
        assert [r["y"].tolist() for r in results] == [[a.sum()], [b.sum()]]
    assert isinstance(engine.seen[0], DeviceArray) and engine.seen[0].shape == (4, 2, 3)
    assert gpu.used_memory() == used  # the batch's device buffer is freed, also when the engine fails


class GraphInputEngine(DeviceInputEngine):
    """A DeviceInputEngine with a CUDA graph's fixed input buffer for batches of 4 x 2 x 3 float32
    (Engine.device_batch_buffers), as ONNX Runtime's engine has one per warmed-up shape."""

    def __init__(self, gpu: FakeCuda, devices: CudaDevices):
        super().__init__(gpu)
        with devices.on(0) as api:
            self.buffer = api.mem_alloc(4 * 24)
        self.asked: list[dict] = []

    def device_batch_buffers(self, shapes):
        self.asked.append(shapes)
        return {"x": self.buffer.ptr} if shapes == {"x": ((4, 2, 3), np.dtype(np.float32))} else None


def test_the_executor_assembles_a_device_batch_in_the_engines_graph_buffer(gpu_and_devices):
    gpu, devices = gpu_and_devices
    a, b = rows(1, 0), rows(1, 50)
    engine = GraphInputEngine(gpu, devices)
    execute = BatchExecutor("m", [engine], [TensorSpec("x", "FP32", (-1, 2, 3))], lambda name: None, 0.0, ["y"])
    parts = [in_region(gpu, devices, a), in_region(gpu, devices, b)]
    used = gpu.used_memory()
    results, _, _ = execute(_executor_batch(parts, 4))
    assert [r["y"].tolist() for r in results] == [[a.sum()], [b.sum()]]
    assert engine.seen[0].ptr == engine.buffer.ptr and engine.asked == [{"x": ((4, 2, 3), np.dtype(np.float32))}]
    assert gpu.used_memory() == used
    # A shape the engine has no buffer for: a buffer of the batch's own, freed after the run.
    results, _, _ = execute(_executor_batch(parts, 2))
    assert [r["y"].tolist() for r in results] == [[a.sum()], [b.sum()]]
    assert engine.seen[1].ptr != engine.buffer.ptr and gpu.used_memory() == used


def test_a_host_request_with_nan_in_a_device_batch_is_refused_and_both_assemblies_are_freed(gpu_and_devices):
    # A batch assembled on the device cannot be checked by numpy: the executor checks each
    # request's host tensors (a region's bytes are the engine's to read), refuses the one with
    # NaN, assembles the batch again without it and frees the first assembly too.
    from edge_batcher.errors import InvalidInput
    from edge_batcher.scheduler.validate import RequestValidator

    gpu, devices = gpu_and_devices
    spec = TensorSpec("x", "FP32", (-1, 2, 3))
    validator = RequestValidator("m", [spec], [TensorSpec("y", "FP32", (-1,))], None)
    a, bad = rows(1, 0), rows(1, 50)
    bad[0, 1, 2] = np.nan
    parts = [in_region(gpu, devices, a), bad]
    engine = DeviceInputEngine(gpu)
    execute = BatchExecutor("m", [engine], [spec], lambda name: None, 0.0, ["y"], finite_check=validator)
    used = gpu.used_memory()
    results, _, _ = execute(_executor_batch(parts, 2))
    assert results[0]["y"].tolist() == [a.sum()]
    assert isinstance(results[1], InvalidInput) and "[0, 1, 2]" in str(results[1])
    assert len(engine.seen) == 1 and engine.seen[0].shape == (2, 2, 3)
    assert gpu.used_memory() == used
