"""CUDA graphs in the TensorRT backend (engines/trt_graphs.py) against FakeTensorRT on the fake
GPU through cuda-python's driver API (FakeCudaDriver records a capture and replays it, each
operation bound to the addresses and shapes it was enqueued with, as a captured kernel is):
one capture per batch shape at its first run, replays after, outputs equal to onnxruntime's and
never one batch's in another's answer, the refusals (pycuda, DLA, an engine that cannot be
captured) with "auto" and "on", and graphs freed on close. What a real GPU adds (the speed) is
measured by `edge-batcher bench` where one is at hand (docs/benchmarks.md)."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from edge_batcher.errors import ConfigError, EngineError
from tests.fakes.fake_cuda_bindings import FakeCudaDriver
from tests.fakes.fake_tensorrt import FakeTensorRT
from tests.trt.test_trt_engine import reference, windows


def graphs_setting(model_dir, value: str):
    toml = model_dir / "model.toml"
    toml.write_text(toml.read_text().replace('cuda_graphs = "auto"', f'cuda_graphs = "{value}"'))
    return model_dir


def executions(trt, kind: str = "execute_async_v3") -> list[tuple[int, ...]]:
    return [c[2]["signal"] for c in trt.calls if c[0] == kind]


def test_each_batch_shape_is_captured_once_and_replayed_with_each_batchs_own_data(repo, build, engine_for, trt, cuda):
    driver = FakeCudaDriver(cuda)
    engine = engine_for(build(), cuda_module=driver)
    assert engine.cuda_graphs
    trt.calls.clear()
    sizes = (2, 8, 4, 4, 2, 8, 2)
    answers = [(x, engine.infer({"signal": x})) for x in (windows(n, seed=i) for i, n in enumerate(sizes))]
    assert executions(trt) == [(2, 256), (8, 256), (4, 256)]  # the first batch of each shape only
    assert executions(trt, "capture_execute_async_v3") == [(2, 256), (8, 256), (4, 256)]
    assert driver.counters["cuGraphLaunch"] == 4 and len(engine.graphs) == 3
    for x, got in answers:  # each answer is its own batch's, and later batches left it alone
        for name, value in reference(repo, x).items():
            np.testing.assert_allclose(got[name], value, rtol=0, atol=1e-6)


def test_without_graphs_runs_execute_even_where_a_graph_is_captured(repo, build, engine_for, trt, cuda):
    driver = FakeCudaDriver(cuda)
    engine = engine_for(build(), cuda_module=driver)
    engine.infer({"signal": windows(4)})
    trt.calls.clear()
    x = windows(4, seed=9)
    got = engine.infer_without_graphs({"signal": x})
    assert executions(trt) == [(4, 256)] and driver.counters["cuGraphLaunch"] == 0
    np.testing.assert_allclose(got["anomaly_score"], reference(repo, x)["anomaly_score"], atol=1e-6)


def test_close_destroys_every_graph(build, engine_for, cuda):
    driver = FakeCudaDriver(cuda)
    engine = engine_for(build(), cuda_module=driver)
    for n in (2, 4, 8):
        engine.infer({"signal": windows(n)})
    assert driver.live_graphs == 3  # executables; each graph is destroyed once instantiated
    engine.close()
    assert driver.live_graphs == 0


def test_an_engine_that_cannot_be_captured_serves_without_graphs_after_one_warning(repo, build, engine_for, cuda,
                                                                                    caplog):
    trt = FakeTensorRT(cuda, capturable=False)
    engine = engine_for(build(trt_module=trt), trt_module=trt, cuda_module=FakeCudaDriver(cuda))
    caplog.set_level(logging.WARNING, logger="edge_batcher.engines.trt_graphs")
    for seed, n in enumerate((2, 2, 4)):
        x = windows(n, seed=seed)
        np.testing.assert_allclose(engine.infer({"signal": x})["anomaly_score"],
                                   reference(repo, x)["anomaly_score"], atol=1e-6)
    assert not engine.cuda_graphs
    said = [r.getMessage() for r in caplog.records if r.name == "edge_batcher.engines.trt_graphs"]
    assert len(said) == 1 and "no CUDA graphs" in said[0] and "cannot be captured" in said[0]
    assert executions(trt) == [(2, 256), (2, 256), (4, 256)]


def test_on_makes_a_capture_failure_an_engine_error(build, engine_for, cuda):
    trt = FakeTensorRT(cuda, capturable=False)
    model_dir = graphs_setting(build(trt_module=trt), "on")
    engine = engine_for(model_dir, trt_module=trt, cuda_module=FakeCudaDriver(cuda))
    with pytest.raises(EngineError, match=r'cuda_graphs = "on" but the batch .* could not be captured'):
        engine.infer({"signal": windows(2)})


def test_pycuda_cannot_capture_auto_says_so_and_on_refuses_to_load(build, engine_for, cuda, caplog):
    caplog.set_level(logging.INFO, logger="edge_batcher.engines.trt_graphs")
    model_dir = build()
    assert not engine_for(model_dir, cuda_module=cuda).cuda_graphs  # FakeCuda stands for pycuda
    assert any("pycuda binding cannot capture" in r.getMessage() for r in caplog.records)
    with pytest.raises(ConfigError, match=r'cuda_graphs = "on" but the pycuda binding cannot capture.*cuda-bindings'):
        engine_for(graphs_setting(model_dir, "on"), cuda_module=cuda)


def test_off_never_captures(build, engine_for, trt, cuda):
    driver = FakeCudaDriver(cuda)
    engine = engine_for(graphs_setting(build(), "off"), cuda_module=driver)
    for _ in range(3):
        engine.infer({"signal": windows(2)})
    assert not engine.cuda_graphs and driver.counters["cuStreamBeginCapture"] == 0


def test_a_bad_setting_names_the_key(build, engine_for):
    with pytest.raises(ConfigError, match=r"\[tensorrt\] cuda_graphs: expected auto, on or off, got 'maybe'"):
        engine_for(graphs_setting(build(), "maybe"), load=False).load()
