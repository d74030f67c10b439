"""`edge-batcher serve` in a subprocess on a private Unix socket, for end-to-end tests."""

from __future__ import annotations

import json
import os
import resource
import signal
import socket as socketlib
import subprocess
import sys
import time
from pathlib import Path

import pytest

from edge_batcher.client import Client
from tests.support.models import ROOT


def allow_descriptors(n: int) -> None:
    """Let this test process open `n` descriptors (a flood's client side), or skip the test."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < n:
        if hard != resource.RLIM_INFINITY and hard < n:
            pytest.skip(f"this test process may open {hard} descriptors, needs {n}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (n, hard))


def require_listen_queue(n: int) -> None:
    """Skip unless the kernel lets a listening socket queue `n` connections (net.core.somaxconn)."""
    with open("/proc/sys/net/core/somaxconn") as f:
        somaxconn = int(f.read())
    if somaxconn < n:
        pytest.skip(f"net.core.somaxconn is {somaxconn}: the kernel queues fewer than {n} connections")


class DaemonProcess:
    """One daemon: its config file, socket and log live in `home`. start() may be called again
    after stop() (same config, same MQTT client id: a restart)."""

    def __init__(self, home: Path, config_text: str = "", *, repo: Path | None = None,
                 env: dict | None = None, socket: Path | None = None, nofile: int | None = None):
        home.mkdir(parents=True, exist_ok=True)
        self.socket = socket or home / "eb.sock"
        self.config = home / "config.toml"
        self.config.write_text(config_text)
        self.log = home / "daemon.log"
        self.repo = repo
        self.env = env or {}
        self.url = f"unix://{self.socket}"
        self.nofile = nofile  # the daemon's descriptor limit (soft and hard), as a unit's LimitNOFILE
        self.proc: subprocess.Popen | None = None

    def start(self) -> DaemonProcess:
        cmd = [sys.executable, "-m", "edge_batcher.cli", "serve", "--config", str(self.config),
               "--unix-socket", str(self.socket)]
        if self.repo is not None:
            cmd += ["--models", str(self.repo)]
        with open(self.log, "ab") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                         env=dict(os.environ, PYTHONPATH=str(ROOT), **self.env),
                                         preexec_fn=self._limit_descriptors if self.nofile else None)
        return self

    def _limit_descriptors(self) -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (self.nofile, self.nofile))

    def wait_ready(self, timeout: float = 60.0) -> DaemonProcess:
        deadline = time.monotonic() + timeout
        with Client(self.url, timeout=2.0) as client:
            while time.monotonic() < deadline:
                self._check_alive()
                if client.ready():
                    return self
                time.sleep(0.05)
        raise RuntimeError(f"daemon not ready after {timeout} s:\n{self.log_text()}")

    def ready_body(self) -> dict | None:
        """GET /v2/health/ready on the Unix socket (any status); None while nothing answers."""
        self._check_alive()
        try:
            with socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM) as s:
                s.settimeout(2)
                s.connect(str(self.socket))
                s.sendall(b"GET /v2/health/ready HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
                data = b""
                while chunk := s.recv(65536):
                    data += chunk
        except OSError:
            return None
        try:
            return json.loads(data.partition(b"\r\n\r\n")[2])
        except ValueError:
            return None

    def client(self, **kwargs) -> Client:
        return Client(self.url, **kwargs)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        """Send `sig` and wait (SIGKILL after `timeout`); the exit status (0 when never started)."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def log_lines_with(self, text: str, within_s: float) -> list[str]:
        """The log's lines holding `text`, once there is one (or `within_s` has passed: none)."""
        deadline = time.monotonic() + within_s
        while text not in self.log_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        return [line for line in self.log_text().splitlines() if text in line]

    def _check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"daemon exited with {self.proc.returncode}:\n{self.log_text()}")
