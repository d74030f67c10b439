"""Overload over the Unix socket, against a real daemon: more connections than the limit, each
keeping requests pipelined, with a model queue far smaller than the offered load. Every request
is answered (200, or 429 when the queue is full; connections beyond the limit get 503 or are
closed at once), memory stays bounded, the log is not flooded, and the daemon serves normally
afterwards. The latency figures are in docs/benchmarks.md (tools/bench_http_overload.py, the
same load code); this test asserts outcomes, not timings."""

from __future__ import annotations

import asyncio
import importlib.util
import re
import shutil

import numpy as np
import psutil

from tests.support.models import ROOT
from tests.support.signals import windows


def _bench_tool():
    spec = importlib.util.spec_from_file_location("bench_http_overload", ROOT / "tools" / "bench_http_overload.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_overload_with_a_small_queue_answers_everyone_and_stays_bounded(start_daemon, model_repo, tmp_path):
    repo = tmp_path / "repo"
    shutil.copytree(model_repo / "vibration", repo / "vibration")
    toml = repo / "vibration" / "model.toml"
    text, count = re.subn(r"(?m)^queue_capacity = \d+$", "queue_capacity = 8", toml.read_text())
    toml.write_text(text if count else text.replace("[batching]", "[batching]\nqueue_capacity = 8", 1))
    d = start_daemon("[server]\nmax_connections = 64\n", repo=repo)
    proc = psutil.Process(d.proc.pid)
    rss_before = proc.memory_info().rss
    tool = _bench_tool()

    # 400 connections (6x the limit), each with 2 requests pipelined, for 3 s.
    report = asyncio.run(tool.phase(str(d.socket), tool.request_bytes("vibration"), 400, 2, 3.0, proc))

    statuses = {k for k in report if k not in ("answers_per_s", "peak_rss_mb")}
    assert {"200", "429"} <= statuses, report  # served, and refused for the full queue
    assert statuses <= {"200", "429", "503", "closed", "connect failed"}, report  # never a 500
    assert report["429"]["count"] > report["200"]["count"] / 10, report
    refused = sum(report.get(k, {}).get("count", 0) for k in ("503", "closed", "connect failed"))
    assert refused >= 200, report  # ~336 connections beyond the limit of 64, turned away at once
    assert report["peak_rss_mb"] * 1e6 - rss_before < 100e6, (rss_before, report)
    log = d.log_text()
    assert "Traceback" not in log and "unhandled error" not in log
    assert len(re.findall(r"connection limit", log)) <= 3, log[-2000:]

    with d.client() as client:  # and afterwards it serves as before
        out = client.infer("vibration", {"signal": windows(2)})
    assert np.asarray(out["class_id"]).shape == (2,)
