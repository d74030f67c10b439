#!/usr/bin/env python3
"""`[batching] dispatch_when_idle` on and off, side by side in one run (docs/benchmarks.md).

Two daemons of this checkout serve the demo vibration model over Unix sockets, one with
`dispatch_when_idle = true` (the default) and one with `false` (every batch waits for partners up
to max_queue_delay_ms, as Triton's dynamic batcher does); `edge_batcher.bench.http_load` drives
each at every `--concurrency` in turn (with `--mqtt`, `edge_batcher.bench.mqtt_load` through a
private mosquitto instead, QoS 1), in rounds that alternate which goes first. Prints medians
over the rounds: throughput, p50 and p99 latency, the daemon's CPU per request (the process)
and rows per batch (from the model's statistics: how much batching the rule gives up).

Usage: python tools/bench_idle_dispatch.py [--repo engines] [--concurrency 1 2 4 8 32]
           [--seconds 3] [--rounds 3] [--mqtt]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from bench_compare import Server, start_daemon  # noqa: E402
from bench_model_setting import measure as setting_run  # noqa: E402
from bench_model_setting import repository  # noqa: E402
from mqtt_faults import _Broker  # noqa: E402

from edge_batcher.bench.http_load import bench_http  # noqa: E402
from edge_batcher.bench.mqtt_load import bench_mqtt  # noqa: E402

MODEL = "vibration"


def measure(server: Server, concurrency: int, seconds: float, mqtt: tuple[str, str] | None) -> dict:
    """One run; `mqtt` (broker address, topic prefix): through the broker instead of the socket."""
    if mqtt is None:
        return setting_run(server, MODEL, lambda: bench_http(server.address, model=MODEL, duration_s=seconds,
                                                              warmup_s=0.0, concurrency=concurrency))
    return setting_run(server, MODEL, lambda: bench_mqtt(mqtt[0], model=MODEL, topic_prefix=mqtt[1],
                                                          duration_s=seconds, warmup_s=0.0, concurrency=concurrency))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", type=Path, default=ROOT / "engines", help="holds the demo vibration model")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 32])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--mqtt", action="store_true", help="load through a private mosquitto (QoS 1), not the socket")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="eb-idle-") as tmp:
        broker = None
        if args.mqtt:
            (Path(tmp) / "broker").mkdir()
            broker = _Broker(Path(tmp) / "broker", 100_000)
            broker.start()
        servers, topics = {}, {}
        try:
            for name, idle in (("idle on", True), ("idle off", False)):
                home = Path(tmp) / name.replace(" ", "-")
                topics[name] = f"edge-batcher/{home.name}"  # one prefix each: both share the broker
                settings = {"mqtt": {"topic_prefix": topics[name]}} if broker else {}
                servers[name] = start_daemon(home, repository(home, args.repo, MODEL, "batching", "dispatch_when_idle",
                                                                        "true" if idle else "false"),
                                             broker.port if broker else None, settings)
            via = {name: (f"127.0.0.1:{broker.port}", topics[name]) if broker else None for name in servers}
            for name, server in servers.items():  # warm both: the first requests pay for imports
                measure(server, 8, 0.5, via[name])
            runs: dict[tuple[str, int], list[dict]] = {}
            for r in range(args.rounds):
                order = list(servers) if r % 2 == 0 else list(reversed(servers))
                for c in args.concurrency:
                    for name in order:
                        runs.setdefault((name, c), []).append(measure(servers[name], c, args.seconds, via[name]))
        finally:
            for server in servers.values():
                server.stop()
            if broker is not None:
                broker.stop()
    transport = "MQTT (QoS 1, one mosquitto)" if args.mqtt else "the Unix socket"
    print(f"demo {MODEL} model, v2 JSON over {transport}, medians of {args.rounds} rounds of {args.seconds:g} s")
    print("| clients | dispatch_when_idle | requests/s | p50 ms | p99 ms | daemon CPU us/request | rows per batch |")
    print("|---|---|---|---|---|---|---|")
    for c in args.concurrency:
        med = {name: {k: statistics.median(run[k] for run in runs[(name, c)]) for k in runs[(name, c)][0]}
               for name in servers}
        for name in servers:
            m = med[name]
            print(f"| {c} | {name.split()[1]} | {m['rps']:.0f} | {m['p50']:.2f} | {m['p99']:.2f} | "
                  f"{m['cpu_us']:.0f} | {m['rows_per_batch']:.2f} |")
        on, off = med["idle on"], med["idle off"]
        print(f"|   | on / off | {on['rps'] / off['rps']:.2f}x | {on['p50'] / off['p50']:.2f}x | "
              f"{on['p99'] / off['p99']:.2f}x | {on['cpu_us'] / off['cpu_us']:.2f}x | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
