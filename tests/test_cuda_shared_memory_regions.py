"""The CUDA shared memory registry (shared_memory/cuda_regions.py) and the lease's CUDA side over
FakeCuda, through both bindings' fakes (pycuda's FakeCuda, cuda-python's FakeCudaDriver):
registration opens the IPC handle once and unregister closes it, limits, every refusal (no CUDA,
an integrated GPU, a wrong device, a bad handle, one namespace with system regions), reference
counts (unregister while a request holds the region), shutdown. NOT a GPU: FakeCudaIpc plays the
client that exports device memory (tests/fakes/fake_cuda_ipc.py)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from edge_batcher.engines.cuda_api import cuda_api_from
from edge_batcher.errors import InvalidInput, Overloaded
from edge_batcher.protocol.v2 import RequestedOutput
from edge_batcher.shared_memory.cuda_regions import (
    INTEGRATED_REFUSED,
    CudaDevices,
    CudaRegionRegistry,
    link_namespaces,
)
from edge_batcher.shared_memory.device_tensor import DeviceTensor
from edge_batcher.shared_memory.lease import Lease
from edge_batcher.shared_memory.regions import RegionLimits, RegionRegistry
from tests.fakes.fake_cuda import FakeCuda
from tests.fakes.fake_cuda_bindings import fake_cuda_module
from tests.fakes.fake_cuda_ipc import FakeCudaIpc


@pytest.fixture(params=["pycuda", "cuda-python"])
def binding(request) -> str:
    return request.param


def registry_over(gpu: FakeCuda, binding: str, limits: RegionLimits | None = None) -> CudaRegionRegistry:
    return CudaRegionRegistry(limits or RegionLimits(max_regions=4, max_bytes=1 << 20),
                              CudaDevices(lambda: cuda_api_from(fake_cuda_module(binding, gpu))))


@pytest.fixture
def gpu() -> FakeCuda:
    return FakeCuda(device_count=2)


@pytest.fixture
def registry(gpu, binding):
    r = registry_over(gpu, binding)
    yield r
    r.close()


def test_register_opens_the_handle_once_status_lists_it_unregister_closes_it(gpu, registry):
    client = FakeCudaIpc(gpu).export(1024)
    registry.register("frames", client.handle, 0, 1024)
    assert registry.status() == [{"name": "frames", "device_id": 0, "byte_size": 1024}]
    assert registry.status("frames") == [{"name": "frames", "device_id": 0, "byte_size": 1024}]
    assert gpu.counters["ipc_open"] == 1 and gpu.open_ipc_mappings() == 1
    registry.unregister("frames")
    assert registry.status() == [] and gpu.open_ipc_mappings() == 0
    registry.unregister("frames")  # unknown: a no-op, as in Triton
    with pytest.raises(InvalidInput, match="no CUDA shared memory region 'frames' is registered"):
        registry.status("frames")


def test_unregister_all_and_shutdown_close_every_mapping_and_release_the_contexts(gpu, registry):
    ipc = FakeCudaIpc(gpu)
    for i in range(3):
        registry.register(f"r{i}", ipc.export(64).handle, i % 2, 64)
    assert gpu.open_ipc_mappings() == 3 and gpu.primary_retained == 2  # one context per device, retained once
    registry.unregister(None)
    assert registry.status() == [] and gpu.open_ipc_mappings() == 0
    registry.register("again", ipc.export(64).handle, 0, 64)
    registry.close()
    assert gpu.open_ipc_mappings() == 0 and gpu.primary_retained == 0


def test_limits_count_regions_and_bytes(gpu, binding):
    registry = registry_over(gpu, binding, RegionLimits(max_regions=2, max_bytes=1000))
    ipc = FakeCudaIpc(gpu)
    registry.register("a", ipc.export(600).handle, 0, 600)
    with pytest.raises(Overloaded, match="more than \\[server\\] shm_max_bytes \\(1000\\)"):
        registry.register("b", ipc.export(600).handle, 0, 600)
    registry.register("b", ipc.export(400).handle, 0, 400)
    with pytest.raises(Overloaded, match="shm_max_regions"):
        registry.register("c", ipc.export(1).handle, 0, 1)
    assert gpu.open_ipc_mappings() == 2  # the refused ones were never opened
    registry.close()


@pytest.mark.parametrize("handle, device_id, byte_size, match", [
    (b"short", 0, 64, "raw_handle must be the 64 bytes of a cudaIpcMemHandle_t"),
    ("text", 0, 64, "raw_handle must be the 64 bytes"),
    (bytes(64), 0, 64, "cannot open the CUDA IPC handle on device 0"),  # no process exported it
    (None, 2, 64, "device_id 2 is not a CUDA device of this machine: it has 2 \\(device_id 0..1\\)"),
    (None, -1, 64, "device_id must be an integer >= 0"),
    (None, True, 64, "device_id must be an integer >= 0"),
    (None, 0, 0, "byte_size must be > 0"),
    (None, 0, -5, "byte_size must be an integer >= 0"),
])
def test_bad_registrations_are_refused_naming_the_problem(gpu, registry, handle, device_id, byte_size, match):
    if handle is None:
        handle = FakeCudaIpc(gpu).export(64).handle
    with pytest.raises(InvalidInput, match=match):
        registry.register("bad", handle, device_id, byte_size)
    assert registry.status() == [] and gpu.open_ipc_mappings() == 0


@pytest.mark.parametrize("name", ["", "a/b", 7])
def test_bad_names(gpu, registry, name):
    with pytest.raises(InvalidInput, match="region name must be a non-empty string"):
        registry.register(name, FakeCudaIpc(gpu).export(8).handle, 0, 8)


def test_one_namespace_with_the_system_regions(gpu, registry):
    system = RegionRegistry()
    link_namespaces(system, registry)
    registry.register("taken", FakeCudaIpc(gpu).export(8).handle, 0, 8)
    with pytest.raises(InvalidInput, match="'taken' is already registered"):
        registry.register("taken", FakeCudaIpc(gpu).export(8).handle, 0, 8)
    with pytest.raises(InvalidInput, match="'taken' is already registered"):
        system.register("taken", "/never-opened", 0, 8)  # refused before the key is even looked at


def test_an_integrated_gpu_is_refused_with_the_jetson_reason(binding):
    jetson = FakeCuda(device_name="Orin (nvgpu)", integrated=True)
    registry = registry_over(jetson, binding)
    with pytest.raises(InvalidInput) as exc:
        registry.register("frames", FakeCudaIpc(jetson).export(64).handle, 0, 64)
    assert INTEGRATED_REFUSED in str(exc.value) and "Orin (nvgpu)" in str(exc.value)
    assert INTEGRATED_REFUSED == ("CUDA IPC is not available on integrated GPUs; use system shared memory, "
                                  "which the GPU reads directly on unified memory")
    assert jetson.counters["ipc_open"] == 0


def test_no_cuda_binding_is_refused_naming_why():
    def no_binding():
        raise ImportError("no CUDA Python binding (cuda-python: No module named 'cuda')")

    registry = CudaRegionRegistry(devices=CudaDevices(no_binding))
    with pytest.raises(InvalidInput, match="needs a discrete CUDA GPU: CUDA is not available to this daemon "
                                           "\\(no CUDA Python binding.*use system shared memory"):
        registry.register("frames", bytes(64), 0, 64)
    assert registry.status() == []
    registry.unregister(None)  # nothing registered: no CUDA needed
    registry.close()


def test_a_region_unregistered_while_a_request_holds_it_closes_when_the_request_ends(gpu, registry):
    client = FakeCudaIpc(gpu).export(64)
    client.put(np.arange(16, dtype=np.float32))
    registry.register("x", client.handle, 0, 64)
    lease = Lease(RegionRegistry(), registry)
    with lease:
        tensor = lease.read_input("x", "FP32", [1, 16], {"shared_memory_region": "x", "shared_memory_byte_size": 64},
                                  "input 'x'")
        assert isinstance(tensor, DeviceTensor) and tensor.shape == (1, 16) and tensor.nbytes == 64
        registry.unregister("x")
        assert registry.status() == []
        assert gpu.open_ipc_mappings() == 1  # still held: the batch may still read it
        out = np.empty((1, 16), np.float32)
        with tensor.devices.on(0) as api:
            api.copy_dtoh(out, tensor.ptr)
        np.testing.assert_array_equal(out[0], np.arange(16, dtype=np.float32))
        del tensor  # the request's batch is done with it
    assert closes_soon(gpu)  # on the registry's own thread


def closes_soon(gpu: FakeCuda) -> bool:
    deadline = time.monotonic() + 5
    while gpu.open_ipc_mappings() and time.monotonic() < deadline:
        time.sleep(0.01)
    return gpu.open_ipc_mappings() == 0


def test_a_request_whose_client_went_away_keeps_the_region_open_while_its_batch_may_read_it(gpu, registry):
    """The lease ends when the handler ends, even if the client disconnected and the request is
    still queued or in a batch: the region stays open until its DeviceTensor is gone too."""
    registry.register("x", FakeCudaIpc(gpu).export(64).handle, 0, 64)
    with Lease(RegionRegistry(), registry) as lease:
        queued = lease.read_input("x", "FP32", [1, 16], {"shared_memory_region": "x", "shared_memory_byte_size": 64},
                                  "input 'x'")
    registry.unregister("x")
    time.sleep(0.05)
    assert gpu.open_ipc_mappings() == 1  # lease over, unregistered, but a batch may still read it
    del queued
    assert closes_soon(gpu)


@pytest.mark.parametrize("params, match", [
    ({"shared_memory_region": "x", "shared_memory_byte_size": 64, "shared_memory_offset": 8},
     "offset 8 \\+ shared_memory_byte_size 64 is beyond CUDA region 'x' \\(64 bytes\\)"),
    ({"shared_memory_region": "x", "shared_memory_byte_size": 32}, "32 does not match shape \\[1, 16\\] of FP32"),
    ({"shared_memory_region": "nope", "shared_memory_byte_size": 64}, "no shared memory region 'nope' is registered"),
    ({"shared_memory_region": "x"}, "shared_memory_byte_size is required"),
])
def test_inputs_out_of_range_or_unknown_are_refused(gpu, registry, params, match):
    registry.register("x", FakeCudaIpc(gpu).export(64).handle, 0, 64)
    with Lease(RegionRegistry(), registry) as lease, pytest.raises(InvalidInput, match=match):
        lease.read_input("x", "FP32", [1, 16], params, "input 'in'")


def test_bytes_inputs_are_not_read_from_cuda_regions(gpu, registry):
    registry.register("x", FakeCudaIpc(gpu).export(64).handle, 0, 64)
    with Lease(RegionRegistry(), registry) as lease, pytest.raises(InvalidInput, match="BYTES inputs"):
        lease.read_input("x", "BYTES", [1], {"shared_memory_region": "x", "shared_memory_byte_size": 64}, "input 'in'")


async def test_outputs_are_written_host_to_device_into_the_region(gpu, registry):
    client = FakeCudaIpc(gpu).export(64)
    registry.register("out", client.handle, 0, 64)
    with Lease(RegionRegistry(), registry) as lease:
        requested = [RequestedOutput("y", True, {"shared_memory_region": "out", "shared_memory_byte_size": 48,
                                                 "shared_memory_offset": 16})]
        targets = lease.output_targets(requested)
        left, entries = await lease.write_outputs({"y": np.array([[1.5, 2.5, 3.5]], np.float32),
                                                   "z": np.zeros(1, np.float32)}, targets)
    assert list(left) == ["z"]
    assert entries == [{"name": "y", "datatype": "FP32", "shape": [1, 3]}]  # as Triton lists them
    np.testing.assert_array_equal(client.get(np.float32, (3,), offset=16), [1.5, 2.5, 3.5])


def test_an_output_target_beyond_the_region_is_refused_before_the_model_runs(gpu, registry):
    registry.register("out", FakeCudaIpc(gpu).export(64).handle, 0, 64)
    with Lease(RegionRegistry(), registry) as lease, pytest.raises(InvalidInput, match="beyond CUDA region 'out'"):
        lease.output_targets([RequestedOutput("y", True, {"shared_memory_region": "out",
                                                          "shared_memory_byte_size": 65})])


def test_cuda_bindings_13_without_the_reserved_attribute(gpu):
    """cuda-bindings 13 dropped CUipcMemHandle.reserved; the handle's bytes go in through getPtr()."""
    from tests.fakes.fake_cuda_bindings import CUipcMemHandle13, FakeCudaDriver

    driver = FakeCudaDriver(gpu)
    driver.CUipcMemHandle = CUipcMemHandle13  # type: ignore[misc]
    registry = CudaRegionRegistry(devices=CudaDevices(lambda: cuda_api_from(driver)))
    client = FakeCudaIpc(gpu).export(16)
    registry.register("r", client.handle, 0, 16)
    assert gpu.open_ipc_mappings() == 1
    registry.close()
    assert gpu.open_ipc_mappings() == 0
