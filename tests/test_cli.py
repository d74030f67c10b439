"""The command line against a real daemon: infer, models, and their errors."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np

from edge_batcher.client import Client


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edge_batcher.cli", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_infer_with_the_sample_request_prints_the_classes(daemon, model_repo):
    proc = cli("infer", "vibration", "--request", str(model_repo / "vibration" / "sample_request.json"),
               "--url", daemon.url, "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["class_id"] == [3, 0]  # the sample holds one bearing_fault window, then one normal one
    assert np.array(out["class_probs"]).shape == (2, 4)


def test_infer_with_npy_and_json_inputs(daemon, tmp_path):
    x = np.zeros((1, 256), np.float32)
    np.save(tmp_path / "x.npy", x)
    proc = cli("infer", "vibration", "--input", f"signal={tmp_path / 'x.npy'}", "--url", daemon.url)
    assert proc.returncode == 0, proc.stderr
    assert "class_id int64 [1]" in proc.stdout
    # Integers typed on the command line are cast to the model's FP32.
    proc = cli("infer", "seqsum", "--input", "x=[[1, 2, 3]]", "--url", daemon.url, "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["sum"] == [6.0]


def test_infer_errors_are_one_line_with_status(daemon):
    proc = cli("infer", "vibration", "--input", "signal=[[1.5, 2.5]]", "--url", daemon.url)
    assert proc.returncode == 1
    assert proc.stderr.strip().startswith("edge-batcher infer: 400:")
    assert "dimension 1 must be 256" in proc.stderr
    proc = cli("infer", "vibration", "--input", "signal=[[1]]", "--url", "unix:///nonexistent/eb.sock")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr


def test_infer_names_a_missing_or_float64_npy_file_and_the_fix(daemon, tmp_path):
    proc = cli("infer", "vibration", "--input", "signal=nope.npy", "--url", daemon.url)
    assert proc.returncode == 1 and proc.stderr.strip() == "edge-batcher infer: --input signal=nope.npy: no such file"
    np.save(tmp_path / "x64.npy", np.zeros((1, 256)))  # numpy's default: float64
    proc = cli("infer", "vibration", "--input", f"signal={tmp_path / 'x64.npy'}", "--url", daemon.url)
    assert proc.returncode == 1
    assert "holds float64 and the model takes FP32: save it as float32" in proc.stderr


def test_the_cli_explains_itself_instead_of_naming_a_missing_argument(model_repo):
    bare = cli()
    assert bare.returncode == 2 and "serve" in bare.stdout and "required" not in bare.stderr
    index = cli("index")
    assert index.returncode == 2 and "add" in index.stdout and "index_command" not in index.stdout + index.stderr
    assert "Run the daemon in the foreground" in cli("serve", "--help").stdout
    wrong = cli("serve", "--models", "vibration")
    assert wrong.returncode == 2 and "--models takes the model repository" in wrong.stderr
    assert "EDGE_BATCHER_MODELS_LOAD=vibration" in wrong.stderr
    model_dir = cli("serve", "--models", str(model_repo / "vibration"))
    assert model_dir.returncode == 2 and f"pass the repository above it (--models {model_repo})" in model_dir.stderr


def test_models_lists_inputs_and_outputs(daemon):
    proc = cli("models", "--url", daemon.url)
    assert proc.returncode == 0, proc.stderr
    assert "vibration  (onnxruntime_onnx, batch sizes [2, 4, 8])" in proc.stdout  # Triton's platform name
    assert "input  signal: FP32 [-1, 256]" in proc.stdout
    proc = cli("models", "--url", daemon.url, "--json")
    names = {m["name"] for m in json.loads(proc.stdout)}
    assert names == {"vibration", "seqsum", "faulty", "oomy"}


def test_python_client_binary_and_json_give_the_same_answer(daemon):
    x = np.random.default_rng(1).standard_normal((3, 256)).astype(np.float32)
    with daemon.client(binary=True) as binary, daemon.client(binary=False) as plain:
        a = binary.infer("vibration", {"signal": x}, outputs=["class_probs"])
        b = plain.infer("vibration", {"signal": x})
        meta = binary.model_metadata("vibration")
    assert list(a) == ["class_probs"]
    np.testing.assert_allclose(a["class_probs"], b["class_probs"], rtol=1e-6)
    assert meta["parameters"]["labels"] == ["normal", "imbalance", "misalignment", "bearing_fault"]
    assert Client("unix:///nonexistent.sock").live() is False
