#!/usr/bin/env python3
"""gRPC against HTTP with Triton's own load generator: perf_analyzer, on one daemon, in one run.

Starts `edge-batcher serve` with HTTP and gRPC on TCP (bearer token) and runs perf_analyzer
(`-i http` and `-i grpc`, batch 1, random data, synchronous calls) against the same model at
each `--concurrency`, in rounds that alternate the protocol's order. The table has each
protocol's median over the rounds (throughput, p50, p99 from perf_analyzer's CSV), gRPC's
throughput relative to HTTP's in the same round (median and range), and the daemon's CPU time
per inference (the server's cost, apart from the load generator's, which shares the machine).
perf_analyzer needs glibc 2.38: tools/fetch_perf_analyzer.sh brings it on Debian 12.

Usage: python tools/bench_perf_analyzer.py --perf-analyzer .perf_analyzer/perf_analyzer
           [--concurrency 8 16] [--rounds 3] [--interval-ms 2000] [--model vibration] [--repo engines]
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT))

from bench_grpc_http import TOKEN, cpu_seconds, start_daemon  # noqa: E402

from edge_batcher.client import Client  # noqa: E402


def served(socket_path: Path, model: str) -> int:
    """Inferences the daemon has answered for `model` (its statistics)."""
    with Client(f"unix://{socket_path}") as client:
        return int(client.stats(model)["model_stats"][0]["inference_count"])


def run_once(args: argparse.Namespace, protocol: str, url: str, concurrency: int, out: Path) -> dict:
    cmd = [args.perf_analyzer, "-m", args.model, "-u", url, "-i", protocol,
           "-H", f"authorization: Bearer {TOKEN}", "--concurrency-range", f"{concurrency}:{concurrency}",
           "--measurement-interval", str(args.interval_ms), "--stability-percentage", "50",
           "--max-trials", "6", "-f", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if result.returncode != 0:
        raise SystemExit(f"perf_analyzer -i {protocol} failed:\n{result.stdout[-2000:]}{result.stderr[-2000:]}")
    with open(out) as f:
        row = next(csv.DictReader(f))
    return {"throughput": float(row["Inferences/Second"]), "p50_ms": float(row["p50 latency"]) / 1e3,
            "p99_ms": float(row["p99 latency"]) / 1e3}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--perf-analyzer", required=True, help="the perf_analyzer command")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--interval-ms", type=int, default=2000)
    parser.add_argument("--model", default="vibration")
    parser.add_argument("--repo", default=str(ROOT / "engines"))
    args = parser.parse_args()
    runs: dict[tuple[str, int], list[dict]] = {}
    ratios: dict[int, list[float]] = {c: [] for c in args.concurrency}
    with tempfile.TemporaryDirectory(prefix="eb-bench-pa-") as tmp:
        home = Path(tmp)
        proc, targets = start_daemon(home, Path(args.repo).resolve(), args.model)
        daemon = psutil.Process(proc.pid)
        urls = {"http": targets["HTTP, TCP"].removeprefix("http://"), "grpc": targets["gRPC, TCP"]}
        try:
            for round_ in range(args.rounds):
                for concurrency in args.concurrency:
                    order = ["http", "grpc"] if round_ % 2 == 0 else ["grpc", "http"]
                    this_round = {}
                    for protocol in order:
                        cpu0, n0 = cpu_seconds(daemon), served(home / "eb.sock", args.model)
                        r = run_once(args, protocol, urls[protocol], concurrency, home / "pa.csv")
                        n = served(home / "eb.sock", args.model) - n0
                        r["cpu_us"] = (cpu_seconds(daemon) - cpu0) / max(n, 1) * 1e6
                        runs.setdefault((protocol, concurrency), []).append(r)
                        this_round[protocol] = r["throughput"]
                    ratios[concurrency].append(this_round["grpc"] / this_round["http"])
        finally:
            proc.terminate()
            proc.wait(30)
    print(f"{args.model}, batch 1, perf_analyzer, {args.rounds} rounds of {args.interval_ms} ms windows "
          f"(medians), {os.cpu_count()} CPUs\n")
    print("| concurrency | protocol | infer/s | p50 ms | p99 ms | daemon CPU us/infer | gRPC/HTTP (range) |\n"
          "|---|---|---|---|---|---|---|")
    for concurrency in args.concurrency:
        for protocol in ("http", "grpc"):
            rs = runs[(protocol, concurrency)]
            ratio = ratios[concurrency]
            ratio_text = (f"{statistics.median(ratio):.2f}x ({min(ratio):.2f}-{max(ratio):.2f})"
                          if protocol == "grpc" else "")
            print(f"| {concurrency} | {protocol.upper() if protocol == 'http' else 'gRPC'} | "
                  f"{statistics.median(r['throughput'] for r in rs):.0f} | "
                  f"{statistics.median(r['p50_ms'] for r in rs):.2f} | "
                  f"{statistics.median(r['p99_ms'] for r in rs):.2f} | "
                  f"{statistics.median(r['cpu_us'] for r in rs):.0f} | {ratio_text} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
