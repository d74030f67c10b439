#!/usr/bin/env python3
"""The daemon's transports against their references, side by side in one run (issue 20).

Each round runs, one after another on the same machine and the same demo vibration model:

* **MLServer** (the `.venv-mlserver` that `make test` creates) with adaptive batching (max 8,
  2 ms) on TCP, loaded with v2 JSON by `edge_batcher.bench.http_load` (closed loop);
* **edge-batcher, Unix socket**: `edge-batcher serve`, the same JSON requests and load;
* **bare MQTT responder**: a paho client (its own process) that answers every request at once
  with a fixed reply (QoS 1): the floor that mosquitto and paho allow here, loaded by
  `edge_batcher.bench.mqtt_load`;
* **edge-batcher, MQTT**: the same daemon through the same broker and load.

For every server it prints CPU time per request: the whole process tree, and its main thread
alone (the daemon's event loop; the responder's main thread runs paho's network loop). The
table gives medians over the rounds and the two ratios issue 20 sets goals for (Unix socket
>= 3x MLServer with a lower p99; MQTT >= 0.8 of the responder with p50 <= 2x). `--daemon
SECTION.KEY=VALUE` sets daemon config keys ("server.loop_cpu=off", "mqtt.max_inflight=256") to
measure one lever at a time; `--baseline DIR` also runs the daemon
from another checkout (`git worktree add /tmp/base HEAD~3`) in the same rounds, so a change to
the code is measured side by side with the code before it.

Usage: python tools/bench_compare.py [--rounds 3] [--seconds 3] [--concurrency 32]
           [--phases mlserver,unix,mqtt-bare,mqtt] [--daemon server.loop_cpu=off] [--baseline DIR]
           [--mqtt-binary] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from mqtt_faults import _Broker, build_models  # noqa: E402
from paho.mqtt.client import Client  # noqa: E402 - after the sys.path lines above
from paho.mqtt.enums import CallbackAPIVersion, MQTTProtocolVersion  # noqa: E402
from paho.mqtt.packettypes import PacketTypes  # noqa: E402
from paho.mqtt.properties import Properties  # noqa: E402

from edge_batcher.bench.http_load import bench_http  # noqa: E402
from edge_batcher.bench.mqtt_load import bench_mqtt  # noqa: E402
from edge_batcher.transports.mqtt import tcp_no_delay  # noqa: E402
from tests.support.mlserver_peer import MLSERVER, MLServerPeer  # noqa: E402

PHASES = ("mlserver", "unix", "mqtt-bare", "mqtt")
PREFIX = "edge-batcher/compare"
REPLY = json.dumps({"model_name": "vibration", "outputs": [{"name": "class_id", "shape": [1],
                                                             "datatype": "INT64", "data": [0]}]}).encode()


def wait_until(check, what: str, proc: subprocess.Popen, log: Path, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not start (exit {proc.poll()}); see {log}")
        time.sleep(0.1)


class Server:
    """A server subprocess and the CPU it spends (its whole process tree; `loop` = its main thread)."""

    def __init__(self, proc: subprocess.Popen, address: str):
        self.proc, self.address = proc, address
        self.ps = psutil.Process(proc.pid)

    def cpu(self) -> tuple[float, float]:
        total = 0.0
        for p in [self.ps, *self.ps.children(recursive=True)]:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.NoSuchProcess:
                pass
        try:  # the main thread's time on a CPU, in ns (Linux)
            loop = int(Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/schedstat").read_text().split()[0]) / 1e9
        except OSError:
            loop = float("nan")
        return total, loop

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start_mlserver(home: Path, repo: Path, workers: int) -> Server:
    """The test suite's MLServer peer (tests/support/mlserver_peer.py), with adaptive batching."""
    peer = MLServerPeer(home, repo, model_settings={"max_batch_size": 8, "max_batch_time": 0.002},
                        parallel_workers=workers).start()
    assert peer.proc is not None
    return Server(peer.proc, peer.url)


def start_daemon(home: Path, repo: Path, broker_port: int | None, settings: dict[str, dict],
                 source: Path = ROOT) -> Server:
    home.mkdir(parents=True, exist_ok=True)
    sections: dict[str, dict] = {"models": {"repository": str(repo)},
                                 "memory": {"probe": "fixed", "budget_mb": 4096}}
    if broker_port is not None:
        # A fresh session each time: a persistent one would have queued the other rounds' requests.
        sections["mqtt"] = {"enabled": True, "host": "127.0.0.1", "port": broker_port, "topic_prefix": PREFIX,
                            "client_id": f"eb-compare-{home.name}", "session_expiry_s": 0}
    for section, keys in settings.items():
        sections.setdefault(section, {}).update(keys)
    lines = []
    for section, keys in sections.items():
        lines += [f"[{section}]", *(f"{k} = {json.dumps(v)}" for k, v in keys.items())]
    (home / "config.toml").write_text("\n".join(lines) + "\n")
    log = home / "daemon.log"
    sock = home / "eb.sock"
    with open(log, "ab") as out:
        cmd = [sys.executable, "-m", "edge_batcher.cli", "serve", "--config", str(home / "config.toml"),
               "--unix-socket", str(sock)]
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=source,
                                env=dict(os.environ, PYTHONPATH=str(source)))
    ready = "MQTT: subscribed" if broker_port is not None else "ready"
    wait_until(lambda: ready in log.read_text(errors="replace"), "edge-batcher", proc, log)
    return Server(proc, f"unix://{sock}")


def bare_responder(port: int) -> None:
    """Answer every request at once, from paho's network thread, until killed (a subprocess:
    `bench_compare.py --bare-responder PORT`, so that its CPU is counted like a server's)."""
    client = Client(CallbackAPIVersion.VERSION2, client_id="bare-responder", protocol=MQTTProtocolVersion.MQTTv5)
    client.max_inflight_messages_set(1000)

    def on_message(c: Client, userdata: object, msg) -> None:
        props = Properties(PacketTypes.PUBLISH)
        props.CorrelationData = msg.properties.CorrelationData
        props.UserProperty = [("status", "200")]
        c.publish(msg.properties.ResponseTopic, REPLY, qos=1, properties=props)

    def on_subscribe(*args) -> None:
        print("subscribed", flush=True)

    client.on_socket_open = tcp_no_delay
    client.on_message = on_message
    client.on_subscribe = on_subscribe
    client.connect("127.0.0.1", port)
    client.subscribe(f"{PREFIX}/infer/+", qos=1)
    client.loop_forever()


def start_bare_responder(port: int) -> Server:
    proc = subprocess.Popen([sys.executable, __file__, "--bare-responder", str(port)], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    if proc.stdout.readline().strip() != b"subscribed":
        raise RuntimeError(f"the bare responder did not subscribe (exit {proc.poll()})")
    return Server(proc, f"mqtt://127.0.0.1:{port}")


def measured(load, server: Server | None) -> dict:
    """Run `load()` once to warm up, then again with the server's CPU counted."""
    load(0.5)
    before = server.cpu() if server else None
    result = load(None)
    if server and before:
        total, loop = (a - b for a, b in zip(server.cpu(), before))
        n = max(1, result.get("requests") or result["completed"])
        result["cpu_us_per_request"] = total / n * 1e6
        result["loop_cpu_us_per_request"] = loop / n * 1e6
    return result


def parse_settings(pairs: list[str]) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for pair in pairs:
        key, _, raw = pair.partition("=")
        section, _, name = key.partition(".")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        out.setdefault(section, {})[name] = value
    return out


def main() -> None:
    if sys.argv[1:2] == ["--bare-responder"]:
        bare_responder(int(sys.argv[2]))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated, of {', '.join(PHASES)}")
    ap.add_argument("--mlserver-workers", type=int, default=1,
                    help="MLServer parallel_workers (its default 1; 0: in-process)")
    ap.add_argument("--daemon", action="append", default=[], help="daemon config SECTION.KEY=VALUE")
    ap.add_argument("--mqtt-binary", action="store_true",
                    help="MQTT requests in the v2 binary extension, not JSON (the responder answers alike)")
    ap.add_argument("--baseline", type=Path, help="another checkout whose daemon runs in the same rounds")
    ap.add_argument("--json", type=Path, help="also write every run's figures here")
    args = ap.parse_args()
    phases = [p for p in args.phases.split(",") if p]
    if unknown := set(phases) - set(PHASES):
        ap.error(f"unknown phases {sorted(unknown)}; choose from {', '.join(PHASES)}")
    if "mlserver" in phases and not MLSERVER.exists():
        ap.error(f"{MLSERVER} is missing: `make test` (or `make mlserver-venv`) creates it")
    settings = parse_settings(args.daemon)
    work = Path(tempfile.mkdtemp(prefix="eb-compare-"))
    repo = build_models(work / "models")
    broker = None
    if {"mqtt", "mqtt-bare"} & set(phases):
        (work / "broker").mkdir()
        broker = _Broker(work / "broker", 100_000)
        broker.start()
    mqtt_address = f"127.0.0.1:{broker.port}" if broker else ""
    results: dict[str, list[dict]] = {p: [] for p in phases}

    def http_load(address: str):
        return lambda warm: bench_http(address, duration_s=warm or args.seconds, warmup_s=0,
                                       concurrency=args.concurrency)

    def mqtt_load(warm):
        return bench_mqtt(mqtt_address, topic_prefix=PREFIX, duration_s=warm or args.seconds, warmup_s=0,
                          concurrency=args.concurrency, binary=args.mqtt_binary)

    try:
        for r in range(args.rounds):
            if "mlserver" in phases:
                server = start_mlserver(work / f"mlserver-{r}", repo, args.mlserver_workers)
                try:
                    results["mlserver"].append(measured(http_load(server.address), server))
                finally:
                    server.stop()
            if "mqtt-bare" in phases:
                bare = start_bare_responder(broker.port)
                try:
                    results["mqtt-bare"].append(measured(mqtt_load, bare))
                finally:
                    bare.stop()
            for source, suffix in ((ROOT, ""), *(((args.baseline, " (baseline)"),) if args.baseline else ())):
                if not {"unix", "mqtt"} & set(phases):
                    break
                port = broker.port if broker and "mqtt" in phases else None
                daemon = start_daemon(work / f"daemon{suffix.strip(' ()')}-{r}", repo, port, settings, source)
                try:
                    for phase in ("unix", "mqtt"):
                        if phase in phases:
                            load = http_load(daemon.address) if phase == "unix" else mqtt_load
                            results.setdefault(phase + suffix, []).append(measured(load, daemon))
                finally:
                    daemon.stop()
            print(f"round {r + 1}: " + ", ".join(
                f"{name} {runs[-1]['throughput_rps']:.0f} req/s p99 {runs[-1]['latency_ms']['p99']:.2f} ms"
                for name, runs in results.items()), flush=True)
    finally:
        if broker:
            broker.stop()
    print(report(results, args, settings))
    if args.json:  # paths (--json, --baseline) written as strings
        args.json.write_text(json.dumps({"args": vars(args), "results": results}, indent=1, default=str))


def report(results: dict[str, list[dict]], args, settings: dict) -> str:
    def med(name: str, key: str, sub: str | None = None) -> float:
        values = [run[key][sub] if sub else run.get(key, float("nan")) for run in results.get(name, [])]
        return statistics.median(values) if values else float("nan")

    labels = {"mlserver": f"MLServer {args.mlserver_workers} workers, TCP", "unix": "edge-batcher, Unix socket",
              "mqtt-bare": "bare MQTT responder", "mqtt": "edge-batcher, MQTT",
              "unix (baseline)": "baseline, Unix socket", "mqtt (baseline)": "baseline, MQTT"}
    lines = [f"{date.today()}, {platform.node()}: {os.cpu_count()} CPUs, Python {platform.python_version()}; "
             f"medians of {args.rounds} rounds of {args.seconds:g} s, {args.concurrency} closed-loop clients, "
             f"v2 JSON{' (MQTT: binary)' if args.mqtt_binary else ''}, demo vibration model; "
             f"daemon settings {settings or 'defaults'}",
             f"{'':28} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'CPU us/req':>11} {'loop us/req':>12}"]
    for name in results:
        lines.append(f"{labels[name]:28} {med(name, 'throughput_rps'):8.0f} {med(name, 'latency_ms', 'p50'):8.2f} "
                     f"{med(name, 'latency_ms', 'p99'):8.2f} {med(name, 'cpu_us_per_request'):11.0f} "
                     f"{med(name, 'loop_cpu_us_per_request'):12.0f}")
    for ours, ref, goal in (("unix", "mlserver", "throughput >= 3x, p99 < 1x"),
                            ("mqtt", "mqtt-bare", "throughput >= 0.8x, p50 <= 2x")):
        if ours in results and ref in results:
            lines.append(f"{labels[ours]} / {labels[ref]}: "
                         f"throughput {med(ours, 'throughput_rps') / med(ref, 'throughput_rps'):.2f}x, "
                         f"p50 {med(ours, 'latency_ms', 'p50') / med(ref, 'latency_ms', 'p50'):.2f}x, "
                         f"p99 {med(ours, 'latency_ms', 'p99') / med(ref, 'latency_ms', 'p99'):.2f}x (goal: {goal})")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
