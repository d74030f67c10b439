"""The vision demo model built by tools/build_vision_model.py: the model on its own (a real
onnxruntime session on the built file, frames the build never saw) and served by a real daemon
over HTTP on its Unix socket (batches of 2, 4 and 8 frames, the binary tensor extension, and 400
for the wrong datatype or frame size). The model is built once into a temporary directory."""

from __future__ import annotations

import importlib.util
import json
import random
import sys
import threading
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from edge_batcher.client import ClientError
from tests.support import rawhttp

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

SCRIPT = Path(__file__).resolve().parent.parent / "tools" / "build_vision_model.py"
LABELS = ["off", "green", "amber", "red"]


@pytest.fixture(scope="module")
def bvm():
    spec = importlib.util.spec_from_file_location("build_vision_model", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def built(bvm, tmp_path_factory):
    out = tmp_path_factory.mktemp("vision_engines")
    steps: list[str] = []
    metrics = bvm.build_vision(out, seed=0, step=steps.append)
    return out, metrics, steps


@pytest.fixture(scope="module")
def session(built):
    out, _, _ = built
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    return ort.InferenceSession(str(out / "vision" / "model.onnx"), opts, providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module")
def fresh(bvm):
    """Frames from a seed the build never used: 24 per class."""
    return bvm.generate(96, np.random.default_rng(20261126), bvm.noise_field(7))


def _run(session, frames):
    probs, label = session.run(["probabilities", "label"], {"frames": frames})
    return probs, label


def test_build_reports_accuracy_and_agreement_with_numpy(bvm, built):
    out, m, steps = built
    assert Path(m["model_path"]) == out / "vision" / "model.onnx"
    assert m["accuracy"] >= bvm.MIN_ACCURACY
    assert min(m["per_class_accuracy"].values()) >= 0.85, m["per_class_accuracy"]
    assert m["max_abs_diff"] < bvm.MAX_ABS_DIFF
    assert len(steps) == bvm.BUILD_STEPS and all(steps)


def test_frames_the_build_never_saw_are_classified(session, fresh):
    frames, y = fresh
    assert frames.shape == (96, 480, 640, 3) and frames.dtype == np.uint8
    labels = np.concatenate([_run(session, frames[i : i + 8])[1] for i in range(0, 96, 8)])
    accuracy = float((labels == y).mean())
    assert accuracy >= 0.9, f"accuracy {accuracy:.3f} on frames of an unseen seed"
    for c, name in enumerate(LABELS):
        assert float((labels[y == c] == c).mean()) >= 0.75, name


def test_generation_is_deterministic_and_frames_vary(bvm):
    a, ya = bvm.generate(4, np.random.default_rng(5), bvm.noise_field(0))
    b, yb = bvm.generate(4, np.random.default_rng(5), bvm.noise_field(0))
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(ya, yb)
    assert sorted(ya.tolist()) == [0, 1, 2, 3]
    assert len({f.tobytes() for f in a}) == 4 and all(f.std() > 5 for f in a)


def test_numpy_reference_matches_onnxruntime(bvm, built, session, fresh):
    _, m, _ = built
    frames = fresh[0][:8]
    probs, labels = _run(session, frames)
    assert probs.shape == (8, 4) and probs.dtype == np.float32
    assert labels.shape == (8,) and labels.dtype == np.int64
    np.testing.assert_allclose(probs.sum(axis=1), 1.0, atol=1e-5)
    np.testing.assert_array_equal(labels, probs.argmax(axis=1))
    ref = bvm.forward(frames, m["params"])
    np.testing.assert_allclose(ref["probabilities"], probs, rtol=0, atol=bvm.MAX_ABS_DIFF)
    np.testing.assert_array_equal(ref["label"], labels)


def test_a_frame_s_result_does_not_depend_on_its_batch(session, fresh):
    frames = fresh[0][:8]
    probs, labels = _run(session, frames)
    for i in (0, 5):
        p1, l1 = _run(session, frames[i : i + 1])
        np.testing.assert_allclose(p1[0], probs[i], rtol=0, atol=1e-6)
        assert l1[0] == labels[i]


def test_graph_interface(built, session):
    out, _, _ = built
    model = onnx.load(str(out / "vision" / "model.onnx"))
    onnx.checker.check_model(model)
    assert {o.domain: o.version for o in model.opset_import}[""] <= 17
    ops = {n.op_type for n in model.graph.node}
    assert {"Cast", "Conv", "MatMul", "Softmax"} <= ops  # preprocessing in the graph, a CNN
    downsampling = [n for n in model.graph.node if n.name.startswith("preprocess/sum_")]
    assert [n.op_type for n in downsampling] == ["MatMul", "MatMul"]  # rows, then columns: GEMMs, not a ReduceMean
    (inp,) = session.get_inputs()
    assert inp.name == "frames" and inp.type == "tensor(uint8)"
    assert inp.shape[1:] == [480, 640, 3] and isinstance(inp.shape[0], str)  # symbolic batch
    outputs = {o.name: o for o in session.get_outputs()}
    assert list(outputs) == ["probabilities", "label"]
    assert outputs["probabilities"].type == "tensor(float)" and outputs["probabilities"].shape[1] == 4
    assert outputs["label"].type == "tensor(int64)" and len(outputs["label"].shape) == 1


def test_model_toml_and_sample_frames(built, session):
    out, _, _ = built
    with open(out / "vision" / "model.toml", "rb") as f:
        cfg = tomllib.load(f)
    assert cfg["backend"] == "onnxruntime" and cfg["model_file"] == "model.onnx"
    assert cfg["labels"] == LABELS
    assert cfg["onnxruntime"]["execution_providers"] == ["CPUExecutionProvider"]
    assert cfg["batching"]["preferred_batch_sizes"] == [2, 4, 8]
    sample = np.load(out / "vision" / "sample_frames.npy")
    assert sample.shape == (2, 480, 640, 3) and sample.dtype == np.uint8
    assert [LABELS[i] for i in _run(session, sample)[1]] == ["red", "off"]


def test_the_build_is_skipped_when_fresh(bvm, built, capsys):
    out, _, _ = built
    model = out / "vision" / "model.onnx"
    before = model.stat().st_mtime_ns
    assert bvm.main(["--out", str(out)]) == 0
    assert "skipped" in capsys.readouterr().out and model.stat().st_mtime_ns == before


# -- served by a real daemon ------------------------------------------------------------------


@pytest.fixture(scope="module")
def vision_repo(built) -> Path:
    return built[0]


@pytest.fixture
def vision_daemon(start_daemon, vision_repo):
    return start_daemon("[server]\nmax_body_bytes = 16777216\n", repo=vision_repo)


def test_batches_of_2_4_8_through_the_daemon_give_the_direct_labels(vision_daemon, session, fresh):
    frames = fresh[0][:8]
    _, direct = _run(session, frames)
    with vision_daemon.client() as client:
        meta = client.model_metadata("vision")
        assert meta["inputs"][0]["datatype"] == "UINT8" and meta["inputs"][0]["shape"][1:] == [480, 640, 3]
        assert meta["parameters"]["labels"] == LABELS
        for n in (2, 4, 8):
            out = client.infer("vision", {"frames": frames[:n]})
            np.testing.assert_array_equal(out["label"], direct[:n])
            assert out["probabilities"].shape == (n, 4)

    # Eight one-frame requests at once: the scheduler batches them; each gets its own frame's label.
    got: dict[int, int] = {}

    def one(i: int) -> None:
        with vision_daemon.client() as c:
            got[i] = int(c.infer("vision", {"frames": frames[i : i + 1]})["label"][0])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [got[i] for i in range(8)] == direct.tolist()
    with vision_daemon.client() as client:
        stats = client.stats("vision")["model_stats"][0]
    sizes = {int(b["batch_size"]) for b in stats["batch_stats"]}
    assert sizes <= {2, 4, 8}, sizes  # one-frame requests ran padded or batched, never alone
    assert stats["inference_count"] >= 2 + 4 + 8 + 8


def test_wrong_datatype_or_frame_size_is_answered_400(vision_daemon, fresh):
    frames = fresh[0][:2]
    with vision_daemon.client() as client:
        with pytest.raises(ClientError) as wrong_dtype:
            client.infer("vision", {"frames": frames.astype(np.float32)})
        with pytest.raises(ClientError) as wrong_size:
            client.infer("vision", {"frames": frames[:, :240, :320]})
        with pytest.raises(ClientError) as channels_first:
            client.infer("vision", {"frames": np.ascontiguousarray(frames.transpose(0, 3, 1, 2))})
    assert wrong_dtype.value.status == 400, wrong_dtype.value.message
    assert "datatype FP32" in wrong_dtype.value.message and "expects UINT8" in wrong_dtype.value.message
    assert wrong_size.value.status == 400 and "[2, 240, 320, 3]" in wrong_size.value.message, wrong_size.value.message
    assert channels_first.value.status == 400 and "dimension 1 must be 480" in channels_first.value.message
    # A JSON request with too few values for its shape: 400, and the daemon goes on serving.
    body = json.dumps({"inputs": [{"name": "frames", "shape": [1, 480, 640, 3], "datatype": "UINT8",
                                   "data": [0] * 10}]}).encode()
    status, answer = rawhttp.request(vision_daemon.socket, "POST", "/v2/models/vision/infer", body)
    assert status == 400 and "error" in answer, answer
    with vision_daemon.client() as client:
        assert client.infer("vision", {"frames": frames})["label"].shape == (2,)


def test_memory_soak_sends_frames_as_binary_tensors_the_daemon_accepts(vision_daemon):
    """tools/memory_soak.py's traffic for a camera model (as gpu_selftest --soak sends it to the
    default repository): binary tensors, answered 200, up to 8 frames per request."""
    memory_soak = sys.modules.get("memory_soak")  # tests/memory loads it under that name too
    if memory_soak is None:
        spec = importlib.util.spec_from_file_location("memory_soak", SCRIPT.parent / "memory_soak.py")
        memory_soak = importlib.util.module_from_spec(spec)
        sys.modules["memory_soak"] = memory_soak  # its dataclasses look their module up there
        spec.loader.exec_module(memory_soak)
    with vision_daemon.client() as client:
        inputs = client.model_metadata("vision")["inputs"]
    traffic = memory_soak.ModelTraffic("vision", inputs, max_rows=8, max_length=0, max_words=100)
    assert traffic.large
    rng = random.Random(0)
    for _ in range(3):
        body, headers = traffic.request(rng)
        assert "Inference-Header-Content-Length" in headers and len(body) < 8 * 921_600 + 4096
        status, answer = rawhttp.request(vision_daemon.socket, "POST", "/v2/models/vision/infer", body, headers)
        assert status == 200, answer
        assert {o["name"] for o in answer["outputs"]} == {"probabilities", "label"}
