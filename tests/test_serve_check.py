"""`edge-batcher serve --check` (edge_batcher/preflight.py): every problem that would stop the
start is listed, without loading a model, and nothing is left behind."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def check(tmp_path: Path, repo: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "edge_batcher.cli", "serve", "--check", "--unix-socket", str(tmp_path / "s.sock"),
         "--models", str(repo), *args],
        capture_output=True, text=True, timeout=60, cwd=ROOT, env={**os.environ, **(env or {})},
    )


def varint(value: int) -> bytes:
    """protobuf's base-128 encoding of a length."""
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def vibration_only(model_repo: Path, tmp_path: Path) -> Path:
    repo = tmp_path / "engines"
    shutil.copytree(model_repo / "vibration", repo / "vibration")
    return repo


def test_a_startable_config_passes_and_leaves_no_socket_behind(model_repo, tmp_path):
    proc = check(tmp_path, vibration_only(model_repo, tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"ok    listeners        can bind unix://{tmp_path / 's.sock'}" in proc.stdout
    assert "ok    model vibration  onnxruntime, model.onnx" in proc.stdout
    assert "ok    memory" in proc.stdout and "nothing found that would stop the start" in proc.stdout
    assert not (tmp_path / "s.sock").exists()
    assert "model vibration loaded" not in proc.stderr  # checked, never loaded


def test_every_problem_is_listed_and_the_exit_status_is_2(model_repo, tmp_path):
    repo = vibration_only(model_repo, tmp_path)
    shutil.copytree(repo / "vibration", repo / "empty")
    (repo / "empty" / "model.onnx").write_bytes(b"")
    # big: the real model and a 60 MiB doc_string field (a sparse file, read only for its size)
    shutil.copytree(repo / "vibration", repo / "big")
    with (repo / "big" / "model.onnx").open("ab") as f:
        f.write(b"\x32" + varint(60 << 20))  # field 6 (doc_string), length-delimited
        f.truncate(f.tell() + (60 << 20))
    shutil.copytree(repo / "vibration", repo / "cut")  # a copy cut short
    whole = (repo / "vibration" / "model.onnx").read_bytes()
    (repo / "cut" / "model.onnx").write_bytes(whole[:len(whole) // 2])
    shutil.copytree(repo / "vibration", repo / "page")  # what a failed download leaves
    (repo / "page" / "model.onnx").write_text("<!DOCTYPE html><html><body>404 Not Found</body></html>\n")
    shutil.copytree(repo / "vibration", repo / "nofile")
    (repo / "nofile" / "model.onnx").unlink()
    shutil.copytree(repo / "vibration", repo / "wrong")
    (repo / "wrong" / "model.toml").write_text('backend = "no_such_module:Engine"\n')
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    token.chmod(0o600)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = check(tmp_path, repo, "--http", f"127.0.0.1:{port}", "--token-file", str(token),
                     env={"EDGE_BATCHER_MEMORY_PROBE": "cpu", "EDGE_BATCHER_MEMORY_BUDGET_MB": "100"})
    out = proc.stdout
    assert proc.returncode == 2, out + proc.stderr
    assert f"FAIL  listeners        cannot listen on 127.0.0.1:{port}: Address already in use" in out
    assert f"FAIL  model empty      its model file {repo / 'empty' / 'model.onnx'} is empty" in out
    assert f"FAIL  model nofile     cannot read its model file {repo / 'nofile' / 'model.onnx'}: " \
           "No such file or directory" in out
    assert "FAIL  model wrong" in out and "no_such_module" in out
    # 60 MiB and the real model: about 121 MiB at its load's peak, more than the budget's 100 MiB
    assert "FAIL  memory" in out and "the start would refuse big (its load needs 121 MiB" in out
    assert f"FAIL  model cut        its model file {repo / 'cut' / 'model.onnx'} is not a whole ONNX model: " \
           "the graph at byte " in out and "a copy cut short?" in out
    assert f"FAIL  model page       its model file {repo / 'page' / 'model.onnx'} is not a whole ONNX model: " \
           "byte 0 holds a protobuf wire type 4 that ONNX never uses: not an ONNX model" in out
    assert "ok    model vibration" in out and "ok    model big" in out
    assert "7 problem(s): the daemon would not start" in out
    assert "Traceback" not in proc.stderr


def test_a_live_daemon_s_socket_is_reported_and_left_alone(model_repo, tmp_path):
    path = tmp_path / "s.sock"
    with socket.socket(socket.AF_UNIX) as live:
        live.bind(str(path))
        live.listen()
        proc = check(tmp_path, vibration_only(model_repo, tmp_path))
        assert proc.returncode == 2
        assert f"FAIL  listeners        another process is serving on {path}" in proc.stdout
        assert path.exists()


def test_a_service_naming_a_model_not_loaded_is_reported(model_repo, tmp_path):
    repo = vibration_only(model_repo, tmp_path)
    (repo / "ask").mkdir()
    (repo / "ask" / "model.toml").write_text('backend = "rag"\n[rag]\nembedding_model = "minilm"\n')
    proc = check(tmp_path, repo)
    assert proc.returncode == 2
    assert "FAIL  model ask        rag service: uses 'minilm', which this daemon does not load" in proc.stdout


def test_a_live_socket_at_a_grpc_unix_address_is_not_replaced(model_repo, tmp_path):
    path = tmp_path / "grpc.sock"
    with socket.socket(socket.AF_UNIX) as live:
        live.bind(str(path))
        live.listen()
        proc = check(tmp_path, vibration_only(model_repo, tmp_path), "--grpc", f"unix:{path}")
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert f"FAIL  listeners        [server] grpc: another process is serving on {path}; stop it or " \
               "choose another [server] grpc address" in proc.stdout
        assert path.exists()
    # and once nothing serves there, the stale file is replaced (and the check removes its own)
    proc = check(tmp_path, vibration_only(model_repo, tmp_path / "again"), "--grpc", f"unix:{path}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"grpc unix:{path}" in proc.stdout
    assert not path.exists()


def test_a_remote_model_without_offload_is_reported(model_repo, tmp_path):
    repo = vibration_only(model_repo, tmp_path)
    shutil.copytree(repo / "vibration", repo / "far")
    toml = repo / "far" / "model.toml"
    toml.write_text('backend = "remote"\n' + toml.read_text().replace('backend = "onnxruntime"\n', ""))
    proc = check(tmp_path, repo)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "FAIL  model far" in proc.stdout and "[offload] must be enabled" in proc.stdout
