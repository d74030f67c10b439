"""The demo vibration model built by tools/build_demo_models.py.

Builds the model once into a temporary directory (a few seconds), then checks it with
onnxruntime independently of the numbers the build script reports.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

SCRIPT = Path(__file__).resolve().parent.parent / "tools" / "build_demo_models.py"
LABELS = ["normal", "imbalance", "misalignment", "bearing_fault"]


def _load_script():
    spec = importlib.util.spec_from_file_location("build_demo_models", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bdm():
    return _load_script()


@pytest.fixture(scope="module")
def build_steps() -> list[str]:
    return []


@pytest.fixture(scope="module")
def built(bdm, build_steps, tmp_path_factory):
    out = tmp_path_factory.mktemp("engines")
    metrics = bdm.build_vibration(out, seed=0, step=build_steps.append)
    return out, metrics


@pytest.fixture(scope="module")
def session(built):
    out, _ = built
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    return ort.InferenceSession(
        str(out / "vibration" / "model.onnx"), opts, providers=["CPUExecutionProvider"]
    )


def _run(session, x):
    probs, ids, score = session.run(
        ["class_probs", "class_id", "anomaly_score"], {"signal": np.asarray(x, dtype=np.float32)}
    )
    return probs, ids, score


def test_build_metrics(built):
    out, m = built
    assert {"accuracy", "max_abs_diff", "model_path"} <= set(m)
    assert Path(m["model_path"]) == out / "vibration" / "model.onnx"
    assert Path(m["model_path"]).is_file()
    assert m["accuracy"] >= 0.95
    assert m["max_abs_diff"] < 1e-4


def test_generate_shapes_and_determinism(bdm):
    x, y = bdm.generate(64, np.random.default_rng(7))
    assert x.shape == (64, 256) and x.dtype == np.float32
    assert y.shape == (64,) and y.dtype == np.int64
    assert set(np.unique(y)) == {0, 1, 2, 3}
    assert np.all(np.isfinite(x))
    x2, y2 = bdm.generate(64, np.random.default_rng(7))
    np.testing.assert_array_equal(x, x2)
    np.testing.assert_array_equal(y, y2)


def test_heldout_accuracy_measured_with_onnxruntime(bdm, session):
    # Fresh windows from a seed the build never used.
    x, y = bdm.generate(2000, np.random.default_rng(20240607))
    _, ids, _ = _run(session, x)
    accuracy = float((ids == y).mean())
    assert accuracy >= 0.95, f"held-out accuracy {accuracy:.3f}"
    for c in range(4):
        assert float((ids[y == c] == c).mean()) >= 0.9, f"class {LABELS[c]}"


def test_rows_are_independent_of_the_batch(bdm, session):
    x, _ = bdm.generate(8, np.random.default_rng(99))
    probs, ids, score = _run(session, x)
    for i in range(8):
        p1, i1, s1 = _run(session, x[i : i + 1])
        np.testing.assert_allclose(p1[0], probs[i], rtol=0, atol=1e-6)
        np.testing.assert_allclose(s1[0], score[i], rtol=0, atol=1e-6)
        assert i1[0] == ids[i]
    # The same rows inside a bigger, shuffled batch of other windows.
    others, _ = bdm.generate(24, np.random.default_rng(100))
    big = np.concatenate([others[:11], x, others[11:]])
    pb, ib, sb = _run(session, big)
    np.testing.assert_allclose(pb[11:19], probs, rtol=0, atol=1e-6)
    np.testing.assert_allclose(sb[11:19], score, rtol=0, atol=1e-6)
    np.testing.assert_array_equal(ib[11:19], ids)


def test_graph_interface(built, session):
    out, _ = built
    model = onnx.load(str(out / "vibration" / "model.onnx"))
    onnx.checker.check_model(model)
    assert model.ir_version <= 9
    assert {o.domain: o.version for o in model.opset_import}[""] <= 17

    (inp,) = session.get_inputs()
    assert inp.name == "signal" and inp.type == "tensor(float)"
    assert inp.shape[1] == 256 and isinstance(inp.shape[0], str)  # symbolic batch
    outputs = {o.name: o for o in session.get_outputs()}
    assert list(outputs) == ["class_probs", "class_id", "anomaly_score"]
    assert outputs["class_probs"].type == "tensor(float)"
    assert outputs["class_probs"].shape[1] == 4
    assert outputs["class_id"].type == "tensor(int64)" and len(outputs["class_id"].shape) == 1
    assert outputs["anomaly_score"].type == "tensor(float)"
    assert len(outputs["anomaly_score"].shape) == 1

    x = np.random.default_rng(3).normal(0, 0.5, size=(5, 256)).astype(np.float32)
    probs, ids, score = _run(session, x)
    assert probs.shape == (5, 4) and probs.dtype == np.float32
    assert ids.shape == (5,) and ids.dtype == np.int64
    assert score.shape == (5,) and score.dtype == np.float32
    np.testing.assert_allclose(probs.sum(axis=1), 1.0, atol=1e-5)
    np.testing.assert_array_equal(ids, probs.argmax(axis=1))
    np.testing.assert_allclose(score, 1.0 - probs[:, 0], atol=1e-6)


def test_model_toml(built):
    out, _ = built
    with open(out / "vibration" / "model.toml", "rb") as f:
        cfg = tomllib.load(f)
    assert cfg["backend"] == "onnxruntime"
    assert cfg["model_file"] == "model.onnx"
    assert (out / "vibration" / cfg["model_file"]).is_file()
    assert cfg["instances"] == 1
    assert cfg["labels"] == LABELS
    assert cfg["description"].startswith("Vibration fault classifier")
    assert cfg["onnxruntime"] == {
        "execution_providers": ["CPUExecutionProvider"],
        "intra_op_threads": 1,
    }
    assert cfg["batching"] == {
        "preferred_batch_sizes": [2, 4, 8],
        "max_queue_delay_ms": 2.0,
        "default_timeout_ms": 5000,
        "queue_capacity": 1024,
    }
    text = (out / "vibration" / "model.toml").read_text()
    assert text.startswith("# Demo sensor model built by tools/build_demo_models.py")


def test_sample_request(built, session):
    out, m = built
    request = json.loads((out / "vibration" / "sample_request.json").read_text())
    assert request["id"] == "demo-1"
    (tensor,) = request["inputs"]
    assert tensor["name"] == "signal"
    assert tensor["shape"] == [2, 256]
    assert tensor["datatype"] == "FP32"
    data = tensor["data"]
    assert len(data) == 512 and all(isinstance(v, (int, float)) for v in data)
    assert all(round(v, 5) == v for v in data)
    assert m["sample_classes"] == ["bearing_fault", "normal"]
    _, ids, score = _run(session, np.asarray(data, dtype=np.float32).reshape(2, 256))
    assert [LABELS[i] for i in ids] == ["bearing_fault", "normal"]
    assert score[0] > 0.5 > score[1]


def test_build_announces_as_many_steps_as_its_progress_counts(bdm, built, build_steps):
    assert len(build_steps) == bdm.BUILD_STEPS and all(build_steps)


def test_cli_skips_when_up_to_date(bdm, built, capsys):
    out, _ = built
    model_path = out / "vibration" / "model.onnx"
    before = model_path.stat().st_mtime_ns
    assert bdm.main(["--out", str(out), "--model", "vibration"]) == 0
    assert "skipped" in capsys.readouterr().out
    assert model_path.stat().st_mtime_ns == before


def test_build_is_deterministic(bdm, built, tmp_path):
    out, _ = built
    bdm.build_vibration(tmp_path, seed=0)
    for name in ("model.onnx", "model.toml", "sample_request.json"):
        assert (tmp_path / "vibration" / name).read_bytes() == (out / "vibration" / name).read_bytes(), name
