"""deploy/: every metric the Grafana dashboard and the Prometheus alert rules use exists in a
running daemon's /metrics (with MQTT and offload configured, so their gauges have series), and
the standard process_* metrics carry plausible values."""

from __future__ import annotations

import json
import os
import re
import time

import pytest

from tests.support import rawhttp
from tests.support.models import ROOT

DEPLOY = ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana" / "edge-batcher-dashboard.json"
ALERTS = DEPLOY / "prometheus" / "edge-batcher-alerts.yml"
METRIC = re.compile(r"\b((?:edge_batcher|process)_[a-z0-9_]+|up)\b")
SYNTHETIC = {"up"}  # made by Prometheus itself for every scrape, not by the daemon
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")

# MQTT and an offload peer that are not there: the daemon serves anyway, and both gauges
# have a series (0 connected; the peer's breaker).
CONFIG = """
[mqtt]
enabled = true
host = "127.0.0.1"
port = 9
[offload]
enabled = true
health_interval_s = 0.2
[[offload.peers]]
url = "http://127.0.0.1:9"
name = "nowhere"
"""


def dashboard_expressions() -> list[str]:
    doc = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in doc["panels"] for t in p["targets"]]
    exprs += [v["definition"] for v in doc["templating"]["list"] if "definition" in v]
    return exprs


def alert_expressions() -> list[str]:
    yaml = pytest.importorskip("yaml")
    doc = yaml.safe_load(ALERTS.read_text())
    rules = [r for g in doc["groups"] for r in g["rules"]]
    assert {r["alert"] for r in rules} >= {"EdgeBatcherQueueFull", "EdgeBatcherOomRetries",
                                           "EdgeBatcherOffloadBreakerOpen", "EdgeBatcherMqttDisconnected"}
    return [r["expr"] for r in rules]


def exposed(text: str) -> tuple[set[str], dict[str, float]]:
    """Metric family names (# TYPE lines) and the values of unlabelled samples."""
    families = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, value = line.split()
            values[name] = float(value)
    return families, values


def family(name: str) -> str:
    for suffix in HISTOGRAM_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def test_every_metric_in_the_dashboard_and_alerts_exists(start_daemon):
    daemon = start_daemon(CONFIG)
    time.sleep(0.5)  # a few peer health checks
    status, text = rawhttp.request(daemon.socket, "GET", "/metrics")
    assert status == 200
    families, values = exposed(text)
    used = {m for expr in dashboard_expressions() + alert_expressions() for m in METRIC.findall(expr)}
    assert len(used) >= 15
    missing = sorted(m for m in used - SYNTHETIC if family(m) not in families)
    assert not missing, f"used by deploy/ but not in /metrics: {missing}"
    assert values["edge_batcher_mqtt_connected"] == 0
    assert re.search(r'^edge_batcher_offload_breaker_open\{peer="nowhere"\} [01]$', text, re.M)


def test_process_metrics_describe_the_daemon(daemon):
    before = time.time()
    status, text = rawhttp.request(daemon.socket, "GET", "/metrics")
    assert status == 200
    _, values = exposed(text)
    started = values["process_start_time_seconds"]
    assert before - 120 < started <= before
    assert values["process_resident_memory_bytes"] > 10 * 2**20  # numpy + onnxruntime loaded
    assert values["process_cpu_seconds_total"] > 0
    assert 3 <= values["process_open_fds"] < values["process_max_fds"]
    pid = daemon.proc.pid
    assert values["process_open_fds"] == pytest.approx(len(os.listdir(f"/proc/{pid}/fd")), abs=3)
