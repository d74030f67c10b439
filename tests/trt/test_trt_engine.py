"""The TensorRT backend against FakeTensorRT/FakeCuda: real outputs (the fake runs the ONNX model
with onnxruntime), the TensorRT calls it makes, its memory and its errors."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import onnxruntime as ort
import pytest

from edge_batcher.config import load_model_config
from edge_batcher.engines import trt_profiles as tp
from edge_batcher.engines.registry import create_engine, engine_class
from edge_batcher.engines.tensorrt import TensorRTEngine
from edge_batcher.engines.trt_settings import plan_info_path, rebuild_command
from edge_batcher.errors import ConfigError, EngineError, OutOfMemory
from edge_batcher.types import TensorSpec
from tests.fakes.fake_tensorrt import FakeCuda, FakeTensorRT, tensorrt_installed


def reference(repo, x: np.ndarray, model: str = "vibration", name: str = "signal") -> dict[str, np.ndarray]:
    session = ort.InferenceSession(str(repo / model / "model.onnx"), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, {name: x})))


def windows(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(0.0, 0.7, size=(n, 256)).astype(np.float32)


# ------------------------------------------------------------------ end to end on the demo model


@pytest.mark.parametrize("size", [2, 4, 8])
def test_fp32_plan_matches_onnxruntime_at_each_preferred_size(repo, build, engine_for, size):
    engine = engine_for(build())
    x = windows(size, seed=size)
    got = engine.infer({"signal": x})
    ref = reference(repo, x)
    assert list(got) == ["class_probs", "class_id", "anomaly_score"]
    for name, value in ref.items():
        assert got[name].shape == value.shape and got[name].dtype == value.dtype
        np.testing.assert_allclose(got[name], value, rtol=0, atol=1e-6)


def test_specs_come_from_the_engine(build, engine_for):
    engine = engine_for(build())
    assert engine.inputs == [TensorSpec("signal", "FP32", (-1, 256))]
    assert engine.outputs == [TensorSpec("class_probs", "FP32", (-1, 4)), TensorSpec("class_id", "INT64", (-1,)),
                              TensorSpec("anomaly_score", "FP32", (-1,))]
    assert [p.inputs["signal"].opt for p in engine.profiles] == [(2, 256), (4, 256), (8, 256)]


def test_fp16_plan_is_close_but_not_identical(repo, build, engine_for):
    engine = engine_for(build("--fp16"))
    x = windows(8, seed=3)
    got, ref = engine.infer({"signal": x}), reference(repo, x)
    np.testing.assert_allclose(got["class_probs"], ref["class_probs"], atol=2e-2)
    assert got["class_probs"].dtype == np.float32  # I/O stays FP32: reduced precision is inside
    assert not np.array_equal(got["class_probs"], ref["class_probs"])


def test_each_batch_size_runs_on_its_own_profile_and_shapes_are_set_after_switching(build, engine_for, trt):
    model_dir = build()
    toml = model_dir / "model.toml"  # the plain path: replayed graphs switch nothing (test_trt_graphs.py)
    toml.write_text(toml.read_text().replace('cuda_graphs = "auto"', 'cuda_graphs = "off"'))
    engine = engine_for(model_dir)
    trt.calls.clear()
    for size in (2, 8, 4, 4, 2):
        engine.infer({"signal": windows(size)})
    executions = [(c[1], c[2]["signal"]) for c in trt.calls if c[0] == "execute_async_v3"]
    assert executions == [(0, (2, 256)), (2, (8, 256)), (1, (4, 256)), (1, (4, 256)), (0, (2, 256))]
    switches = [c[1] for c in trt.calls if c[0] == "set_optimization_profile_async"]
    assert switches == [0, 2, 1, 0]  # only when the profile changes


def test_a_range_plan_serves_every_size_up_to_the_largest(repo, build, engine_for):
    engine = engine_for(build("--range"))
    for size in (1, 3, 8):
        x = windows(size)
        np.testing.assert_allclose(engine.infer({"signal": x})["anomaly_score"], reference(repo, x)["anomaly_score"],
                                   atol=1e-6)
    with pytest.raises(EngineError, match=r"outside every optimization profile.*1x256\.\.8x256"):
        engine.infer({"signal": windows(16)})


def test_a_batch_outside_every_profile_is_an_engine_error_naming_them(build, engine_for):
    engine = engine_for(build())
    with pytest.raises(EngineError, match=r"signal \[3, 256\].*profile 0: signal 2x256"):
        engine.infer({"signal": windows(3)})
    # the engine still serves afterwards
    assert engine.infer({"signal": windows(2)})["class_id"].shape == (2,)


def test_inputs_are_cast_to_the_engine_datatype_and_a_missing_input_is_an_error(repo, build, engine_for):
    engine = engine_for(build())
    x = windows(4)
    got = engine.infer({"signal": x.astype(np.float64)})
    np.testing.assert_allclose(got["anomaly_score"], reference(repo, x)["anomaly_score"], atol=1e-6)
    with pytest.raises(EngineError, match="no input 'signal'"):
        engine.infer({"other": x})


def test_outputs_are_copies_not_views_of_the_reused_buffers(build, engine_for):
    engine = engine_for(build())
    first = engine.infer({"signal": windows(2, seed=1)})
    kept = {k: v.copy() for k, v in first.items()}
    engine.infer({"signal": windows(2, seed=2)})
    for name in kept:
        np.testing.assert_array_equal(first[name], kept[name])


def test_page_locked_inputs_are_handed_out_and_a_batch_already_there_is_not_copied(build, engine_for, cuda,
                                                                                   monkeypatch):
    """Engine.host_batch_buffers: the executor assembles a host batch in the input's page-locked
    buffer, so infer() copies nothing on the host before the copy to the device."""
    engine = engine_for(build())
    x = windows(4, seed=5)
    assert engine.host_batch_buffers({"signal": ((4, 256), np.dtype(np.float64))}) is None
    assert engine.host_batch_buffers({"other": ((4, 256), np.dtype(np.float32))}) is None
    views = engine.host_batch_buffers({"signal": ((4, 256), np.dtype(np.float32))})
    assert views is not None and cuda._is_pinned(views["signal"])
    views["signal"][...] = x
    copies = []
    copyto = np.copyto
    monkeypatch.setattr(np, "copyto", lambda dst, src, **kw: (copies.append(dst.shape), copyto(dst, src, **kw)))
    in_place = engine.infer(views)
    assert copies == []
    copied = engine.infer({"signal": x.copy()})
    assert copies == [(4, 256)]
    for name in copied:
        np.testing.assert_array_equal(in_place[name], copied[name])


def test_no_memory_is_allocated_per_batch(build, engine_for, cuda):
    engine = engine_for(build())
    engine.infer({"signal": windows(8)})
    before = dict(cuda.counters)
    used = cuda.used_memory()
    for size in (2, 4, 8) * 5:
        engine.infer({"signal": windows(size)})
    assert cuda.counters["mem_alloc"] == before["mem_alloc"]
    assert cuda.counters["pagelocked_empty"] == before["pagelocked_empty"]
    assert cuda.used_memory() == used


def test_load_and_infer_on_different_threads(repo, build, cuda, trt):
    """The runner loads on one executor thread and infers on the instance's worker thread; CUDA
    contexts are per thread, so the engine must make its context current itself."""
    engine = TensorRTEngine(load_model_config(build()), trt_module=trt, cuda_module=cuda)
    x = windows(4)
    with ThreadPoolExecutor(1) as loader, ThreadPoolExecutor(1) as worker:
        loader.submit(engine.load).result()
        got = worker.submit(engine.infer, {"signal": x}).result()
        worker.submit(engine.close).result()
    np.testing.assert_allclose(got["class_probs"], reference(repo, x)["class_probs"], atol=1e-6)
    assert cuda.used_memory() == 0


def test_close_frees_everything_and_is_idempotent(build, engine_for, cuda):
    engine = engine_for(build())
    assert cuda.used_memory() > 0 and cuda.primary_retained == 1
    engine.close()
    engine.close()
    import gc

    gc.collect()  # the fake frees the engine's weights when TensorRT's engine object goes away
    assert cuda.used_memory() == 0
    assert cuda.primary_retained == 0
    with pytest.raises(EngineError, match="after close"):
        engine.infer({"signal": windows(2)})


# ------------------------------------------------------------------ memory


def test_memory_footprint_is_tensorrts_own_numbers(build, engine_for, cuda):
    model_dir = build()
    plan = json.loads((model_dir / "model.plan").read_text())  # the fake plan records what it reports
    before = cuda.used_memory()
    engine = engine_for(model_dir)
    held = cuda.used_memory() - before
    io = [{"signal": s * 1024, "class_probs": s * 16, "class_id": s * 8, "anomaly_score": s * 4} for s in (2, 4, 8)]
    for index, size in enumerate((2, 4, 8)):
        f = engine.memory_footprint(size)
        assert f["weights"] == plan["weights_bytes"]
        assert f["activations"] == plan["device_memory"][index]
        assert f["io"] == sum(io[index].values())
        assert f["reserved"] == max(plan["device_memory"]) + sum(io[2].values())
        assert f["resident"] == f["weights"] + f["reserved"]
        assert f["per_batch"] == 0
    assert held == engine.memory_footprint(8)["resident"]  # exactly what the instance holds
    with pytest.raises(EngineError, match="no optimization profile serves batch size 3"):
        engine.memory_footprint(3)


def test_weights_fall_back_to_the_plan_size_without_engine_stats(build, engine_for, cuda, trt):
    old = FakeTensorRT(cuda, version=trt.__version__, engine_stats=False)
    model_dir = build(trt_module=old)
    engine = engine_for(model_dir, trt_module=old)
    assert engine.memory_footprint(2)["weights"] == (model_dir / "model.plan").stat().st_size


def test_out_of_memory_at_load_is_out_of_memory_and_frees_what_it_took(build, engine_for, trt):
    model_dir = build()
    small = FakeCuda(total_memory=300_000)  # room for the weights, not for the buffers too
    engine = engine_for(model_dir, trt_module=FakeTensorRT(small, version=trt.__version__), cuda_module=small,
                        load=False)
    with pytest.raises(OutOfMemory, match="out of memory loading"):
        engine.load()
    import gc

    gc.collect()
    assert small.used_memory() == 0 and small.primary_retained == 0


def test_sequence_model_runs_per_bucket_and_sizes_for_the_longest_bucket(repo, build, engine_for, trt):
    engine = engine_for(build(source="seqsum"))
    assert len(engine.profiles) == 9  # sizes 2/4/8 x buckets 8/16/32
    x = np.random.default_rng(0).normal(size=(4, 16)).astype(np.float32)
    got = engine.infer({"x": x})
    np.testing.assert_allclose(got["sum"], reference(repo, x, "seqsum", "x")["sum"], atol=1e-5)
    assert [c for c in trt.calls if c[0] == "execute_async_v3"][-1][1:] == (4, {"x": (4, 16)})
    longest = engine.memory_footprint(4, 32)
    assert engine.memory_footprint(4) == longest
    assert engine.memory_footprint(4, 8)["activations"] < longest["activations"]


# ------------------------------------------------------------------ errors at load


def test_plan_from_another_tensorrt_version_says_how_to_rebuild(repo, build, engine_for, cuda, trt):
    model_dir = build(trt_module=FakeTensorRT(cuda, version="10.0.1"))
    engine = engine_for(model_dir, load=False)  # loaded by the 10.3.0 or 11.4.0 fake
    with pytest.raises(ConfigError) as info:
        engine.load()
    text = str(info.value)
    assert f"TensorRT {trt.__version__} cannot load the plan" in text
    assert "built for another TensorRT version or GPU" in text
    assert "built with TensorRT 10.0.1" in text and "model.plan.json" in text
    assert "edge-batcher build-engine" in text and "tools/build_engine.py" in text
    assert f"--model {model_dir.name}" in text and "--force" in text
    assert "Version tag does not match" in text  # TensorRT's own words are kept
    assert cuda.primary_retained == 0


def test_plan_from_another_gpu_is_refused_too(build, engine_for, trt):
    model_dir = build()
    other = FakeCuda(compute_capability=(7, 2))  # a Xavier
    engine = engine_for(model_dir, trt_module=FakeTensorRT(other, version=trt.__version__), cuda_module=other,
                        load=False)
    with pytest.raises(ConfigError, match="another TensorRT version or GPU.*incompatible device"):
        engine.load()


def test_unreadable_plan_without_a_build_record(build, engine_for):
    model_dir = build()
    (model_dir / "model.plan").write_bytes(b"\x00garbage")
    plan_info_path(model_dir / "model.plan").unlink()
    engine = engine_for(model_dir, load=False)
    with pytest.raises(ConfigError, match="unknown TensorRT version \\(no build record"):
        engine.load()


def test_missing_plan_says_how_to_build_it(build, engine_for):
    model_dir = build()
    (model_dir / "model.plan").unlink()
    engine = engine_for(model_dir, load=False)
    with pytest.raises(ConfigError,
                       match="plan .*model.plan not found; build it on this device: edge-batcher build-engine"):
        engine.load()


def test_plan_without_a_profile_for_a_preferred_size(build, engine_for):
    model_dir = build("--sizes", "2,4")
    toml = model_dir / "model.toml"
    toml.write_text(toml.read_text().replace("preferred_batch_sizes = [2, 4]", "preferred_batch_sizes = [2, 4, 8]"))
    engine = engine_for(model_dir, load=False)
    with pytest.raises(ConfigError, match=r"no optimization profile for batch size\(s\) 8 .*rebuild it: edge-batcher"):
        engine.load()


def test_bad_tensorrt_table_names_the_key(build, engine_for):
    model_dir = build()
    toml = model_dir / "model.toml"
    toml.write_text(toml.read_text().replace('precision = "fp32"', 'precision = "fp64"'))
    engine = engine_for(model_dir, load=False)
    with pytest.raises(ConfigError, match=r"\[tensorrt\] precision: expected one of fp32, fp16, int8"):
        engine.load()
    toml.write_text(toml.read_text().replace('precision = "fp64"', "precision = 16"))
    with pytest.raises(ConfigError, match=r"\[tensorrt\] precision: expected a string"):
        engine_for(model_dir, load=False).load()


def test_dla_core_on_a_device_without_dla(build, engine_for, cuda, trt):
    agx = FakeTensorRT(cuda, version=trt.__version__, num_dla_cores=2)
    model_dir = build("--fp16", "--dla-core", "1", trt_module=agx)
    engine = engine_for(model_dir, load=False)  # an Orin Nano: no DLA
    with pytest.raises(ConfigError, match="dla_core = 1, but this device has 0 DLA core"):
        engine.load()


def test_dla_plan_loads_on_the_configured_core(repo, build, engine_for, cuda, trt):
    agx = FakeTensorRT(cuda, version=trt.__version__, num_dla_cores=2)
    model_dir = build("--fp16", "--dla-core", "1", trt_module=agx)
    engine = engine_for(model_dir, trt_module=agx)  # the fake refuses a DLA plan unless DLA_core was set
    x = windows(4)
    np.testing.assert_allclose(engine.infer({"signal": x})["class_probs"], reference(repo, x)["class_probs"], atol=2e-2)


def test_rebuild_command_repeats_the_build_options(build):
    config = load_model_config(build("--fp16", "--range", "--workspace-mb", "512", "--sizes", "2,4,8"))
    command = rebuild_command(config)
    assert command.startswith("edge-batcher build-engine ")
    for part in ("vibration/model.onnx", "--model vibration-trt", "--sizes 2,4,8", "--range", "--fp16",
                 "--workspace-mb 512", "--force"):
        assert part in command


# ------------------------------------------------------------------ lazy import


def test_importing_the_backend_imports_neither_tensorrt_nor_a_cuda_binding():
    code = ("import sys, edge_batcher.engines.tensorrt, edge_batcher.engines.trt_build, edge_batcher.engines.trt_api, "
            "edge_batcher.engines.trt_profiles, edge_batcher.engines.cuda_api, edge_batcher.memory.probe; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('tensorrt', 'pycuda', 'cuda')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_registry_finds_the_backend():
    assert engine_class("tensorrt") is TensorRTEngine


def test_without_tensorrt_installed_load_says_what_to_install(build):
    if tensorrt_installed():
        pytest.skip("tensorrt is installed here")
    engine = create_engine(load_model_config(build()))
    with pytest.raises(ConfigError,
                       match=r"needs TensorRT and a CUDA Python binding.*JetPack.*edge-batcher\[tensorrt\]"):
        engine.load()


def test_tensorrt_older_than_10_is_refused(build, engine_for, cuda):
    engine = engine_for(build(), trt_module=FakeTensorRT(cuda, version="8.6.2"), load=False)
    with pytest.raises(ConfigError, match="needs TensorRT >= 10.*8.6.2.*TensorrtExecutionProvider"):
        engine.load()


def test_profile_module_and_engine_agree_on_selection(build, engine_for):
    engine = engine_for(build())
    for size in (2, 4, 8):
        assert tp.profile_for_batch(size, engine.profiles) == tp.select_profile({"signal": (size, 256)},
                                                                                engine.profiles)


# ------------------------------------------------------------------ TensorRT 10.x and 11.x


def test_capabilities_are_found_by_looking_not_by_version(trt10, trt11):
    from edge_batcher.engines.trt_api import tensorrt_capabilities

    c10, c11 = tensorrt_capabilities(trt10), tensorrt_capabilities(trt11)
    assert (c10.precision_flags, c10.int8_calibration, c10.explicit_batch_flag, c10.strongly_typed_only) == (
        True, True, True, False)
    assert (c11.precision_flags, c11.int8_calibration, c11.explicit_batch_flag, c11.strongly_typed_only) == (
        False, False, False, True)
    assert c10.describe() == "TensorRT 10.3.0: FP16/INT8 builder flags, INT8 calibration"
    assert c11.describe().startswith("TensorRT 11.4.0: strongly typed networks only")


def test_import_tensorrt_reports_version_capabilities_and_binding(trt, cuda_module, binding, caplog):
    from edge_batcher.engines.trt_api import import_tensorrt

    with caplog.at_level("INFO", logger="edge_batcher.engines.trt_api"):
        modules = import_tensorrt(trt, cuda_module)
    assert modules.trt is trt and modules.cuda.name == binding
    assert modules.capabilities.version == trt.__version__
    assert f"TensorRT {trt.__version__}: " in caplog.text and f"CUDA binding {binding}" in caplog.text


def test_a_tensorrt_newer_than_11_loads_with_a_warning(build, engine_for, cuda, caplog):
    future = FakeTensorRT(cuda, version="12.0.0")  # behaves as the 11.x fake: strongly typed only
    model_dir = build(trt_module=future)
    with caplog.at_level("WARNING", logger="edge_batcher.engines.trt_api"):
        engine = engine_for(model_dir, trt_module=future)
    assert "TensorRT 12.0.0 is newer than the 11.x" in caplog.text
    x = windows(2)
    np.testing.assert_allclose(engine.infer({"signal": x})["class_probs"],
                               reference(model_dir.parent, x)["class_probs"], atol=1e-5)


def test_a_tensorrt_lacking_a_needed_name_is_refused(build, engine_for, cuda, trt):
    broken = _Without(FakeTensorRT(cuda, version=trt.__version__), "ExecutionContextAllocationStrategy")
    engine = engine_for(build(), trt_module=broken, load=False)
    with pytest.raises(ConfigError, match="lacks ExecutionContextAllocationStrategy.*TensorRT 10.x and 11.x"):
        engine.load()


class _Without:
    """A module stand-in that hides one name of the wrapped fake."""

    def __init__(self, inner, hidden: str):
        self._inner, self._hidden = inner, hidden

    def __getattr__(self, name):
        if name == self._hidden:
            raise AttributeError(name)
        return getattr(self._inner, name)


def test_a_stale_calibrated_int8_plan_on_tensorrt_11_prints_a_rebuild_it_can_do(repo, build, engine_for, cuda,
                                                                                 trt10, trt11, tmp_path):
    cache = tmp_path / "calib.cache"
    cache.write_bytes(b"TRT-100300-EntropyCalibration2\n")
    model_dir = build("--int8", "--calibration-cache", str(cache), trt_module=trt10)
    engine = engine_for(model_dir, trt_module=trt11, load=False)  # JetPack plan moved to a TensorRT 11 desktop
    with pytest.raises(ConfigError) as info:
        engine.load()
    text = str(info.value)
    assert "TensorRT 11.4.0 cannot load the plan" in text and "built with TensorRT 10.3.0" in text
    assert "--int8" in text and "--calibration-cache" not in text.split("(TensorRT 11.4.0 has no")[0]
    assert "has no INT8 calibration" in text and "modelopt.onnx.quantization" in text
    # The same plan on a TensorRT 10 of another version keeps the calibration cache in the command.
    older = FakeTensorRT(cuda, version="10.0.1")
    with pytest.raises(ConfigError, match=f"--calibration-cache {cache}"):
        engine_for(model_dir, trt_module=older, load=False).load()


def test_tensorrt_11_engines_have_no_v1_memory_queries_and_the_backend_does_not_need_them(build, engine_for, trt11):
    engine = engine_for(build(trt_module=trt11), trt_module=trt11)
    assert not hasattr(engine._engine, "get_device_memory_size_for_profile")
    assert not hasattr(engine._engine, "device_memory_size")
    f = engine.memory_footprint(8)
    assert f["activations"] == engine._engine.get_device_memory_size_for_profile_v2(2) > 0
