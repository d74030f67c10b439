"""A model's load holds what it needs in the memory budget while its engines load
(memory/device.py, DeviceLoad.held): batches and sequences of the models serving meanwhile are
not admitted against memory the load is about to take, and all of it comes back after."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

from edge_batcher.config import DaemonConfig, MemorySettings, ModelsSettings, load_model_config
from edge_batcher.memory.budget import MemoryBudget
from edge_batcher.memory.device import DeviceLoad, ModelDoesNotFit, load_need
from edge_batcher.memory.probe import CpuProbe
from edge_batcher.runtime import Runtime
from tests.support.models import add_vibration_variant, build_demo

MiB = 1 << 20


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("held")
    build_demo(out)
    add_vibration_variant(out, "heavy", "tests.support.faulty_engine:HeavyLoadEngine", "")
    for name in ("minilm", "encoder"):
        shutil.rmtree(out / name, ignore_errors=True)
    return out


def cgroup_budget(tmp_path: Path, free: int) -> tuple[MemoryBudget, Path]:
    """A budget on the real CPU probe, bounded by a cgroup directory this test writes (its limit
    less its usage is what is free, unless the host has less), without margins."""
    cg = tmp_path / "cg"
    cg.mkdir(exist_ok=True)
    (cg / "memory.max").write_text(f"{1 << 30}\n")
    (cg / "memory.current").write_text(f"{(1 << 30) - free}\n")
    return MemoryBudget(CpuProbe(cgroup_dir=cg), reserve_fraction=0.0, headroom_bytes=0), cg


def test_a_load_holds_its_need_until_its_engines_are_loaded(repo, tmp_path):
    config = load_model_config(repo / "vibration")
    budget, _ = cgroup_budget(tmp_path, 256 * MiB)
    need = load_need(config, budget.probe, 1)
    assert need is not None and need[0] == 2 * (repo / "vibration" / "model.onnx").stat().st_size
    before = budget.available()
    with DeviceLoad(budget).held(config):
        assert budget.reserved == need[0]
        assert budget.available() == before - need[0]
    assert budget.reserved == 0
    with pytest.raises(RuntimeError, match="the engine failed"), DeviceLoad(budget).held(config):
        raise RuntimeError("the engine failed")
    assert budget.reserved == 0


def test_a_load_that_does_not_fit_now_is_refused_and_holds_nothing(repo, tmp_path):
    config = load_model_config(repo / "vibration")
    budget, cg = cgroup_budget(tmp_path, 256 * MiB)
    need = load_need(config, budget.probe, 1)[0]
    (cg / "memory.current").write_text(f"{(1 << 30) - need + 1}\n")
    with pytest.raises(ModelDoesNotFit, match=r"model 'vibration': loading it needs about .* MiB \(2x its model "
                                              r"file.*the memory budget has; it was not loaded"):
        with DeviceLoad(budget).held(config):
            pytest.fail("loaded what does not fit")
    assert budget.reserved == 0
    # Free before, but promised to a batch admitted between the look and the load.
    (cg / "memory.current").write_text(f"{(1 << 30) - 256 * MiB}\n")
    load = DeviceLoad(budget)
    budget.reserve(256 * MiB - need // 2)
    with pytest.raises(ModelDoesNotFit, match="loading it needs about"), load.held(config):
        pytest.fail("loaded against memory a batch holds")
    assert budget.reserved == 256 * MiB - need // 2


async def test_a_model_loaded_while_others_serve_is_held_in_the_budget_while_it_loads(repo):
    """Through the runtime, as POST /v2/repository/models/heavy/load does: the heavy engine's
    load takes a second, during which the budget holds its need; then nothing is held."""
    runtime = Runtime(DaemonConfig(models=ModelsSettings(repository=str(repo), warmup=False, load=["vibration"]),
                                   memory=MemorySettings(probe="cpu")))
    await runtime.start()
    try:
        need = load_need(load_model_config(repo / "heavy"), runtime.budget.probe, 1)[0]
        seen: list[int] = []
        loading = asyncio.ensure_future(runtime.load_model("heavy"))
        while not loading.done():
            seen.append(runtime.budget.reserved)
            await asyncio.sleep(0.02)
        assert await loading == "loaded"
        assert need in seen and max(seen) == need, seen
        assert runtime.budget.reserved == 0
    finally:
        await runtime.close()



async def test_each_size_s_measuring_runs_are_held_in_the_budget(repo, monkeypatch):
    """A size's first runs at load grow the model's memory by about its predicted growth; that
    figure is held while they run (DeviceLoad.holding in measure_device), then given back."""
    from edge_batcher.scheduler.runner import ModelRunner

    runtime = Runtime(DaemonConfig(models=ModelsSettings(repository=str(repo), warmup=False, load=["vibration"]),
                                   memory=MemorySettings(probe="cpu")))
    held: list[tuple[int, int]] = []  # (rows, reserved) at each measuring run
    infer_on = ModelRunner.infer_on

    def measuring(runner, instance, batch):
        held.append((next(iter(batch.values())).shape[0], runtime.budget.reserved))
        return infer_on(runner, instance, batch)

    monkeypatch.setattr(ModelRunner, "infer_on", measuring)
    await runtime.start()
    try:
        assert sorted({rows for rows, _ in held}) == [2, 4, 8]
        assert len(held) == 3 * 3  # first, second and third run of each size, one instance
        assert all(reserved > 0 for _, reserved in held), held
        assert runtime.budget.reserved == 0
    finally:
        await runtime.close()
