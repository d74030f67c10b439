"""A newcomer's first commands: no daemon yet, --version, where the socket is, --http without a
token, index add on a missing file, labels in `infer`. Real sockets, real daemons, real CLI."""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import time
from importlib.metadata import version

import numpy as np
import pytest

from edge_batcher.client import AsyncClient, Client, ClientError, DaemonUnreachable
from tests.support.models import ROOT
from tests.support.ports import free_port


def cli(*args: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edge_batcher.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, PYTHONPATH=str(ROOT), **(env or {})))


# ------------------------------------------------------------------ no daemon: ClientError naming the address


def test_missing_socket_is_a_client_error_naming_it_and_the_fix(tmp_path):
    url = f"unix://{tmp_path}/eb.sock"
    with Client(url) as client, pytest.raises(ClientError) as info:
        client.models()
    err = info.value
    assert isinstance(err, DaemonUnreachable) and isinstance(err.reason, FileNotFoundError)
    assert err.status == 0 and err.address == url
    assert str(err).startswith(f"no daemon at {url}: the socket does not exist; start it (`edge-batcher serve`")
    assert "edge-batcher config" in str(err)


def test_stale_socket_and_closed_port_are_client_errors(tmp_path):
    stale = tmp_path / "stale.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(stale))  # bound, never listening: what a killed daemon leaves behind
        with Client(f"unix://{stale}") as client, pytest.raises(DaemonUnreachable, match="nothing accepts on it"):
            client.model_metadata("vibration")
    url = f"http://127.0.0.1:{free_port()}"
    with Client(url) as client:
        with pytest.raises(DaemonUnreachable, match=f"no daemon at {url}: connection refused"):
            client.infer("vibration", {"signal": np.zeros((1, 256), np.float32)})
        assert client.live() is False  # health checks still answer False instead of raising


def test_async_client_raises_the_same_error(tmp_path):
    url = f"unix://{tmp_path}/eb.sock"

    async def main():
        async with AsyncClient(url) as client:
            assert await client.ready() is False
            await client.models()

    with pytest.raises(DaemonUnreachable, match=f"no daemon at {url}: the socket does not exist"):
        asyncio.run(main())


def test_cli_without_a_daemon_says_where_it_looked(tmp_path):
    url = f"unix://{tmp_path}/eb.sock"
    for command in (["models"], ["infer", "vibration", "--input", "signal=[[1]]"]):
        proc = cli(*command, "--url", url)
        assert proc.returncode == 1
        assert proc.stderr.startswith(f"edge-batcher {command[0]}: no daemon at {url}: the socket does not exist")
        assert "Traceback" not in proc.stderr and "Errno" not in proc.stderr


# ------------------------------------------------------------------ --version, config


def test_version():
    proc = cli("--version")
    assert proc.returncode == 0
    assert proc.stdout.strip() == f"edge-batcher {version('edge-batcher')}"


def test_config_prints_the_socket_a_daemon_with_the_same_settings_uses(tmp_path, model_repo):
    env = {"XDG_RUNTIME_DIR": str(tmp_path)}
    proc = cli("config", "--models", str(model_repo), "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    settings = json.loads(proc.stdout)
    assert settings["unix_socket"] == f"{tmp_path}/edge-batcher/edge-batcher.sock"
    assert settings["models_repository"] == str(model_repo)
    assert "vibration" in settings["models_found"]
    assert settings["version"] == version("edge-batcher")

    serve = subprocess.Popen([sys.executable, "-m", "edge_batcher.cli", "serve", "--models", str(model_repo)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             env=dict(os.environ, PYTHONPATH=str(ROOT), **env))
    try:
        with Client(f"unix://{settings['unix_socket']}") as client:
            deadline = time.monotonic() + 60
            while not client.ready():
                assert serve.poll() is None and time.monotonic() < deadline
                time.sleep(0.05)
        proc = cli("models", env=env)  # no --url: the same rule finds the same socket
        assert proc.returncode == 0, proc.stderr
        assert "vibration  (onnxruntime" in proc.stdout
    finally:
        serve.terminate()
        serve.wait(timeout=30)
    text = cli("config", "--models", str(model_repo), env=env).stdout
    assert re.search(rf"^unix_socket +{re.escape(settings['unix_socket'])}$", text, re.M)
    # --socket: the path alone, for curl --unix-socket (no service socket exists here).
    assert cli("config", "--socket", env=env).stdout == settings["unix_socket"] + "\n"


def test_config_prints_every_setting_and_where_it_came_from(model_repo):
    env = {"EDGE_BATCHER_SERVER_DRAIN_TIMEOUT_S": "3", "EDGE_BATCHER_SERVER_TOKEN": "secret-value"}
    proc = cli("config", "--models", str(model_repo), "--log-level", "debug", env=env)
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    origin = r"\(environment EDGE_BATCHER_SERVER_DRAIN_TIMEOUT_S\)"
    assert re.search(rf"^  server.drain_timeout_s +3.0  {origin}$", text, re.M)
    assert re.search(r'^  server.log_level +"DEBUG"  \(--log-level\)$', text, re.M)
    assert re.search(r'^  server.loop_cpu +"auto"  \(default\)$', text, re.M)
    assert re.search(r'^  server.token +"\(set\)"', text, re.M) and "secret-value" not in text
    settings = json.loads(cli("config", "--models", str(model_repo), "--json", env=env).stdout)["settings"]
    assert settings["models.repository"] == {"value": str(model_repo), "from": "--models"}
    typo = cli("config", env={"EDGE_BATCHER_SERVER_DRAIN_TIMOUT_S": "3"})
    assert typo.returncode == 2 and "did you mean EDGE_BATCHER_SERVER_DRAIN_TIMEOUT_S?" in typo.stderr


# ------------------------------------------------------------------ --http and its token


def test_http_without_a_token_fails_before_any_model_loads(model_repo):
    started = time.monotonic()
    proc = cli("serve", "--models", str(model_repo), "--http", f"127.0.0.1:{free_port()}")
    assert proc.returncode == 2
    assert "needs a bearer token: pass --token-file FILE" in proc.stderr
    assert "loading" not in proc.stderr.lower()  # nothing was loaded or warmed
    assert time.monotonic() - started < 30
    proc = cli("serve", "--models", str(model_repo), "--http", "127.0.0.1:1", "--token-file", "/nonexistent/token")
    assert proc.returncode == 2 and "cannot read /nonexistent/token" in proc.stderr


def test_token_file_protects_the_tcp_listener(tmp_path, model_repo):
    token = tmp_path / "token"
    token.write_text("s3cret-token\n")
    port = free_port()
    sock = tmp_path / "eb.sock"
    serve = subprocess.Popen([sys.executable, "-m", "edge_batcher.cli", "serve", "--models", str(model_repo),
                              "--unix-socket", str(sock), "--http", f"127.0.0.1:{port}", "--token-file", str(token)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             env=dict(os.environ, PYTHONPATH=str(ROOT)))
    try:
        with Client(f"unix://{sock}") as local:
            deadline = time.monotonic() + 60
            while not local.ready():
                assert serve.poll() is None and time.monotonic() < deadline
                time.sleep(0.05)
        with Client(f"http://127.0.0.1:{port}", token="s3cret-token") as client:
            assert "vibration" in {m["name"] for m in client.models()}
        with Client(f"http://127.0.0.1:{port}") as client, pytest.raises(ClientError) as info:
            client.models()
        assert info.value.status == 401
    finally:
        serve.terminate()
        serve.wait(timeout=30)


# ------------------------------------------------------------------ index add, infer labels


def test_index_add_on_a_missing_file_names_it(tmp_path):
    proc = cli("index", "add", str(tmp_path / "manual.md"), "--index", str(tmp_path / "index"))
    assert proc.returncode == 2  # a usage error, as the CLI's others
    assert proc.stderr.strip() == (
        f"edge-batcher index add: no such file: {tmp_path / 'manual.md'} (nothing was indexed)")
    assert not (tmp_path / "index").exists()
    proc = cli("index", "info", "--index", str(tmp_path / "index"))
    assert proc.returncode == 2 and "build one with `edge-batcher index add FILE...`" in proc.stderr
    assert "configuration error" not in proc.stderr


def test_infer_prints_the_models_labels(daemon, model_repo):
    request = str(model_repo / "vibration" / "sample_request.json")
    proc = cli("infer", "vibration", "--request", request, "--url", daemon.url)
    assert proc.returncode == 0, proc.stderr
    assert "class_id int64 [2]:\n[3 0]\n  labels: bearing_fault, normal\n" in proc.stdout
    out = json.loads(cli("infer", "vibration", "--request", request, "--url", daemon.url, "--json").stdout)
    assert out["class_id"] == [3, 0] and out["labels"] == {"class_id": ["bearing_fault", "normal"]}
    # A model without labels prints no labels line.
    proc = cli("infer", "seqsum", "--input", "x=[[1, 2]]", "--url", daemon.url)
    assert proc.returncode == 0 and "labels" not in proc.stdout
