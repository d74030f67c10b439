"""A closed-loop HTTP/1.1 load generator light enough not to be the thing it measures.

`concurrency` keep-alive connections (Unix socket or TCP) each send one pre-encoded request,
wait for its whole answer (Content-Length framing) and send the next at once; latency is from
write to the last byte. Requests are bytes built once and answers are only framed and their
status read, so the generator spends a few tens of microseconds per request: the same cost in
front of every server it is pointed at (this daemon, MLServer), which is what makes their
ratio fair on a machine where load and server share the cores. Used by tools/bench_compare.py.

Entry point: :func:`bench_http` (returns a dict like `bench_mqtt`'s).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import numpy as np

from ..protocol import v2
from .figures import latency_summary


def v2_json_request(inputs: dict[str, np.ndarray]) -> bytes:
    """The KServe v2 JSON body for `inputs` (no binary extension), as tritonclient sends it."""
    body, _ = v2.encode_request(inputs, binary_inputs=False, binary_outputs=False)
    return body


def http_request(path: str, body: bytes, host: str = "localhost") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


class _Connection(asyncio.Protocol):
    """One keep-alive connection: resends `request` as soon as the previous answer is complete."""

    def __init__(self, request: bytes, stop_at: float, done: asyncio.Future, latencies: list[float],
                 statuses: Counter) -> None:
        self.request, self.stop_at, self.done = request, stop_at, done
        self.latencies, self.statuses = latencies, statuses
        self.buffer = bytearray()
        self.need = -1  # bytes of the current answer, once its header is in
        self.sent_at = 0.0

    def connection_made(self, transport) -> None:
        self.transport = transport
        self._send()

    def _send(self) -> None:
        self.sent_at = time.perf_counter()
        self.transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while True:
            if self.need < 0:
                end = self.buffer.find(b"\r\n\r\n")
                if end < 0:
                    return
                head = bytes(self.buffer[:end]).lower().split(b"\r\n")
                length = next((int(line[15:]) for line in head if line.startswith(b"content-length:")), 0)
                self.status = int(head[0][9:12])
                self.need = end + 4 + length
            if len(self.buffer) < self.need:
                return
            del self.buffer[:self.need]
            self.need = -1
            now = time.perf_counter()
            self.latencies.append(now - self.sent_at)
            self.statuses[self.status] += 1
            if now >= self.stop_at:
                self.transport.close()
                return
            self._send()

    def connection_lost(self, exc) -> None:
        if not self.done.done():
            self.done.set_result(exc)


async def _run(address: str, request: bytes, concurrency: int, seconds: float) -> tuple[list[float], Counter, float]:
    loop = asyncio.get_running_loop()
    latencies: list[float] = []
    statuses: Counter = Counter()
    stop_at = time.perf_counter() + seconds
    dones = [loop.create_future() for _ in range(concurrency)]

    def factory(done: asyncio.Future):
        return lambda: _Connection(request, stop_at, done, latencies, statuses)

    t0 = time.perf_counter()
    for done in dones:
        if address.startswith("unix://"):
            await loop.create_unix_connection(factory(done), address[len("unix://"):])
        else:
            host, _, port = address.removeprefix("http://").rpartition(":")
            await loop.create_connection(factory(done), host, int(port))
    errors = [e for e in await asyncio.gather(*dones) if e is not None]
    if errors:
        raise RuntimeError(f"{len(errors)} connections failed: {errors[0]!r}")
    return latencies, statuses, time.perf_counter() - t0


def bench_http(address: str, *, model: str = "vibration", inputs: dict[str, np.ndarray] | None = None,
               duration_s: float = 3.0, warmup_s: float = 0.5, concurrency: int = 32) -> dict:
    """Load the server at `address` ("unix:///path" or "http://host:port") with v2 JSON infer
    requests for `model` and report throughput, latency percentiles and the statuses seen.
    `inputs` defaults to one random row for the demo vibration model (`signal` FP32 [1, 256])."""
    if inputs is None:
        inputs = {"signal": np.random.default_rng(0).standard_normal((1, 256)).astype(np.float32)}
    request = http_request(f"/v2/models/{model}/infer", v2_json_request(inputs))
    if warmup_s > 0:
        asyncio.run(_run(address, request, concurrency, warmup_s))
    latencies, statuses, wall = asyncio.run(_run(address, request, concurrency, duration_s))
    ms = sorted(x * 1e3 for x in latencies)
    return {
        "address": address, "concurrency": concurrency, "requests": len(ms),
        "throughput_rps": len(ms) / wall if wall else 0.0,
        "latency_ms": latency_summary(ms),
        "status": {str(k): v for k, v in sorted(statuses.items())},
    }
