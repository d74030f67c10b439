"""edge_batcher/engines/cuda_api.py over both bindings' fakes (one fake GPU), and the names it
uses checked against the real cuda-python module where that is installed (it imports without a
GPU; calling it needs the driver)."""

from __future__ import annotations

import inspect
import re

import numpy as np
import pytest

from edge_batcher.config import load_model_config
from edge_batcher.engines import cuda_api
from edge_batcher.engines.cuda_api import CudaError, CudaPythonApi, PycudaApi, cuda_api_from, load_cuda_api
from edge_batcher.engines.tensorrt import TensorRTEngine
from edge_batcher.errors import ConfigError
from tests.fakes.fake_cuda_bindings import CUresult, FakeCudaDriver
from tests.fakes.fake_tensorrt import FakeCuda


@pytest.fixture
def api(cuda_module):
    return cuda_api_from(cuda_module)


def test_the_binding_under_test_is_the_one_asked_for(api, binding):
    assert api.name == binding
    assert isinstance(api, CudaPythonApi if binding == "cuda-python" else PycudaApi)


def test_device_queries(api, cuda):
    api.init()
    assert api.device_count() == 1
    assert api.device_name(0) == cuda.device_name
    assert api.compute_capability(0) == (8, 7)
    assert api.driver_version() == 12060
    assert api.describe().endswith("(CUDA driver 12.6)")


def test_a_round_trip_through_device_memory_happens_at_synchronize(api, cuda):
    api.init()
    ctx = api.open_device(0)
    ctx.push()
    try:
        device = api.mem_alloc(64)
        src = api.pinned_empty(16, np.float32)
        dst = api.pinned_empty(16, np.float32)
        stream = api.stream()
        src.array[:] = np.arange(16, dtype=np.float32)
        dst.array[:] = -1
        api.copy_htod_async(device, src.array, stream)
        api.copy_dtoh_async(dst.array, device, stream)
        assert (dst.array == -1).all()  # queued, not done: as on a GPU
        stream.synchronize()
        np.testing.assert_array_equal(dst.array, np.arange(16, dtype=np.float32))
        free, total = api.mem_get_info()
        assert total == cuda.total_memory and free == total - 64
        device.free()
        device.free()  # idempotent
        assert api.mem_get_info()[0] == total
        src.free(), dst.free(), stream.close()
    finally:
        ctx.pop()
        ctx.release()
    assert cuda.primary_retained == 0 and cuda.Context.get_current() is None


def test_calls_that_need_a_context_fail_without_one(api):
    api.init()
    with pytest.raises(Exception, match="(?i)context"):
        api.mem_alloc(16)
    with pytest.raises(Exception, match="(?i)context"):
        api.mem_get_info()


def test_out_of_memory_is_recognised_in_either_bindings_errors(binding):
    gpu = FakeCuda(total_memory=1024)
    api = cuda_api_from(gpu if binding == "pycuda" else FakeCudaDriver(gpu))
    api.init()
    ctx = api.open_device(0)
    ctx.push()
    try:
        with pytest.raises(Exception) as info:
            api.mem_alloc(4096)
        assert api.is_out_of_memory(info.value)
        if binding == "cuda-python":
            assert isinstance(info.value, CudaError) and info.value.code == "CUDA_ERROR_OUT_OF_MEMORY"
        assert not api.is_out_of_memory(ValueError("shape mismatch"))
    finally:
        ctx.pop()
        ctx.release()


def test_the_engine_frees_every_host_and_device_buffer_on_close(build, engine_for, cuda_module, cuda):
    engine = engine_for(build())
    engine.infer({"signal": np.zeros((4, 256), np.float32)})
    engine.close()
    assert cuda.used_memory() == 0 and cuda.primary_retained == 0
    if isinstance(cuda_module, FakeCudaDriver):
        c = cuda_module.counters
        assert c["cuMemAllocHost"] == c["cuMemFreeHost"] > 0 and c["cuMemAlloc"] == c["cuMemFree"] > 0
        assert cuda_module._host == {}


def test_cuda_api_from_wraps_modules_and_refuses_others(cuda):
    assert isinstance(cuda_api_from(cuda), PycudaApi)
    assert isinstance(cuda_api_from(FakeCudaDriver(cuda)), CudaPythonApi)
    api = cuda_api_from(cuda)
    assert cuda_api_from(api) is api
    with pytest.raises(TypeError, match="neither cuda.bindings.driver nor pycuda.driver"):
        cuda_api_from(object())


def test_load_cuda_api_prefers_cuda_python_and_honours_the_environment(monkeypatch):
    monkeypatch.setenv(cuda_api.BINDING_ENV, "cupy")
    with pytest.raises(ImportError, match="expected one of cuda-python, pycuda"):
        load_cuda_api()
    monkeypatch.delenv(cuda_api.BINDING_ENV)
    try:
        import cuda.bindings.driver  # noqa: F401
    except ImportError:
        have_cuda_python = False
    else:
        have_cuda_python = True
    if have_cuda_python:
        assert load_cuda_api().name == "cuda-python"
    try:
        import pycuda.driver  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="pycuda.*pip install cuda-bindings"):
            load_cuda_api("pycuda")


def _driver_names(cls: type) -> set[str]:
    """Every `self.d.NAME` the class calls: the binding surface it depends on."""
    return set(re.findall(r"self\.d\.(\w+)", inspect.getsource(cls)))


def test_the_fakes_have_every_name_the_api_calls(cuda):
    driver = FakeCudaDriver(cuda)
    assert sorted(n for n in _driver_names(CudaPythonApi) if not hasattr(driver, n)) == []
    assert sorted(n for n in _driver_names(PycudaApi) if not hasattr(cuda, n)) == []


def test_real_cuda_python_has_every_name_the_api_calls():
    driver = pytest.importorskip("cuda.bindings.driver", reason="cuda-python is not installed")
    assert sorted(n for n in _driver_names(CudaPythonApi) if not hasattr(driver, n)) == []
    for attr in ("CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR", "CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR"):
        assert hasattr(driver.CUdevice_attribute, attr)
    assert hasattr(driver.CUstream_flags, "CU_STREAM_NON_BLOCKING")
    # The fake's codes are the real ones, so error names read the same.
    for code in CUresult:
        assert int(getattr(driver.CUresult, code.name)) == int(code)


def test_engine_load_reports_the_binding_in_a_device_error(build, cuda_module, binding, trt):
    config = load_model_config(build())
    config.tensorrt = {**(config.tensorrt or {}), "device": 3}
    engine = TensorRTEngine(config, trt_module=trt, cuda_module=cuda_module)
    with pytest.raises(ConfigError, match=f"cannot open CUDA device 3 \\({binding}\\)"):
        engine.load()
