"""Fixed buffers per batch shape (engines/ort_graphs.py) and CUDA graphs on them (issue 27).

The buffer mechanics (IOBinding, copy in, copy out, reuse by the next batch) run here on ONNX
Runtime's CPU provider with the demo model; the CUDA-graph tests run wherever the CUDA provider
and a GPU are present and skip elsewhere: outputs equal the plain path's within 1e-5, and a
response keeps its values after the buffers have served later batches."""

from __future__ import annotations

import ctypes
import shutil

import numpy as np
import onnxruntime as ort
import pytest

from edge_batcher.config import load_model_config
from edge_batcher.engines.base import DeviceArray
from edge_batcher.engines.onnxruntime import OnnxRuntimeEngine, without_graphs
from edge_batcher.engines.ort_graphs import BoundSession, graph_ids_missing
from edge_batcher.errors import ConfigError


def batches(rows: int, n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((rows, 256)).astype(np.float32) for _ in range(n)]


@pytest.fixture
def vibration_session(model_repo):
    return ort.InferenceSession(str(model_repo / "vibration" / "model.onnx"), providers=["CPUExecutionProvider"])


def test_bound_buffers_answer_as_the_plain_session_at_every_size(vibration_session):
    bound = BoundSession(vibration_session, "cpu", graphs=False)
    name = vibration_session.get_inputs()[0].name
    for size in (2, 4, 8, 2, 8):
        for x in batches(size, 3, seed=size):
            plain = vibration_session.run(None, {name: x})
            for got, want in zip(bound.run({name: x}), plain, strict=True):
                np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert len(bound.shapes) == 3  # one set of buffers per shape, reused


def test_a_response_is_not_overwritten_by_the_next_batch_in_the_same_buffers(vibration_session):
    bound = BoundSession(vibration_session, "cpu", graphs=False)
    name = vibration_session.get_inputs()[0].name
    first, second = batches(8, 2, seed=7)
    kept = bound.run({name: first})
    snapshot = [v.copy() for v in kept]
    later = bound.run({name: second})
    for a, b in zip(kept, snapshot, strict=True):
        np.testing.assert_array_equal(a, b)  # the first response is untouched
    assert not all(np.array_equal(a, b) for a, b in zip(kept, later, strict=True))  # and it was different data


def host_backed(x: np.ndarray) -> DeviceArray:
    """A DeviceArray whose memory is this host array: on the CPU provider the bound buffers are
    host memory too, so copy_to is a memmove (the GPU test below uses device memory)."""
    return DeviceArray(x.ctypes.data, 0, x.dtype, x.shape, lambda dst: ctypes.memmove(dst, x.ctypes.data, x.nbytes))


def test_a_device_batch_is_copied_into_its_shapes_buffers_and_reuses_them(vibration_session):
    """A batch assembled on the device replays its shape's bound buffers (and graph) instead of
    a run outside them; a shape warm-up never bound is left to the caller (`knows`)."""
    bound = BoundSession(vibration_session, "cpu", graphs=False)
    name = vibration_session.get_inputs()[0].name
    warm, x = batches(4, 2, seed=7)
    assert not bound.knows({name: host_backed(x)})
    bound.run({name: warm})
    shape = next(iter(bound.shapes.values()))
    assert bound.knows({name: host_backed(x)}) and not bound.knows({name: host_backed(batches(2, 1, 8)[0])})
    got = bound.run({name: host_backed(x)})
    for value, want in zip(got, vibration_session.run(None, {name: x}), strict=True):
        np.testing.assert_allclose(value, want, rtol=1e-6)
    assert len(bound.shapes) == 1 and shape.runs == 2
    # Assembled in place (Engine.device_batch_buffers): the buffer is the input, nothing is copied.
    assert bound.buffers_for({name: ((2, 256), np.dtype(np.float32))}) is None
    (target,) = bound.buffers_for({name: ((4, 256), np.dtype(np.float32))}).values()
    y = batches(4, 1, seed=9)[0]
    ctypes.memmove(target, y.ctypes.data, y.nbytes)

    def must_not_copy(dst: int) -> None:
        raise AssertionError("a batch already in the bound buffer was copied")

    got = bound.run({name: DeviceArray(target, 0, y.dtype, y.shape, must_not_copy)})
    for value, want in zip(got, vibration_session.run(None, {name: y}), strict=True):
        np.testing.assert_allclose(value, want, rtol=1e-6)


def test_cuda_graphs_setting_is_checked(model_repo, tmp_path):
    model = tmp_path / "vibration"
    shutil.copytree(model_repo / "vibration", model)
    text = (model / "model.toml").read_text().replace("[onnxruntime]\n", '[onnxruntime]\ncuda_graphs = "maybe"\n')
    (model / "model.toml").write_text(text)
    with pytest.raises(ConfigError, match="cuda_graphs: expected auto, on or off"):
        load_model_config(model)


@pytest.mark.parametrize("version", ["1.18.0", "1.31.1", "2.0.0", "1.20.0.dev20240501", "custom-build"])
def test_graph_ids_are_trusted_from_onnxruntime_1_18(version):
    assert graph_ids_missing(version) is None


def test_an_older_onnxruntime_says_why_it_gets_no_graphs():
    why = graph_ids_missing("1.17.3")
    assert why is not None and "one CUDA graph per session" in why and "1.18" in why


def test_cpu_sessions_never_use_graphs(model_repo):
    engine = OnnxRuntimeEngine(load_model_config(model_repo / "vibration"))
    engine.load()
    assert not engine.cuda_graphs


def test_without_graphs_the_cuda_ep_plans_convolutions_heuristically_unless_told():
    chain = [("CUDAExecutionProvider", {"device_id": "0", "enable_cuda_graph": "1"}), ("CPUExecutionProvider", {})]
    assert without_graphs(chain) == [
        ("CUDAExecutionProvider", {"device_id": "0", "cudnn_conv_algo_search": "HEURISTIC"}),
        ("CPUExecutionProvider", {}),
    ]
    told = [("CUDAExecutionProvider", {"cudnn_conv_algo_search": "EXHAUSTIVE"})]
    assert without_graphs(told) == told
    # one batch shape only: never planned again, so ONNX Runtime's exhaustive default stays
    assert without_graphs(chain, one_shape=True)[0] == ("CUDAExecutionProvider", {"device_id": "0"})
    assert chain[0][1]["enable_cuda_graph"] == "1"  # the chain given is left as it was


def _cuda_available() -> bool:
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return False
    try:  # a CUDA build can still lack a device
        import ctypes

        count = ctypes.c_int(0)
        return ctypes.CDLL("libcudart.so").cudaGetDeviceCount(ctypes.byref(count)) == 0 and count.value > 0
    except OSError:
        return True  # the runtime library under another name: let ONNX Runtime say


needs_cuda = pytest.mark.skipif(not _cuda_available(), reason="needs onnxruntime-gpu and a CUDA GPU")


def _cuda_engine(model_repo, tmp_path, mode: str) -> OnnxRuntimeEngine:
    model = tmp_path / f"vibration-{mode}"
    shutil.copytree(model_repo / "vibration", model)
    text = (model / "model.toml").read_text()
    text = text.replace('execution_providers = ["CPUExecutionProvider"]',
                        f'execution_providers = ["CUDAExecutionProvider"]\ncuda_graphs = "{mode}"')
    assert "CUDAExecutionProvider" in text
    (model / "model.toml").write_text(text)
    engine = OnnxRuntimeEngine(load_model_config(model))
    engine.load()
    return engine


@needs_cuda
def test_graphs_replay_with_the_plain_paths_outputs(model_repo, tmp_path, vibration_session):
    engine = _cuda_engine(model_repo, tmp_path, "auto")
    assert engine.cuda_graphs and engine.providers[0] == "CUDAExecutionProvider"
    name = engine.inputs[0].name
    kept = []
    for size in (2, 4, 8, 4, 2, 8):
        for x in batches(size, 4, seed=size + 100):
            got = engine.infer({name: x})
            plain = engine.infer_without_graphs({name: x})  # the same session and kernels, no graph
            want = [plain[spec.name] for spec in engine.outputs]
            for spec, value in zip(engine.outputs, want, strict=True):
                np.testing.assert_allclose(got[spec.name], value, rtol=1e-5, atol=1e-5)
            kept.append((got, want))
    for got, want in kept:  # every earlier response still holds its own values
        for spec, value in zip(engine.outputs, want, strict=True):
            np.testing.assert_allclose(got[spec.name], value, rtol=1e-5, atol=1e-5)
    assert engine.cuda_graphs  # no fallback happened


@needs_cuda
def test_a_batch_in_device_memory_replays_its_shapes_graph(model_repo, tmp_path):
    """Inputs in CUDA shared memory reach the engine as a DeviceArray: with graphs it is copied
    into the shape's bound buffer and the graph replays (outside a graph, every change of batch
    size made the vision model's convolutions plan again: ~27 ms a batch on an H200)."""
    from edge_batcher.shared_memory.cuda_regions import CudaDevices

    engine = _cuda_engine(model_repo, tmp_path, "auto")
    name = engine.inputs[0].name
    devices = CudaDevices()
    try:
        for size in (2, 8, 4, 8, 2):
            warm, x = batches(size, 2, seed=size)
            engine.infer({name: warm})  # warm-up binds each shape from a host batch
            with devices.on(0) as api:
                buffer = api.mem_alloc(x.nbytes)
                api.copy_htod(buffer.ptr, x)
                api.synchronize()

            def copy_to(dst: int, src: int = buffer.ptr, nbytes: int = x.nbytes) -> None:
                with devices.on(0) as api:
                    api.copy_dtod(dst, src, nbytes)
                    api.synchronize()

            assert engine.bound is not None
            runs = sum(shape.runs for shape in engine.bound.shapes.values())
            got = engine.infer({name: DeviceArray(buffer.ptr, 0, x.dtype, x.shape, copy_to)})
            assert sum(shape.runs for shape in engine.bound.shapes.values()) == runs + 1  # replayed
            want = engine.infer_without_graphs({name: x})
            for spec in engine.outputs:
                np.testing.assert_allclose(got[spec.name], want[spec.name], rtol=1e-5, atol=1e-5)
            # Assembled in the graph's own input buffer (what the executor does): no copy at all.
            assert engine.device_batch_buffers is not None
            targets = engine.device_batch_buffers({name: (x.shape, x.dtype)})
            assert targets is not None
            with devices.on(0) as api:
                api.copy_htod(targets[name], x)
                api.synchronize()
            in_place = engine.infer({name: DeviceArray(targets[name], 0, x.dtype, x.shape, copy_to)})
            for spec in engine.outputs:
                np.testing.assert_allclose(in_place[spec.name], want[spec.name], rtol=1e-5, atol=1e-5)
            with devices.on(0):
                buffer.free()
    finally:
        devices.close()


@needs_cuda
def test_host_batches_in_page_locked_staging_replay_with_the_plain_paths_outputs(model_repo, tmp_path):
    """With a CUDA Python binding, each bound shape has page-locked host arrays the executor
    assembles host batches in (Engine.host_batch_buffers): the copy to the device reads them by DMA."""
    from edge_batcher.engines.cuda_api import load_cuda_api

    try:
        load_cuda_api()
    except ImportError:
        pytest.skip("no CUDA Python binding: host batches are copied from pageable memory")
    engine = _cuda_engine(model_repo, tmp_path, "auto")
    assert engine.staging is not None and engine.host_batch_buffers is not None
    name = engine.inputs[0].name
    for size in (2, 4, 8, 4, 2):
        warm, x = batches(size, 2, seed=size + 30)
        engine.infer({name: warm})  # warm-up binds the shape and its staging
        staging = engine.host_batch_buffers({name: ((size, 256), np.dtype(np.float32))})
        assert staging is not None
        staging[name][...] = x
        got = engine.infer(staging)
        want = engine.infer_without_graphs({name: x})
        for spec in engine.outputs:
            np.testing.assert_allclose(got[spec.name], want[spec.name], rtol=1e-5, atol=1e-5)
    assert engine.staging.nbytes == (2 + 4 + 8) * 256 * 4
    engine.close()
    assert engine.staging is None


@needs_cuda
def test_graphs_off_is_the_plain_cuda_session(model_repo, tmp_path):
    engine = _cuda_engine(model_repo, tmp_path, "off")
    assert not engine.cuda_graphs and engine.host_batch_buffers is None
    options = engine.session.get_provider_options()["CUDAExecutionProvider"]
    assert options["cudnn_conv_algo_search"] == "HEURISTIC" and options["enable_cuda_graph"] == "0"
    with_graphs = _cuda_engine(model_repo, tmp_path, "on").session.get_provider_options()["CUDAExecutionProvider"]
    assert with_graphs["cudnn_conv_algo_search"] == "EXHAUSTIVE" and with_graphs["enable_cuda_graph"] == "1"
    out = engine.infer({engine.inputs[0].name: np.zeros((2, 256), np.float32)})
    assert all(v.shape[0] == 2 for v in out.values())


@needs_cuda
def test_the_encoder_replays_graphs_per_bucket_or_says_why_not(tmp_path, caplog):
    """The BERT-shaped demo encoder on the CUDA EP: per (size, bucket) its graph replays give the
    plain session.run's outputs within 1e-5, or, if ONNX Runtime refuses to capture it, the
    engine serves without graphs and logs why (cuda_graphs = "auto")."""
    from tests.support.models import _tool

    tool = _tool("build_encoder_model")
    tool.build_encoder(tmp_path, layers=1)
    toml = tmp_path / "encoder" / "model.toml"
    toml.write_text(toml.read_text().replace('execution_providers = ["CPUExecutionProvider"]',
                                             'execution_providers = ["CUDAExecutionProvider"]'))
    engine = OnnxRuntimeEngine(load_model_config(tmp_path / "encoder"))
    with caplog.at_level("WARNING"):
        engine.load()
        for seq in (32, 64, 32):
            for size in (2, 4, 8):
                for seed in range(3):
                    x = tool.sample_inputs(size, seq, seed=seed)
                    got = engine.infer(x)
                    want = engine.infer_without_graphs(x)
                    for name, value in want.items():
                        np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-5)
    assert engine.providers[0] == "CUDAExecutionProvider"
    if not engine.cuda_graphs:
        assert "no CUDA graphs" in caplog.text, caplog.text
    else:
        assert len(engine.bound.shapes) == 6  # 3 sizes x 2 buckets, each captured once


def _model_with_a_cpu_only_node(directory, mode: str):
    """Relu -> Det -> Relu: ONNX Runtime's CUDA EP has no Det kernel, so Det runs on the CPU
    between two CUDA nodes, with copies around it, which CUDA graphs refuse at session creation
    ("cannot use the graph capture feature"), as many detection models' CPU-only ops do."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Det", ["r"], ["d"]),
         helper.make_node("Relu", ["d"], ["y"])],
        "cpu_node", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 2, 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n"])])
    directory.mkdir()
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8),
              directory / "model.onnx")
    (directory / "model.toml").write_text(
        'backend = "onnxruntime"\n[onnxruntime]\nexecution_providers = ["CUDAExecutionProvider"]\n'
        f'cuda_graphs = "{mode}"\n[batching]\npreferred_batch_sizes = [2, 4]\n')
    return load_model_config(directory)


@needs_cuda
def test_a_model_graphs_refuse_at_session_creation_is_served_without_them(tmp_path, caplog):
    engine = OnnxRuntimeEngine(_model_with_a_cpu_only_node(tmp_path / "auto", "auto"))
    with caplog.at_level("WARNING"):
        engine.load()
    assert not engine.cuda_graphs and "no CUDA graphs" in caplog.text and "graph capture" in caplog.text
    assert engine.session.get_provider_options()["CUDAExecutionProvider"]["cudnn_conv_algo_search"] == "HEURISTIC"
    x = np.array([[[2, 1], [1, 3]], [[1, 2], [3, 4]]], np.float32)  # determinants 5 and 0 (Relu of -2)
    np.testing.assert_allclose(engine.infer({"x": x})["y"], [5.0, 0.0], rtol=1e-5)
    with pytest.raises(ConfigError, match='cuda_graphs = "on" but ONNX Runtime cannot capture it'):
        OnnxRuntimeEngine(_model_with_a_cpu_only_node(tmp_path / "on", "on")).load()
