"""`edge-batcher bench`: its arguments, and what it prints (report.py) or writes.

The phases and their order are local_bench.py's, or url_bench.py's against a running daemon
(--url); while they run, each step is announced on stderr (progress.py: a bar on a terminal,
plain lines in logs). The results are tables (throughput and latency; batching and overhead;
the open loop's), or JSON; with --csv FILE also one row per phase and model (csv_table.py), and
with --plot FILE.png a picture of the tables (report.py; matplotlib, the `plot` extra).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from ..client import ClientError
from ..config import load_config
from ..errors import ConfigError
from .csv_table import write_csv
from .local_bench import bench_local
from .open_loop import rates
from .report import format_report, plot_report, pyplot
from .url_bench import bench_url


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="daemon config (default: built-in defaults)")
    p.add_argument("--models", help="model repository (default: the config's)")
    p.add_argument("--model", help="model to measure (default: vibration; with --url, every model the daemon serves)")
    p.add_argument("--duration", type=float, default=3.0, help="seconds per phase (default 3)")
    p.add_argument("--concurrency", type=int, default=64, help="closed-loop callers (default 64)")
    p.add_argument("--rate", type=rates, default=rates("25%,50%,75%"), metavar="RATE[,RATE...]",
                   help="open-loop arrivals per second, one open-loop phase each: a number, or a share of the "
                        "measured closed-loop throughput such as 50%% (default 25%%,50%%,75%%)")
    p.add_argument("--unix", action="store_true", help="also load a daemon subprocess over its Unix socket")
    p.add_argument("--mqtt", metavar="HOST:PORT", help="also load a daemon subprocess through this MQTT broker "
                                                       "(with --url: the daemon at the URL, subscribed there)")
    p.add_argument("--url", help="load a running daemon instead (unix:///path.sock, http://host:port): only the "
                                 "transport phases, on the models it serves; the engine and in-process phases "
                                 "need the model in this process and are skipped")
    p.add_argument("--token", help="bearer token for a --url TCP endpoint that requires one")
    p.add_argument("--mqtt-prefix", metavar="PREFIX",
                   help="with --url and --mqtt: the daemon's [mqtt] topic_prefix (default edge-batcher/<this host>)")
    p.add_argument("--repeat", type=int, default=3, help="repeat each phase, report medians (default 3)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--csv", metavar="FILE", type=Path,
                   help="also write one row per phase and model: throughput, latency percentiles, answers by "
                        "status, batch sizes (columns: docs/benchmarks.md)")
    p.add_argument("--plot", metavar="FILE.png", type=Path,
                   help="also draw throughput, p50/p99 latency and the batch-size mix per phase "
                        "(needs matplotlib: pip install 'edge-batcher[plot]'; not with --url)")


def run(args: argparse.Namespace) -> int:
    if args.csv is not None and not args.csv.resolve().parent.is_dir():
        raise ConfigError(f"--csv {args.csv}: no such directory")  # now, not after minutes of measuring
    if args.url is not None:
        given = [flag for flag, value in (("--config", args.config), ("--models", args.models), ("--unix", args.unix),
                                          ("--plot", args.plot)) if value]
        if given:
            raise ConfigError(f"{', '.join(given)}: not with --url, which loads the daemon at the URL as it runs")
        try:
            results = asyncio.run(bench_url(args))
        except ClientError as exc:  # the daemon unreachable, or refusing the token
            print(f"edge-batcher bench: {exc}", file=sys.stderr)
            return 1
    else:
        config = load_config(args.config)
        if args.models:
            config.models.repository = str(Path(args.models).resolve())
        if args.model is None:
            args.model = "vibration"
        if args.plot is not None:
            pyplot()  # fail now, not after minutes of measuring
        results = asyncio.run(bench_local(config, args))
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print(format_report(results))
    if args.csv is not None:
        write_csv(results, args.csv)
        print(f"CSV written to {args.csv}", file=sys.stderr)
    if args.plot is not None:
        plot_report(results, args.plot)
        print(f"plot written to {args.plot}", file=sys.stderr)
    return 0
