"""Tests that need real TensorRT, a CUDA binding (cuda-python or pycuda) and an NVIDIA GPU: skipped elsewhere.

They are the on-device counterpart of the fake-backed tests: same builder and backend, the real
modules. Nothing in this file has run in this project's CI (there is no GPU there).
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from edge_batcher.config import load_model_config
from edge_batcher.engines import trt_build
from edge_batcher.engines.cuda_api import cuda_api_from
from edge_batcher.engines.tensorrt import TensorRTEngine
from edge_batcher.engines.trt_api import tensorrt_capabilities
from edge_batcher.errors import ConfigError
from tests.fakes.fake_tensorrt import FakeCuda, FakeTensorRT, require_real_tensorrt

# Every TensorRT name the backend and the builder use, checked against the real bindings on the
# device and against the fake here, so the two cannot drift apart silently.
MODULE_NAMES = ["Runtime", "Builder", "OnnxParser", "ILogger", "IProgressMonitor", "TensorIOMode",
                "ExecutionContextAllocationStrategy", "BuilderFlag", "MemoryPoolType", "DeviceType",
                "NetworkDefinitionCreationFlag"]
# Used only where tensorrt_capabilities() finds the weak-typing API (TensorRT 10.x); 11.x has none of them.
WEAK_TYPING_NAMES = ["IInt8EntropyCalibrator2", "BuilderFlag.FP16", "BuilderFlag.INT8"]
ENGINE_NAMES = ["num_io_tensors", "get_tensor_name", "get_tensor_mode", "get_tensor_dtype", "get_tensor_shape",
                "num_optimization_profiles", "get_tensor_profile_shape", "get_device_memory_size_for_profile_v2",
                "create_execution_context", "is_shape_inference_io"]
CONTEXT_NAMES = ["set_device_memory", "set_optimization_profile_async", "set_input_shape", "get_tensor_shape",
                 "set_tensor_address", "execute_async_v3"]
PYCUDA_NAMES = ["init", "Device", "Context", "Stream", "mem_alloc", "pagelocked_empty", "memcpy_htod_async",
                "memcpy_dtoh_async", "mem_get_info", "MemoryError", "get_driver_version"]
CUDA_PYTHON_NAMES = ["cuInit", "cuDeviceGet", "cuDeviceGetCount", "cuDeviceGetName", "cuDeviceGetAttribute",
                     "cuDriverGetVersion", "cuDevicePrimaryCtxRetain", "cuDevicePrimaryCtxRelease", "cuCtxPushCurrent",
                     "cuCtxPopCurrent", "cuMemAlloc", "cuMemFree", "cuMemAllocHost", "cuMemFreeHost",
                     "cuMemcpyHtoDAsync", "cuMemcpyDtoHAsync", "cuStreamCreate", "cuStreamSynchronize",
                     "cuStreamDestroy", "cuMemGetInfo", "cuGetErrorName", "CUdevice_attribute", "CUstream_flags"]


def _surface(trt, cuda, plan: bytes) -> list[str]:
    missing = [f"tensorrt.{n}" for n in MODULE_NAMES if not hasattr(trt, n)]
    if tensorrt_capabilities(trt).precision_flags:
        for name in WEAK_TYPING_NAMES:
            owner, _, attr = name.rpartition(".")
            if not hasattr(getattr(trt, owner) if owner else trt, attr):
                missing.append(f"tensorrt.{name}")
    api = cuda_api_from(cuda)
    names = CUDA_PYTHON_NAMES if api.name == "cuda-python" else PYCUDA_NAMES
    missing += [f"{api.name}.{n}" for n in names if not hasattr(cuda, n)]
    if not hasattr(trt.ExecutionContextAllocationStrategy, "USER_MANAGED"):
        missing.append("ExecutionContextAllocationStrategy.USER_MANAGED")
    api.init()
    ctx = api.open_device(0)
    ctx.push()
    try:
        from edge_batcher.engines.trt_api import make_logger

        engine = trt.Runtime(make_logger(trt)).deserialize_cuda_engine(plan)
        assert engine is not None
        missing += [f"ICudaEngine.{n}" for n in ENGINE_NAMES if not hasattr(engine, n)]
        context = engine.create_execution_context(trt.ExecutionContextAllocationStrategy.USER_MANAGED)
        missing += [f"IExecutionContext.{n}" for n in CONTEXT_NAMES if not hasattr(context, n)]
        del context, engine
    finally:
        ctx.pop()
        ctx.release()
    return missing


def _build(repo, trt, cuda, *argv):
    request = trt_build.request_from_args(
        trt_build.make_parser().parse_args([str(repo / "vibration" / "model.onnx"), "--quiet", "--force", *argv]))
    trt_build.build_engine(request, trt, cuda, progress=False)
    return request.model_dir


def test_the_fake_has_every_name_the_backend_uses(build, trt, cuda_module):
    assert _surface(trt, cuda_module, (build() / "model.plan").read_bytes()) == []


def test_real_tensorrt_has_every_name_the_backend_uses(repo):
    trt, cuda = require_real_tensorrt()
    model_dir = _build(repo, trt, cuda)
    assert _surface(trt, cuda, (model_dir / "model.plan").read_bytes()) == []


@pytest.mark.parametrize("precision, atol", [("fp32", 1e-3), ("fp16", 3e-2)])
def test_real_plan_matches_onnxruntime(repo, precision, atol):
    trt, cuda = require_real_tensorrt()
    model_dir = _build(repo, trt, cuda, *(["--fp16"] if precision == "fp16" else []))
    engine = TensorRTEngine(load_model_config(model_dir))  # the real modules, as the daemon loads it
    engine.load()
    try:
        session = ort.InferenceSession(str(repo / "vibration" / "model.onnx"), providers=["CPUExecutionProvider"])
        for size in (2, 4, 8):
            x = np.random.default_rng(size).normal(0, 0.7, size=(size, 256)).astype(np.float32)
            got = engine.infer({"signal": x})
            ref = session.run(["class_probs", "anomaly_score"], {"signal": x})
            np.testing.assert_allclose(got["class_probs"], ref[0], atol=atol)
            np.testing.assert_allclose(got["anomaly_score"], ref[1], atol=atol)
            f = engine.memory_footprint(size)
            assert 0 < f["activations"] <= f["reserved"] and f["weights"] > 0
    finally:
        engine.close()


def test_real_tensorrt_refuses_a_fake_plan_with_the_rebuild_message(repo, build):
    trt, cuda = require_real_tensorrt()
    fake_cuda = FakeCuda()
    model_dir = build(trt_module=FakeTensorRT(fake_cuda, version="9.9.9"), cuda_module=fake_cuda)
    engine = TensorRTEngine(load_model_config(model_dir))
    with pytest.raises(ConfigError, match="built for another TensorRT version or GPU.*edge-batcher build-engine"):
        engine.load()
