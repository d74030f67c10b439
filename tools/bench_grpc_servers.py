#!/usr/bin/env python3
"""The gRPC server's own cost per call, by server kind: grpc.aio (request-streaming handler, as the
edge used to read messages itself; unary on raw bytes; a sync handler on grpcio's pool), grpcio's
sync server, and the daemon's HTTP/2 (transports/grpc_v2/http2.py). Each serves an echo of a
1 KiB message on a Unix socket in a process of its own; grpcio's client drives it from this one
(16 calls in flight) and the server's CPU time per call is printed (docs/benchmarks.md, "gRPC
against HTTP"). No model, no edge: the per-call machinery alone.

Usage: python tools/bench_grpc_servers.py [--seconds 4] [--passes 2] [--kinds own unary ...]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from concurrent import futures
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

KINDS = ("aio-stream", "aio-unary", "aio-sync-handler", "sync-server", "own")
PAYLOAD = b"x" * 1024


def serve(kind: str, path: str) -> None:
    import grpc

    if kind == "sync-server":
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "S", {"M": grpc.unary_unary_rpc_method_handler(lambda raw, context: raw[:100])}),))
        server.add_insecure_port(f"unix:{path}")
        server.start()
        server.wait_for_termination()
        return
    asyncio.run(_serve_async(kind, path))


async def _serve_async(kind: str, path: str) -> None:
    if kind == "own":
        from edge_batcher.transports.grpc_v2.http2 import GrpcConnection

        async def echo(call) -> None:
            message = await call.read_message(1 << 20)
            await call.conn.respond_with(call, message[:100])

        def dispatch(call) -> None:
            call.task = asyncio.get_running_loop().create_task(echo(call))

        def connection() -> GrpcConnection:
            return GrpcConnection(dispatch, idle_timeout_s=60, unix=True, admit=lambda c: True, closed=lambda c: None)

        await asyncio.get_running_loop().create_unix_server(connection, path)
        await asyncio.Event().wait()
    import grpc

    server = grpc.aio.server(options=[("grpc.http2.bdp_probe", 0)])
    if kind == "aio-stream":
        async def streaming(messages, context):
            return (await context.read())[:100]
        handler = grpc.stream_unary_rpc_method_handler(streaming)
    elif kind == "aio-unary":
        async def unary(raw, context):
            return raw[:100]
        handler = grpc.unary_unary_rpc_method_handler(unary)
    else:
        handler = grpc.unary_unary_rpc_method_handler(lambda raw, context: raw[:100])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("S", {"M": handler}),))
    server.add_insecure_port(f"unix:{path}")
    await server.start()
    await server.wait_for_termination()


async def drive(path: str, seconds: float, in_flight: int = 16) -> int:
    import grpc

    calls = 0
    async with grpc.aio.insecure_channel(f"unix:{path}") as channel:
        method = channel.unary_unary("/S/M")
        stop = time.monotonic() + seconds

        async def caller() -> None:
            nonlocal calls
            while time.monotonic() < stop:
                await method(PAYLOAD)
                calls += 1

        await asyncio.gather(*(caller() for _ in range(in_flight)))
    return calls


def measure(kind: str, seconds: float) -> tuple[float, float]:
    import psutil

    with tempfile.TemporaryDirectory(prefix="eb-grpc-servers-") as tmp:
        path = os.path.join(tmp, "s.sock")
        proc = subprocess.Popen([sys.executable, __file__, "--serve", kind, path],
                                env=dict(os.environ, PYTHONPATH=str(ROOT)))
        try:
            deadline = time.monotonic() + 30
            while not os.path.exists(path):
                if time.monotonic() > deadline:
                    raise SystemExit(f"{kind}: the server did not start")
                time.sleep(0.05)
            asyncio.run(drive(path, 1.0))  # warm up
            server = psutil.Process(proc.pid)
            cpu0, t0 = sum(server.cpu_times()[:2]), time.monotonic()
            calls = asyncio.run(drive(path, seconds))
            cpu = sum(server.cpu_times()[:2]) - cpu0
            return calls / (time.monotonic() - t0), cpu / calls * 1e6
        finally:
            proc.kill()
            proc.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    parser.add_argument("--serve", nargs=2, metavar=("KIND", "PATH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(*args.serve)
        return 0
    results: dict[str, list[tuple[float, float]]] = {kind: [] for kind in args.kinds}
    for _ in range(args.passes):
        for kind in args.kinds:
            results[kind].append(measure(kind, args.seconds))
    print("| server | calls/s | server CPU us/call |\n|---|---|---|")
    for kind, runs in results.items():
        print(f"| {kind} | {', '.join(f'{r:.0f}' for r, _ in runs)} | {', '.join(f'{c:.0f}' for _, c in runs)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
