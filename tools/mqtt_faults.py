#!/usr/bin/env python3
"""Fault injection for MQTT at-least-once: does every QoS 1 request get a reply?

Starts a private mosquitto (persistence on) and an `edge-batcher serve` subprocess on the demo
vibration model, publishes N QoS 1 v2 requests with unique Correlation Data at a given rate, and
injects one fault mid-burst: none, `kill9` (the daemon is SIGKILLed and restarted after
`--restart-after` seconds, like systemd's RestartSec), `sigterm` (graceful stop, then restart),
`broker` (mosquitto stopped and started again on the same port) or `broker-kill9` (mosquitto
SIGKILLed, a crash: what it had not saved yet is gone; `--autosave-interval` and
`--autosave-on-changes` set how often it saves). It then waits until every
request has a reply (or `--timeout` passes, or no reply came for `--idle-timeout` seconds: the
rest are lost) and reports unanswered requests, duplicates, the
reply statuses, the daemon's peak RSS and its MQTT counters.

The broker is configured with `max_queued_messages` (default 100000): mosquitto's own default,
1000 per client, makes the *broker* drop requests published while the daemon is away
(docs/mqtt.md). `--broker-queue 1000` shows that.

Usage::

    python tools/mqtt_faults.py --requests 10000 --rate 6000 --fault kill9
    python tools/mqtt_faults.py --requests 10000 --rate 6000 --fault none --json
    python tools/mqtt_faults.py --fault broker-kill9 --autosave-interval 1

`run()` is the same as a function; the test suite calls it with a few thousand requests.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import psutil  # noqa: E402
from paho.mqtt.client import Client  # noqa: E402
from paho.mqtt.enums import CallbackAPIVersion, MQTTProtocolVersion  # noqa: E402
from paho.mqtt.packettypes import PacketTypes  # noqa: E402
from paho.mqtt.properties import Properties  # noqa: E402

FAULTS = ("none", "kill9", "sigterm", "broker", "broker-kill9")
PREFIX = "edge-batcher/faults"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise RuntimeError(f"timed out after {timeout} s waiting for {what}")


class _Broker:
    def __init__(self, home: Path, queue: int, autosave_interval: int | None = None, autosave_on_changes: bool = False):
        self.home, self.port = home, _free_port()
        self.log = home / "mosquitto.log"
        lines = [f"listener {self.port} 127.0.0.1", "allow_anonymous true", "persistence true",
                 f"persistence_location {home}/", f"max_queued_messages {queue}", "set_tcp_nodelay true"]
        if autosave_interval is not None:  # mosquitto's default: 1800 (seconds)
            lines.append(f"autosave_interval {autosave_interval}")
        if autosave_on_changes:  # autosave_interval counts changes (messages, subscriptions), not seconds
            lines.append("autosave_on_changes true")
        if os.geteuid() == 0:
            lines.append("user root")
        (home / "mosquitto.conf").write_text("\n".join(lines) + "\n")
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        binary = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([binary, "-c", str(self.home / "mosquitto.conf")], stdout=log,
                                         stderr=subprocess.STDOUT)

        def accepting() -> bool:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return True
            except OSError:
                return False

        _wait(accepting, 10, "mosquitto")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)  # SIGTERM: mosquitto saves its persistence file; SIGKILL: it cannot
            self.proc.wait(10)


class _Daemon:
    def __init__(self, home: Path, models: Path, broker_port: int, extra_mqtt: dict):
        self.home, self.log = home, home / "daemon.log"
        self.socket = home / "eb.sock"
        mqtt = {"enabled": True, "host": "127.0.0.1", "port": broker_port, "client_id": "eb-faults",
                "topic_prefix": PREFIX, "reconnect_min_s": 0.1, "reconnect_max_s": 1.0, **extra_mqtt}
        lines = ["[server]", "drain_timeout_s = 10", "[models]", f'repository = "{models}"',
                 "[memory]", 'probe = "fixed"', "budget_mb = 4096", "[mqtt]"]
        lines += [f"{k} = {json.dumps(v)}" for k, v in mqtt.items()]
        (home / "config.toml").write_text("\n".join(lines) + "\n")
        self.proc: subprocess.Popen | None = None
        self.peak_rss = 0

    def start(self) -> None:
        cmd = [sys.executable, "-m", "edge_batcher.cli", "serve", "--config", str(self.home / "config.toml"),
               "--unix-socket", str(self.socket)]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                         env=dict(os.environ, PYTHONPATH=str(ROOT)))

    def stop(self, sig: int) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(30)

    def sample_rss(self) -> None:
        try:
            if self.proc and self.proc.poll() is None:
                self.peak_rss = max(self.peak_rss, psutil.Process(self.proc.pid).memory_info().rss)
        except psutil.Error:
            pass

    def mqtt_stats(self) -> str:
        """The counters from the last 'MQTT: stopped (...)' line of the log, if any."""
        lines = [ln for ln in self.log.read_text(errors="replace").splitlines() if "MQTT: stopped" in ln]
        return lines[-1].split("MQTT: stopped", 1)[1].strip() if lines else ""


def _mqtt_client(port: int, client_id: str, persistent: bool) -> Client:
    client = Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=MQTTProtocolVersion.MQTTv5)
    client.max_inflight_messages_set(1000)
    client.max_queued_messages_set(0)  # the load generator must not be the one that drops requests
    client.reconnect_delay_set(0.1, 1.0)
    properties = Properties(PacketTypes.CONNECT)
    if persistent:
        properties.SessionExpiryInterval = 600
    client.connect("127.0.0.1", port, keepalive=10, clean_start=not persistent, properties=properties)
    client.loop_start()
    return client


def _payload(i: int, rng: np.random.Generator) -> bytes:
    data = (0.5 * rng.standard_normal(256)).astype(np.float32).round(4).tolist()
    return json.dumps({"id": f"req-{i}", "inputs": [{"name": "signal", "shape": [1, 256], "datatype": "FP32",
                                                     "data": data}]}).encode()


def build_models(out: Path) -> Path:
    subprocess.run([sys.executable, str(ROOT / "tools" / "build_demo_models.py"), "--out", str(out),
                    "--model", "vibration"], check=True, stdout=subprocess.DEVNULL)  # the only one it serves
    repo = out / "repo"
    repo.mkdir(exist_ok=True)
    if not (repo / "vibration").exists():
        shutil.copytree(out / "vibration", repo / "vibration")
    return repo


def run(*, requests: int = 10_000, rate: float = 6000.0, fault: str = "none", fault_at: float = 0.3,
        restart_after_s: float = 2.0, timeout_s: float = 180.0, idle_timeout_s: float = 60.0,
        broker_queue: int = 100_000,
        autosave_interval: int | None = None, autosave_on_changes: bool = False,
        models: Path | None = None, workdir: Path | None = None, mqtt: dict | None = None) -> dict:
    """Publish `requests` QoS 1 requests at `rate` per second, inject `fault` once `fault_at` of
    them are published, and wait for every reply. Returns the figures (see format_report)."""
    if fault not in FAULTS:
        raise ValueError(f"fault must be one of {', '.join(FAULTS)}, got {fault!r}")
    work = Path(workdir or tempfile.mkdtemp(prefix="eb-faults-"))
    (work / "broker").mkdir(parents=True, exist_ok=True)
    (work / "daemon").mkdir(parents=True, exist_ok=True)
    repo = models or build_models(work / "models")
    broker = _Broker(work / "broker", broker_queue, autosave_interval, autosave_on_changes)
    broker.start()
    daemon = _Daemon(work / "daemon", repo, broker.port, mqtt or {})
    replies: dict[bytes, list[str]] = {}
    last_reply = [0.0]  # when the last reply came (time.monotonic())
    lock = threading.Lock()
    stop_sampling = threading.Event()
    collector = publisher = None
    try:
        daemon.start()
        _wait(lambda: "MQTT: subscribed" in daemon.log.read_text(errors="replace"), 120, "the daemon to subscribe")
        response_topic = "faults/replies"

        def on_message(client, userdata, msg) -> None:
            status = dict(getattr(msg.properties, "UserProperty", None) or []).get("status", "?")
            with lock:
                replies.setdefault(getattr(msg.properties, "CorrelationData", b""), []).append(status)
                last_reply[0] = time.monotonic()

        collector = _mqtt_client(broker.port, "faults-collector", persistent=True)
        collector.on_message = on_message
        # Again on every connection: a broker that crashed before saving has lost the session.
        collector.on_connect = lambda client, userdata, flags, rc, properties: client.subscribe(response_topic, qos=1)
        collector.subscribe(response_topic, qos=1)
        publisher = _mqtt_client(broker.port, "faults-publisher", persistent=True)
        time.sleep(0.3)

        def sample() -> None:
            while not stop_sampling.wait(0.1):
                daemon.sample_rss()

        threading.Thread(target=sample, daemon=True).start()
        rng = np.random.default_rng(0)
        payloads = [_payload(i, rng) for i in range(requests)]
        topic = f"{PREFIX}/infer/vibration"
        fault_index = int(requests * fault_at) if fault != "none" else -1
        fault_thread = None
        started = time.monotonic()
        for i, payload in enumerate(payloads):
            due = started + i / rate
            delay = due - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            properties = Properties(PacketTypes.PUBLISH)
            properties.ResponseTopic = response_topic
            properties.CorrelationData = i.to_bytes(4, "big")
            publisher.publish(topic, payload, qos=1, properties=properties)
            if i == fault_index:
                fault_thread = threading.Thread(target=_inject, args=(fault, daemon, broker, restart_after_s))
                fault_thread.start()
        published_s = time.monotonic() - started
        if fault_thread is not None:
            fault_thread.join()
        wanted = {i.to_bytes(4, "big") for i in range(requests)}
        deadline = time.monotonic() + timeout_s
        last_reply[0] = time.monotonic()
        while time.monotonic() < deadline:
            with lock:
                if wanted <= replies.keys() or time.monotonic() - last_reply[0] > idle_timeout_s:
                    break
            time.sleep(0.1)
        elapsed = time.monotonic() - started
        with lock:
            answered = {k: v for k, v in replies.items() if k in wanted}
        statuses = Counter(s for copies in answered.values() for s in copies)
        daemon.stop(signal.SIGTERM)
        return {
            "requests": requests, "rate": rate, "fault": fault, "published_s": round(published_s, 2),
            "elapsed_s": round(elapsed, 2), "answered": len(answered), "unanswered": requests - len(answered),
            "duplicates": sum(len(v) - 1 for v in answered.values()), "statuses": dict(statuses),
            "peak_rss_mb": round(daemon.peak_rss / 2**20, 1), "daemon_mqtt": daemon.mqtt_stats(),
            "broker_dropped": "being dropped" in broker.log.read_text(errors="replace"),
            "workdir": str(work),
        }
    finally:
        stop_sampling.set()
        for client in (publisher, collector):
            if client is not None:
                client.disconnect()
                client.loop_stop()
        daemon.stop(signal.SIGKILL)
        broker.stop()


def _inject(fault: str, daemon: _Daemon, broker: _Broker, restart_after_s: float) -> None:
    if fault in ("kill9", "sigterm"):
        daemon.stop(signal.SIGKILL if fault == "kill9" else signal.SIGTERM)
        time.sleep(restart_after_s)
        daemon.start()
    elif fault in ("broker", "broker-kill9"):
        broker.stop(signal.SIGKILL if fault == "broker-kill9" else signal.SIGTERM)
        time.sleep(restart_after_s)
        broker.start()


def format_report(r: dict) -> str:
    statuses = ", ".join(f"{k}: {v}" for k, v in sorted(r["statuses"].items()))
    return (f"{r['requests']} QoS 1 requests at {r['rate']:g}/s, fault {r['fault']}: "
            f"{r['unanswered']} unanswered, {r['duplicates']} duplicate replies; statuses {statuses}; "
            f"published in {r['published_s']} s, all answered after {r['elapsed_s']} s; "
            f"daemon peak RSS {r['peak_rss_mb']} MB; broker dropped messages: {r['broker_dropped']}\n"
            f"  daemon MQTT counters: {r['daemon_mqtt']}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--rate", type=float, default=6000.0, help="requests published per second")
    p.add_argument("--fault", choices=FAULTS, default="none")
    p.add_argument("--fault-at", type=float, default=0.3, help="fraction of the burst published before the fault")
    p.add_argument("--restart-after", type=float, default=2.0, help="seconds between the fault and the restart")
    p.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for the last reply")
    p.add_argument("--idle-timeout", type=float, default=60.0,
                   help="stop waiting once no reply came for this long (what is missing then is lost)")
    p.add_argument("--broker-queue", type=int, default=100_000, help="mosquitto max_queued_messages")
    p.add_argument("--autosave-interval", type=int, help="mosquitto autosave_interval (its default: 1800 s)")
    p.add_argument("--autosave-on-changes", action="store_true",
                   help="mosquitto autosave_on_changes: --autosave-interval counts changes, not seconds")
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="eb-faults-models-") as tmp:
        repo = build_models(Path(tmp))
        worst = 0
        for _ in range(a.runs):
            r = run(requests=a.requests, rate=a.rate, fault=a.fault, fault_at=a.fault_at,
                    restart_after_s=a.restart_after, timeout_s=a.timeout, idle_timeout_s=a.idle_timeout,
                    broker_queue=a.broker_queue,
                    autosave_interval=a.autosave_interval, autosave_on_changes=a.autosave_on_changes, models=repo)
            print(json.dumps(r) if a.json else format_report(r), flush=True)
            worst = max(worst, r["unanswered"])
    return 1 if worst else 0


if __name__ == "__main__":
    sys.exit(main())
