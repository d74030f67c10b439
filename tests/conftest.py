"""Shared fixtures: a model repository built once per session, and real daemon processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from edge_batcher.client import Client
from tests.support.models import ROOT, build_repository


@pytest.fixture(scope="session")
def model_repo(tmp_path_factory) -> Path:
    return build_repository(tmp_path_factory.mktemp("engines"))


class DaemonProcess:
    """`edge-batcher serve` in a subprocess on a private Unix socket."""

    def __init__(self, tmp: Path, repo: Path, config_text: str = "", env: dict | None = None,
                 socket: Path | None = None):
        self.socket = socket or tmp / "eb.sock"
        self.config = tmp / "config.toml"
        self.config.write_text(config_text)
        self.log = tmp / "daemon.log"
        cmd = [sys.executable, "-m", "edge_batcher.cli", "serve", "--config", str(self.config),
               "--unix-socket", str(self.socket), "--models", str(repo)]
        full_env = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
        self._log_file = open(self.log, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log_file, stderr=subprocess.STDOUT, env=full_env)
        self.url = f"unix://{self.socket}"

    def wait_ready(self, timeout: float = 60.0) -> "DaemonProcess":
        deadline = time.monotonic() + timeout
        with Client(self.url, timeout=2.0) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"daemon exited with {self.proc.returncode}:\n{self.log.read_text()}")
                if client.ready():
                    return self
                time.sleep(0.05)
        raise RuntimeError(f"daemon not ready after {timeout} s:\n{self.log.read_text()}")

    def client(self, **kwargs) -> Client:
        return Client(self.url, **kwargs)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log_file.close()
        return self.proc.returncode

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


@pytest.fixture
def start_daemon(tmp_path, model_repo):
    started: list[DaemonProcess] = []

    def start(config_text: str = "", env: dict | None = None, repo: Path | None = None,
              socket: Path | None = None) -> DaemonProcess:
        home = tmp_path / f"d{len(started)}"
        home.mkdir()
        d = DaemonProcess(home, repo or model_repo, config_text, env, socket)
        started.append(d)
        return d.wait_ready()

    yield start
    for d in started:
        d.stop()


@pytest.fixture
def daemon(start_daemon) -> DaemonProcess:
    return start_daemon("[server]\nmax_body_bytes = 1048576\n")
