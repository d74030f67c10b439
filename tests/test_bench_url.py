"""`edge-batcher bench --url`: a daemon that is already running (its own process, as the
installed service is) loaded over its Unix socket, its TCP port with a token, and the MQTT
broker it is subscribed on; only the transport phases, on the models it serves."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import numpy as np
import pytest

from tests.support.mqtt import MOSQUITTO, Broker, wait_mqtt
from tests.support.ports import free_port

TOKEN = "bench-s3cret"


def bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edge_batcher.cli", "bench", "--duration", "0.3", "--repeat", "1",
                           "--concurrency", "4", *args], capture_output=True, text=True, timeout=120)


def test_bench_url_loads_the_models_a_running_daemon_serves(start_daemon, tmp_path):
    port = free_port()
    daemon = start_daemon(f'[models]\nload = ["vibration", "seqsum"]\n'
                          f'[server]\nhttp = "127.0.0.1:{port}"\ntoken = "{TOKEN}"\n')
    with daemon.client() as client:  # traffic before the bench: its statistics must not count it
        for _ in range(20):
            client.infer("vibration", {"signal": np.zeros((1, 256), np.float32)})
        batches_before = sum(b["compute_infer"]["count"]
                             for b in client.stats("vibration")["model_stats"][0]["batch_stats"])

    proc = bench("--url", f"http://127.0.0.1:{port}", "--token", TOKEN, "--json", "--csv", str(tmp_path / "url.csv"))
    assert proc.returncode == 0, proc.stderr
    assert "skipped: raw engine ceiling, minimal asyncio batcher and in-process phases" in proc.stderr
    r = json.loads(proc.stdout)
    assert r["url"] == f"http://127.0.0.1:{port}" and "in-process" in r["skipped"]
    assert [m["model"] for m in r["models"]] == ["seqsum", "vibration"]  # every model served, none asked for
    for m in r["models"]:
        assert set(m) == {"model", "preferred_batch_sizes", "concurrency", "duration_s", "repeat", "url_closed"}
        p = m["url_closed"]
        assert p["url"] == r["url"] and p["requests"] > 0 and p["statuses"] == {"200": p["requests"]}
        assert 0 < p["p50_ms"] <= p["p95_ms"] <= p["p99_ms"]
        # The daemon's batches over the phase: every request in one, padding allowed.
        rows = sum(int(size) * count for size, count in p["batch_sizes"].items())
        assert sum(p["batch_sizes"].values()) <= p["requests"] <= rows
        assert sum(p["dispatch_reasons"].values()) == sum(p["batch_sizes"].values())
    with daemon.client() as client:
        batches_after = sum(b["compute_infer"]["count"]
                            for b in client.stats("vibration")["model_stats"][0]["batch_stats"])
    vibration = r["models"][1]["url_closed"]
    assert sum(vibration["batch_sizes"].values()) == batches_after - batches_before
    with open(tmp_path / "url.csv", newline="") as f:  # --csv: a row per model, the URL as its target
        rows = list(csv.DictReader(f))
    assert [(row["model"], row["phase"], row["target"]) for row in rows] == [
        ("seqsum", "url_closed", r["url"]), ("vibration", "url_closed", r["url"])]
    for row, m in zip(rows, r["models"]):
        assert int(row["requests"]) == m["url_closed"]["requests"] and row["statuses"] == f"200:{row['requests']}"

    # The Unix socket, one model; the table names the URL and what was skipped.
    proc = bench("--url", daemon.url, "--model", "vibration")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"the daemon at {daemon.url}: vibration\nskipped: ")
    assert f"{daemon.url} (binary), closed loop" in proc.stdout
    assert "raw engine ceiling" not in proc.stdout.split("skipped:")[1].split("\n", 1)[1]


def test_bench_url_refusals_are_one_line(start_daemon):
    port = free_port()
    daemon = start_daemon(f'[models]\nload = ["vibration"]\n[server]\nhttp = "127.0.0.1:{port}"\ntoken = "{TOKEN}"\n')
    proc = bench("--url", f"http://127.0.0.1:{port}", "--token", "wrong")
    assert proc.returncode == 1 and proc.stderr.strip().splitlines()[-1].startswith("edge-batcher bench: HTTP 401")
    proc = bench("--url", daemon.url, "--model", "nosuch")
    assert proc.returncode == 2 and f"--model nosuch: the daemon at {daemon.url} serves vibration" in proc.stderr
    proc = bench("--url", daemon.url, "--unix")
    assert proc.returncode == 2 and "--unix: not with --url" in proc.stderr


@pytest.mark.skipif(MOSQUITTO is None, reason="mosquitto is not installed (apt-get install mosquitto)")
def test_bench_url_with_mqtt_loads_the_daemon_through_its_broker(start_daemon, tmp_path):
    broker = Broker(tmp_path / "broker").start()
    try:
        daemon = start_daemon(f'[models]\nload = ["vibration"]\n[mqtt]\nenabled = true\nhost = "127.0.0.1"\n'
                              f'port = {broker.port}\ntopic_prefix = "bench-test/dev"\n')
        wait_mqtt(daemon)
        proc = bench("--url", daemon.url, "--mqtt", f"127.0.0.1:{broker.port}", "--mqtt-prefix", "bench-test/dev",
                     "--json")
        assert proc.returncode == 0, proc.stderr
        (m,) = json.loads(proc.stdout)["models"]
        mqtt = m["mqtt"]
        assert mqtt["topic"] == "bench-test/dev/infer/vibration"
        assert mqtt["completed"] > 0 and mqtt["status"] == {"200": mqtt["completed"]}
    finally:
        broker.stop()
