"""[server] loop_cpu = "auto": the daemon measures both placements on its own models after
warm-up and keeps the faster (placement.py); real runners, real thread affinity."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import numpy as np

from edge_batcher import placement
from edge_batcher.config import BatchingSettings, ModelConfig
from edge_batcher.cpu_affinity import PROCESS_CPUS, choose, pin_this_thread
from edge_batcher.metrics import Metrics
from edge_batcher.placement import shared_cpu_wins
from edge_batcher.runtime import discover_models, load_runner
from edge_batcher.scheduler import runner as runner_module
from edge_batcher.scheduler.runner import ModelRunner
from edge_batcher.types import TensorSpec
from tests.test_cpu_affinity import in_thread, needs_two_cpus


def test_the_placement_with_the_higher_geometric_mean_wins():
    assert shared_cpu_wins({"a": (2000.0, 1000.0)})
    assert not shared_cpu_wins({"a": (1000.0, 2000.0)})
    # One model 2x faster shared, another 3x slower: any CPU wins overall.
    assert not shared_cpu_wins({"a": (2000.0, 1000.0), "b": (1000.0, 3000.0)})
    assert shared_cpu_wins({"a": (3000.0, 1000.0), "b": (1000.0, 2000.0)})
    assert not shared_cpu_wins({})  # nothing measured: threads stay on any CPU
    assert not shared_cpu_wins({"a": (1000.0, 1000.0)})  # a tie: the OS places threads


def run_on_fresh_loop_thread(model_repo, body, *, every_cpu_from_s: float | None = None):
    """Load the demo model, start its runner on a new loop in a new thread, run `body(runner)`,
    and return its result with the loop thread's and the worker's CPUs after it."""
    (mc,) = discover_models(model_repo, ["vibration"])

    async def main():
        loop = asyncio.get_running_loop()
        metrics = Metrics()
        runner = await loop.run_in_executor(None, load_runner, mc, metrics, True)
        await runner.start()
        try:
            result = await body(runner)
            worker_cpus = os.sched_getaffinity(runner._threads.workers[0].native_id)
            return result, os.sched_getaffinity(0), worker_cpus, runner, metrics
        finally:
            await runner.close()

    def serve():
        if every_cpu_from_s is not None:
            saved = runner_module.WORKER_ON_EVERY_CPU_FROM_S
            runner_module.WORKER_ON_EVERY_CPU_FROM_S = every_cpu_from_s
            try:
                return asyncio.run(main())
            finally:
                runner_module.WORKER_ON_EVERY_CPU_FROM_S = saved
        return asyncio.run(main())

    return in_thread(serve)


@needs_two_cpus
def test_auto_measures_both_placements_applies_the_faster_and_counts_no_request(model_repo):
    cpu = choose("auto")
    choice, loop_cpus, worker_cpus, runner, metrics = run_on_fresh_loop_thread(
        model_repo, lambda runner: placement.choose(cpu, [runner]))
    shared, anywhere = choice.rates["vibration"]
    assert shared > 0 and anywhere > 0
    assert choice.cpu == (cpu if shared_cpu_wins(choice.rates) else None)
    expected = {cpu} if choice.cpu is not None else set(PROCESS_CPUS)
    assert loop_cpus == worker_cpus == expected  # the loop and its worker moved together
    assert "vibration" in choice.describe() and 'loop_cpu = "auto"' in choice.describe()
    # Thousands of calibration requests ran, none of them in the statistics or metrics.
    assert runner.stats.success_count == 0 and runner.stats.execution_count == 0
    assert "edge_batcher_requests_total{" not in metrics.render()


@needs_two_cpus
def test_a_model_whose_workers_run_on_every_cpu_is_not_measured(model_repo):
    """Workers of long-batch models never follow the loop (cpu_affinity.py): placing the loop
    alone is not worth a measurement, and threads stay on any CPU."""
    cpu = choose("auto")
    choice, loop_cpus, worker_cpus, _runner, _metrics = run_on_fresh_loop_thread(
        model_repo, lambda runner: placement.choose(cpu, [runner]), every_cpu_from_s=0.0)
    assert choice.cpu is None and choice.rates == {}
    assert "no local model" in choice.why
    assert loop_cpus == worker_cpus == set(PROCESS_CPUS)


@needs_two_cpus
def test_apply_moves_the_loop_and_its_workers_and_back(model_repo):
    cpu = choose("auto")

    async def body(runner):
        placement.apply(cpu, [runner])
        pinned = os.sched_getaffinity(0), os.sched_getaffinity(runner._threads.workers[0].native_id)
        placement.apply(None, [runner])
        return pinned

    pinned, loop_cpus, worker_cpus, _runner, _metrics = run_on_fresh_loop_thread(model_repo, body)
    assert pinned == ({cpu}, {cpu})
    assert loop_cpus == worker_cpus == set(PROCESS_CPUS)


def test_sample_inputs_fit_the_model(model_repo):
    (mc,) = discover_models(model_repo, ["vibration"])
    runner = load_runner(mc, Metrics(), False)
    sample = placement.sample_inputs(runner)
    assert {k: v.shape for k, v in sample.items()} == {"signal": (1, 256)}
    runner.validator.validate(runner_module.InferRequest("vibration", sample), check_length=True)


class FailsOnRealDataEngine:
    """Passes warm-up (all-zero batches), fails every real request: a broken model."""

    inputs = [TensorSpec("x", "FP32", (-1, 2))]
    outputs = [TensorSpec("y", "FP32", (-1, 2))]

    def infer(self, inputs):
        if np.any(inputs["x"]):
            raise RuntimeError("injected: this engine fails real data")
        return {"y": inputs["x"]}

    def close(self) -> None:
        pass


@needs_two_cpus
def test_a_model_that_fails_hands_the_measurement_to_the_next(model_repo):
    """The broken model has the shortest batches, so it is tried first; the daemon still gets a
    measured placement, from the demo model, and starts."""
    cpu = choose("auto")

    async def body(vibration):
        config = ModelConfig(name="broken", directory=Path("."),
                             batching=BatchingSettings(preferred_batch_sizes=[1, 2], max_batch_size=2))
        broken = ModelRunner(config, [FailsOnRealDataEngine()], Metrics())
        await asyncio.get_running_loop().run_in_executor(None, broken.warm_up)
        await broken.start()
        try:
            return await placement.choose(cpu, [broken, vibration])
        finally:
            await broken.close()

    choice, *_ = run_on_fresh_loop_thread(model_repo, body)
    assert set(choice.rates) == {"vibration"}
    assert "vibration" in choice.why and "failed" not in choice.why


@needs_two_cpus
def test_threads_the_pinned_loop_started_are_on_any_cpu_once_that_is_chosen():
    """The default executor's threads (which load the models, later decode large bodies) are
    started while "auto" has the loop pinned for the measurement, and inherit its CPU: when any
    CPU wins, they must follow, not stay on the measured one."""
    cpu = choose("auto")

    async def main():
        loop = asyncio.get_running_loop()
        pin_this_thread(cpu)
        started_pinned = await loop.run_in_executor(None, os.sched_getaffinity, 0)
        placement.apply(None, [])
        # an idle executor thread is reused: the one started while the loop was pinned
        return started_pinned, await loop.run_in_executor(None, os.sched_getaffinity, 0)

    started_pinned, after = in_thread(lambda: asyncio.run(main()))
    assert started_pinned == {cpu}
    assert after == set(PROCESS_CPUS)
