"""Shared fixtures: model repositories built once per session, real daemon processes, a broker."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.support.daemon import DaemonProcess
from tests.support.models import build_demo_repository, build_minilm, build_repository
from tests.support.mqtt import MOSQUITTO, Broker


@pytest.fixture(scope="session")
def minilm_dir(tmp_path_factory) -> Path:
    """The real MiniLM embedding model (tools/build_embedding_model.py); skips without its packages."""
    return build_minilm(tmp_path_factory.mktemp("minilm_engines"))


@pytest.fixture(scope="session")
def demo_repo(tmp_path_factory, minilm_dir) -> Path:
    """What `make run` builds and serves: vibration, minilm and rag (extractive, over an index of
    the shipped manual)."""
    return build_demo_repository(tmp_path_factory.mktemp("demo_engines"), minilm_dir)


@pytest.fixture
def small_disk(tmp_path):
    """A file system with little room (tmpfs, 1 MiB): a device's full eMMC. Needs root (mount)."""
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.fixture(scope="session")
def model_repo(tmp_path_factory) -> Path:
    return build_repository(tmp_path_factory.mktemp("engines"))


@pytest.fixture
def start_daemon(tmp_path, model_repo):
    started: list[DaemonProcess] = []

    def start(config_text: str = "", env: dict | None = None, repo: Path | None = None,
              socket: Path | None = None) -> DaemonProcess:
        home = tmp_path / f"d{len(started)}"
        home.mkdir()
        d = DaemonProcess(home, config_text, repo=repo or model_repo, env=env, socket=socket)
        started.append(d)
        return d.start().wait_ready()

    yield start
    for d in started:
        d.stop()


@pytest.fixture
def daemon(start_daemon) -> DaemonProcess:
    return start_daemon("[server]\nmax_body_bytes = 1048576\n")


@pytest.fixture
def broker(tmp_path):
    """A private mosquitto for one test (tests/mqtt/ has its own, with that directory's skip)."""
    if MOSQUITTO is None:
        pytest.skip("mosquitto is not installed (apt-get install mosquitto)")
    b = Broker(tmp_path / "broker").start()
    yield b
    b.stop()

