#!/usr/bin/env python3
"""gRPC against HTTP (binary tensors), over TCP and over the Unix socket, in one run.

Starts `edge-batcher serve` with four listeners (HTTP on its Unix socket and on TCP, gRPC on a
Unix socket and on TCP, the TCP ones with a bearer token) and drives the same model with the same
closed-loop load through each: `--concurrency` callers, one 1-row request each at a time, for
`--seconds`. HTTP goes through edge-batcher's AsyncClient (aiohttp, Triton's binary tensor
extension), gRPC through a grpc.aio channel with the generated KServe v2 messages
(raw_input_contents); both in one asyncio loop of this process. The four are run in turn,
`--repeats` times in rotated order; the table has each one's median run (throughput, p50, p99)
and its throughput relative to HTTP on the same socket kind, with the range over the runs, and
the daemon's CPU time per request in that run (the server's cost, apart from the client's). The
load generator shares the machine with the daemon: compare figures from one run only.

Usage: python tools/bench_grpc_http.py [--seconds 5] [--concurrency 16] [--repeats 3]
           [--model vibration] [--repo engines] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from edge_batcher.client import AsyncClient, Client, ClientError  # noqa: E402

TOKEN = "bench-token"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) * 1e3 if values else float("nan")


async def closed_loop(call, concurrency: int, seconds: float) -> dict:
    loop = asyncio.get_running_loop()
    latencies: list[float] = []
    stop_at = loop.time() + seconds

    async def caller() -> None:
        while loop.time() < stop_at:
            t0 = loop.time()
            await call()
            latencies.append(loop.time() - t0)

    for _ in range(concurrency):  # warm the connections up first
        await call()
    t0 = loop.time()
    await asyncio.gather(*(caller() for _ in range(concurrency)))
    wall = loop.time() - t0
    return {"requests": len(latencies), "throughput_rps": len(latencies) / wall,
            "p50_ms": percentile(latencies, 50), "p99_ms": percentile(latencies, 99)}


def http_caller(url: str, model: str, x: np.ndarray):
    client = AsyncClient(url, token=TOKEN if url.startswith("http") else None, binary=True)

    async def call() -> None:
        await client.infer(model, {"signal": x})

    return call, client.close


def grpc_caller(address: str, model: str, x: np.ndarray):
    import grpc

    from edge_batcher.transports.grpc_v2 import grpc_service_pb2 as pb

    channel = grpc.aio.insecure_channel(address)
    infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                                request_serializer=pb.ModelInferRequest.SerializeToString,
                                response_deserializer=pb.ModelInferResponse.FromString)
    metadata = () if address.startswith("unix:") else (("authorization", f"Bearer {TOKEN}"),)

    async def call() -> None:
        request = pb.ModelInferRequest(model_name=model)
        request.inputs.add(name="signal", datatype="FP32", shape=list(x.shape))
        request.raw_input_contents.append(x.tobytes())
        response = await infer(request, metadata=metadata)
        np.frombuffer(response.raw_output_contents[0], "<f4")  # what a caller would decode

    return call, channel.close


def start_daemon(home: Path, repo: Path, model: str, root: Path = ROOT) -> tuple[subprocess.Popen, dict[str, str]]:
    """A daemon of the checkout at `root` with the four listeners, once it is ready."""
    (home / "token").write_text(TOKEN)
    http_port, grpc_port = free_port(), free_port()
    targets = {
        "HTTP, Unix socket": f"unix://{home / 'eb.sock'}",
        "gRPC, Unix socket": f"unix:{home / 'grpc.sock'}",
        "HTTP, TCP": f"http://127.0.0.1:{http_port}",
        "gRPC, TCP": f"127.0.0.1:{grpc_port}",
    }
    (home / "config.toml").write_text(
        f'[server]\nunix_socket = "{home / "eb.sock"}"\nhttp = "127.0.0.1:{http_port}"\n'
        f'token_file = "{home / "token"}"\ngrpc = ["127.0.0.1:{grpc_port}", "unix:{home / "grpc.sock"}"]\n'
        f'log_level = "WARNING"\n[models]\nrepository = "{repo}"\nload = ["{model}"]\n')
    proc = subprocess.Popen([sys.executable, "-m", "edge_batcher.cli", "serve", "--config", str(home / "config.toml")],
                            env=dict(os.environ, PYTHONPATH=str(root)), cwd=root,
                            stdout=open(home / "daemon.log", "wb"),
                            stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while not _ready(home / "eb.sock"):  # the sockets are bound before the models load: wait for ready
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"daemon did not start:\n{(home / 'daemon.log').read_text()}")
        time.sleep(0.1)
    return proc, targets


def _ready(socket_path: Path) -> bool:
    try:
        with Client(f"unix://{socket_path}", timeout=2) as client:
            return client.ready()
    except ClientError:
        return False


def cpu_seconds(process) -> float:
    times = process.cpu_times()
    return times.user + times.system


async def run(args: argparse.Namespace, targets: dict[str, str], daemon_pid: int) -> dict[str, dict]:
    import psutil

    daemon = psutil.Process(daemon_pid)
    x = np.random.default_rng(0).standard_normal((1, 256)).astype(np.float32)
    runs: dict[str, list[dict]] = {name: [] for name in targets}
    names = list(targets)
    for repeat in range(args.repeats):
        for name in names[repeat % len(names):] + names[:repeat % len(names)]:
            make = grpc_caller if name.startswith("gRPC") else http_caller
            call, close = make(targets[name], args.model, x)
            cpu0 = cpu_seconds(daemon)
            result = await closed_loop(call, args.concurrency, args.seconds)
            # the daemon's CPU per request: the server's cost, apart from the load generator's
            result["daemon_cpu_us"] = (cpu_seconds(daemon) - cpu0) / (result["requests"] + args.concurrency) * 1e6
            runs[name].append(result)
            await close()
    medians = {}
    for name, results in runs.items():
        results.sort(key=lambda r: r["throughput_rps"])
        medians[name] = dict(results[len(results) // 2],
                             range_rps=[results[0]["throughput_rps"], results[-1]["throughput_rps"]])
    return medians


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", default="vibration")
    parser.add_argument("--repo", default=str(ROOT / "engines"))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="eb-bench-grpc-") as tmp:
        proc, targets = start_daemon(Path(tmp), Path(args.repo).resolve(), args.model)
        try:
            medians = asyncio.run(run(args, targets, proc.pid))
        finally:
            proc.terminate()
            proc.wait(30)
    if args.json:
        print(json.dumps(medians, indent=2))
        return 0
    print(f"{args.model}, 1-row requests, {args.concurrency} callers, {args.seconds:g} s x {args.repeats} "
          f"(median run), {os.cpu_count()} CPUs\n")
    print("| transport | requests/s | (min-max of the runs) | vs HTTP | p50 ms | p99 ms | daemon CPU us/request |\n"
          "|---|---|---|---|---|---|---|")
    for name, r in medians.items():
        http = medians["HTTP, " + name.split(", ")[1]]["throughput_rps"]
        low, high = r["range_rps"]
        print(f"| {name} | {r['throughput_rps']:.0f} | {low:.0f}-{high:.0f} | {r['throughput_rps'] / http:.2f}x | "
              f"{r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {r['daemon_cpu_us']:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
