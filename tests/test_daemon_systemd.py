"""The daemon as a systemd service: notify protocol, watchdog, socket activation, SIGHUP reload.
Real processes, real datagram and stream sockets; systemd itself is played by the test."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from edge_batcher.client import Client, ClientError
from tests.support.models import ROOT


def serve_cmd(repo: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "edge_batcher.cli", "serve", "--models", str(repo), *extra]


def receive_all(sock: socket.socket, until: float) -> list[tuple[float, str]]:
    out = []
    while time.monotonic() < until:
        sock.settimeout(max(0.01, until - time.monotonic()))
        try:
            data = sock.recv(4096)
        except TimeoutError:
            break
        out.append((time.monotonic(), data.decode()))
    return out


def test_ready_only_when_serving_then_watchdog_then_stopping(tmp_path, model_repo):
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp_path / "notify.sock"))
    sock_path = tmp_path / "eb.sock"
    env = dict(os.environ, PYTHONPATH=str(ROOT), NOTIFY_SOCKET=str(tmp_path / "notify.sock"),
               WATCHDOG_USEC="400000", EDGE_BATCHER_MODELS_LOAD="vibration")
    proc = subprocess.Popen(serve_cmd(model_repo, "--unix-socket", str(sock_path)), env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        messages = []
        deadline = time.monotonic() + 60
        ready_at = None
        while time.monotonic() < deadline and ready_at is None:
            notify.settimeout(deadline - time.monotonic())
            text = notify.recv(4096).decode()
            messages.append(text)
            if "READY=1" in text:
                ready_at = time.monotonic()
                # READY comes after engines are warm and the socket listens: it serves right now.
                with Client(f"unix://{sock_path}") as client:
                    assert client.ready()
                    out = client.infer("vibration", {"signal": np.zeros((1, 256), np.float32)})
                    assert out["class_id"].shape == (1,)
        assert ready_at is not None, messages
        before_ready = "".join(messages[:-1])
        assert "EXTEND_TIMEOUT_USEC=300000000" in before_ready and "STATUS=loading model vibration" in before_ready
        # Watchdog pings at half of WATCHDOG_USEC (0.2 s), from the event loop.
        pings = [t for t, m in receive_all(notify, time.monotonic() + 1.3) if "WATCHDOG=1" in m]
        assert 4 <= len(pings) <= 9, pings
        gaps = np.diff(pings)
        assert 0.1 < float(np.median(gaps)) < 0.35, gaps
        proc.send_signal(signal.SIGTERM)
        tail = receive_all(notify, time.monotonic() + 10)
        assert any("STOPPING=1" in m for _, m in tail), tail
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        notify.close()


def test_socket_activation_serves_on_the_socket_systemd_passes(tmp_path, model_repo):
    path = tmp_path / "activated.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(16)
    fd = listener.fileno()
    # bash puts our socket on fd 3 and sets LISTEN_PID to its own pid, which exec keeps.
    script = f'exec 3<&{fd}; exec {fd}<&-; export LISTEN_PID=$$ LISTEN_FDS=1; exec "$@"'
    env = dict(os.environ, PYTHONPATH=str(ROOT), EDGE_BATCHER_MODELS_LOAD="vibration")
    serve = serve_cmd(model_repo, "--unix-socket", str(tmp_path / "unused.sock"))
    proc = subprocess.Popen(["bash", "-c", script, "bash", *serve],
                            env=env, pass_fds=[fd], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    listener.close()  # the daemon holds it now
    try:
        with Client(f"unix://{path}") as client:
            for _ in range(600):
                if client.ready():
                    break
                time.sleep(0.05)
            out = client.infer("vibration", {"signal": np.zeros((2, 256), np.float32)})
        assert out["class_id"].shape == (2,)
        assert not (tmp_path / "unused.sock").exists()  # it did not bind a socket of its own
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert path.exists()  # the socket file belongs to systemd's socket unit: left alone
    finally:
        if proc.poll() is None:
            proc.kill()


def test_sighup_adds_changes_and_removes_models_without_dropping_others(start_daemon, model_repo, tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copytree(model_repo / "vibration", repo / "vibration")
    shutil.copytree(model_repo / "faulty", repo / "faulty")
    d = start_daemon(repo=repo)
    errors: list[BaseException] = []
    answered = [0]
    stop = threading.Event()

    def steady_load() -> None:
        with d.client() as client:
            x = np.random.default_rng(0).standard_normal((1, 256)).astype(np.float32)
            while not stop.is_set():
                try:
                    client.infer("vibration", {"signal": x})
                    answered[0] += 1
                except BaseException as exc:  # noqa: BLE001 - every failure counts
                    errors.append(exc)

    load = threading.Thread(target=steady_load)
    load.start()
    try:
        shutil.copytree(model_repo / "seqsum", repo / "seqsum")  # added
        shutil.rmtree(repo / "faulty")  # removed
        d.proc.send_signal(signal.SIGHUP)
        with d.client() as client:
            for _ in range(400):
                names = {m["name"] for m in client.models()}
                if names == {"vibration", "seqsum"}:
                    break
                time.sleep(0.05)
            assert names == {"vibration", "seqsum"}
            assert client.infer("seqsum", {"x": np.ones((1, 5), np.float32)})["sum"].tolist() == [5.0]
            try:
                client.infer("faulty", {"signal": np.zeros((1, 256), np.float32)})
                raise AssertionError("a removed model still answered")
            except ClientError as exc:
                assert exc.status == 404
        # Changed: a new model.toml for vibration (another queue delay) is picked up.
        toml = repo / "vibration" / "model.toml"
        toml.write_text(toml.read_text().replace("max_queue_delay_ms = 2.0", "max_queue_delay_ms = 3.0"))
        d.proc.send_signal(signal.SIGHUP)
        with d.client() as client:
            for _ in range(400):
                delay = client.model_metadata("vibration")["parameters"]["max_queue_delay_ms"]
                if delay == 3.0:
                    break
                time.sleep(0.05)
            assert delay == 3.0
    finally:
        stop.set()
        load.join()
    assert not errors, errors[:3]
    assert answered[0] > 5
    log = d.log_text()
    assert "reload: added ['seqsum'], removed ['faulty']" in log
    # Logged once the old version has drained, after the new one already answers the metadata above.
    assert d.log_lines_with("reload: changed ['vibration']", within_s=30)


def test_status_line_names_models_queue_mqtt_and_peers(tmp_path, model_repo):
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp_path / "notify.sock"))
    config = tmp_path / "config.toml"
    # A peer nobody listens on (loopback port 1): it is configured but not usable.
    config.write_text('[models]\nload = ["vibration"]\n[offload]\nenabled = true\n'
                      '[[offload.peers]]\nname = "nobody"\nurl = "http://127.0.0.1:1"\n')
    env = dict(os.environ, PYTHONPATH=str(ROOT), NOTIFY_SOCKET=str(tmp_path / "notify.sock"))
    proc = subprocess.Popen(serve_cmd(model_repo, "--config", str(config), "--unix-socket", str(tmp_path / "s.sock")),
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        ready = []
        while not ready and time.monotonic() < deadline:
            notify.settimeout(deadline - time.monotonic())
            text = notify.recv(4096).decode()
            if "READY=1" in text:
                ready.append(text)
        assert ready, "no READY=1"
        assert "STATUS=1 model(s), 0 queued, mqtt disabled, peers 0/1 usable" in ready[0]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        notify.close()
