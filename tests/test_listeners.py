"""Listener set-up mistakes (issue 31 rows 12 and 13), against the real `edge-batcher serve`: a
Unix socket path the system cannot bind stops start-up with one line naming it (the HTTP socket
and gRPC's), and permissions that open the API or the token to every local user are warned about."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from tests.support import rawhttp
from tests.support.models import ROOT


def serve(tmp_path, model_repo, config: str, socket) -> subprocess.CompletedProcess:
    path = tmp_path / "config.toml"
    path.write_text(config + '[models]\nload = ["vibration"]\nwarmup = false\n')
    return subprocess.run([sys.executable, "-m", "edge_batcher.cli", "serve", "--config", str(path),
                           "--models", str(model_repo), "--unix-socket", str(socket)],
                          capture_output=True, text=True, timeout=120)


def unix_cases(tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory")
    too_long = tmp_path / ("x" * 120) / "eb.sock"
    return {
        "http, too long": ("", too_long, ["[server] unix_socket", "longer than the 107"]),
        "http, no directory": ("", a_file / "run" / "eb.sock", ["[server] unix_socket", "cannot create the directory"]),
        "grpc, too long": (f'[server]\ngrpc = ["unix:{too_long}"]\n', tmp_path / "eb.sock",
                           ["[server] grpc", "longer than the 107"]),
        "grpc, no directory": (f'[server]\ngrpc = ["unix:{a_file / "run" / "g.sock"}"]\n', tmp_path / "eb2.sock",
                               ["[server] grpc", "cannot create the directory"]),
    }


@pytest.mark.parametrize("case", ["http, too long", "http, no directory", "grpc, too long", "grpc, no directory"])
def test_a_unix_socket_path_that_cannot_be_bound_is_one_line(tmp_path, model_repo, case):
    pytest.importorskip("grpc", reason="the grpc extra is not installed")
    config, socket, words = unix_cases(tmp_path)[case]
    proc = serve(tmp_path, model_repo, config, socket)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    line = next(line for line in proc.stderr.splitlines() if "configuration error" in line)
    assert all(w in line for w in words) and "None" not in line, line


def test_a_token_file_and_a_socket_open_to_every_user_are_warned_about(start_daemon, tmp_path):
    token = tmp_path / "token"
    token.write_text("secret\n")
    token.chmod(0o644)
    daemon = start_daemon(f'[server]\nsocket_mode = "0777"\ntoken_file = "{token}"\n')
    assert rawhttp.request(daemon.socket, "GET", "/v2/health/live") == (200, {"live": True})  # still serving
    warnings = [line for line in daemon.log_text().splitlines() if " WARNING " in line]
    assert any("token_file" in w and "0644" in w and "every local user can read" in w for w in warnings), warnings
    assert any("socket_mode" in w and "0777" in w and "every local user" in w for w in warnings), warnings


def _serve(tmp_path, model_repo, *extra: str, socket_path=None) -> tuple[subprocess.CompletedProcess, float]:
    token = tmp_path / "token"
    token.write_text("a-token-for-the-test\n")
    token.chmod(0o600)
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "edge_batcher.cli", "serve", "--models", str(model_repo),
                           "--unix-socket", str(socket_path or tmp_path / "eb.sock"), "--token-file", str(token),
                           *extra], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    return proc, time.monotonic() - t0


def test_a_port_in_use_fails_the_start_before_any_model_loads(tmp_path, model_repo):
    """Issue 32: it failed after every model had loaded and warmed up (4.3 s here; the whole
    load time of TensorRT engines on a Jetson, five times over with Restart=on-failure)."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        proc, seconds = _serve(tmp_path, model_repo, "--http", f"127.0.0.1:{port}")
    finally:
        taken.close()
    assert proc.returncode == 2, proc.stderr
    assert f"127.0.0.1:{port}" in proc.stderr and "in use" in proc.stderr.lower()
    assert "onnxruntime session" not in proc.stderr  # no model was loaded
    print(f"failed in {seconds:.2f} s")


def test_another_daemon_on_the_socket_fails_the_start_before_any_model_loads(start_daemon, tmp_path, model_repo):
    first = start_daemon("")
    proc, _ = _serve(tmp_path, model_repo, socket_path=first.socket)
    assert proc.returncode == 2, proc.stderr
    assert str(first.socket) in proc.stderr and "onnxruntime session" not in proc.stderr
    with first.client() as client:
        assert client.ready()  # the first one still serves
