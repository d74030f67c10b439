"""Helpers for the MQTT tests: a private mosquitto broker, a synchronous paho MQTT 5 test client,
an event loop on its own thread, and `edge-batcher serve` subprocesses. Fixtures: tests/mqtt/conftest.py."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import queue
import shutil
import socket
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from paho.mqtt.client import Client
from paho.mqtt.enums import CallbackAPIVersion, MQTTProtocolVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from tests.support.ports import free_port
from tests.support.processes import terminate

ROOT = Path(__file__).resolve().parents[2]
MOSQUITTO = shutil.which("mosquitto") or next(
    (p for p in ("/usr/sbin/mosquitto", "/usr/local/sbin/mosquitto") if os.access(p, os.X_OK)), None
)
PREFIX = "edge-batcher/testdev"  # the in-process transport tests' device_id "testdev"
INFER = f"{PREFIX}/infer/vibration"


def signal_rows(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(256) / 2560.0
    return (np.sin(2 * np.pi * 30 * t)[None] * rng.uniform(0.5, 2.0, (n, 1))
            + 0.1 * rng.standard_normal((n, 256))).astype(np.float32)


def v2_json(rows: np.ndarray, id: str | None = None) -> bytes:
    body = {"inputs": [{"name": "signal", "shape": list(rows.shape), "datatype": "FP32",
                        "data": rows.ravel().tolist()}]}
    if id is not None:
        body["id"] = id
    return json.dumps(body).encode()


def wait_until(predicate, timeout: float, what: str, interval: float = 0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


class Broker:
    """mosquitto on a private loopback port with its own config file; restartable on that port."""

    def __init__(self, home: Path, port: int | None = None, persistence: bool = False, extra: list[str] = ()):
        self.home = home
        home.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.config = home / "mosquitto.conf"
        self.log = home / "mosquitto.log"
        lines = [f"listener {self.port} 127.0.0.1", "allow_anonymous true",
                 f"persistence {'true' if persistence else 'false'}", "set_tcp_nodelay true"]
        if persistence:
            lines.append(f"persistence_location {home}/")
        lines += list(extra)  # e.g. TLS: cafile/certfile/keyfile
        if os.geteuid() == 0:  # stay root: the files live in the test's private (0700) tmp directory
            lines.append("user root")
        self.config.write_text("\n".join(lines) + "\n")
        self.proc: subprocess.Popen | None = None

    def start(self) -> Broker:
        log = open(self.log, "ab")
        self.proc = subprocess.Popen([MOSQUITTO, "-c", str(self.config)], stdout=log, stderr=subprocess.STDOUT)
        log.close()

        def accepting() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mosquitto exited with {self.proc.returncode}:\n{self.log.read_text()}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return True
            except OSError:
                return False

        wait_until(accepting, 10, f"mosquitto on port {self.port}")
        return self

    def stop(self) -> None:
        terminate(self.proc, 5)
        self.proc = None


def make_tls_files(directory: Path) -> dict[str, Path]:
    """A throwaway CA and a server certificate for 127.0.0.1/localhost signed by it (openssl CLI)."""
    directory.mkdir(parents=True, exist_ok=True)
    f = {name: directory / name for name in ("ca.crt", "ca.key", "server.crt", "server.key", "server.csr", "san.ext")}
    f["san.ext"].write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run = functools.partial(subprocess.run, check=True, capture_output=True)
    run(["openssl", "req", "-x509", *ec, "-keyout", f["ca.key"], "-out", f["ca.crt"], "-days", "1",
         "-subj", "/CN=edge-batcher test CA"])
    run(["openssl", "req", *ec, "-keyout", f["server.key"], "-out", f["server.csr"], "-subj", "/CN=localhost"])
    run(["openssl", "x509", "-req", "-in", f["server.csr"], "-CA", f["ca.crt"], "-CAkey", f["ca.key"],
         "-CAcreateserial", "-out", f["server.crt"], "-days", "1", "-extfile", f["san.ext"]])
    return f


class LoopThread:
    """An event loop on its own thread, like the daemon's: the transport and runtime live there,
    the (synchronous) tests talk to them through the broker."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="test-event-loop", daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@dataclass
class Reply:
    topic: str
    payload: bytes
    status: str | None
    correlation: bytes | None
    content_type: str | None
    user_properties: dict

    def json(self):
        return json.loads(self.payload)


class TestClient:
    """A synchronous paho MQTT 5 client: publishes requests, collects replies in a thread-safe queue."""

    __test__ = False  # not a test class

    def __init__(self, port: int, client_id: str | None = None, tls_ca: str | None = None):
        self.client = Client(CallbackAPIVersion.VERSION2, client_id=client_id or f"tc-{uuid.uuid4().hex[:8]}",
                             protocol=MQTTProtocolVersion.MQTTv5)
        self.messages: queue.Queue[Reply] = queue.Queue()
        self.response_topic = f"test/replies/{uuid.uuid4().hex[:8]}"
        self._subacks: dict[int, threading.Event] = {}
        self._connected = threading.Event()
        self.client.on_connect = lambda c, u, f, rc, p: self._connected.set()
        self.client.on_message = self._on_message
        self.client.on_subscribe = self._on_subscribe
        if tls_ca:
            self.client.tls_set(ca_certs=tls_ca)
        self.client.connect("127.0.0.1", port, keepalive=10)
        self.client.loop_start()
        assert self._connected.wait(10), "test client did not connect"
        self.subscribe(self.response_topic)

    def _on_message(self, client, userdata, msg) -> None:
        props = msg.properties
        users = dict(getattr(props, "UserProperty", None) or [])
        self.messages.put(Reply(msg.topic, msg.payload, users.get("status"), getattr(props, "CorrelationData", None),
                                getattr(props, "ContentType", None), users))

    def _on_subscribe(self, client, userdata, mid, reason_codes, properties) -> None:
        self._subacks.setdefault(mid, threading.Event()).set()

    def subscribe(self, topic: str, qos: int = 1) -> None:
        _, mid = self.client.subscribe(topic, qos)
        assert self._subacks.setdefault(mid, threading.Event()).wait(10), f"no SUBACK for {topic}"

    def publish(self, topic: str, payload: bytes | str, *, correlation: bytes | None = None, qos: int = 1,
                response_topic: str | None | bool = True, content_type: str | None = None,
                user_properties: list[tuple[str, str]] = (), expiry_s: int | None = None) -> None:
        props = Properties(PacketTypes.PUBLISH)
        if response_topic is True:
            response_topic = self.response_topic
        if response_topic:
            props.ResponseTopic = response_topic
        if correlation is not None:
            props.CorrelationData = correlation
        if content_type:
            props.ContentType = content_type
        if user_properties:
            props.UserProperty = list(user_properties)
        if expiry_s is not None:
            props.MessageExpiryInterval = expiry_s
        info = self.client.publish(topic, payload, qos=qos, properties=props)
        assert info.rc == 0, f"publish failed: {info.rc}"

    def collect(self, count: int, timeout: float = 10.0) -> list[Reply]:
        """Exactly the next `count` messages (fails after `timeout`)."""
        deadline = time.monotonic() + timeout
        out = []
        while len(out) < count:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"got {len(out)} of {count} messages within {timeout} s: {out[:3]}")
            try:
                out.append(self.messages.get(timeout=remaining))
            except queue.Empty:
                pass
        return out

    def collect_correlations(self, wanted: set[bytes], timeout: float) -> dict[bytes, list[Reply]]:
        """Replies until every correlation in `wanted` has one (duplicates are kept)."""
        deadline = time.monotonic() + timeout
        seen: dict[bytes, list[Reply]] = {}
        while not wanted <= seen.keys():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(wanted - seen.keys())
                raise AssertionError(f"{len(missing)} of {len(wanted)} requests unanswered after {timeout} s, "
                                     f"e.g. {missing[:5]}")
            try:
                reply = self.messages.get(timeout=remaining)
            except queue.Empty:
                continue
            seen.setdefault(reply.correlation, []).append(reply)
        return seen

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def wait_mqtt(daemon, state: str = "connected", timeout: float = 60) -> dict:
    """Wait until the daemon's readiness body reports this MQTT state; returns the body."""
    return wait_until(lambda: (b := daemon.ready_body()) and b.get("mqtt") == state and b,
                      timeout, f"daemon ready with mqtt {state}:\n{daemon.log}", interval=0.05)
