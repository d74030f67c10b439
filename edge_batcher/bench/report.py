"""What `edge-batcher bench` shows: its results as readable tables, and as a picture.

:func:`format_report` turns the results that local_bench.py (or url_bench.py, per model of a
running daemon) measures into a throughput/latency table, a batching/overhead table and the
open loop's table, with the ratios under them; :func:`plot_report` draws throughput, p50/p99
latency and the batch-size mix per phase into a PNG with matplotlib (the optional ``plot``
extra, imported only when a plot is asked for).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import ConfigError


def _phases(r: dict) -> list[tuple[str, dict]]:
    """The load phases in the order they ran, each as one row: label and figures (a daemon at
    --url has only the transport phases)."""
    rows = []
    if "in_process_closed" in r:
        rows.append(("in-process, closed loop", r["in_process_closed"]))
        rows += [(f"in-process, open loop at {p['load']}", p) for p in r["in_process_open"]]
        rows.append(("in-process, batching off", r["in_process_no_batching"]))
    if "in_process_closed_any_cpu" in r:
        rows.append(("in-process, threads on any CPU", r["in_process_closed_any_cpu"]))
    if "in_process_closed_auto" in r:
        cpu = r["in_process_closed_auto"].get("placement_cpu")
        chose = f"CPU {cpu}" if cpu is not None else "any CPU"
        rows.append((f"in-process, loop_cpu auto (chose {chose})", r["in_process_closed_auto"]))
    if "unix_socket_closed" in r:
        rows.append(("Unix socket (binary), closed loop", r["unix_socket_closed"]))
    if "url_closed" in r:
        rows.append((f"{r['url_closed']['url']} (binary), closed loop", r["url_closed"]))
    if "mqtt" in r:
        m = r["mqtt"]
        lat = m["latency_ms"]
        rows.append(("MQTT 5 request/response",
                     {**m, "p50_ms": lat["p50"], "p95_ms": lat["p95"], "p99_ms": lat["p99"], "statuses": m["status"]}))
    return rows


def _table(rows: list[list[str]]) -> list[str]:
    """Columns padded to their widest cell; the first left-aligned, the others right-aligned."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip()
            for row in rows]


def _counts(counts: dict | None, order=None) -> str:
    if not counts:
        return "-"
    keys = sorted(counts, key=order) if order else sorted(counts, key=lambda k: -counts[k])
    return " ".join(f"{k}:{counts[k]}" for k in keys if counts[k])


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _open_loop_table(r: dict) -> list[str]:
    """What each open-loop rate offered and what was served while arrivals were due: where the
    runtime stops keeping up. The lag (arrival submitted - scheduled) is the generator's part of
    the latency: up to ~1 ms from the loop's millisecond sleeps, more when the loop is busy."""
    closed = r["in_process_closed"]["throughput_rps"]
    rows = [["open loop (Poisson)", "offered/s", "of closed loop", "served/s", "answers by status",
             "lag p50 ms", "lag p99 ms", "generator alone us/req"]]
    for p in r["in_process_open"]:
        rows.append([f"at {p['load']}", f"{p['offered_rps']:.0f}", f"{p['offered_rps'] / closed:.2f}",
                     f"{p['throughput_rps']:.0f}", _counts(p["statuses"], order=int),
                     _ms(p["lag_p50_ms"]), _ms(p["lag_p99_ms"]), f"{p['generator_us_per_request']:.1f}"])
    return _table(rows)


def format_report(results: dict) -> str:
    """One model's bench, or (--url) each model of the daemon at the URL in turn."""
    if "models" not in results:
        return _format_model(results)
    names = ", ".join(r["model"] for r in results["models"]) or "none"
    lines = [f"the daemon at {results['url']}: {names}", f"skipped: {results['skipped']}", ""]
    return "\n".join(lines) + "\n\n".join(_format_model(r) for r in results["models"])


def _format_model(r: dict) -> str:
    placement = (f"event loop and engine threads on CPU {r['loop_cpu']}" if r.get("loop_cpu") is not None
                 else "threads on any CPU")
    where = f", {placement}" if "loop_cpu" in r else ""
    lines = [f"model {r['model']}, preferred sizes {r['preferred_batch_sizes']}, {r['concurrency']} closed-loop "
             f"callers, {r['duration_s']} s x {r['repeat']} run(s) per phase (the median run){where}", ""]

    speed = [["phase", "req/s", "runs", "p50 ms", "p95 ms", "p99 ms", "errors"]]
    if "raw_ceiling_rps" in r:
        largest = r["preferred_batch_sizes"][-1]
        graphs = " with CUDA graphs" if "raw_ceiling_plain_rps" in r else ""
        speed += [[f"raw engine ceiling (size {largest}){graphs}", f"{r['raw_ceiling_rps']:.0f}", "", "", "", "", ""]]
        if graphs:
            speed += [[f"raw engine ceiling (size {largest}), plain session.run", f"{r['raw_ceiling_plain_rps']:.0f}",
                       "", "", "", "", ""]]
        speed += [["minimal asyncio batcher (reference)", f"{r['minimal_batcher_rps']:.0f}", "", "", "", "", ""]]
    batching = [["phase", "batches by size", "why batches left", "padding", "overhead us/req (runtime's own)",
                 "engine us/req"]]
    for label, p in _phases(r):
        runs = p.get("throughput_rps_all") or []
        refused = {k: v for k, v in (p.get("statuses") or {}).items() if k != "200"}
        speed.append([label, f"{p['throughput_rps']:.0f}",
                      f"{min(runs):.0f}-{max(runs):.0f}" if len(runs) > 1 else "",
                      _ms(p["p50_ms"]), _ms(p["p95_ms"]), _ms(p["p99_ms"]),
                      _counts(refused, order=str) if refused else ""])
        overhead = p.get("overhead_us_per_request")
        own = p.get("runtime_overhead_us_per_request")
        engine = p.get("engine_us_per_request")
        batching.append([label, _counts(p.get("batch_sizes"), order=lambda k: -int(k)),
                         _counts(p.get("dispatch_reasons")),
                         "-" if p.get("padding_ratio") is None else f"{p['padding_ratio']:.2f}",
                         "-" if overhead is None else f"{overhead:.1f}" + ("" if own is None else f" ({own:.1f})"),
                         "-" if engine is None else f"{engine:.1f}"])
    lines += _table(speed) + [""] + _table(batching) + [""]
    if "in_process_open" in r:
        lines += _open_loop_table(r) + [""]
    if "raw_ceiling_rps" in r:
        lines.append(f"speedup over no batching: {r['speedup_over_no_batching']:.2f}x")
        lines.append(f"throughput / raw ceiling: {r['ratio_to_ceiling']:.2f} "
                     f"(the minimal batcher: {r['minimal_batcher_rps'] / r['raw_ceiling_rps']:.2f}; "
                     f"the runtime / the minimal batcher: "
                     f"{r['in_process_closed']['throughput_rps'] / r['minimal_batcher_rps']:.2f})")
    if "in_process_closed_any_cpu" in r:
        gain = r["in_process_closed"]["throughput_rps"] / r["in_process_closed_any_cpu"]["throughput_rps"]
        lines.append(f"one shared CPU vs threads on any CPU: {gain:.2f}x")
    if "in_process_closed_auto" in r and "in_process_closed_any_cpu" in r:
        auto = r["in_process_closed_auto"]
        better = max(r["in_process_closed"]["throughput_rps"], r["in_process_closed_any_cpu"]["throughput_rps"])
        ratio = auto["throughput_rps"] / better
        lines.append(f"loop_cpu auto vs the better of the two: {ratio:.2f}x ({auto['placement']})")
    if "mqtt" in r:
        from .mqtt_load import format_mqtt_report

        lines += ["", format_mqtt_report(r["mqtt"])]
    return "\n".join(lines).rstrip("\n")


def pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ConfigError(
            "--plot needs matplotlib: pip install 'edge-batcher[plot]' (or pip install matplotlib)"
        ) from None
    matplotlib.use("Agg")  # files only: no display on a device or in CI
    import matplotlib.pyplot as plt

    return plt


def plot_report(r: dict, path: Path) -> None:
    """Throughput, p50/p99 latency and the batch-size mix per phase, in one PNG."""
    plt = pyplot()
    phases = _phases(r)
    labels = [label for label, _ in phases]
    y = np.arange(len(phases))
    legend = {"loc": "upper center", "bbox_to_anchor": (0.5, -0.16), "ncol": 2, "fontsize": 8, "frameon": False}
    fig, (ax_rps, ax_lat, ax_mix) = plt.subplots(1, 3, figsize=(15, 0.55 * len(phases) + 2.8), sharey=True)
    ax_rps.barh(y, [p["throughput_rps"] for _, p in phases], color="tab:blue")
    for value, name, style in ((r["raw_ceiling_rps"],
                                f"raw engine ceiling (size {r['preferred_batch_sizes'][-1]})", "--"),
                               (r["minimal_batcher_rps"], "minimal asyncio batcher", ":")):
        ax_rps.axvline(value, color="black", linestyle=style, linewidth=1, label=name)
    ax_rps.set_xlabel("requests/s (median run)")
    ax_rps.legend(**legend)
    ax_rps.set_yticks(y, labels)
    ax_rps.invert_yaxis()

    height = 0.38
    ax_lat.barh(y - height / 2, [p["p50_ms"] for _, p in phases], height, label="p50", color="tab:green")
    ax_lat.barh(y + height / 2, [p["p99_ms"] for _, p in phases], height, label="p99", color="tab:red")
    ax_lat.set_xscale("log")
    ax_lat.set_xlabel("latency, ms (log scale)")
    ax_lat.legend(**legend)

    sizes = sorted({int(s) for _, p in phases for s in (p.get("batch_sizes") or {})})
    left = np.zeros(len(phases))
    colors = plt.get_cmap("viridis")
    for i, size in enumerate(sizes):
        shares = []
        for _, p in phases:
            counts = p.get("batch_sizes") or {}
            total = sum(counts.values())
            shares.append(counts.get(str(size), 0) / total if total else 0.0)
        ax_mix.barh(y, shares, left=left, label=f"size {size}", color=colors(i / max(1, len(sizes) - 1)))
        left += shares
    ax_mix.set_xlim(0, 1)
    ax_mix.set_xlabel("share of batches by size (where measured)")
    ax_mix.legend(**legend)

    placement = f"loop_cpu {r['loop_cpu']}" if r.get("loop_cpu") is not None else "threads on any CPU"
    fig.suptitle(f"edge-batcher bench: {r['model']}, {r['concurrency']} callers, {r['duration_s']} s x {r['repeat']} "
                 f"runs per phase, {placement}; {r['speedup_over_no_batching']:.2f}x over no batching")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
