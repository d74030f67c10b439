"""`bench --csv FILE`: one row per phase and model, as perf_analyzer's `-f` writes one per load.

The columns, in order (an empty cell: the figure does not apply to that phase):

* ``model``: the model loaded.
* ``phase``: the phase's key in ``--json``: raw_ceiling, minimal_batcher, in_process_closed,
  in_process_open, in_process_no_batching, in_process_closed_any_cpu, in_process_closed_auto,
  unix_socket_closed, url_closed, mqtt.
* ``target``: where the load went: ``engine`` (its infer() called directly), ``in-process``
  (the runtime in the bench's process), the daemon's URL, or ``mqtt://HOST:PORT/TOPIC``.
* ``load``: an open-loop phase's --rate as given (``50%`` of the closed loop's throughput, or
  ``2000/s``).
* ``concurrency``: closed-loop callers (requests outstanding, for MQTT).
* ``offered_rps``: open loop: arrivals submitted per second.
* ``throughput_rps``: the median run's successful answers per second (rows per second for the
  raw ceiling; for the open loop, those answered while arrivals were due).
* ``runs_rps``: every run's throughput, space-separated, in the order they ran.
* ``requests``: successful answers in the median run.
* ``p50_ms``, ``p95_ms``, ``p99_ms``: latency of those answers, milliseconds.
* ``statuses``: every answer of the median run by status, ``200:9000 429:12``.
* ``batch_sizes``: batches run by size, ``8:1100 4:3``; ``dispatch_reasons``: by why they left.
"""

from __future__ import annotations

import csv
from pathlib import Path

COLUMNS = ["model", "phase", "target", "load", "concurrency", "offered_rps", "throughput_rps", "runs_rps",
           "requests", "p50_ms", "p95_ms", "p99_ms", "statuses", "batch_sizes", "dispatch_reasons"]
IN_PROCESS = ["in_process_closed", "in_process_open", "in_process_no_batching", "in_process_closed_any_cpu",
              "in_process_closed_auto"]


def write_csv(results: dict, path: Path) -> None:
    """The results of one model's bench, or of --url's models, as rows with a header."""
    models = results["models"] if "models" in results else [results]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        for r in models:
            for row in rows(r):
                writer.writerow({k: _cell(k, v) for k, v in row.items()})


def rows(r: dict) -> list[dict]:
    """One model's phases as CSV rows, in the order they ran."""
    model = r["model"]
    out = []
    if "raw_ceiling_rps" in r:
        out.append({"model": model, "phase": "raw_ceiling", "target": "engine", "throughput_rps": r["raw_ceiling_rps"]})
        out.append({"model": model, "phase": "minimal_batcher", "target": "engine", "concurrency": r["concurrency"],
                    "throughput_rps": r["minimal_batcher_rps"]})
    for key in IN_PROCESS:
        phases = r.get(key)
        for p in phases if isinstance(phases, list) else [phases] if phases else []:
            closed = p.get("offered_rps") is None
            out.append(_load_row(model, key, "in-process", p, r["concurrency"] if closed else None))
    for key in ("unix_socket_closed", "url_closed"):
        if key in r:
            out.append(_load_row(model, key, r[key]["url"], r[key], r["concurrency"]))
    if "mqtt" in r:
        m = r["mqtt"]
        lat = m["latency_ms"]
        out.append({"model": model, "phase": "mqtt", "target": f"mqtt://{m['address']}/{m['topic']}",
                    "concurrency": m["concurrency"], "throughput_rps": m["throughput_rps"],
                    "runs_rps": _runs(m), "requests": m["completed"], "p50_ms": lat["p50"], "p95_ms": lat["p95"],
                    "p99_ms": lat["p99"], "statuses": _counts(m["status"])})
    return out


def _load_row(model: str, phase: str, target: str, p: dict, concurrency: int | None) -> dict:
    return {"model": model, "phase": phase, "target": target, "load": p.get("load"), "concurrency": concurrency,
            "offered_rps": p.get("offered_rps"), "throughput_rps": p["throughput_rps"], "runs_rps": _runs(p),
            "requests": p["requests"], "p50_ms": p["p50_ms"], "p95_ms": p["p95_ms"], "p99_ms": p["p99_ms"],
            "statuses": _counts(p.get("statuses")), "batch_sizes": _counts(p.get("batch_sizes")),
            "dispatch_reasons": _counts(p.get("dispatch_reasons"))}


def _cell(column: str, value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):  # rates to 0.1/s, latencies to the microsecond
        return f"{value:.3f}" if column.endswith("_ms") else f"{value:.1f}"
    return str(value)


def _runs(p: dict) -> str:
    return " ".join(f"{x:.1f}" for x in p.get("throughput_rps_all", [p["throughput_rps"]]))


def _counts(counts: dict | None) -> str:
    return " ".join(f"{k}:{v}" for k, v in (counts or {}).items())
