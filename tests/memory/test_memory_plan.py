"""The memory plan under traffic (memory/plan.py): what the daemon holds at ready is counted, and
growth beyond it while serving is seen, logged with the models that ran, and counted."""

from __future__ import annotations

import mmap
import re
import shutil
import time

import numpy as np
import pytest

from edge_batcher.client import ClientError
from edge_batcher.memory.plan import NOISE_BYTES, MemoryPlan
from edge_batcher.memory.probe import FixedProbe
from tests.support import rawhttp
from tests.support.faulty_engine import LEAK, LEAK_BYTES, RELEASE_ENV, TRANSIENT_LEAK
from tests.support.models import add_vibration_variant, build_demo

MiB = 1 << 20


def resident(nbytes: int) -> mmap.mmap:
    """nbytes of new resident memory: pages of a fresh anonymous mapping, each written. (A numpy
    array may reuse heap pages an earlier test freed and the process still holds: no growth.)"""
    pages = mmap.mmap(-1, nbytes)
    pages.write(b"\1" * nbytes)
    return pages


def test_growth_beyond_the_plan_is_reported_once_and_counted():
    plan = MemoryPlan(FixedProbe(1 << 30))  # not a device: the process's resident memory is the meter
    plan.start()
    plan.settle({"process": 0})
    assert plan.check({"process": 0}, 0, {"process": 0}) == []  # nothing grew
    grown = resident(64 * MiB)
    assert plan.check({"process": 0}, 0, {}) == []  # a meter not asked about is not checked
    overruns = plan.check({"process": 0}, 0, {"process": 0})
    assert [o.meter for o in overruns] == ["process"]
    assert 60 * MiB < overruns[0].excess < 80 * MiB
    assert plan.check({"process": 0}, 0, {"process": 0}) == []  # counted: the next check compares with it
    assert plan.planned({"process": 0})["process"] >= overruns[0].used
    # growth that the models' plan or the tolerance explain is not an overrun
    more = resident(32 * MiB)
    assert plan.check({"process": 32 * MiB}, 0, {"process": 0}) == []
    assert plan.check({"process": 0}, 0, {"process": 64 * MiB}) == []
    assert NOISE_BYTES < 32 * MiB
    grown.close()
    more.close()


def test_growth_that_goes_again_leaves_the_plan_but_not_what_ready_counted():
    plan = MemoryPlan(FixedProbe(1 << 30))  # the process's resident memory is the meter
    plan.start()
    plan.settle({"process": 0})
    at_ready = plan.planned({"process": 0})["process"]
    grown = resident(64 * MiB)
    [overrun] = plan.check({"process": 0}, 0, {"process": 0})
    assert plan.given_back({"process": 0}, 0, {"process"}) == []  # still held: nothing goes
    grown.close()
    assert plan.given_back({"process": 0}, 0, set()) == []  # only the meters asked about
    [back] = plan.given_back({"process": 0}, 0, {"process"})
    assert overrun.excess - 8 * MiB <= back.amount <= overrun.excess
    assert at_ready <= plan.planned({"process": 0})["process"] <= at_ready + 8 * MiB
    # far less in use than planned: only the growth still counted goes, never what ready counted
    left = plan.grown["process"]
    assert sum(b.amount for b in plan.given_back({"process": 256 * MiB}, 0, {"process"})) == left
    assert plan.planned({"process": 0})["process"] == at_ready
    assert plan.given_back({"process": 256 * MiB}, 0, {"process"}) == []


def test_a_daemon_warns_of_memory_that_serving_took_and_no_load_measured_and_shrinks(start_daemon, tmp_path):
    """The leak is counted as resident; with budget_mb = 40 that overdraws the budget: the model
    that ran serves smaller batches, and while the budget stays overdrawn nothing more is run."""
    repo = tmp_path / "engines"
    build_demo(repo)
    add_vibration_variant(repo, "leaky", "tests.support.faulty_engine:LeakyEngine", "max_queue_delay_ms = 2.0\n")
    shutil.rmtree(repo / "vibration")
    # probe "cpu": the process's own memory is the meter, also on a machine with a GPU
    d = start_daemon('[memory]\nprobe = "cpu"\ncheck_interval_s = 0.2\nheadroom_mb = 8\nbudget_mb = 40\n', repo=repo)
    _, metrics = rawhttp.request(d.socket, "GET", "/metrics")
    planned = float(re.search(r'edge_batcher_memory_planned_bytes\{meter="process"\} (\S+)', metrics).group(1))
    with d.client() as client:
        client.infer("leaky", {"signal": np.zeros((1, 256), np.float32)})
        time.sleep(0.6)
        assert "above the plan" not in d.log_text()  # serving as measured grows nothing
        client.infer("leaky", {"signal": np.full((1, 256), LEAK, np.float32)})
    deadline = time.monotonic() + 30
    while "above the plan" not in d.log_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    line = next(line for line in d.log_text().splitlines() if "above the plan" in line)
    assert "WARNING" in line and "memory: process in use is" in line
    assert "models that ran since the last check: leaky (sizes up to 8)" in line

    def planned_now() -> float:
        _, metrics = rawhttp.request(d.socket, "GET", "/metrics")
        return float(re.search(r'edge_batcher_memory_planned_bytes\{meter="process"\} (\S+)', metrics).group(1))

    deadline = time.monotonic() + 30  # the leak may be seen in two looks, while its pages are written
    while planned_now() - planned < LEAK_BYTES - 8 * MiB and time.monotonic() < deadline:
        time.sleep(0.1)
    assert planned_now() - planned >= LEAK_BYTES - 8 * MiB  # counted into the plan
    shrunk = next(line for line in d.log_text().splitlines() if "serving batch sizes up to" in line)
    assert "WARNING" in shrunk and "model leaky: the memory budget is overdrawn" in shrunk and "up to 4" in shrunk
    with d.client() as client:
        # The budget is a ceiling and the leak holds more than it: even a batch of 2 is refused,
        # with the figures, and the daemon goes on (it is alive and answers).
        with pytest.raises(ClientError) as info:
            client.infer("leaky", {"signal": np.zeros((1, 256), np.float32)})
        assert info.value.status == 503 and "does not fit in device memory: a batch of 2 needs" in info.value.message
        assert client.ready()


def test_batch_sizes_shrunk_by_a_transient_peak_grow_back_once_it_is_gone(start_daemon, tmp_path):
    """A peak that overdraws the budget shrinks the model that ran; once the memory is back with
    the system, the growth leaves the plan, the budget has room, and the sizes come back one step
    per look, up to the largest before the shrink, and nothing is refused."""
    repo = tmp_path / "engines"
    build_demo(repo)
    add_vibration_variant(repo, "leaky", "tests.support.faulty_engine:LeakyEngine", "max_queue_delay_ms = 2.0\n")
    shutil.rmtree(repo / "vibration")
    release = tmp_path / "release"
    d = start_daemon('[memory]\nprobe = "cpu"\ncheck_interval_s = 0.2\nheadroom_mb = 8\nbudget_mb = 40\n', repo=repo,
                     env={RELEASE_ENV: str(release)})

    def sizes() -> list[int]:
        _, body = rawhttp.request(d.socket, "GET", "/v2/models/leaky/stats")
        return body["model_stats"][0]["batch_sizes"]

    def wait_for(text: str) -> str:
        deadline = time.monotonic() + 30
        while text not in d.log_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        return next(line for line in d.log_text().splitlines() if text in line)

    assert sizes() == [2, 4, 8]
    with d.client() as client:
        client.infer("leaky", {"signal": np.full((1, 256), TRANSIENT_LEAK, np.float32)})
    shrunk = wait_for("serving batch sizes up to")
    assert "WARNING" in shrunk and "overdrawn" in shrunk and "up to 4" in shrunk
    assert sizes() == [2, 4]
    release.touch()  # the engine unmaps the peak's pages
    back = wait_for("given back to the budget")
    assert "INFO" in back
    grown = wait_for("no longer overdrawn")
    assert "INFO" in grown and "model leaky" in grown and "serving batch sizes up to 8" in grown
    assert sizes() == [2, 4, 8]
    with d.client() as client:
        out = client.infer("leaky", {"signal": np.zeros((8, 256), np.float32)})
    assert out["class_probs"].shape[0] == 8
    assert "overdrawn by growth" not in d.log_text().split(grown)[1]  # no new shrink after it


def test_a_reload_s_memory_is_not_taken_for_growth_and_what_it_leaves_is_named(start_daemon, tmp_path):
    """While a model is loaded again through the API, its new version's 48 MiB (a load of 1 s, the
    watch looking every 0.2 s) are in no model's resident figure until measured, and the old
    version holds its own until it has drained: the watch waits for the change instead of
    warning of growth no load measured (before: a WARNING at every reload). What a change leaves
    behind (an engine that keeps its pages when closed, as an allocator keeps freed memory; a
    reload of the small model leaves ~12 MiB of ONNX Runtime's heap here) is counted at the
    next look, at INFO, named after the change."""
    repo = tmp_path / "engines"
    build_demo(repo)
    add_vibration_variant(repo, "heavy", "tests.support.faulty_engine:HeavyLoadEngine", "")
    add_vibration_variant(repo, "leaves", "tests.support.faulty_engine:LeavesMemoryEngine", "")
    shutil.rmtree(repo / "vibration")
    d = start_daemon('[memory]\nprobe = "cpu"\ncheck_interval_s = 0.2\nheadroom_mb = 8\n', repo=repo)
    for _ in range(2):
        status, body = rawhttp.request(d.socket, "POST", "/v2/repository/models/heavy/load", {})
        assert status == 200, body
    time.sleep(0.6)  # three looks after the change
    assert "growth that no measurement at load saw" not in d.log_text()
    for line in (line for line in d.log_text().splitlines() if "above the plan" in line):
        assert "INFO" in line and "after loading model heavy: what the change left" in line
    with d.client() as client:
        out = client.infer("heavy", {"signal": np.zeros((1, 256), np.float32)})
    assert out["class_id"].shape == (1,)

    status, body = rawhttp.request(d.socket, "POST", "/v2/repository/models/leaves/load", {})
    assert status == 200, body
    deadline = time.monotonic() + 30
    while "after loading model leaves" not in d.log_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    line = next(line for line in d.log_text().splitlines() if "after loading model leaves" in line)
    assert "INFO" in line and "what the change left beyond the models' measured memory" in line
    assert float(re.search(r"([\d.]+) MiB above the plan", line).group(1)) > 40  # the 48 MiB kept
    assert "growth that no measurement at load saw" not in d.log_text()


def test_a_reloaded_model_is_measured_with_what_it_holds_not_what_it_reused(start_daemon, tmp_path):
    """An engine that holds 48 MiB in the C heap, loaded again through the API twice: glibc keeps
    an unloaded version's freed pages and the next load reuses them, which no meter shows as the
    load's growth (a reloaded SmolLM2 measured 12 MiB of its ~160). The heap is trimmed after an
    unload and before a load: every version measures its 48 MiB, and the unloaded versions'
    heap is not left beyond the plan."""
    repo = tmp_path / "engines"
    build_demo(repo)
    add_vibration_variant(repo, "heapy", "tests.support.faulty_engine:HeapLoadEngine", "")
    shutil.rmtree(repo / "vibration")
    d = start_daemon('[memory]\nprobe = "cpu"\ncheck_interval_s = 0.2\nheadroom_mb = 8\n', repo=repo)

    def resident_mib() -> float:
        _, body = rawhttp.request(d.socket, "GET", "/v2/models/heapy/stats")
        return body["model_stats"][0]["memory"]["resident_bytes"] / MiB

    measured = [resident_mib()]
    for _ in range(2):
        status, body = rawhttp.request(d.socket, "POST", "/v2/repository/models/heapy/load", {})
        assert status == 200, body
        measured.append(resident_mib())
    assert all(m > 40 for m in measured), measured
    time.sleep(0.6)  # three looks after the change
    # Left: at most the one-time cost the first version's measurement carried (ONNX Runtime's
    # library, ~10 MiB, which the process keeps), not the 48 MiB heap of a version unloaded.
    for line in (line for line in d.log_text().splitlines() if "above the plan" in line):
        assert "INFO" in line and "after loading model heapy" in line
        assert float(re.search(r"([\d.]+) MiB above the plan", line).group(1)) < 24
