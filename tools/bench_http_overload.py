#!/usr/bin/env python3
"""Overload over the Unix socket: how fast a rejected request is told so, and what it costs.

Starts `edge-batcher serve` on a private socket and measures, in one run:

1. capacity: 16 connections, one request each at a time (closed loop);
2. open loop at `--factor` (3) times that capacity: arrivals on a fixed schedule, each sent on an
   idle connection of a pool (at most `--pool` connections, below `max_connections`); latency
   counts from the scheduled arrival, so a client-side wait is not hidden (no coordinated
   omission). This is "3x overload" as a fleet of clients offers it;
3. optionally (`--connections N --depth D`) many connections each keeping D requests pipelined,
   the shape of the original report (HTTP/1.1 answers a connection in order, so there a 429 waits
   behind the requests ahead of it on its connection).

Reports per phase the answers per second, count / p50 / p99 latency / time of the first answer per
status (429 = the model's queue is full, 503 = connection refused at the limit), and the daemon's
RSS at start and at its peak. `--queue-capacity N` runs the model with a smaller queue (a copy of
its repository). The load generator shares the machine with the daemon: compare figures from one
run only.

Usage: python tools/bench_http_overload.py [--factor 3] [--seconds 10] [--queue-capacity 64]
           [--connections 2048 --depth 4] [--model vibration] [--repo engines] [--config-extra ...]
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


def summarize(out: list, wall: float, peak: int) -> dict:
    """out: (status, latency_s, at_s) per answer (status "closed" / "connect failed" for failures)."""
    by_status: dict = {}
    for status, latency, at in out:
        by_status.setdefault(status, []).append((latency, at))
    report = {"answers_per_s": round(sum(1 for s, *_ in out if isinstance(s, int)) / wall),
              "peak_rss_mb": round(peak / 1e6)}
    for status, items in sorted(by_status.items(), key=str):
        lat = np.array([i[0] for i in items]) * 1e3
        report[str(status)] = {"count": len(items), "p50_ms": round(float(np.median(lat)), 1),
                               "p99_ms": round(float(np.percentile(lat, 99)), 1),
                               "first_at_s": round(min(i[1] for i in items), 2)}
    return report


async def watch_rss(proc: psutil.Process, tasks: list) -> int:
    peak = proc.memory_info().rss
    while not all(t.done() for t in tasks):
        peak = max(peak, proc.memory_info().rss)
        await asyncio.sleep(0.05)
    return peak


async def phase(path: str, req: bytes, conns: int, depth: int, seconds: float, proc: psutil.Process) -> dict:
    out: list = []
    t0 = time.perf_counter()
    until = t0 + seconds
    tasks = [asyncio.create_task(connection(path, req, depth, until, out, t0)) for _ in range(conns)]
    peak = await watch_rss(proc, tasks)
    return summarize(out, time.perf_counter() - t0, peak)


async def open_loop(path: str, req: bytes, rate: float, seconds: float, pool: int, proc: psutil.Process) -> dict:
    """Arrivals every 1/rate s for `seconds`, each sent on an idle pooled connection (a new one while
    fewer than `pool` are open; else it waits for one, and that wait counts in its latency)."""
    out: list = []
    idle: asyncio.Queue = asyncio.Queue()
    opened = 0
    t0 = time.perf_counter()

    async def one(due: float) -> None:
        nonlocal opened
        if idle.empty() and opened < pool:
            opened += 1
            try:
                conn = await asyncio.open_unix_connection(path, limit=1 << 20)
            except OSError:
                opened -= 1
                out.append(("connect failed", time.perf_counter() - due, due - t0))
                return
        else:
            conn = await idle.get()
        reader, writer = conn
        try:
            writer.write(req)
            status = await read_status(reader)
        except (OSError, asyncio.IncompleteReadError):
            opened -= 1
            writer.close()
            out.append(("closed", time.perf_counter() - due, due - t0))
            return
        out.append((status, time.perf_counter() - due, due - t0))
        idle.put_nowait(conn)

    tasks: list = []
    watcher = asyncio.ensure_future(watch_rss(proc, tasks))
    n = int(rate * seconds)
    for i in range(n):
        due = t0 + i / rate
        delay = due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(due)))
    await asyncio.gather(*tasks)
    wall = time.perf_counter() - t0
    peak = await watcher
    while not idle.empty():
        idle.get_nowait()[1].close()
    report = summarize(out, wall, peak)
    report["offered_per_s"] = round(rate)
    report["connections_opened"] = opened
    return report


def repository(repo: Path, model: str, queue_capacity: int | None, home: Path) -> Path:
    """`repo`, or a copy of its `model` with another queue_capacity."""
    if queue_capacity is None:
        return repo
    import re
    import shutil

    copy = home / "engines"
    shutil.copytree(repo / model, copy / model)
    toml = copy / model / "model.toml"
    text, count = re.subn(r"(?m)^queue_capacity = \d+$", f"queue_capacity = {queue_capacity}", toml.read_text())
    if not count:
        text = text.replace("[batching]", f"[batching]\nqueue_capacity = {queue_capacity}", 1)
    toml.write_text(text)
    return copy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--factor", type=float, default=3.0, help="open-loop rate as a multiple of the capacity")
    ap.add_argument("--pool", type=int, default=400, help="open loop: connections at most")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--queue-capacity", type=int, default=None, help="run the model with this queue_capacity")
    ap.add_argument("--connections", type=int, default=0, help="also a pipelined phase with this many connections")
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--model", default="vibration")
    ap.add_argument("--repo", default=str(ROOT / "engines"))
    ap.add_argument("--config-extra", default="", help="lines added to [server], ';'-separated")
    args = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # this process and the daemon it starts
    home = Path(tempfile.mkdtemp(prefix="eb-overload-"))
    sock = home / "eb.sock"
    repo = repository(Path(args.repo), args.model, args.queue_capacity, home)
    (home / "config.toml").write_text("[server]\n" + args.config_extra.replace(";", "\n") + "\n")
    log = open(home / "daemon.log", "wb")
    daemon = subprocess.Popen([sys.executable, "-m", "edge_batcher.cli", "serve", "--config", str(home / "config.toml"),
                               "--unix-socket", str(sock), "--models", str(repo)],
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
        results: dict = {"rss_at_start_mb": round(proc.memory_info().rss / 1e6)}
        capacity = asyncio.run(phase(str(sock), req, 16, 1, 3.0, proc))
        results["capacity (16 connections, depth 1)"] = capacity
        rate = args.factor * capacity["answers_per_s"]
        results[f"open loop at {args.factor:g}x capacity ({rate:.0f}/s, pool {args.pool})"] = asyncio.run(
            open_loop(str(sock), req, rate, args.seconds, args.pool, proc))
        if args.connections:
            results[f"pipelined ({args.connections} connections, depth {args.depth})"] = asyncio.run(
                phase(str(sock), req, args.connections, args.depth, args.seconds, proc))
        results["rss_after_mb"] = round(proc.memory_info().rss / 1e6)
        print(json.dumps(results, indent=2))
    finally:
        daemon.terminate()
        daemon.wait(30)


if __name__ == "__main__":
    main()
