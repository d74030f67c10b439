"""Triton's model repository extension through tritonclient (HTTP and gRPC), and `edge-batcher ps`:
an operator loads, replaces and unloads models of the running daemon without touching its files
or restarting it (issue 32)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading

import numpy as np
import pytest

from tests.support.daemon import DaemonProcess
from tests.support.models import ROOT
from tests.support.ports import free_port

httpclient = pytest.importorskip("tritonclient.http")
grpcclient = pytest.importorskip("tritonclient.grpc")
pytest.importorskip("grpc")
from tritonclient.utils import InferenceServerException  # noqa: E402

TOKEN = "repository-test-token"
HEADERS = {"Authorization": f"Bearer {TOKEN}"}
GRPC_HEADERS = {"authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def daemon(tmp_path, model_repo):
    repo = tmp_path / "engines"
    for name in ("vibration", "seqsum"):
        shutil.copytree(model_repo / name, repo / name)
    (tmp_path / "token").write_text(TOKEN + "\n")
    (tmp_path / "token").chmod(0o600)
    http, grpc_address = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    d = DaemonProcess(tmp_path / "d", f'[server]\nhttp = "{http}"\ntoken_file = "{tmp_path / "token"}"\n'
                                      f'grpc = ["{grpc_address}"]\n[models]\nload = ["vibration"]\n'
                                      # the process meter on any machine: on one with a GPU "auto" is
                                      # the GPU's probe, which measures only models on the GPU
                                      '[memory]\nprobe = "cpu"\n', repo=repo)
    d.http, d.grpc, d.repo = http, grpc_address, repo
    d.start().wait_ready()
    yield d
    d.stop()


def _seqsum(client, module, headers):
    inp = module.InferInput("x", [1, 3], "FP32")
    inp.set_data_from_numpy(np.array([[1, 2, 3]], np.float32))
    return client.infer("seqsum", [inp], headers=headers).as_numpy("sum")


def ps(d: DaemonProcess, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edge_batcher.cli", "ps", "--url", d.url, *args],
                          capture_output=True, text=True, timeout=60, env={"PYTHONPATH": str(ROOT)})


def test_load_use_and_unload_a_model_through_tritonclient(daemon):
    http = httpclient.InferenceServerClient(daemon.http)
    grpc = grpcclient.InferenceServerClient(daemon.grpc)
    assert not _known(http, "seqsum")  # in the repository, not loaded ([models] load)
    http.load_model("seqsum", headers=HEADERS)
    assert http.is_model_ready("seqsum", headers=HEADERS)
    assert _seqsum(http, httpclient, HEADERS).tolist() == [6.0]
    index = http.get_model_repository_index(headers=HEADERS)
    assert {m["name"]: m["state"] for m in index} == {"seqsum": "READY", "vibration": "READY"}

    listed = ps(daemon)
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    assert lines[0].split() == ["MODEL", "STATE", "INSTANCES", "SIZES", "MEMORY", "QUEUE", "BATCHES", "REQUESTS"]
    seqsum = next(line for line in lines if line.startswith("seqsum"))
    assert seqsum.split()[:4] == ["seqsum", "READY", "1", "2,4,8"] and "MiB (process)" in seqsum
    rows = {r["model"]: r for r in json.loads(ps(daemon, "--json").stdout)}
    assert rows["seqsum"]["requests"] == 1 and rows["seqsum"]["batches"] == 1 and rows["seqsum"]["queue"] == 0
    assert rows["vibration"]["memory_bytes"] >= 0 and rows["vibration"]["measured_by"] == "process"

    grpc.unload_model("seqsum", headers=GRPC_HEADERS)  # sends unload_dependents: false
    with pytest.raises(InferenceServerException, match="unknown model 'seqsum'"):
        _seqsum(http, httpclient, HEADERS)
    assert [m["name"] for m in http.get_model_repository_index(headers=HEADERS)] == ["vibration"]
    grpc.load_model("seqsum", headers=GRPC_HEADERS)
    assert _seqsum(grpc, grpcclient, GRPC_HEADERS).tolist() == [6.0]
    http.close(), grpc.close()


def _known(client, model: str) -> bool:
    try:
        client.get_model_metadata(model, headers=HEADERS)
        return True
    except InferenceServerException:
        return False


def test_a_model_replaced_while_it_serves_answers_every_request(daemon):
    """load_model on a loaded model reads it again; the old version answers until the new one is
    warm, then drains: no request is lost or refused meanwhile."""
    http = httpclient.InferenceServerClient(daemon.http, concurrency=8)
    toml = daemon.repo / "vibration" / "model.toml"
    toml.write_text(toml.read_text().replace("max_queue_delay_ms = 2.0", "max_queue_delay_ms = 3.0"))
    errors: list[BaseException] = []
    answered = [0]
    stop = threading.Event()

    def load() -> None:
        own = httpclient.InferenceServerClient(daemon.http)
        x = np.zeros((1, 256), np.float32)
        while not stop.is_set():
            inp = httpclient.InferInput("signal", [1, 256], "FP32")
            inp.set_data_from_numpy(x)
            try:
                own.infer("vibration", [inp], headers=HEADERS)
                answered[0] += 1
            except InferenceServerException as exc:
                errors.append(exc)
        own.close()

    threads = [threading.Thread(target=load) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        http.load_model("vibration", headers=HEADERS)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors, errors[:3]
    assert answered[0] > 0
    config = http.get_model_config("vibration", headers=HEADERS)
    assert config["dynamic_batching"]["max_queue_delay_microseconds"] == 3000  # the new version serves
    assert "model vibration reloaded through the API" in daemon.log_text()
    http.close()


def test_what_cannot_be_loaded_or_unloaded_is_a_clear_error(daemon):
    http = httpclient.InferenceServerClient(daemon.http)
    with pytest.raises(InferenceServerException, match="no model 'nope' in the repository"):
        http.load_model("nope", headers=HEADERS)
    with pytest.raises(InferenceServerException, match="parameters config are not supported"):
        http.load_model("seqsum", headers=HEADERS, config='{"max_batch_size": 4}')
    with pytest.raises(InferenceServerException, match="unknown model 'seqsum'"):
        http.unload_model("seqsum", headers=HEADERS)
    (daemon.repo / "broken").mkdir()
    (daemon.repo / "broken" / "model.toml").write_text('backend = "onnxruntime"\nmodel_file = "none.onnx"\n')
    with pytest.raises(InferenceServerException, match="failed to load 'broken'"):
        http.load_model("broken", headers=HEADERS)
    assert "WARNING edge_batcher.runtime: model broken: loading it through the API failed (not loaded): " \
        in daemon.log_text()
    assert http.is_server_ready(headers=HEADERS) and http.is_model_ready("vibration", headers=HEADERS)
    with pytest.raises(InferenceServerException, match="missing or invalid bearer token"):
        http.load_model("seqsum")  # the TCP API's token guards model control too
    http.close()
