#!/usr/bin/env python3
"""Camera frames over the Unix socket three ways, side by side in one run: JSON, Triton's binary
tensor extension, and system shared memory (issue 30).

Starts `edge-batcher serve` on a private Unix socket with `--repo` and drives `--model` (default
`vision`: uint8 frames [N, 480, 640, 3]) with the same frames through each: `--concurrency`
threads, one 1-frame request each at a time, for `--seconds`. The request bodies are encoded
before the clock starts and each shared memory caller has its frames already in its region (a
camera would write them there), so what is timed is the transport and the daemon, not this
process's encoding. Outputs come back as JSON, as binary tensors, or written into the caller's
region. The three are run in turn, `--repeats` times in rotated order; the table has each one's
median run (throughput, p50, p99, ratios to binary) and the daemon's CPU time per request in that
run, with its event loop thread's share in brackets, and the callers' own CPU per request (this
process's: the load generator's part of what follows). It also splits each request's mean latency
into the daemon's own time for it (from arrival at the model's queue to its answer: batching, the
engine, the split; the model statistics' `success` time) and the rest, the transport's share
(sending and reading the body, decoding, encoding and the answer's way back), and prints how far
shared memory takes that share below binary tensors': what issue 30 asks where the model's own
time dominates. The load generator shares the machine
with the daemon: compare figures from one run only.

Usage: python tools/bench_shared_memory.py [--repo engines] [--model vision] [--shape 480,640,3]
           [--seconds 5] [--concurrency 4] [--repeats 3] [--frames 8] [--modes 0,1,2]
           [--caller-cpus 0] [--json]
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import socket
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from bench_compare import Server, start_daemon  # noqa: E402

from edge_batcher.client import Client, SharedMemoryRegion  # noqa: E402
from edge_batcher.client_shared_memory import encode_request as encode_with_regions  # noqa: E402
from edge_batcher.protocol.v2 import (  # noqa: E402
    BINARY_CONTENT_TYPE,
    HEADER_LENGTH,
    JSON_CONTENT_TYPE,
    encode_request,  # noqa: E402
)
from edge_batcher.types import DATATYPE_TO_NUMPY  # noqa: E402

MODES = ("JSON", "binary tensors", "shared memory")


class UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str):
        super().__init__("localhost", timeout=120)
        self.path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(self.path)


class Caller:
    """One thread's connection and requests for one mode; call() sends the next frame."""

    def __init__(self, sock: str, mode: str, model: str, input_name: str, frames: np.ndarray, outputs: dict):
        self.conn = UnixConnection(sock)
        self.path = f"/v2/models/{model}/infer"
        self.region: SharedMemoryRegion | None = None
        self.bodies: list[tuple[bytes, dict[str, str]]] = []
        if mode == "shared memory":
            frame_bytes = frames[0].nbytes
            out_bytes = sum(outputs.values())
            self.region = SharedMemoryRegion(f"bench-{uuid.uuid4().hex[:8]}", f"/eb-bench-{uuid.uuid4().hex[:12]}",
                                             len(frames) * frame_bytes + out_bytes)
            with Client(f"unix://{sock}") as client:
                client.register_region(self.region)
            places = {}
            offset = len(frames) * frame_bytes
            for name, size in outputs.items():
                places[name] = self.region.output(offset, size)
                offset += size
            for i, frame in enumerate(frames):
                placed = self.region.put(frame[None], offset=i * frame_bytes)
                self.bodies.append(_headers(*encode_with_regions({input_name: placed}, places, outputs=None, id=None,
                                                                 parameters=None, binary=True)))
        else:
            binary = mode == "binary tensors"
            for frame in frames:
                self.bodies.append(_headers(*encode_request({input_name: frame[None]}, binary_inputs=binary,
                                                            binary_outputs=binary)))
        self.next = 0

    def call(self) -> None:
        body, headers = self.bodies[self.next % len(self.bodies)]
        self.next += 1
        self.conn.request("POST", self.path, body=body, headers=headers)
        response = self.conn.getresponse()
        data = response.read()
        if response.status != 200:
            raise SystemExit(f"request failed: {response.status} {data[:300]!r}")

    def close(self, sock: str) -> None:
        self.conn.close()
        if self.region is not None:
            with Client(f"unix://{sock}") as client:
                client.unregister_region(self.region.name)
            self.region.close()


def _headers(body: bytes, header_length: int | None) -> tuple[bytes, dict[str, str]]:
    if header_length is None:
        return body, {"Content-Type": JSON_CONTENT_TYPE}
    return body, {"Content-Type": BINARY_CONTENT_TYPE, HEADER_LENGTH: str(header_length)}


def closed_loop(callers: list[Caller], seconds: float, server_time: Callable[[], tuple[int, int]]) -> dict:
    """`seconds` of `callers` each sending its next frame when the last is answered; `server_time`
    gives the model's (answered requests, their summed time in the daemon in ns) so far."""
    latencies: list[list[float]] = [[] for _ in callers]

    def work(caller: Caller, out: list[float]) -> None:
        while True:  # one request at least, however slow (JSON bodies of large frames take seconds)
            t0 = time.perf_counter()
            caller.call()
            out.append(time.perf_counter() - t0)
            if time.perf_counter() >= stop_at:
                return

    for caller in callers:
        caller.call()  # connections open, daemon paths warm
    count0, ns0 = server_time()
    cpu0 = time.process_time()  # this process's: the callers' own cost
    t0 = time.perf_counter()
    stop_at = t0 + seconds
    threads = [threading.Thread(target=work, args=(c, out)) for c, out in zip(callers, latencies, strict=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    client_cpu = time.process_time() - cpu0
    count1, ns1 = server_time()
    flat = np.asarray([x for out in latencies for x in out])
    mean_ms = float(flat.mean()) * 1e3
    in_daemon_ms = (ns1 - ns0) / max(count1 - count0, 1) / 1e6
    return {"requests": len(flat), "throughput_rps": len(flat) / wall,
            "p50_ms": float(np.percentile(flat, 50)) * 1e3, "p99_ms": float(np.percentile(flat, 99)) * 1e3,
            "mean_ms": mean_ms, "model_ms": in_daemon_ms, "transport_ms": mean_ms - in_daemon_ms,
            "client_cpu_ms": client_cpu / max(len(flat), 1) * 1e3}


def success_time(sock: str, model: str) -> tuple[int, int]:
    """The model's answered requests and their summed time from arrival to answer (ns)."""
    with Client(f"unix://{sock}") as client:
        success = client.stats(model)["model_stats"][0]["inference_stats"]["success"]
    return int(success["count"]), int(success["ns"])


def model_io(sock: str, model: str) -> tuple[str, dict[str, int]]:
    """The model's first input, and each output's bytes for one row."""
    with Client(f"unix://{sock}") as client:
        meta = client.model_metadata(model)
    outputs = {o["name"]: math.prod(max(d, 1) for d in o["shape"][1:]) * DATATYPE_TO_NUMPY[o["datatype"]].itemsize
               for o in meta["outputs"]}
    return meta["inputs"][0]["name"], outputs


def run(args: argparse.Namespace, sock: str, daemon: Server) -> dict[str, dict]:
    shape = tuple(int(d) for d in args.shape.split(","))
    frames = np.random.default_rng(0).integers(0, 256, (args.frames, *shape), dtype=np.uint8)
    input_name, outputs = model_io(sock, args.model)
    modes = [MODES[int(i)] for i in args.modes.split(",")] if args.modes else list(MODES)
    runs: dict[str, list[dict]] = {mode: [] for mode in modes}
    for repeat in range(args.repeats):
        for mode in modes[repeat % len(modes):] + modes[:repeat % len(modes)]:
            callers = [Caller(sock, mode, args.model, input_name, frames, outputs) for _ in range(args.concurrency)]
            cpu0, loop0 = daemon.cpu()
            result = closed_loop(callers, args.seconds, lambda: success_time(sock, args.model))
            # the daemon's CPU per request: the server's cost, apart from the load generator's;
            # of it, the event loop's thread (HTTP, decoding, scheduling, answers)
            answered = result["requests"] + len(callers)
            cpu1, loop1 = daemon.cpu()
            result["daemon_cpu_ms"] = (cpu1 - cpu0) / answered * 1e3
            result["loop_cpu_ms"] = (loop1 - loop0) / answered * 1e3
            runs[mode].append(result)
            for caller in callers:
                caller.close(sock)
    medians = {}
    for mode, results in runs.items():
        results.sort(key=lambda r: r["throughput_rps"])
        medians[mode] = dict(results[len(results) // 2],
                             range_rps=[results[0]["throughput_rps"], results[-1]["throughput_rps"]])
    return medians


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", default=str(ROOT / "engines"))
    parser.add_argument("--model", default="vision")
    parser.add_argument("--shape", default="480,640,3", help="one frame's shape (uint8), without the batch")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--frames", type=int, default=8, help="distinct frames each caller cycles through")
    parser.add_argument("--modes", default="", help="which of 0 (JSON), 1 (binary), 2 (shared memory): e.g. 1,2")
    parser.add_argument("--caller-cpus", default="",
                        help="keep the callers on these CPUs (e.g. 0), the daemon on all: on a small machine, "
                             "cameras whose processes run beside the daemon's rather than in its way")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="eb-bench-shm-") as tmp:
        daemon = start_daemon(Path(tmp), Path(args.repo).resolve(), None,
                              {"server": {"max_body_bytes": 256 << 20}, "models": {"load": [args.model]}})
        if args.caller_cpus:  # after the daemon started: it keeps every CPU
            os.sched_setaffinity(0, {int(c) for c in args.caller_cpus.split(",")})
        try:
            medians = run(args, str(Path(tmp) / "eb.sock"), daemon)
        finally:
            daemon.stop()
    if args.json:
        print(json.dumps(medians, indent=2))
        return 0
    print(f"{args.model}, 1-frame uint8 [{args.shape}] requests over the Unix socket, {args.concurrency} callers, "
          f"{args.seconds:g} s x {args.repeats} (median run), {os.cpu_count()} CPUs"
          f"{f', callers on CPU {args.caller_cpus}' if args.caller_cpus else ''}\n")
    # ratios against binary tensors; a run without them compares with its first transport
    ref = "binary tensors" if "binary tensors" in medians else next(iter(medians))
    base = medians[ref]
    print(f"| transport | requests/s | (min-max of the runs) | vs {ref} | p50 ms | p50 vs {ref} | p99 ms | "
          "daemon CPU ms/request (event loop) | callers' CPU ms/request | mean ms = in the daemon + transport |\n"
          "|---|---|---|---|---|---|---|---|---|---|")
    for mode, r in medians.items():
        low, high = r["range_rps"]
        print(f"| {mode} | {r['throughput_rps']:.1f} | {low:.1f}-{high:.1f} | "
              f"{r['throughput_rps'] / base['throughput_rps']:.2f}x | {r['p50_ms']:.2f} | "
              f"{r['p50_ms'] / base['p50_ms']:.2f}x | {r['p99_ms']:.2f} | "
              f"{r['daemon_cpu_ms']:.2f} ({r['loop_cpu_ms']:.2f}) | {r['client_cpu_ms']:.2f} | "
              f"{r['mean_ms']:.2f} = {r['model_ms']:.2f} + {r['transport_ms']:.2f} |")
    if "shared memory" in medians and "binary tensors" in medians:
        shm = medians["shared memory"]
        print(f"\ntransport's share of a request: binary tensors {base['transport_ms']:.2f} ms "
              f"({base['transport_ms'] / base['mean_ms']:.0%} of its mean latency), shared memory "
              f"{shm['transport_ms']:.2f} ms ({shm['transport_ms'] / shm['mean_ms']:.0%}): "
              f"{1 - shm['transport_ms'] / base['transport_ms']:.0%} less")
    return 0


if __name__ == "__main__":
    sys.exit(main())
