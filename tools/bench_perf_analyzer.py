#!/usr/bin/env python3
"""Transports side by side with Triton's own load generator: perf_analyzer, on one daemon, in one run.

Starts `edge-batcher serve` with HTTP and gRPC on TCP (bearer token) and runs perf_analyzer
(batch 1, random data, synchronous calls) against the same model at each `--concurrency`, once
per variant and round, the variants' order rotating from round to round. A variant is a protocol
(`http`, `grpc`) with `+shm` for Triton's system shared memory or `+cudashm` for CUDA shared
memory (a GPU's; inputs and outputs in regions perf_analyzer creates and registers). The table
has each variant's median over the rounds (throughput, p50, p99), its throughput relative to the
first variant's in the same round (median and range), the daemon's CPU time per inference (the
server's cost, apart from the load generator's, which shares the machine), and each request's
mean latency split into the time the daemon's statistics count (queue and compute) and the
rest: the transport's share (sending, reading and decoding the body, the answer's way back).
perf_analyzer needs glibc 2.38: tools/fetch_perf_analyzer.sh brings it on Debian 12.
`--baseline DIR` starts another checkout's daemon beside this one and runs every variant on
both, alternating within each round: a change's A/B in one command (rows marked "(baseline)").

Usage: python tools/bench_perf_analyzer.py --perf-analyzer .perf_analyzer/perf_analyzer
           [--concurrency 8 16] [--rounds 3] [--interval-ms 2000] [--model vibration] [--repo engines]
           [--variants http grpc]        # e.g. --variants http http+shm --model vision
           [--baseline DIR]              # e.g. git worktree add /tmp/base HEAD~3
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

# perf_analyzer's CSV columns (microseconds of the mean request): the time the server's
# statistics count, and the rest (its "Network+Server Send/Recv" is the mean latency less all others)
SERVER_COLUMNS = ("Server Queue", "Server Compute Input", "Server Compute Infer", "Server Compute Output")
TRANSPORT_COLUMNS = ("Client Send", "Network+Server Send/Recv", "Client Recv")


def served(socket_path: Path, model: str) -> int:
    """Inferences the daemon has answered for `model` (its statistics)."""
    with Client(f"unix://{socket_path}") as client:
        return int(client.stats(model)["model_stats"][0]["inference_count"])


def label(variant: str) -> str:
    protocol, _, shm = variant.partition("+")
    return ("HTTP" if protocol == "http" else "gRPC") + {"": "", "shm": ", shared memory",
                                                          "cudashm": ", CUDA shared memory"}[shm]


def run_once(args: argparse.Namespace, variant: str, url: str, concurrency: int, out: Path) -> dict:
    protocol, _, shm = variant.partition("+")
    cmd = [args.perf_analyzer, "-m", args.model, "-u", url, "-i", protocol,
           "-H", f"authorization: Bearer {TOKEN}", "--concurrency-range", f"{concurrency}:{concurrency}",
           "--measurement-interval", str(args.interval_ms), "--stability-percentage", "50",
           "--max-trials", "6", "-f", str(out)]
    if shm:
        cmd += ["--shared-memory", "cuda" if shm == "cudashm" else "system",
                "--output-shared-memory-size", str(args.output_shm_bytes)]
    out.unlink(missing_ok=True)  # never read the last variant's figures as this one's
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if result.returncode != 0 or not out.exists():
        written = "" if out.exists() else ", no CSV written"
        raise SystemExit(f"perf_analyzer ({variant}) failed (exit {result.returncode}{written}):\n"
                         f"{result.stdout[-2000:]}{result.stderr[-2000:]}")
    with open(out) as f:
        row = next(csv.DictReader(f), None)
    if row is None:
        raise SystemExit(f"perf_analyzer ({variant}) wrote no measurement:\n{result.stdout[-2000:]}")
    in_daemon_ms = sum(float(row[c]) for c in SERVER_COLUMNS) / 1e3
    mean_ms = in_daemon_ms + sum(float(row[c]) for c in TRANSPORT_COLUMNS) / 1e3
    return {"throughput": float(row["Inferences/Second"]), "p50_ms": float(row["p50 latency"]) / 1e3,
            "p99_ms": float(row["p99 latency"]) / 1e3, "mean_ms": mean_ms, "in_daemon_ms": in_daemon_ms}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--perf-analyzer", required=True, help="the perf_analyzer command")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--interval-ms", type=int, default=2000)
    parser.add_argument("--model", default="vibration")
    parser.add_argument("--repo", default=str(ROOT / "engines"))
    parser.add_argument("--variants", nargs="+", default=["http", "grpc"],
                        choices=["http", "grpc", "http+shm", "grpc+shm", "http+cudashm", "grpc+cudashm"],
                        help="the first is the one the others are compared with")
    parser.add_argument("--output-shm-bytes", type=int, default=4096,
                        help="bytes of shared memory perf_analyzer gives each output (+shm, +cudashm)")
    parser.add_argument("--baseline", type=Path, help="another checkout whose daemon runs in the same rounds")
    args = parser.parse_args()
    sides = [("", ROOT)] + ([(" (baseline)", args.baseline.resolve())] if args.baseline else [])
    rows = [(variant, side) for variant in args.variants for side, _ in sides]
    runs: dict[tuple[str, str, int], list[dict]] = {}
    ratios: dict[tuple[str, str, int], list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="eb-bench-pa-") as tmp:
        daemons = {}
        try:
            for i, (side, root) in enumerate(sides):
                home = Path(tmp) / f"d{i}"
                home.mkdir()
                proc, targets = start_daemon(home, Path(args.repo).resolve(), args.model, root)
                daemons[side] = (home, proc, psutil.Process(proc.pid),
                                 {"http": targets["HTTP, TCP"].removeprefix("http://"), "grpc": targets["gRPC, TCP"]})
            for round_ in range(args.rounds):
                for concurrency in args.concurrency:
                    shift = round_ % len(rows)
                    this_round = {}
                    for variant, side in rows[shift:] + rows[:shift]:
                        home, _, daemon, urls = daemons[side]
                        cpu0, n0 = cpu_seconds(daemon), served(home / "eb.sock", args.model)
                        r = run_once(args, variant, urls[variant.partition("+")[0]], concurrency, home / "pa.csv")
                        n = served(home / "eb.sock", args.model) - n0
                        if n == 0:
                            raise SystemExit(f"perf_analyzer ({variant}{side}) reported {r['throughput']:.0f} "
                                             "infer/s but the daemon answered nothing")
                        r["cpu_us"] = (cpu_seconds(daemon) - cpu0) / max(n, 1) * 1e6
                        runs.setdefault((variant, side, concurrency), []).append(r)
                        this_round[(variant, side)] = r["throughput"]
                    for variant, side in rows:
                        if variant != args.variants[0]:
                            ratios.setdefault((variant, side, concurrency), []).append(
                                this_round[(variant, side)] / this_round[(args.variants[0], side)])
        finally:
            for _, proc, _, _ in daemons.values():
                proc.terminate()
                proc.wait(30)
    print(f"{args.model}, batch 1, perf_analyzer, {args.rounds} rounds of {args.interval_ms} ms windows "
          f"(medians), {os.cpu_count()} CPUs\n")
    print(f"| concurrency | variant | infer/s | vs {label(args.variants[0])} (range) | p50 ms | p99 ms "
          "| daemon CPU us/infer | mean ms = in the daemon + transport |\n|---|---|---|---|---|---|---|---|")
    for concurrency in args.concurrency:
        for variant, side in rows:
            rs = runs[(variant, side, concurrency)]
            ratio = ratios.get((variant, side, concurrency))
            ratio_text = f"{statistics.median(ratio):.2f}x ({min(ratio):.2f}-{max(ratio):.2f})" if ratio else ""
            mean, in_daemon = (statistics.median(r[k] for r in rs) for k in ("mean_ms", "in_daemon_ms"))
            print(f"| {concurrency} | {label(variant)}{side} | {statistics.median(r['throughput'] for r in rs):.0f} | "
                  f"{ratio_text} | {statistics.median(r['p50_ms'] for r in rs):.2f} | "
                  f"{statistics.median(r['p99_ms'] for r in rs):.2f} | "
                  f"{statistics.median(r['cpu_us'] for r in rs):.0f} | "
                  f"{mean:.2f} = {in_daemon:.2f} + **{mean - in_daemon:.2f}** |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
