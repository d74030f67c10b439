"""The benchmark tool runs every phase and reports coherent figures (no speed thresholds here:
targets live in the benchmark's own output, see docs/benchmarks.md)."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

CSV_COLUMNS = ["model", "phase", "target", "load", "concurrency", "offered_rps", "throughput_rps", "runs_rps",
               "requests", "p50_ms", "p95_ms", "p99_ms", "statuses", "batch_sizes", "dispatch_reasons"]


def test_bench_reports_every_phase(model_repo, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "edge_batcher.cli", "bench", "--models", str(model_repo), "--duration", "0.5",
         "--repeat", "1", "--concurrency", "16", "--rate", "25%,2000", "--unix", "--json",
         "--csv", str(tmp_path / "bench.csv")],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)
    check_csv_rows(tmp_path / "bench.csv", r)
    assert r["raw_ceiling_rps"] > 0
    assert r["minimal_batcher_rps"] > 0
    if r["loop_cpu"] is not None:  # threads share one CPU: the bench also measures without that
        assert r["in_process_closed_any_cpu"]["throughput_rps"] > 0
    opened = r["in_process_open"]
    for p in (r["in_process_closed"], *opened, r["in_process_no_batching"], r["unix_socket_closed"]):
        assert p["requests"] > 0 and p["throughput_rps"] > 0, p
        assert 0 < p["p50_ms"] <= p["p95_ms"] <= p["p99_ms"], p
    # One open-loop phase per --rate: a share of the closed loop's throughput, or arrivals/s.
    assert [p["load"] for p in opened] == ["25%", "2000/s"]
    assert [p["rate"] for p in opened] == [0.25 * r["in_process_closed"]["throughput_rps"], 2000]
    for p in opened:
        expected = p["rate"] * r["duration_s"]
        assert abs(p["offered_rps"] * r["duration_s"] - expected) < 5 * expected ** 0.5  # a Poisson count
        assert sum(p["statuses"].values()) == round(p["offered_rps"] * r["duration_s"])
    unix = r["unix_socket_closed"]
    assert unix["url"].startswith("unix://") and unix["statuses"] == {"200": unix["requests"]}
    assert sum(int(size) * count for size, count in unix["batch_sizes"].items()) >= unix["requests"]
    assert set(r["in_process_closed"]["batch_sizes"]) <= {"2", "4", "8"}
    assert set(r["in_process_no_batching"]["batch_sizes"]) == {"1"}
    assert r["in_process_closed"]["overhead_us_per_request"] > 0
    assert r["speedup_over_no_batching"] == (
        r["in_process_closed"]["throughput_rps"] / r["in_process_no_batching"]["throughput_rps"])


def check_csv_rows(path: Path, r: dict) -> None:
    """--csv: the documented header, then one row per phase in the order they ran, each
    holding the figures --json gives for it."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == CSV_COLUMNS
        rows = list(reader)
    phases = [("in_process_closed", r["in_process_closed"]), *(("in_process_open", p) for p in r["in_process_open"]),
              ("in_process_no_batching", r["in_process_no_batching"])]
    phases += [(key, r[key]) for key in ("in_process_closed_any_cpu", "in_process_closed_auto") if key in r]
    phases.append(("unix_socket_closed", r["unix_socket_closed"]))
    assert [row["phase"] for row in rows] == ["raw_ceiling", "minimal_batcher"] + [key for key, _ in phases]
    assert {row["model"] for row in rows} == {"vibration"}
    assert float(rows[0]["throughput_rps"]) == round(r["raw_ceiling_rps"], 1) and rows[0]["target"] == "engine"
    for row, (key, p) in zip(rows[2:], phases):
        assert row["target"] == p.get("url", "in-process")
        assert float(row["throughput_rps"]) == round(p["throughput_rps"], 1)
        assert int(row["requests"]) == p["requests"]
        assert [float(row[q]) for q in ("p50_ms", "p95_ms", "p99_ms")] == [
            round(p[q], 3) for q in ("p50_ms", "p95_ms", "p99_ms")]
        assert dict(item.split(":") for item in row["statuses"].split()) == {
            status: str(n) for status, n in p["statuses"].items()}
        assert sum(int(item.split(":")[1]) for item in row["batch_sizes"].split()) == sum(p["batch_sizes"].values())
        if key == "in_process_open":
            assert row["load"] == p["load"] and float(row["offered_rps"]) == round(p["offered_rps"], 1)
            assert row["concurrency"] == ""
        else:
            assert row["load"] == row["offered_rps"] == "" and int(row["concurrency"]) == r["concurrency"]


def test_gil_bench_times_the_engine_alone_and_beside_a_python_thread(model_repo):
    proc = subprocess.run(
        [sys.executable, "tools/bench_gil.py", "--model", str(model_repo / "vibration" / "model.onnx"),
         "--seconds", "0.3"],
        capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[1],
    )
    assert proc.returncode == 0, proc.stderr
    assert "alone:" in proc.stdout
    if "one CPU only" not in proc.stdout:
        assert "other core:" in proc.stdout and "same core:" in proc.stdout


def test_engine_cost_bench_builds_checked_spectrum_models_and_measures_each():
    proc = subprocess.run(
        [sys.executable, "tools/bench_engine_cost.py", "--sizes", "64,128", "--duration", "0.3",
         "--repeat", "1", "--json"],
        capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[1],
    )
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    assert [r["window"] for r in rows] == [64, 128]
    for r in rows:
        assert r["engine_us_per_row"] > 0 and r["in_process_rps"] > 0
        assert 0 < r["ratio_to_ceiling"] == r["in_process_rps"] / r["raw_ceiling_rps"]
        assert r["overhead_us_per_request"] > 0 and r["speedup_over_no_batching"] > 0


def test_open_loop_arrivals_keep_their_schedule_and_latency_counts_from_the_arrival():
    """Poisson arrivals keep their schedule while the loop is stalled: the ones due during a
    stall are submitted together when it ends, their latency includes the stall (no
    coordinated omission: a slow runtime cannot lower the load it is measured under), and
    their lag says how late they were submitted. The runner here answers on the next loop
    iteration, so any latency is the generator's own; the real runtime under this generator
    is in test_open_loop_past_capacity_counts_what_was_offered_served_and_refused."""
    import asyncio
    import time

    from edge_batcher.bench.open_loop import poisson_arrivals

    class RunnerAnsweringAtOnce:
        submitted = 0

        def refuse_if_full(self):
            pass

        def infer(self, request):
            self.submitted += 1
            future = asyncio.get_running_loop().create_future()
            future.get_loop().call_soon(future.set_result, request.inputs)
            return future

    rate, duration, stall = 400.0, 0.5, 0.15

    async def main():
        runner = RunnerAnsweringAtOnce()
        asyncio.get_running_loop().call_later(0.1, time.sleep, stall)  # the whole loop stops, as under a CPU stall
        run = await poisson_arrivals(runner, "m", {"x": None}, rate, duration)
        return runner.submitted, run

    submitted, run = asyncio.run(main())
    expected = rate * duration
    assert run.errors == {} and run.statuses == {200: submitted} and run.offered == submitted
    assert len(run.latencies) == len(run.lags) == submitted
    assert abs(submitted - expected) < 5 * expected ** 0.5  # a Poisson count, within 5 sigma
    # ~rate * stall arrivals fell due during the stall, half of them over half of it before
    # its end; timing from submission would see at most the one then in flight.
    waited_out = sum(1 for latency in run.latencies if latency >= 0.5 * stall)
    assert waited_out >= 0.25 * rate * stall
    assert sum(1 for lag in run.lags if lag >= 0.5 * stall) >= 0.25 * rate * stall
    assert run.served_in_window <= submitted


def test_open_loop_past_capacity_counts_what_was_offered_served_and_refused(model_repo):
    """The real runtime with a queue of 8 under ten times the arrivals it can take: every
    arrival is answered once, as a client would count it (200, or 429 from the full queue);
    throughput is what was served while arrivals were due, below what was offered."""
    import argparse
    import asyncio

    from edge_batcher import placement
    from edge_batcher.bench.in_process import in_process
    from edge_batcher.metrics import Metrics
    from edge_batcher.runtime import discover_models, load_runner

    (model,) = discover_models(model_repo, ["vibration"])
    model.batching.queue_capacity = 8
    args = argparse.Namespace(duration=0.5, concurrency=8)

    async def main():
        runner = await asyncio.get_running_loop().run_in_executor(None, load_runner, model, Metrics(), True)
        sample = placement.sample_inputs(runner)
        await runner.close()
        closed = await in_process(model, sample, args, closed=True)
        return closed, await in_process(model, sample, args, closed=False, rate=10 * closed["throughput_rps"])

    closed, p = asyncio.run(main())
    assert closed["statuses"] == {"200": closed["requests"]}
    offered = round(p["offered_rps"] * args.duration)
    assert set(p["statuses"]) == {"200", "429"} and sum(p["statuses"].values()) == offered
    assert p["errors"] == {"Overloaded": p["statuses"]["429"]} and p["requests"] == p["statuses"]["200"]
    assert 0 < p["throughput_rps"] * args.duration <= p["requests"] < offered
    assert 0 <= p["lag_p50_ms"] <= p["lag_p99_ms"]
    assert p["generator_us_per_request"] > 0 and p["overhead_us_per_request"] > 0


def test_the_http_load_generator_counts_answers_by_status(daemon):
    """edge_batcher/bench/http_load.py (tools/bench_compare.py's load) against a real daemon: every
    answer framed and counted, for a served model and an unknown one."""
    from edge_batcher.bench.http_load import bench_http

    ok = bench_http(f"unix://{daemon.socket}", duration_s=0.3, warmup_s=0.1, concurrency=4)
    assert ok["requests"] > 0 and ok["status"] == {"200": ok["requests"]}
    assert 0 < ok["latency_ms"]["p50"] <= ok["latency_ms"]["p99"] <= ok["latency_ms"]["max"]
    missing = bench_http(f"unix://{daemon.socket}", model="nosuch", duration_s=0.2, warmup_s=0, concurrency=2)
    assert missing["requests"] > 0 and missing["status"] == {"404": missing["requests"]}


def test_model_setting_bench_serves_the_model_twice_with_the_setting_changed(model_repo):
    """tools/bench_model_setting.py against two real daemons; their rows per batch show that each
    got its own value (preferred sizes [2] against the shipped [2, 4, 8] with 8 callers)."""
    proc = subprocess.run(
        [sys.executable, "tools/bench_model_setting.py", "--model", "vibration", "--repo", str(model_repo),
         "--setting", "batching.preferred_batch_sizes", "--values", "[2]", "[2, 4, 8]",
         "--concurrency", "8", "--seconds", "0.5", "--rounds", "1"],
        capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[1],
    )
    assert proc.returncode == 0, proc.stderr
    rows = {line.split("|")[2].strip(): line.split("|") for line in proc.stdout.splitlines()
            if line.startswith("| 8 |")}
    assert set(rows) == {"[2]", "[2, 4, 8]"}
    assert float(rows["[2]"][7]) <= 2.0  # rows per batch: never more than the only size (a lone one pads)
    assert float(rows["[2, 4, 8]"][7]) > 2.0
    assert float(rows["[2]"][3]) > 0 and float(rows["[2, 4, 8]"][3]) > 0
