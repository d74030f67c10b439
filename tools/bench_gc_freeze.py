#!/usr/bin/env python3
"""`[server] gc_freeze` on and off, side by side in one run (docs/benchmarks.md).

Two daemons of this checkout serve the same model repository (the demo's, by default: every
model loaded, as `make run` does) over Unix sockets, one with `gc_freeze = true` (the default)
and one with `false`; `edge_batcher.bench.http_load` drives each in turn with v2 JSON requests
for the vibration model, in rounds that alternate which goes first. Prints per daemon the
medians over the rounds of throughput, p50, p99 and p99.9 latency and daemon CPU per request,
the largest latency seen in any round, and the full (generation 2) collections the daemon ran
while loaded (`python_gc_collections_total`, read from /metrics around each run): the pauses
gc_freeze shortens are those collections' walks over the daemon's long-lived objects.

Usage: python tools/bench_gc_freeze.py [--repo engines] [--concurrency 32] [--seconds 10] [--rounds 3]
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from bench_compare import Server, start_daemon  # noqa: E402

from edge_batcher.bench.http_load import bench_http  # noqa: E402
from edge_batcher.client import Client  # noqa: E402

MODEL = "vibration"


def gc_state(server: Server) -> tuple[int, int]:
    """(full collections so far, objects frozen) from the daemon's /metrics."""
    client = Client(server.address)
    try:
        text = client.metrics()
    finally:
        client.close()
    full = re.search(r'^python_gc_collections_total\{generation="2"\} (\d+)$', text, re.MULTILINE)
    frozen = re.search(r"^edge_batcher_gc_frozen_objects (\d+)$", text, re.MULTILINE)
    assert full and frozen, "the daemon's /metrics lacks the gc series"
    return int(full.group(1)), int(frozen.group(1))


def measure(server: Server, concurrency: int, seconds: float) -> dict:
    cpu0, _ = server.cpu()
    full0, _ = gc_state(server)
    result = bench_http(server.address, model=MODEL, duration_s=seconds, warmup_s=0.0, concurrency=concurrency)
    cpu1, _ = server.cpu()
    full1, frozen = gc_state(server)
    lat = result["latency_ms"]
    return {"rps": result["throughput_rps"], "p50": lat["p50"], "p99": lat["p99"], "p99.9": lat["p99.9"],
            "max": lat["max"], "cpu_us": (cpu1 - cpu0) / max(result["requests"], 1) * 1e6,
            "full_gcs": full1 - full0, "frozen": frozen}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", type=Path, default=ROOT / "engines", help="the model repository (holds vibration)")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    servers: dict[str, Server] = {}
    with tempfile.TemporaryDirectory(prefix="eb-gc-") as tmp:
        try:
            for name, freeze in (("on", True), ("off", False)):
                servers[name] = start_daemon(Path(tmp) / name, args.repo, None, {"server": {"gc_freeze": freeze}})
            for server in servers.values():  # warm both: the first requests pay for imports
                measure(server, 8, 1.0)
            runs: dict[str, list[dict]] = {name: [] for name in servers}
            for r in range(args.rounds):
                for name in (list(servers) if r % 2 == 0 else list(reversed(servers))):
                    runs[name].append(measure(servers[name], args.concurrency, args.seconds))
        finally:
            for server in servers.values():
                server.stop()
    print(f"{MODEL} over the Unix socket (v2 JSON), {args.concurrency} clients, models of {args.repo}, "
          f"medians of {args.rounds} rounds of {args.seconds:g} s")
    print("| gc_freeze | objects frozen | requests/s | p50 ms | p99 ms | p99.9 ms | max ms (median; largest) "
          "| full collections per run | daemon CPU us/request |")
    print("|---|---|---|---|---|---|---|---|---|")
    med = {}
    for name, rs in runs.items():
        m = med[name] = {k: statistics.median(run[k] for run in rs) for k in rs[0]}
        print(f"| {name} | {m['frozen']:.0f} | {m['rps']:.0f} | {m['p50']:.2f} | {m['p99']:.2f} | "
              f"{m['p99.9']:.2f} | {m['max']:.1f}; {max(run['max'] for run in rs):.1f} | "
              f"{', '.join(str(run['full_gcs']) for run in rs)} | {m['cpu_us']:.0f} |")
    on, off = med["on"], med["off"]
    ratio = {k: on[k] / off[k] for k in ("rps", "p50", "p99", "p99.9", "max", "cpu_us")}
    print(f"| on / off | | {ratio['rps']:.2f}x | {ratio['p50']:.2f}x | {ratio['p99']:.2f}x | {ratio['p99.9']:.2f}x "
          f"| {ratio['max']:.2f}x | | {ratio['cpu_us']:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
