"""The memory plan on a real GPU: ONNX Runtime's CUDA execution provider and the cuda probe.

Skipped where onnxruntime has no CUDA provider or no GPU answers (this file is what the suite
adds on a GPU machine; tests/memory/test_memory_device.py plays the same with a fake device).
The cuda probe reads the whole GPU, so these need it to themselves: run this file alone (as
the device runs did: `pytest tests/memory/test_memory_cuda.py`, then the rest in parallel);
beside parallel workers, each daemon's CUDA context (~500 MiB) moves the figures compared.
"""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest

from edge_batcher.config import ExecutionProvider, load_model_config
from edge_batcher.memory.device import ModelDoesNotFit, device_used
from edge_batcher.memory.wiring import build_budget, release_resident
from edge_batcher.metrics import Metrics
from edge_batcher.runtime import load_runner
from edge_batcher.types import InferRequest

MiB = 1 << 20
CUDA = "CUDAExecutionProvider"


def cuda_or_skip() -> None:
    import onnxruntime

    if CUDA not in onnxruntime.get_available_providers():
        pytest.skip("onnxruntime has no CUDA execution provider here")
    from edge_batcher.memory.probe import detect_probe

    try:
        detect_probe("cuda").read()
    except Exception as exc:  # no driver, no device, no binding
        pytest.skip(f"no GPU answers the cuda probe: {exc}")


def on_cuda(config):
    ort = dataclasses.replace(config.onnxruntime, execution_providers=[ExecutionProvider(CUDA),
                                                                       ExecutionProvider("CPUExecutionProvider")])
    return dataclasses.replace(config, onnxruntime=ort)


def budget(mb: float = 0):
    from edge_batcher.config import MemorySettings

    return build_budget(MemorySettings(probe="cuda", budget_mb=mb, headroom_mb=0, reserve_fraction=0.0))


def test_serving_on_the_worker_threads_grows_nothing_the_plan_did_not_count(model_repo):
    cuda_or_skip()
    config = dataclasses.replace(on_cuda(load_model_config(model_repo / "seqsum")), instances=2)
    b = budget()
    before = device_used(b.probe)
    runner = load_runner(config, Metrics(), warmup=True, budget=b)
    assert runner.engines[0].providers[0] == CUDA
    assert not runner.engines[0].accepts_any_length  # on a device: bucket lengths only
    planned = device_used(b.probe) - before
    assert runner.resident_bytes == pytest.approx(planned, abs=4 * MiB)
    rng = np.random.default_rng(0)

    rows = 0

    async def serve() -> int:
        nonlocal rows
        await runner.start()
        for _ in range(8):  # rounds of 50: the queue holds 256
            requests = [InferRequest("seqsum", {"x": rng.standard_normal(
                (int(rng.integers(1, 9)), int(rng.integers(1, 33)))).astype(np.float32)}) for _ in range(50)]
            rows += sum(len(r.inputs["x"]) for r in requests)
            await asyncio.gather(*(runner.infer(r) for r in requests))
        serving = device_used(b.probe) - before
        await runner.close()
        return serving

    serving = asyncio.run(serve())
    assert runner.stats.success_count == 400 and runner.stats.inference_count == rows  # Triton's: rows
    assert serving - planned <= 4 * MiB, f"serving took {(serving - planned) / MiB:.1f} MiB beyond the plan"
    release_resident(b, runner.resident_bytes)


def test_a_budget_below_the_model_s_measured_memory_is_refused_and_given_back(model_repo):
    cuda_or_skip()
    config = on_cuda(load_model_config(model_repo / "vibration"))
    free = budget()
    runner = load_runner(config, Metrics(), warmup=False, budget=free)
    resident = runner.resident_bytes
    runner.close_unstarted()
    release_resident(free, resident)
    tight = budget(round(0.5 * resident / MiB, 1))
    before = device_used(tight.probe)
    with pytest.raises(ModelDoesNotFit, match=r"model 'vibration': .* MiB"):
        load_runner(config, Metrics(), warmup=False, budget=tight)
    assert device_used(tight.probe) - before <= 4 * MiB
