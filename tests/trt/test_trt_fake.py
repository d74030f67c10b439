"""The fakes enforce what real TensorRT and CUDA enforce (the checks the backend tests rely on)."""

from __future__ import annotations

import numpy as np
import pytest

from edge_batcher.engines.trt_api import make_logger
from tests.fakes.fake_tensorrt import CudaLogicError, CudaMemoryError, FakeCuda, FakeTensorRT


@pytest.fixture
def loaded(build, trt, cuda):
    """A deserialized fake engine of the demo model (profiles 2/4/8) and a USER_MANAGED context
    with device memory, on a pushed primary context."""
    plan = (build() / "model.plan").read_bytes()
    logger = make_logger(trt)
    runtime = trt.Runtime(logger)
    engine = runtime.deserialize_cuda_engine(plan)
    cuda.init()
    ctx = cuda.Device(0).retain_primary_context()
    ctx.push()
    context = engine.create_execution_context(trt.ExecutionContextAllocationStrategy.USER_MANAGED)
    size = max(engine.get_device_memory_size_for_profile_v2(p) for p in range(engine.num_optimization_profiles))
    memory = cuda.mem_alloc(size)
    context.set_device_memory(int(memory), size)
    stream = cuda.Stream()
    yield engine, context, stream, logger
    cuda.Context.pop()
    ctx.detach()


def buffers(cuda, shapes: dict[str, tuple], dtypes: dict[str, type]):
    out = {}
    for name, shape in shapes.items():
        host = cuda.pagelocked_empty(shape, dtypes[name])
        out[name] = (cuda.mem_alloc(max(host.nbytes, 1)), host)
    return out


DTYPES = {"signal": np.float32, "class_probs": np.float32, "class_id": np.int64, "anomaly_score": np.float32}


def shapes_for(n: int) -> dict[str, tuple]:
    return {"signal": (n, 256), "class_probs": (n, 4), "class_id": (n,), "anomaly_score": (n,)}


def test_set_input_shape_must_be_inside_the_selected_profile(loaded):
    engine, context, stream, logger = loaded
    assert context.active_optimization_profile == 0
    assert context.set_input_shape("signal", (2, 256)) is True
    assert context.set_input_shape("signal", (4, 256)) is False  # profile 0 is 2x256 only
    assert "outside the selected optimization profile 0" in logger.take()
    assert context.set_optimization_profile_async(1, stream.handle) is True
    assert context.set_input_shape("signal", (4, 256)) is True
    assert context.set_input_shape("signal", (4, 255)) is False  # a static dimension changed
    assert context.set_input_shape("signal", (4,)) is False  # wrong rank
    assert context.set_input_shape("class_id", (4,)) is False  # an output
    assert context.set_optimization_profile_async(3, stream.handle) is False  # no such profile
    assert "out of range" in logger.take()


def test_execute_needs_shapes_addresses_and_device_memory(loaded, cuda):
    engine, context, stream, logger = loaded
    bufs = buffers(cuda, shapes_for(2), DTYPES)
    assert context.execute_async_v3(stream.handle) is False
    assert "input shapes not specified" in logger.take()
    context.set_input_shape("signal", (2, 256))
    assert context.execute_async_v3(stream.handle) is False
    assert "no address set" in logger.take()
    for name, (dev, _) in bufs.items():
        assert context.set_tensor_address(name, int(dev))
    assert context.execute_async_v3(stream.handle) is True
    context.set_device_memory(int(bufs["class_id"][0]), 16)  # too small for the profile
    assert context.execute_async_v3(stream.handle) is False
    assert "smaller than" in logger.take()


def test_switching_profiles_forgets_the_input_shapes(loaded, cuda):
    engine, context, stream, logger = loaded
    for name, (dev, _) in buffers(cuda, shapes_for(4), DTYPES).items():
        context.set_tensor_address(name, int(dev))
    context.set_input_shape("signal", (2, 256))
    context.set_optimization_profile_async(1, stream.handle)
    assert context.execute_async_v3(stream.handle) is False  # shapes from profile 0 do not carry over
    assert "input shapes not specified" in logger.take()


def test_addresses_must_hold_the_tensor(loaded, cuda):
    engine, context, stream, logger = loaded
    context.set_optimization_profile_async(2, stream.handle)
    context.set_input_shape("signal", (8, 256))
    for name, (dev, _) in buffers(cuda, shapes_for(2), DTYPES).items():  # sized for 2 rows, running 8
        context.set_tensor_address(name, int(dev))
    assert context.execute_async_v3(stream.handle) is False
    assert "overruns its allocation" in logger.take()


def test_work_happens_at_synchronize_not_before(loaded, cuda):
    engine, context, stream, logger = loaded
    bufs = buffers(cuda, shapes_for(2), DTYPES)
    context.set_input_shape("signal", (2, 256))
    for name, (dev, _) in bufs.items():
        context.set_tensor_address(name, int(dev))
    dev, host = bufs["signal"]
    host[:] = np.random.default_rng(0).normal(size=(2, 256))
    cuda.memcpy_htod_async(dev, host, stream)
    assert context.execute_async_v3(stream.handle)
    out_dev, out_host = bufs["class_probs"]
    out_host[:] = -1.0
    cuda.memcpy_dtoh_async(out_host, out_dev, stream)
    assert np.all(out_host == -1.0)  # nothing ran yet
    stream.synchronize()
    np.testing.assert_allclose(out_host.sum(axis=1), 1.0, atol=1e-5)


def test_cuda_calls_need_a_current_context():
    cuda = FakeCuda()
    with pytest.raises(CudaLogicError, match="cuInit"):
        cuda.Device(0)
    cuda.init()
    with pytest.raises(CudaLogicError, match="invalid device context"):
        cuda.mem_alloc(16)
    ctx = cuda.Device(0).retain_primary_context()
    ctx.push()
    assert int(cuda.mem_alloc(16)) > 0
    cuda.Context.pop()
    with pytest.raises(CudaLogicError, match="invalid device context"):
        cuda.Stream()


def test_mem_alloc_runs_out_and_async_copies_need_pinned_memory():
    cuda = FakeCuda(total_memory=1024)
    cuda.init()
    cuda.Device(0).retain_primary_context().push()
    a = cuda.mem_alloc(1000)
    with pytest.raises(CudaMemoryError, match="out of memory"):
        cuda.mem_alloc(100)
    a.free()
    b = cuda.mem_alloc(100)
    with pytest.raises(CudaLogicError, match="pageable"):
        cuda.memcpy_htod_async(b, np.zeros(4, np.float32), cuda.Stream())
    with pytest.raises(CudaLogicError, match="not device memory"):
        cuda.memcpy_htod_async(int(a), cuda.pagelocked_empty(4, np.float32), cuda.Stream())
    cuda.Context.pop()


def test_deserialize_returns_none_for_other_versions_gpus_and_garbage(build, cuda, trt):
    plan = (build() / "model.plan").read_bytes()
    other_version = "11.4.0" if trt.major == 10 else "10.3.0"
    for other in (FakeTensorRT(cuda, version=other_version),
                  FakeTensorRT(FakeCuda(compute_capability=(8, 6)), version=trt.__version__)):
        logger = make_logger(other)
        assert other.Runtime(logger).deserialize_cuda_engine(plan) is None
        assert logger.take()
    logger = make_logger(trt)
    assert trt.Runtime(logger).deserialize_cuda_engine(b"\x7fELF") is None
    assert "magic tag" in logger.take()
    assert trt.Runtime(logger).deserialize_cuda_engine(plan) is not None


def test_runtime_wants_an_ilogger(trt):
    with pytest.raises(TypeError, match="ILogger"):
        trt.Runtime(object())


def test_builder_checks_profiles(repo, trt):
    logger = make_logger(trt)
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    assert parser.parse_from_file(str(repo / "vibration" / "model.onnx"))
    assert network.num_inputs == 1 and network.get_input(0).shape == (-1, 256)
    config = builder.create_builder_config()
    assert builder.build_serialized_network(network, config) is None
    assert "no optimization profile" in logger.take()
    profile = builder.create_optimization_profile()
    profile.set_shape("signal", (4, 256), (2, 256), (8, 256))  # opt < min
    config.add_optimization_profile(profile)
    assert builder.build_serialized_network(network, config) is None
    assert "invalid" in logger.take()
    bad = trt.OnnxParser(builder.create_network(0), logger)
    assert not bad.parse(b"not onnx") and bad.num_errors == 1


# ------------------------------------------------------------------ the two API generations


def test_the_11_fake_has_none_of_what_tensorrt_11_removed(repo, build, trt10, trt11):
    from tests.fakes.fake_tensorrt import REMOVED_IN_11

    for name in REMOVED_IN_11["module"]:
        assert hasattr(trt10, name) and not hasattr(trt11, name)
    for name in REMOVED_IN_11["BuilderFlag"]:
        assert hasattr(trt10.BuilderFlag, name) and not hasattr(trt11.BuilderFlag, name)
    assert hasattr(trt10.NetworkDefinitionCreationFlag, "EXPLICIT_BATCH")
    assert not hasattr(trt11.NetworkDefinitionCreationFlag, "EXPLICIT_BATCH")
    for trt, present in ((trt10, True), (trt11, False)):
        builder = trt.Builder(make_logger(trt))
        config = builder.create_builder_config()
        for name in REMOVED_IN_11["IBuilder"]:
            assert hasattr(builder, name) is present
        for name in REMOVED_IN_11["IBuilderConfig"]:
            assert hasattr(config, name) is present
        engine = trt.Runtime(make_logger(trt)).deserialize_cuda_engine(
            (build(trt_module=trt, model=f"m{trt.major}") / "model.plan").read_bytes())
        for name in REMOVED_IN_11["ICudaEngine"]:
            assert hasattr(engine, name) is present
        assert hasattr(engine, "get_device_memory_size_for_profile_v2")
        context = engine.create_execution_context(trt.ExecutionContextAllocationStrategy.USER_MANAGED)
        assert hasattr(context, "set_device_memory")
        if not present:
            with pytest.raises(AttributeError, match="removed in TensorRT 11"):
                context.device_memory = 1 << 20


def test_the_11_fake_refuses_the_explicit_batch_flag_and_10_refuses_flags_on_a_strongly_typed_network(repo, trt10,
                                                                                                   trt11):
    logger = make_logger(trt11)
    assert trt11.Builder(logger).create_network(1 << 0) is None
    assert "unknown NetworkDefinitionCreationFlag" in logger.take()
    assert trt11.Builder(logger).create_network(1 << int(trt11.NetworkDefinitionCreationFlag.STRONGLY_TYPED))

    logger = make_logger(trt10)
    builder = trt10.Builder(logger)
    network = builder.create_network(1 << int(trt10.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    assert trt10.OnnxParser(network, logger).parse_from_file(str(repo / "vibration" / "model.onnx"))
    config = builder.create_builder_config()
    profile = builder.create_optimization_profile()
    profile.set_shape("signal", (2, 256), (2, 256), (2, 256))
    config.add_optimization_profile(profile)
    config.set_flag(trt10.BuilderFlag.FP16)
    assert builder.build_serialized_network(network, config) is None
    assert "not allowed on a strongly typed network" in logger.take()
