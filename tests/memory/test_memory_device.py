"""Device-memory admission (memory/device.py) on a fake GPU: FakeCuda's memory counter read by the
real CudaProbe, the CUDA EP's arena played by tests/memory/fake_cuda_ep.py over a real ONNX
Runtime CPU session, loaded and warmed up by the real loader and runner (runtime.load_runner)."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import numpy as np
import pytest

from edge_batcher.config import load_model_config
from edge_batcher.engines.onnxruntime import provider_options
from edge_batcher.memory import device as device_module
from edge_batcher.memory.budget import MemoryBudget
from edge_batcher.memory.device import DeviceProfile, ModelDoesNotFit, SizeMeasurement
from edge_batcher.memory.probe import CudaProbe, FixedProbe
from edge_batcher.memory.wiring import release_resident
from edge_batcher.metrics import Metrics
from edge_batcher.runtime import load_runner
from tests.fakes.fake_cuda import FakeCuda
from tests.memory import fake_cuda_ep
from tests.memory.fake_cuda_ep import (
    CONTEXT_BYTES,
    PLANNER_FACTOR,
    WORKSPACE_BYTES,
    FakeCudaEpEngine,
)

MiB = 1 << 20
SIZES = [16, 256, 1024]  # the vibration demo: 3 KiB of activations a row, ~5 MiB of arena at 1024


def fake_gpu_model(model_repo: Path, tmp_path: Path, name: str = "vib", instances: int = 1):
    model = tmp_path / name
    shutil.copytree(model_repo / "vibration", model)
    toml = (model / "model.toml").read_text()
    toml = toml.replace('backend = "onnxruntime"', 'backend = "tests.memory.fake_cuda_ep:FakeCudaEpEngine"')
    toml = toml.replace("instances = 1", f"instances = {instances}")
    toml = toml.replace("preferred_batch_sizes = [2, 4, 8]", f"preferred_batch_sizes = {SIZES}")
    assert "FakeCudaEpEngine" in toml and str(SIZES) in toml
    (model / "model.toml").write_text(toml)
    return load_model_config(model)


@pytest.fixture
def gpu(monkeypatch):
    fake = FakeCuda(total_memory=4 << 30)
    monkeypatch.setattr(FakeCudaEpEngine, "device", fake)
    monkeypatch.setattr(fake_cuda_ep, "_contexts", {})
    return fake


def budget_on(fake: FakeCuda, **kwargs) -> MemoryBudget:
    return MemoryBudget(CudaProbe(cuda_module=fake), reserve_fraction=0.0, headroom_bytes=0,
                        refresh_interval_s=0.0, **kwargs)


def test_the_cuda_arena_is_configured_explicitly():
    assert provider_options("CUDAExecutionProvider", {"device_id": 0}, 512 * MiB) == {
        "device_id": "0", "arena_extend_strategy": "kSameAsRequested", "gpu_mem_limit": str(512 * MiB)}
    # model.toml's own choice wins; no limit without a budget; other providers untouched
    assert provider_options("CUDAExecutionProvider", {"arena_extend_strategy": "kNextPowerOfTwo",
                                                      "gpu_mem_limit": 1024}, 512 * MiB) == {
        "arena_extend_strategy": "kNextPowerOfTwo", "gpu_mem_limit": "1024"}
    assert provider_options("CUDAExecutionProvider", {}, None) == {"arena_extend_strategy": "kSameAsRequested"}
    assert provider_options("CPUExecutionProvider", {"x": 1}, 512 * MiB) == {"x": "1"}


@pytest.mark.parametrize("strategy, pattern", [("kSameAsRequested", False), ("kNextPowerOfTwo", False),
                                               ("kSameAsRequested", True)])
def test_what_the_device_lost_is_resident_and_measured_batches_reserve_nothing(
        gpu, model_repo, tmp_path, monkeypatch, caplog, strategy, pattern):
    monkeypatch.setattr(FakeCudaEpEngine, "cuda_ep_options", {"arena_extend_strategy": strategy})
    monkeypatch.setattr(FakeCudaEpEngine, "memory_pattern", pattern)
    config = fake_gpu_model(model_repo, tmp_path, instances=2)
    budget = budget_on(gpu)
    before = budget.refresh().total_bytes - budget.refresh().free_bytes
    with caplog.at_level(logging.INFO, logger="edge_batcher.memory"):
        runner = load_runner(config, Metrics(), warmup=True, budget=budget)
    lost = gpu.used_memory() - before
    admission = runner.admission
    device = admission.device
    assert device is not None
    # everything the device lost to the model (context, weights x2, workspaces x2, two arenas),
    # and no more: the runner's warm-up after the measurement grew nothing
    assert runner.resident_bytes == budget.resident == device.resident == lost
    assert device.load_bytes == CONTEXT_BYTES + 2 * config.model_path.stat().st_size
    engines = runner.engines
    assert device.arena_bytes == sum(e.arena.capacity for e in engines) + 2 * WORKSPACE_BYTES
    largest = engines[0].need({engines[0].inputs[0].name: np.zeros((1024, 256), "float32")})
    if strategy == "kNextPowerOfTwo":
        assert engines[0].arena.capacity > largest  # whole doubling regions: more than the need
    elif not pattern:
        assert engines[0].arena.capacity == pytest.approx(largest, abs=8)  # growth equals need
    else:
        # the largest size's buffers and its memory-pattern block, a run later, each as requested
        assert engines[0].arena.capacity == pytest.approx(2 * largest, abs=8)
        assert device.sizes[(256, 0)].second_run[0] > 0
    # the arena is resident: a measured size reserves nothing more on a discrete GPU
    for size in SIZES:
        assert device.sizes[(size, 0)].repeat_run == 0
        assert admission.batch_bytes(size, 0) == 0
        assert admission.fits(size, 0)
    # one log line per size while measuring
    assert sum("device memory grew" in r.getMessage() for r in caplog.records) == len(SIZES)
    # an unmeasured size falls back to the estimate, calibrated with what the arena grew to
    # (with the pattern: buffers and block, twice the planner's need, as on the H200)
    if strategy == "kSameAsRequested":
        factor = PLANNER_FACTOR * (2 if pattern else 1)
        assert admission.estimator.calibration == pytest.approx(factor, rel=0.01)
    assert admission.batch_bytes(512, 0) == admission.footprint(512, 0).activations > 0
    release_resident(budget, runner.resident_bytes)
    for engine in engines:
        engine.close()
    assert budget.resident == 0


def test_two_models_add_up_against_one_budget(gpu, model_repo, tmp_path):
    budget = budget_on(gpu, fixed_bytes=1 << 30)
    before = gpu.used_memory()
    a = load_runner(fake_gpu_model(model_repo, tmp_path, "a"), Metrics(), warmup=True, budget=budget)
    after_a = gpu.used_memory()
    b = load_runner(fake_gpu_model(model_repo, tmp_path, "b"), Metrics(), warmup=True, budget=budget)
    # the context is paid once, by the first model; the second pays its weights, workspace and arena
    assert a.resident_bytes == after_a - before > CONTEXT_BYTES
    assert b.resident_bytes == gpu.used_memory() - after_a < CONTEXT_BYTES
    assert budget.resident == gpu.used_memory() - before
    # budget_mb caps what the daemon uses, everything measured included
    assert budget.available() == (1 << 30) - budget.resident
    release_resident(budget, b.resident_bytes)
    assert budget.available() == (1 << 30) - a.resident_bytes


def context_paid(gpu: FakeCuda) -> None:
    """The primary context exists before the model loads (the cuda probe's first read makes it)."""
    gpu.init()
    context = gpu.get_device(0).retain_primary_context()
    context.push()
    try:
        fake_cuda_ep._contexts[id(gpu)] = gpu.mem_alloc(CONTEXT_BYTES)
    finally:
        context.pop()


def test_a_size_the_budget_cannot_hold_is_never_run(gpu, model_repo, tmp_path):
    config = fake_gpu_model(model_repo, tmp_path)
    weights = config.model_path.stat().st_size
    # room for the context, weights, the serving thread's workspace and 3 MiB of arena: batch
    # 256 holds 1.3 MiB, batch 1024 would need 5.3 (4.5 predicted above 256's)
    fixed = CONTEXT_BYTES + weights + WORKSPACE_BYTES + 3 * MiB
    budget = budget_on(gpu, fixed_bytes=fixed)
    before = gpu.used_memory()
    runner = load_runner(config, Metrics(), warmup=True, budget=budget)
    device = runner.admission.device
    assert set(device.sizes) == {(16, 0), (256, 0)}
    assert "batch 1024 would need about 4.5 MiB more; the budget has" in device.failed[(1024, 0)]
    assert runner.engines[0].arena.capacity < 2 * MiB  # 1024 never ran, not even once
    assert not runner.admission.fits(1024, 0) and runner.admission.fits(256, 0)  # never planned
    assert gpu.used_memory() - before == runner.resident_bytes <= fixed


def test_the_arena_limit_stops_growth_the_prediction_missed(gpu, model_repo, tmp_path, monkeypatch):
    monkeypatch.setattr(device_module, "PREDICTION_FACTOR", 0.0)  # a prediction that sees nothing
    monkeypatch.setattr(fake_cuda_ep, "WORKSPACE_BYTES", 0)  # all of the growth is the arena's
    context_paid(gpu)
    config = fake_gpu_model(model_repo, tmp_path)
    weights = config.model_path.stat().st_size
    budget = budget_on(gpu, fixed_bytes=weights + 3 * MiB)
    runner = load_runner(config, Metrics(), warmup=True, budget=budget)
    engine = runner.engines[0]
    assert engine.cuda_options["gpu_mem_limit"] == str(3 * MiB)  # from the budget, before load
    device = runner.admission.device
    assert set(device.sizes) == {(16, 0), (256, 0)}
    assert "Failed to allocate" in device.failed[(1024, 0)]
    assert engine.arena.capacity <= 3 * MiB
    assert not runner.admission.fits(1024, 0) and runner.admission.fits(256, 0)  # 1024 is never planned


def test_a_size_that_took_the_model_past_the_budget_is_dropped_by_a_reload(gpu, model_repo, tmp_path, monkeypatch,
                                                                            caplog):
    monkeypatch.setattr(device_module, "PREDICTION_FACTOR", 0.0)
    context_paid(gpu)
    config = fake_gpu_model(model_repo, tmp_path)
    weights = config.model_path.stat().st_size
    fixed = weights + WORKSPACE_BYTES + 3 * MiB  # the arena's cap at load cannot see the workspace
    budget = budget_on(gpu, fixed_bytes=fixed)
    before = gpu.used_memory()
    with caplog.at_level(logging.WARNING, logger="edge_batcher"):
        runner = load_runner(config, Metrics(), warmup=True, budget=budget)
    assert "took the model to" in caplog.text and "reloading it with batch sizes [16, 256]" in caplog.text
    assert runner.config.batching.preferred_batch_sizes == [16, 256]
    assert set(runner.admission.device.sizes) == {(16, 0), (256, 0)}
    assert gpu.used_memory() - before == runner.resident_bytes <= fixed  # the first arenas were freed


def test_a_model_whose_load_does_not_fit_is_refused_with_the_figures(gpu, model_repo, tmp_path):
    config = fake_gpu_model(model_repo, tmp_path)
    budget = budget_on(gpu, fixed_bytes=100 * MiB)  # the 300 MiB context alone is more
    before = gpu.used_memory()
    with pytest.raises(ModelDoesNotFit, match=r"model 'vib': loading it took 300\.\d MiB of device memory, more "
                                              r"than the 100\.0 MiB the memory budget had for it"):
        load_runner(config, Metrics(), warmup=True, budget=budget)
    assert budget.resident == 0
    assert gpu.used_memory() - before == CONTEXT_BYTES  # the engine closed; the primary context stays


def test_the_thread_that_serves_is_the_one_measured(gpu, model_repo, tmp_path):
    """The CUDA EP's per-thread workspace (the fake's WORKSPACE_BYTES) is paid by the thread that
    serves, at measurement: serving grows nothing the plan did not count."""
    import asyncio

    config = fake_gpu_model(model_repo, tmp_path)
    budget = budget_on(gpu)
    before = gpu.used_memory()
    runner = load_runner(config, Metrics(), warmup=True, budget=budget)
    planned = gpu.used_memory() - before
    assert runner.resident_bytes == planned

    async def serve() -> int:
        from edge_batcher.types import InferRequest

        await runner.start()
        x = np.zeros((1, 256), np.float32)
        await asyncio.gather(*(runner.infer(InferRequest("vib", {"signal": x})) for _ in range(64)))
        serving = gpu.used_memory() - before
        await runner.close()
        return serving

    assert asyncio.run(serve()) == planned  # once 32 MiB more: the workspace of an unmeasured thread
    assert runner.stats.inference_count == 64
    assert gpu.used_memory() - before == CONTEXT_BYTES  # closed: all given back but the primary context


def test_unified_memory_reserves_the_batch_host_arrays():
    m = SizeMeasurement(8, 0, (4 * MiB,), (MiB,), repeat_run=0, io_bytes=64 * 1024)
    discrete = DeviceProfile(load_bytes=100 * MiB, unified=False, sizes={(8, 0): m})
    jetson = DeviceProfile(load_bytes=100 * MiB, unified=True, sizes={(8, 0): m})
    assert discrete.transient(8, 0) == 0 and jetson.transient(8, 0) == 64 * 1024
    assert discrete.transient(4, 0) is None  # not measured: the estimate decides
    assert discrete.resident == 105 * MiB
    # a size whose repeated run still grows is not held by the arena: reserved every time
    leaky = DeviceProfile(0, False, {(8, 0): SizeMeasurement(8, 0, (MiB,), (0,), repeat_run=MiB, io_bytes=0)})
    assert leaky.transient(8, 0) == MiB


def test_the_cpu_execution_provider_keeps_the_estimate(model_repo):
    config = load_model_config(model_repo / "vibration")
    budget = MemoryBudget(FixedProbe(1 << 30), reserve_fraction=0.0, headroom_bytes=0)
    runner = load_runner(config, Metrics(), warmup=False, budget=budget)
    assert runner.admission.device is None
    assert runner.resident_bytes == runner.admission.footprint(2, 0).weights
    for engine in runner.engines:
        engine.close()


def test_estimate_measure_reports_the_device_per_size(gpu, model_repo, tmp_path, capsys):
    from edge_batcher.config import load_config
    from edge_batcher.memory.report import build_report, format_report

    fake_gpu_model(model_repo, tmp_path / "repo")
    config = load_config(None)
    config.models.repository = str(tmp_path / "repo")
    seen: list[str] = []
    report = build_report(config, measure=True, progress=seen.append, memory_budget=budget_on(gpu))
    assert seen == [f"measuring vib batch {size}" for size in SIZES]  # one line per size
    rows = report["models"][0]["rows"]
    weights = (tmp_path / "repo" / "vib" / "model.onnx").stat().st_size
    for row in rows:
        d = row["device"]
        # a fresh engine per size: its load (the context only for the first), its first run
        # (workspace + buffers), nothing on later runs; all given back when it closes
        assert d["load_bytes"] == weights + (CONTEXT_BYTES if row["batch"] == SIZES[0] else 0)
        need = int(row["activations"] * PLANNER_FACTOR)
        assert d["first_run"] == pytest.approx(WORKSPACE_BYTES + need, abs=8)
        assert d["second_run"] == d["repeat_run"] == 0
    # above the smallest size the workspace cancels out: the error is the planner's 1.75x
    assert rows[-1]["device_estimate_error"] == pytest.approx(1 / PLANNER_FACTOR - 1, rel=0.02)
    assert gpu.used_memory() == CONTEXT_BYTES  # every engine closed; the primary context stays
    text = format_report(report)
    assert "Device memory (cuda:0)" in text and "run 1 MiB" in text


def test_the_memory_pattern_is_off_on_the_cuda_ep_only(model_repo):
    from edge_batcher.engines.onnxruntime import OnnxRuntimeEngine, uses_memory_pattern

    assert not uses_memory_pattern(["CUDAExecutionProvider", "CPUExecutionProvider"])
    assert uses_memory_pattern(["TensorrtExecutionProvider", "CPUExecutionProvider"])
    assert uses_memory_pattern(["CPUExecutionProvider"])
    engine = OnnxRuntimeEngine(load_model_config(model_repo / "vibration"))
    engine.load()  # on the CPU EP here: ONNX Runtime's default stays
    assert engine.session.get_session_options().enable_mem_pattern
    engine.close()
