#!/usr/bin/env python3
"""MQTT request/response: the daemon against a bare paho responder, side by side in one run.

Starts a private mosquitto, then alternates, `--rounds` times: a bare responder (a paho client
that answers every request at once with a fixed small reply, QoS 1, auto-ack: the floor that the
broker and paho allow on this machine) and `edge-batcher serve` on the demo vibration model, each
measured by `edge_batcher.bench_mqtt` (closed loop, `--concurrency` outstanding, the same v2 JSON
payload). Prints each round and the medians, and the daemon's throughput as a ratio of the
responder's (issue 20's goal: >= 0.8, p50 <= 2x). `--mqtt KEY=VALUE` sets the daemon's [mqtt]
keys (e.g. max_inflight=256) to measure one lever at a time; `--variant` runs a second daemon
configuration in the same rounds.

Usage: python tools/bench_mqtt_compare.py [--rounds 3] [--seconds 3] [--concurrency 32]
           [--mqtt max_inflight=256] [--variant max_inflight=20]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from mqtt_faults import _Broker, build_models  # noqa: E402
from paho.mqtt.client import Client  # noqa: E402 - after the sys.path lines above
from paho.mqtt.enums import CallbackAPIVersion, MQTTProtocolVersion  # noqa: E402
from paho.mqtt.packettypes import PacketTypes  # noqa: E402
from paho.mqtt.properties import Properties  # noqa: E402

from edge_batcher.bench_mqtt import bench_mqtt  # noqa: E402
from edge_batcher.transports.mqtt import tcp_no_delay  # noqa: E402

PREFIX = "edge-batcher/compare"
REPLY = json.dumps({"model_name": "vibration", "outputs": [{"name": "class_id", "shape": [1],
                                                             "datatype": "INT64", "data": [0]}]}).encode()


def bare_responder(port: int) -> Client:
    client = Client(CallbackAPIVersion.VERSION2, client_id="bare-responder", protocol=MQTTProtocolVersion.MQTTv5)
    client.max_inflight_messages_set(1000)

    def on_message(c: Client, userdata: object, msg) -> None:
        props = Properties(PacketTypes.PUBLISH)
        props.CorrelationData = msg.properties.CorrelationData
        props.UserProperty = [("status", "200")]
        c.publish(msg.properties.ResponseTopic, REPLY, qos=1, properties=props)

    client.on_socket_open = tcp_no_delay
    client.on_message = on_message
    client.connect("127.0.0.1", port)
    client.subscribe(f"{PREFIX}/infer/+", qos=1)
    client.loop_start()
    time.sleep(0.3)
    return client


def start_daemon(home: Path, repo: Path, port: int, mqtt: dict) -> subprocess.Popen:
    home.mkdir(parents=True, exist_ok=True)
    fields = {"enabled": True, "host": "127.0.0.1", "port": port, "topic_prefix": PREFIX, **mqtt}
    lines = ["[models]", f'repository = "{repo}"', "[memory]", 'probe = "fixed"', "budget_mb = 4096", "[mqtt]"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in fields.items()]
    (home / "config.toml").write_text("\n".join(lines) + "\n")
    log = open(home / "daemon.log", "ab")
    proc = subprocess.Popen([sys.executable, "-m", "edge_batcher.cli", "serve", "--config", str(home / "config.toml"),
                             "--unix-socket", str(home / "eb.sock")], stdout=log, stderr=subprocess.STDOUT,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))
    deadline = time.monotonic() + 120
    while "MQTT: subscribed" not in (home / "daemon.log").read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"daemon did not subscribe: {home / 'daemon.log'}")
        time.sleep(0.1)
    return proc


def parse_keys(pairs: list[str]) -> dict:
    out = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        out[key] = json.loads(value) if value[:1].isdigit() or value in ("true", "false") else value
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--mqtt", action="append", default=[], help="daemon [mqtt] KEY=VALUE")
    ap.add_argument("--variant", action="append", default=[], help="a second daemon's [mqtt] KEY=VALUE")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="eb-mqtt-compare-"))
    (work / "broker").mkdir()
    repo = build_models(work / "models")
    broker = _Broker(work / "broker", 100_000)
    broker.start()
    setups = {"daemon": parse_keys(args.mqtt)}
    if args.variant:
        setups["variant"] = {**setups["daemon"], **parse_keys(args.variant)}
    results: dict[str, list[dict]] = {"bare responder": [], **{name: [] for name in setups}}
    try:
        for r in range(args.rounds):
            bare = bare_responder(broker.port)
            results["bare responder"].append(bench_mqtt(f"127.0.0.1:{broker.port}", topic_prefix=PREFIX,
                                                        duration_s=args.seconds, concurrency=args.concurrency))
            bare.disconnect()
            bare.loop_stop()
            for name, mqtt in setups.items():
                # A fresh session each time: a persistent one would have queued the other rounds' requests.
                session = {"client_id": f"eb-{name}-{r}", "session_expiry_s": 0}
                proc = start_daemon(work / f"{name}-{r}", repo, broker.port, {**session, **mqtt})
                try:
                    results[name].append(bench_mqtt(f"127.0.0.1:{broker.port}", topic_prefix=PREFIX,
                                                    duration_s=args.seconds, concurrency=args.concurrency))
                finally:
                    proc.send_signal(signal.SIGTERM)
                    proc.wait(30)
            print(f"round {r + 1}: " + ", ".join(
                f"{name} {runs[-1]['throughput_rps']:.0f} req/s p50 {runs[-1]['latency_ms']['p50']:.2f} ms"
                for name, runs in results.items()), flush=True)
    finally:
        broker.stop()
    floor = statistics.median(run["throughput_rps"] for run in results["bare responder"])
    floor_p50 = statistics.median(run["latency_ms"]["p50"] for run in results["bare responder"])
    print(f"\nmedians of {args.rounds} rounds, {args.concurrency} outstanding, {args.seconds:g} s each "
          f"(daemon [mqtt] {setups['daemon'] or 'defaults'}"
          + (f"; variant {setups['variant']}" if "variant" in setups else "") + ")")
    print(f"{'':16} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'x floor':>8} {'p50 x':>6}")
    for name, runs in results.items():
        rps = statistics.median(run["throughput_rps"] for run in runs)
        p50 = statistics.median(run["latency_ms"]["p50"] for run in runs)
        p99 = statistics.median(run["latency_ms"]["p99"] for run in runs)
        print(f"{name:16} {rps:8.0f} {p50:8.2f} {p99:8.2f} {rps / floor:8.2f} {p50 / floor_p50:6.2f}")


if __name__ == "__main__":
    main()
