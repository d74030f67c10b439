"""What `edge-batcher bench` shows a person: progress while it runs (plain lines in logs, a bar
on a terminal), two readable tables, and --plot FILE.png. Speed is not judged here."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
import time

import pytest

from edge_batcher.bench.figures import median_run
from edge_batcher.progress import Progress


def test_bench_shows_progress_tables_and_a_plot(model_repo, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "bench.png"
    proc = subprocess.run(
        [sys.executable, "-m", "edge_batcher.cli", "bench", "--models", str(model_repo), "--duration", "0.3",
         "--repeat", "2", "--concurrency", "16", "--plot", str(png)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    steps = re.findall(r"^bench (\d+)/(\d+): (.+) \(\d+ s", proc.stderr, re.M)
    total = int(steps[0][1])
    assert [int(n) for n, _, _ in steps] == list(range(1, total + 1))  # every step announced, in order
    assert steps[0][2] == "raw engine ceiling, run 1/2"
    out = proc.stdout
    assert "{" not in out and "None" not in out  # no Python dicts or None in the report
    assert re.search(r"^phase +req/s +runs +p50 ms +p95 ms +p99 ms +errors$", out, re.M)
    row = re.search(r"^in-process, closed loop +(\d+) +(\d+)-(\d+) +([\d.]+) +([\d.]+) +([\d.]+)$", out, re.M)
    assert row, out
    rps, low, high = (int(row[i]) for i in (1, 2, 3))
    assert low <= rps <= high
    assert float(row[4]) <= float(row[5]) <= float(row[6])  # p50 <= p95 <= p99
    assert re.search(r"^in-process, batching off +1:\d+ +full:\d+", out, re.M)
    assert re.search(r"^speedup over no batching: [\d.]+x$", out, re.M)

    import matplotlib.image

    image = matplotlib.image.imread(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and image.shape[0] > 300 and image.shape[1] > 1000


def test_progress_redraws_one_line_on_a_terminal_and_writes_lines_elsewhere():
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    log, tty = io.StringIO(), Terminal()
    for stream in (log, tty):
        progress = Progress("bench", 3, stream)
        for label in ("a", "b", "c"):
            progress.step(label)
        progress.close()
    assert log.getvalue().splitlines()[0] == "bench 1/3: a (0 s)"
    assert len(log.getvalue().splitlines()) == 3
    assert "\n" not in tty.getvalue()
    assert tty.getvalue().count("\r\033[K") == 4 and "[######..............] 2/3 b" in tty.getvalue()


def test_progress_weighs_the_steps_left_by_their_expected_cost():
    progress = Progress("bench", 3, io.StringIO(), weights=[1, 1, 8])
    plain = Progress("bench", 3, io.StringIO())
    for p in (progress, plain):
        p.step("a")
        p.step("b")
    # Two steps of weight 1 took 4 s: the last, of weight 8, should take 16 s, not 2 s.
    assert progress.time_left(4.0) == 16.0
    assert plain.time_left(4.0) == 2.0
    with pytest.raises(ValueError):
        Progress("bench", 3, io.StringIO(), weights=[1, 1])


def test_bench_time_left_holds_before_its_daemon_step(model_repo):
    """The last step (a daemon subprocess: it starts, loads, calibrates, then runs) is several
    times longer than the in-process steps before it; the estimate announced with it must be
    of its length, where a count of steps said ~1 s before a ~3 s step (issue 32)."""
    started = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "edge_batcher.cli", "bench", "--models", str(model_repo), "--duration", "0.5",
         "--repeat", "1", "--concurrency", "16", "--rate", "50%", "--unix", "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    lines = [(time.monotonic() - started, line) for line in proc.stderr]
    out, _ = proc.communicate(timeout=300)
    ended = time.monotonic() - started
    assert proc.returncode == 0, "".join(line for _, line in lines)
    assert "unix_socket_closed" in json.loads(out)
    announced_at, last = lines[-1]
    assert last.startswith("bench ") and "Unix socket" in last, last
    estimate = float(re.search(r"~(\d+) s left", last)[1])
    took = ended - announced_at
    assert took > 1.5  # the daemon's start alone: far more than one in-process step
    assert 0.6 * took <= estimate <= 1.6 * took + 1, (estimate, took)


def test_the_range_printed_beside_a_median_always_holds_it():
    """A run of 12,764.54 req/s was once printed as the median "12765" beside a range ending at
    "12764": the runs were rounded to 0.1 first, then again for display."""
    runs = [{"throughput_rps": 12700.0}, {"throughput_rps": 12764.54}]
    best = median_run(runs)
    figure, high = f"{best['throughput_rps']:.0f}", f"{max(best['throughput_rps_all']):.0f}"
    assert (figure, high) == ("12765", "12765")
    assert sorted(best["throughput_rps_all"]) == [12700.0, 12764.54]
