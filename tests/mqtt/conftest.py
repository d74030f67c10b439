"""Fixtures for the MQTT transport tests: a private mosquitto per test, the demo model built once,
a Runtime serving it on its own event-loop thread, paho test clients, and daemon subprocesses.

Nothing is mocked: requests go through a real broker into the real transport and model.
"""

from __future__ import annotations

import shutil
import signal
import uuid
from pathlib import Path

import pytest

from edge_batcher.config import DaemonConfig, MqttSettings
from edge_batcher.runtime import Runtime
from edge_batcher.transports.mqtt import MqttTransport
from tests.support.daemon import DaemonProcess
from tests.support.mqtt import MOSQUITTO, Broker, LoopThread, TestClient

if MOSQUITTO is None:
    pytest.skip("mosquitto is not installed (apt-get install mosquitto): the MQTT tests need a real broker",
                allow_module_level=True)


@pytest.fixture
def broker(tmp_path):
    """A private mosquitto on a free loopback port (persistence off); restartable on that port."""
    b = Broker(tmp_path).start()
    yield b
    b.stop()


@pytest.fixture(scope="session")
def mqtt_model_repo(model_repo, tmp_path_factory) -> Path:
    """A repository holding only the demo vibration model (copied from the session's build)."""
    out = tmp_path_factory.mktemp("mqtt-engines")
    shutil.copytree(model_repo / "vibration", out / "vibration")
    return out


@pytest.fixture(scope="session")
def served(mqtt_model_repo):
    """(loop thread, started Runtime with the vibration model), shared by the in-process tests."""
    lt = LoopThread()
    config = DaemonConfig()
    config.models.repository = str(mqtt_model_repo)
    config.memory.probe = "fixed"
    config.memory.budget_mb = 4096
    runtime = Runtime(config)
    lt.run(runtime.start(), timeout=120)
    yield lt, runtime
    lt.run(runtime.close())
    lt.close()


@pytest.fixture
def start_transport(served, broker):
    """start_transport(**MqttSettings fields) -> a connected, subscribed MqttTransport on `broker`."""
    lt, runtime = served
    started: list[MqttTransport] = []

    def start(wait: bool = True, **overrides) -> MqttTransport:
        fields = dict(enabled=True, host="127.0.0.1", port=broker.port, client_id=f"eb-test-{uuid.uuid4().hex[:8]}",
                      device_id="testdev", reconnect_min_s=0.1, reconnect_max_s=0.5, keepalive_s=5)
        fields.update(overrides)
        transport = MqttTransport(MqttSettings(**fields), runtime, source="test")
        lt.run(transport.start())
        started.append(transport)
        if wait:
            assert lt.run(transport.wait_connected(10)), "transport did not connect"
        return transport

    yield start
    for t in started:
        lt.run(t.stop(timeout=2))


@pytest.fixture
def mqtt_client(broker):
    """mqtt_client() -> a connected TestClient on `broker` (closed at teardown)."""
    clients: list[TestClient] = []

    def make(**kwargs) -> TestClient:
        c = TestClient(broker.port, **kwargs)
        clients.append(c)
        return c

    yield make
    for c in clients:
        c.close()


@pytest.fixture
def daemon_process(tmp_path):
    """daemon_process(name, config_text) -> a DaemonProcess (not started); killed at teardown."""
    made: list[DaemonProcess] = []

    def make(name: str, config_text: str) -> DaemonProcess:
        d = DaemonProcess(tmp_path / name, config_text)
        made.append(d)
        return d

    yield make
    for d in made:
        d.stop(signal.SIGTERM)
