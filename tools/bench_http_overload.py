#!/usr/bin/env python3
"""Overload over the Unix socket: how fast a rejected request is told so, and what it costs.

Starts `edge-batcher serve` on a private socket, measures its capacity with a few connections,
then opens many connections that each keep `--depth` requests pipelined (a closed loop: a new
request as soon as one is answered) for `--seconds`. Reports, per phase, the answers per second,
the count, median and p99 latency of each status (429 = rejected because the model's queue is
full), the time to the first 429, and the daemon's RSS at start and at its peak. The load
generator shares the machine with the daemon, so compare figures from one run only.

Usage: python tools/bench_http_overload.py [--connections 2048] [--depth 4] [--seconds 10]
           [--model vibration] [--repo engines] [--config-extra 'max_connections = 4096']
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil

ROOT = Path(__file__).resolve().parents[1]


def request_bytes(model: str) -> bytes:
    x = np.random.default_rng(0).standard_normal((1, 256)).astype(np.float32)
    body = json.dumps({"inputs": [{"name": "signal", "shape": [1, 256], "datatype": "FP32",
                                   "data": x.ravel().tolist()}]}).encode()
    return (f"POST /v2/models/{model}/infer HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


async def read_status(reader: asyncio.StreamReader) -> int:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    await reader.readexactly(length)
    return int(head.split(b" ", 2)[1])


async def connection(path: str, req: bytes, depth: int, until: float, out: list, t0: float) -> None:
    try:
        reader, writer = await asyncio.open_unix_connection(path, limit=1 << 20)
    except OSError:
        out.append(("connect failed", 0.0, time.perf_counter() - t0))
        return
    sent: list[float] = []
    try:
        while time.perf_counter() < until:
            while len(sent) < depth:
                sent.append(time.perf_counter())
                writer.write(req)
            status = await read_status(reader)
            now = time.perf_counter()
            out.append((status, now - sent.pop(0), now - t0))
    except (OSError, asyncio.IncompleteReadError):
        out.append(("closed", 0.0, time.perf_counter() - t0))
    finally:
        writer.close()


async def phase(path: str, req: bytes, conns: int, depth: int, seconds: float, proc: psutil.Process) -> dict:
    out: list = []
    peak = proc.memory_info().rss
    t0 = time.perf_counter()
    until = t0 + seconds
    tasks = [asyncio.create_task(connection(path, req, depth, until, out, t0)) for _ in range(conns)]
    while not all(t.done() for t in tasks):
        peak = max(peak, proc.memory_info().rss)
        await asyncio.sleep(0.05)
    wall = time.perf_counter() - t0
    by_status: dict = {}
    for status, latency, at in out:
        by_status.setdefault(status, []).append((latency, at))
    report = {"answers_per_s": round(sum(1 for s, *_ in out if isinstance(s, int)) / wall), "peak_rss_mb": round(peak / 1e6)}
    for status, items in sorted(by_status.items(), key=str):
        lat = np.array([i[0] for i in items]) * 1e3
        report[str(status)] = {"count": len(items), "p50_ms": round(float(np.median(lat)), 1),
                               "p99_ms": round(float(np.percentile(lat, 99)), 1),
                               "first_at_s": round(min(i[1] for i in items), 2)}
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--connections", type=int, default=2048)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--model", default="vibration")
    ap.add_argument("--repo", default=str(ROOT / "engines"))
    ap.add_argument("--config-extra", default="max_connections = 4096", help="lines added to [server]")
    args = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # this process and the daemon it starts
    home = Path(tempfile.mkdtemp(prefix="eb-overload-"))
    sock = home / "eb.sock"
    (home / "config.toml").write_text("[server]\n" + args.config_extra.replace(";", "\n") + "\n")
    log = open(home / "daemon.log", "wb")
    daemon = subprocess.Popen([sys.executable, "-m", "edge_batcher.cli", "serve", "--config", str(home / "config.toml"),
                               "--unix-socket", str(sock), "--models", args.repo],
                              stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    try:
        deadline = time.monotonic() + 60
        while not sock.exists():
            if daemon.poll() is not None or time.monotonic() > deadline:
                sys.exit(f"daemon did not start; see {home / 'daemon.log'}")
            time.sleep(0.1)
        time.sleep(1.0)
        proc = psutil.Process(daemon.pid)
        req = request_bytes(args.model)
        results = {"rss_at_start_mb": round(proc.memory_info().rss / 1e6)}
        results["capacity (16 connections, depth 1)"] = asyncio.run(phase(str(sock), req, 16, 1, 3.0, proc))
        results[f"overload ({args.connections} connections, depth {args.depth})"] = asyncio.run(
            phase(str(sock), req, args.connections, args.depth, args.seconds, proc))
        results["rss_after_mb"] = round(proc.memory_info().rss / 1e6)
        print(json.dumps(results, indent=2))
    finally:
        daemon.terminate()
        daemon.wait(30)


if __name__ == "__main__":
    main()
