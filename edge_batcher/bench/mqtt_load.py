"""Throughput and latency of a running daemon measured through an MQTT broker.

Closed loop: `concurrency` requests are outstanding at any time; each reply (matched by its
Correlation Data) sends the next request at once. Latency is from publish to reply, as a client
sees it: broker hops both ways, the daemon's queue, batching and the engine. The first
`warmup_s` seconds are not counted. The daemon must already be serving with `[mqtt]` enabled on
that broker; `topic_prefix` must match its prefix (default `edge-batcher/<this host name>`,
which is the daemon's default when both run on one machine).

Entry points: :func:`bench_mqtt` (returns a dict) and :func:`format_mqtt_report`.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import uuid
from collections import Counter
from typing import Any

import numpy as np

from ..config import parse_host_port
from ..protocol import v2
from ..transports.mqtt import tcp_no_delay
from .figures import latency_summary


def bench_mqtt(
    address: str,
    *,
    model: str = "vibration",
    topic_prefix: str | None = None,
    inputs: dict[str, np.ndarray] | None = None,
    duration_s: float = 3.0,
    warmup_s: float = 0.5,
    concurrency: int = 32,
    qos: int = 1,
    binary: bool = False,
    connect_timeout_s: float = 10.0,
    drain_timeout_s: float = 10.0,
) -> dict:
    """Load the daemon behind broker `address` ("HOST:PORT") and report throughput and latency.

    `inputs` defaults to one random row for the demo vibration model (`signal` FP32 [1, 256]).
    `binary` sends the v2 binary extension (Content Type application/octet-stream).
    """
    from paho.mqtt.client import Client
    from paho.mqtt.enums import CallbackAPIVersion, MQTTProtocolVersion
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties

    host, port = parse_host_port(address, "--mqtt")
    prefix = topic_prefix or f"edge-batcher/{socket.gethostname()}"
    topic = f"{prefix}/infer/{model}"
    if inputs is None:
        inputs = {"signal": np.random.default_rng(0).standard_normal((1, 256)).astype(np.float32)}
    if binary:
        payload, header_length = v2.encode_request(inputs, binary_inputs=True, binary_outputs=True)
    else:
        payload, header_length = v2.encode_request(inputs, binary_inputs=False, binary_outputs=False)
    reply_topic = f"edge-batcher-bench/{uuid.uuid4().hex}"

    lock = threading.Lock()
    sent: dict[bytes, float] = {}
    done: list[tuple[float, float, str]] = []  # (published, answered, status) of counted requests
    state: dict[str, Any] = {"measuring_from": None, "stop": False, "seq": 0, "counted": 0}
    connected, subscribed, drained = threading.Event(), threading.Event(), threading.Event()

    client = Client(CallbackAPIVersion.VERSION2, client_id=f"eb-bench-{uuid.uuid4().hex[:8]}",
                    protocol=MQTTProtocolVersion.MQTTv5)
    client.max_inflight_messages_set(max(20, concurrency))

    def publish_next() -> None:
        with lock:
            if state["stop"]:
                return
            state["seq"] += 1
            corr = state["seq"].to_bytes(8, "big")
            sent[corr] = time.perf_counter()
        props = Properties(PacketTypes.PUBLISH)
        props.ResponseTopic = reply_topic
        props.CorrelationData = corr
        if header_length is not None:
            props.ContentType = v2.BINARY_CONTENT_TYPE
            props.UserProperty = [(v2.HEADER_LENGTH, str(header_length))]
        client.publish(topic, payload, qos=qos, properties=props)

    def on_message(c, userdata, msg) -> None:
        now = time.perf_counter()
        corr = getattr(msg.properties, "CorrelationData", None)
        status = dict(getattr(msg.properties, "UserProperty", None) or []).get("status", "?")
        with lock:
            started = sent.pop(corr, None) if corr is not None else None
            if started is None:
                return  # a duplicate
            since = state["measuring_from"]
            if since is not None and started >= since:
                done.append((started, now, status))
            if state["stop"] and not sent:
                drained.set()
        publish_next()  # closed loop: paho's thread only queues it

    client.on_socket_open = tcp_no_delay
    client.on_connect = lambda c, u, f, rc, p: connected.set()
    client.on_subscribe = lambda c, u, mid, rcs, p: subscribed.set()
    client.on_message = on_message
    client.connect(host, port, keepalive=30)
    client.loop_start()
    try:
        if not connected.wait(connect_timeout_s):
            raise ConnectionError(f"no MQTT connection to {address} within {connect_timeout_s} s")
        client.subscribe(reply_topic, qos=qos)
        if not subscribed.wait(connect_timeout_s):
            raise ConnectionError(f"subscription to {reply_topic} not acknowledged")
        started = time.perf_counter()
        for _ in range(concurrency):
            publish_next()
        time.sleep(warmup_s)
        with lock:
            state["measuring_from"] = time.perf_counter()
        time.sleep(duration_s)
        with lock:
            window_end = time.perf_counter()
            measured_s = window_end - state["measuring_from"]
            state["stop"] = True
            if not sent:
                drained.set()
        drained.wait(drain_timeout_s)
        with lock:
            unanswered = len(sent)
    finally:
        client.disconnect()
        client.loop_stop()

    counted = [(t1 - t0, status) for t0, t1, status in done if t1 <= window_end]
    completed = len(counted)
    statuses = Counter(status for _, status in counted)
    ms = sorted(x * 1000.0 for x, _ in counted)
    return {
        "address": address,
        "topic": topic,
        "qos": qos,
        "binary": binary,
        "concurrency": concurrency,
        "duration_s": measured_s,
        "total_s": time.perf_counter() - started,
        "completed": completed,
        "throughput_rps": completed / measured_s if measured_s > 0 else 0.0,
        "latency_ms": latency_summary(ms),
        "status": dict(statuses),
        "unanswered": unanswered,
    }


def format_mqtt_report(results: dict) -> str:
    lat = results["latency_ms"]
    status = ", ".join(f"{k}: {v}" for k, v in sorted(results["status"].items())) or "none"
    return "\n".join([
        f"MQTT via {results['address']} ({results['topic']}, qos {results['qos']}, "
        f"{'binary' if results['binary'] else 'JSON'}, {results['concurrency']} outstanding)",
        f"  throughput  {results['throughput_rps']:.0f} req/s "
        f"({results['completed']} in {results['duration_s']:.1f} s)",
        f"  latency     p50 {lat['p50']:.2f} ms, p95 {lat['p95']:.2f} ms, "
        f"p99 {lat['p99']:.2f} ms, max {lat['max']:.2f} ms",
        f"  status      {status}" + (f"; {results['unanswered']} unanswered" if results["unanswered"] else ""),
    ])


if __name__ == "__main__":  # python -m edge_batcher.bench.mqtt_load HOST:PORT [TOPIC_PREFIX] [--json]
    import sys

    args = [a for a in sys.argv[1:] if a != "--json"]
    res = bench_mqtt(args[0], topic_prefix=args[1] if len(args) > 1 else None)
    print(json.dumps(res, indent=2) if "--json" in sys.argv else format_mqtt_report(res))
