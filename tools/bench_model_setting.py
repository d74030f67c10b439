#!/usr/bin/env python3
"""One model.toml setting at two values, side by side in one run (docs/benchmarks.md).

Two daemons of this checkout serve the same model, copied from `--repo`, its model.toml
differing only in `--setting TABLE.KEY` (`A` and `B`, TOML values); `edge_batcher.bench.http_load`
drives each over its Unix socket at every `--concurrency` in turn, in rounds that alternate which
goes first. Prints medians over the rounds: throughput, p50 and p99 latency, the daemon's CPU per
request (the whole process: engine thread pools included) and rows per batch.

Usage: python tools/bench_model_setting.py --model minilm --setting onnxruntime.allow_spinning
           --values true false [--repo engines] [--concurrency 1 4 16] [--seconds 3] [--rounds 3]
           [--text "how often should the bearings be greased?"]
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from bench_compare import Server, start_daemon  # noqa: E402

from edge_batcher.bench.http_load import bench_http  # noqa: E402
from edge_batcher.bench.url_bench import sample_inputs  # noqa: E402
from edge_batcher.client import Client  # noqa: E402


def with_setting(text: str, table: str, key: str, value: str) -> str:
    """model.toml `text` with `key = value` in `[table]` (the key replaced, or added; the table
    added at the end if the file has none)."""
    header = re.search(rf"^\[{re.escape(table)}\]\s*$", text, re.MULTILINE)
    if header is None:
        return text.rstrip("\n") + f"\n\n[{table}]\n{key} = {value}\n"
    end = re.search(r"^\[", text[header.end():], re.MULTILINE)
    stop = header.end() + end.start() if end else len(text)
    body = text[header.end():stop]
    line = re.compile(rf"^{re.escape(key)}\s*=.*$", re.MULTILINE)
    body = line.sub(f"{key} = {value}", body) if line.search(body) else f"\n{key} = {value}" + body
    return text[:header.end()] + body + text[stop:]


def repository(home: Path, source: Path, model: str, table: str, key: str, value: str) -> Path:
    repo = home / "repo"
    shutil.copytree(source / model, repo / model)
    toml = repo / model / "model.toml"
    toml.write_text(with_setting(toml.read_text(), table, key, value))
    return repo


def counts(server: Server, model: str) -> tuple[int, int]:
    """(requests answered, batches run) so far, from the model's statistics."""
    client = Client(server.address)
    stats = client.stats(model)["model_stats"][0]
    client.close()
    return stats["inference_stats"]["success"]["count"], stats["execution_count"]


def measure(server: Server, model: str, load: Callable[[], dict]) -> dict:
    """One run of `load` (bench_http or bench_mqtt against the server): its throughput and
    latency, and the server's CPU and rows per batch over it."""
    cpu0, _ = server.cpu()
    answered0, batches0 = counts(server, model)
    result = load()
    cpu1, _ = server.cpu()
    answered1, batches1 = counts(server, model)
    n = max(answered1 - answered0, 1)
    return {"rps": result["throughput_rps"], "p50": result["latency_ms"]["p50"], "p99": result["latency_ms"]["p99"],
            "cpu_us": (cpu1 - cpu0) / n * 1e6, "rows_per_batch": n / max(batches1 - batches0, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--setting", required=True, help="TABLE.KEY of model.toml, e.g. onnxruntime.allow_spinning")
    parser.add_argument("--values", nargs=2, required=True, metavar=("A", "B"), help="two TOML values")
    parser.add_argument("--repo", type=Path, default=ROOT / "engines")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--text", default="how often should the bearings on the fan motor be greased?",
                        help="the text of a BYTES input")
    args = parser.parse_args(argv)
    table, _, key = args.setting.rpartition(".")
    if not table or not key:
        parser.error("--setting: expected TABLE.KEY")
    names = [f"{key} = {value}" for value in args.values]
    if len(set(names)) != 2:
        parser.error("--values: two different values")
    with tempfile.TemporaryDirectory(prefix="eb-setting-") as tmp:
        servers: dict[str, Server] = {}
        try:
            for i, (name, value) in enumerate(zip(names, args.values)):
                home = Path(tmp) / f"variant{i}"
                servers[name] = start_daemon(home, repository(home, args.repo, args.model, table, key, value),
                                             None, {})
            client = Client(next(iter(servers.values())).address)
            inputs = sample_inputs(client.model_metadata(args.model))
            client.close()
            for name in inputs:
                if inputs[name].dtype == object:
                    inputs[name] = np.full(inputs[name].shape, args.text.encode(), dtype=object)

            def over_socket(server: Server, concurrency: int, seconds: float) -> dict:
                return measure(server, args.model, lambda: bench_http(
                    server.address, model=args.model, inputs=inputs, duration_s=seconds, warmup_s=0.0,
                    concurrency=concurrency))

            for server in servers.values():  # warm both: the first requests pay for imports
                over_socket(server, 4, 0.5)
            runs: dict[tuple[str, int], list[dict]] = {}
            for r in range(args.rounds):
                order = names if r % 2 == 0 else names[::-1]
                for c in args.concurrency:
                    for name in order:
                        runs.setdefault((name, c), []).append(over_socket(servers[name], c, args.seconds))
        finally:
            for server in servers.values():
                server.stop()
    print(f"{args.model}, v2 JSON over the Unix socket, [{table}] {key} = {' or '.join(args.values)}, "
          f"medians of {args.rounds} rounds of {args.seconds:g} s")
    print(f"| clients | {key} | requests/s | p50 ms | p99 ms | daemon CPU us/request | rows per batch |")
    print("|---|---|---|---|---|---|---|")
    for c in args.concurrency:
        med = {name: {k: statistics.median(run[k] for run in runs[(name, c)]) for k in runs[(name, c)][0]}
               for name in names}
        for name, value in zip(names, args.values):
            m = med[name]
            print(f"| {c} | {value} | {m['rps']:.0f} | {m['p50']:.2f} | {m['p99']:.2f} | "
                  f"{m['cpu_us']:.0f} | {m['rows_per_batch']:.2f} |")
        a, b = med[names[0]], med[names[1]]
        print(f"|   | {args.values[0]} / {args.values[1]} | {a['rps'] / b['rps']:.2f}x | {a['p50'] / b['p50']:.2f}x | "
              f"{a['p99'] / b['p99']:.2f}x | {a['cpu_us'] / b['cpu_us']:.2f}x | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
