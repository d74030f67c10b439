"""[server] loop_cpu: which CPU the event loop and engine threads share, and how threads
inherit it (real sched_setaffinity calls on this Linux machine)."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest

from edge_batcher import cpu_affinity
from edge_batcher.cpu_affinity import PROCESS_CPUS, choose, full_affinity, pin_this_thread
from edge_batcher.errors import ConfigError
from edge_batcher.types import TensorSpec

needs_two_cpus = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or PROCESS_CPUS is None or len(PROCESS_CPUS) < 2,
    reason="needs Linux thread affinity and at least two CPUs",
)


def in_thread(fn):
    """Run fn on a fresh thread and return its result: pinning stays inside that thread."""
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("value", fn()))
    t.start()
    t.join()
    return out["value"]


@needs_two_cpus
def test_auto_is_the_highest_cpu_off_is_none_and_a_number_must_be_allowed():
    assert choose("auto") == max(PROCESS_CPUS)
    assert choose("off") is None
    assert choose(str(min(PROCESS_CPUS))) == min(PROCESS_CPUS)
    with pytest.raises(ConfigError, match=r"loop_cpu = 4096: this process may only run on CPUs \["):
        choose("4096")


def test_with_one_cpu_or_without_the_api_there_is_nothing_to_choose(monkeypatch):
    monkeypatch.setattr(cpu_affinity, "PROCESS_CPUS", frozenset({0}))
    assert choose("auto") is None
    monkeypatch.setattr(cpu_affinity, "_set", None)
    assert choose("0") is None
    pin_this_thread(0)  # a no-op, not an error


async def started_worker_cpus(runner) -> set[int]:
    """Start the runner, read the CPUs its first engine worker thread may run on, close it."""
    await runner.start()
    seen = asyncio.get_running_loop().create_future()
    worker = runner._threads.workers[0]
    worker.submit(lambda _: os.sched_getaffinity(0), None, lambda _a, cpus, _e: seen.set_result(cpus))
    cpus = await seen
    await runner.close()
    return cpus


@needs_two_cpus
def test_a_pinned_thread_passes_its_cpu_on_to_the_threads_it_starts():
    cpu = choose("auto")

    def pinned_then_child():
        pin_this_thread(cpu)
        return os.sched_getaffinity(0), in_thread(lambda: os.sched_getaffinity(0))

    own, child = in_thread(pinned_then_child)
    assert own == child == {cpu}


@needs_two_cpus
def test_full_affinity_gives_every_cpu_for_the_block_and_restores_the_pin():
    cpu = choose("auto")

    def body():
        pin_this_thread(cpu)
        with full_affinity():
            inside = os.sched_getaffinity(0)
            child = in_thread(lambda: os.sched_getaffinity(0))  # e.g. an engine's thread pool
        return inside, child, os.sched_getaffinity(0)

    inside, child, after = in_thread(body)
    assert inside == child == set(PROCESS_CPUS)
    assert after == {cpu}


@needs_two_cpus
def test_engine_workers_started_from_a_pinned_loop_share_its_cpu(model_repo):
    """The daemon pins the loop thread; a runner started there runs its engine on that CPU,
    while the engine itself was created with every CPU (load_runner)."""
    from edge_batcher.metrics import Metrics
    from edge_batcher.runtime import discover_models, load_runner

    cpu = choose("auto")
    (mc,) = discover_models(model_repo, ["vibration"])

    async def main():
        loop = asyncio.get_running_loop()
        runner = await loop.run_in_executor(None, load_runner, mc, Metrics(), False)
        return await started_worker_cpus(runner)

    def serve():
        pin_this_thread(cpu)
        return asyncio.run(main())

    assert in_thread(serve) == {cpu}


class SleepyEngine:
    """y = x, after `seconds` of waiting: an engine whose batches take that long."""

    inputs = [TensorSpec("x", "FP32", (-1, 2))]
    outputs = [TensorSpec("y", "FP32", (-1, 2))]

    def __init__(self, seconds: float):
        self.seconds = seconds

    def infer(self, inputs):
        time.sleep(self.seconds)
        return {"y": inputs["x"]}

    def close(self) -> None:
        pass


@needs_two_cpus
def test_a_slow_engine_s_worker_runs_on_every_cpu_and_a_fast_one_shares_the_loop_s():
    """Warm-up measures the batches; from WORKER_ON_EVERY_CPU_FROM_S on, sharing the loop's CPU
    would only keep the engine off the other cores (docs/benchmarks.md)."""
    from pathlib import Path

    from edge_batcher.config import BatchingSettings, ModelConfig
    from edge_batcher.metrics import Metrics
    from edge_batcher.scheduler.runner import WORKER_ON_EVERY_CPU_FROM_S, ModelRunner

    cpu = choose("auto")

    async def worker_cpus(seconds: float) -> set[int]:
        config = ModelConfig(name="sleepy", directory=Path("."), batching=BatchingSettings(max_batch_size=8))
        runner = ModelRunner(config, [SleepyEngine(seconds)], Metrics())
        runner.warm_up()
        return await started_worker_cpus(runner)

    def serve():
        pin_this_thread(cpu)
        return asyncio.run(worker_cpus(0.0)), asyncio.run(worker_cpus(2 * WORKER_ON_EVERY_CPU_FROM_S))

    fast, slow = in_thread(serve)
    assert fast == {cpu}
    assert slow == set(PROCESS_CPUS)
