"""`edge-batcher estimate` (edge_batcher.memory.report), its measurement (measure.py) and
calibration (calibration.py), and
the encoder demo model built by tools/build_encoder_model.py.

The repository is built once for the module in a temporary directory: the vibration demo
model (a few seconds of training), a two-layer encoder, a copy of the vibration model limited
to one batch size (for the --measure path) and a TensorRT entry that the report must skip.
Measurements run real ONNX Runtime subprocesses (about a second each).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import shutil
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from edge_batcher.config import load_model_config
from edge_batcher.errors import EdgeBatcherError
from edge_batcher.memory import calibration, measure, report
from edge_batcher.memory.estimator import OnnxFootprintEstimator
from tests.support.models import ROOT, build_demo

MiB = 1 << 20
BUDGET_MB = 20


def _encoder_tool():
    spec = importlib.util.spec_from_file_location("build_encoder_model", ROOT / "tools" / "build_encoder_model.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    out = tmp_path_factory.mktemp("engines")
    build_demo(out)
    _encoder_tool().build_encoder(out, layers=2)
    one = out / "vib4"
    one.mkdir()
    shutil.copy(out / "vibration" / "model.onnx", one / "model.onnx")
    (one / "model.toml").write_text('backend = "onnxruntime"\n[batching]\npreferred_batch_sizes = [4]\n')
    trt = out / "trt"
    trt.mkdir()
    (trt / "model.toml").write_text('backend = "tensorrt"\nmodel_file = "model.plan"\n')
    return out


@pytest.fixture(scope="module")
def config_file(repo, tmp_path_factory):
    path = tmp_path_factory.mktemp("config") / "config.toml"
    path.write_text(f'[models]\nrepository = "{repo}"\n[memory]\nprobe = "fixed"\nbudget_mb = {BUDGET_MB}\n')
    return path


def run_estimate(capsys, *argv: str) -> tuple[int, str]:
    parser = argparse.ArgumentParser()
    report.add_arguments(parser)
    code = report.run(parser.parse_args(list(argv)))
    return code, capsys.readouterr().out


def estimator_for(repo, name: str) -> OnnxFootprintEstimator:
    mc = load_model_config(repo / name)
    s = mc.sequence
    return OnnxFootprintEstimator(mc.model_path, sequence_axes={i: s.axis for i in s.inputs} if s else None)


# ------------------------------------------------------------------------------- the report


def test_json_rows_match_the_estimator_and_the_budget(repo, config_file, capsys):
    code, out = run_estimate(capsys, "--config", str(config_file), "--json")
    assert code == 0
    data = json.loads(out)

    budget = data["budget"]
    assert budget["probe"] == "fixed"
    assert budget["available_bytes"] == BUDGET_MB * MiB  # fixed probe: no margins
    assert "measurement" not in data

    models = {m["name"]: m for m in data["models"]}
    assert set(models) == {"encoder", "vibration", "vib4"}
    assert data["skipped"] == [{"name": "trt", "reason": "backend 'tensorrt': only models that run an ONNX graph "
                                                         "in ONNX Runtime are estimated"}]

    vib = models["vibration"]
    assert [(r["batch"], r["seq_len"]) for r in vib["rows"]] == [(2, None), (4, None), (8, None)]
    enc = models["encoder"]
    assert [(r["batch"], r["seq_len"]) for r in enc["rows"]] == [
        (b, s) for s in (32, 64, 128) for b in (2, 4, 8)
    ]

    fits = set()
    for name in ("vibration", "encoder"):
        est = estimator_for(repo, name)
        assert models[name]["weights_bytes"] == est.weights_bytes()
        for r in models[name]["rows"]:
            f = est.estimate(r["batch"], r["seq_len"])
            assert (r["weights"], r["activations"], r["kv_cache"], r["total"]) == (
                f.weights, f.activations, f.kv_cache, f.total
            )
            assert r["unknown_shapes"] == 0
            assert r["fits"] == (r["total"] <= budget["available_bytes"])
            fits.add(r["fits"])
    assert fits == {True, False}  # 20 MiB: small encoder batches fit, batch 8 x 128 does not


def test_human_table_in_mib(repo, config_file, capsys):
    code, out = run_estimate(capsys, "--config", str(config_file), "--model", "vibration", "--model", "encoder")
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == f"Memory budget: {BUDGET_MB:.1f} MiB available for batches"
    header = next(line for line in lines if line.startswith("model"))
    assert header.split() == ["model", "batch", "seq", "weights", "activ.", "KV", "total", "fits"]

    est = estimator_for(repo, "encoder")
    f = est.estimate(8, 128)
    row = next(line.split() for line in lines if line.split()[:3] == ["encoder", "8", "128"])
    assert row[3:] == [f"{f.weights / MiB:.1f}", f"{f.activations / MiB:.1f}", f"{f.kv_cache / MiB:.1f}",
                       f"{f.total / MiB:.1f}", "NO"]
    row = next(line.split() for line in lines if line.split()[:3] == ["vibration", "2", "-"])
    assert row[-1] == "yes"
    assert not any(line.startswith("vib4") for line in lines)  # --model filters


# ------------------------------------------------------------------------------- --measure


def test_measure_one_size_of_the_vibration_model(config_file, capsys):
    code, out = run_estimate(capsys, "--config", str(config_file), "--model", "vib4", "--measure", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["measurement"]["resolution_bytes"] == measure.RESOLUTION_BYTES
    (row,) = data["models"][0]["rows"]
    m = row["measured"]
    assert m["batch"] == 4 and m["seq_len"] is None
    assert m["input_bytes"] == 4 * 256 * 4  # signal FP32 [4, 256]
    # A few KiB of activations: the RSS rise may read anywhere from 0 to a few pages.
    assert m["run_peak"] >= 0 and m["activation_peak"] == m["input_bytes"] + m["run_peak"] > 0
    assert (m["arena"], m["mem_pattern"], m["warmup"]) == (False, False, True)
    assert m["providers"] == ["CPUExecutionProvider"]
    assert row["error"] == pytest.approx((row["activations"] - m["activation_peak"]) / m["activation_peak"])
    # A few KiB of activations are far below the RSS resolution: no calibration from them.
    assert row["calibration"]["point"] is True and row["calibration"]["factor"] is None

    code, out = run_estimate(capsys, "--config", str(config_file), "--model", "vib4", "--measure")
    assert code == 0
    header = next(line for line in out.splitlines() if line.startswith("model"))
    assert header.split()[-3:] == ["measured", "error", "calibrated"]
    row = next(line for line in out.splitlines() if line.startswith("vib4"))
    assert "%" in row
    assert "not calibrated" in out


def test_calibration_on_the_encoder(repo):
    """Calibrated at 2 x 64, the estimate of 4 x 64 is close to what is measured there."""
    mc = load_model_config(repo / "encoder")
    est = estimator_for(repo, "encoder")
    raw = est.activation_peak(2, 64)
    cal = calibration.calibrate(est, mc, 2, 64)
    assert cal.applied, cal.reason
    assert cal.raw_estimate == raw
    assert cal.factor == pytest.approx(cal.measurement.activation_peak / raw)
    assert est.calibration == cal.factor
    # ONNX Runtime keeps one buffer per tensor size for the whole run: more than liveness.
    assert 1.2 < cal.factor < 2.5

    measured = measure.measure_activation_peak(mc, 4, 64)
    calibrated = est.estimate(4, 64).activations
    assert math.isclose(calibrated, measured.activation_peak, rel_tol=0.15)


def test_calibration_refuses_a_measurement_below_resolution(repo):
    est = estimator_for(repo, "vibration")
    cal = calibration.calibrate(est, repo / "vibration", 2)
    assert not cal.applied
    assert "below" in cal.reason
    assert est.calibration == 1.0


def test_measure_needs_sizes_for_every_dynamic_dimension(tmp_path):
    d = tmp_path / "twodyn"
    d.mkdir()
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])], "twodyn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "n"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "n"])],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), d / "model.onnx")
    (d / "model.toml").write_text('backend = "onnxruntime"\n')
    with pytest.raises(EdgeBatcherError, match="no size for dynamic dimension 1"):
        measure.measure_activation_peak(d, 2)
    with pytest.raises(ValueError, match="batch must be"):
        measure.measure_activation_peak(d, 0)


# ------------------------------------------------------------------------------- encoder model


def test_encoder_builder_makes_a_runnable_model_with_the_declared_io(repo):
    model = onnx.load(repo / "encoder" / "model.onnx")
    onnx.checker.check_model(model)
    assert model.opset_import[0].version == 17
    ops = {n.op_type for n in model.graph.node}
    assert {"Gather", "MatMul", "Softmax", "LayerNormalization", "Erf"} <= ops

    sess = ort.InferenceSession(str(repo / "encoder" / "model.onnx"), providers=["CPUExecutionProvider"])
    assert [(i.name, i.type, i.shape) for i in sess.get_inputs()] == [
        ("input_ids", "tensor(int64)", ["batch", "seq"]),
        ("attention_mask", "tensor(int64)", ["batch", "seq"]),
    ]
    assert [(o.name, o.type, o.shape) for o in sess.get_outputs()] == [("embedding", "tensor(float)", ["batch", 256])]
    tool = _encoder_tool()
    for batch, seq in ((2, 32), (3, 17)):  # any length: seq is symbolic
        (emb,) = sess.run(None, tool.sample_inputs(batch, seq))
        assert emb.shape == (batch, 256) and np.all(np.isfinite(emb))
    # padding does not leak into the pooled embedding of an unpadded row
    feeds = tool.sample_inputs(1, 32)
    padded = {k: np.pad(v, ((0, 0), (0, 32))) for k, v in feeds.items()}
    (a,), (b,) = sess.run(None, feeds), sess.run(None, padded)
    np.testing.assert_allclose(a, b, atol=1e-4)

    mc = load_model_config(repo / "encoder")
    assert mc.backend == "onnxruntime"
    assert mc.batching.preferred_batch_sizes == [2, 4, 8]
    assert mc.sequence is not None
    assert (mc.sequence.inputs, mc.sequence.axis, mc.sequence.buckets) == (
        ["input_ids", "attention_mask"], 1, [32, 64, 128])
    assert "random" in mc.description.lower()
    est = estimator_for(repo, "encoder")
    est.estimate(8, 128)
    assert est.unknown_shapes == 0


def test_warm_up_calibration_measures_every_length_bucket(repo):
    """[memory] calibrate_at_warmup: the longest bucket sets the default factor, each shorter
    bucket gets its own (ONNX Runtime's excess over liveness grows with the length)."""
    mc = load_model_config(repo / "encoder")
    est = estimator_for(repo, "encoder")
    calibration.calibrate_model(mc, est)
    size = mc.batching.preferred_batch_sizes[-1]
    factors = {seq_len: est.calibration_for(seq_len) for seq_len in mc.sequence.buckets}
    assert est.calibration == factors[128]
    for seq_len, factor in factors.items():
        assert 1.0 < factor < 2.5, factors  # measured, not the untouched 1.0
        assert est.estimate(size, seq_len).activations == math.ceil(est.activation_peak(size, seq_len) * factor)
    assert factors[32] < factors[128], factors
