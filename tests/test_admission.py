"""Memory-aware admission end to end: a real daemon with a fixed, tight memory budget."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import numpy as np

from edge_batcher.client import AsyncClient
from edge_batcher.memory.estimator import OnnxFootprintEstimator

MiB = 1 << 20


def estimates(model_repo, name="vibration"):
    est = OnnxFootprintEstimator(model_repo / name / "model.onnx")
    return {size: est.estimate(size) for size in (2, 4, 8)}


async def burst(url: str, model: str, n: int, seed: int = 0):
    x = np.random.default_rng(seed).standard_normal((n, 256)).astype(np.float32)
    async with AsyncClient(url) as client:
        return await asyncio.gather(*(client.infer(model, {"signal": x[i:i + 1]}) for i in range(n)),
                                    return_exceptions=True)


def fixed_budget(model_repo, batch_bytes: int, models=("vibration",)) -> str:
    """A config whose fixed budget leaves `batch_bytes` for batches after the models' weights."""
    weights = sum(estimates(model_repo, m)[2].weights for m in models)
    budget_mb = (weights + batch_bytes) / MiB
    return (f"[models]\nload = {list(models)!r}\n"
            f"[memory]\nprobe = \"fixed\"\nbudget_mb = {budget_mb!r}\n").replace("'", '"')


def test_a_tight_budget_serves_a_burst_in_smaller_batches_that_fit(start_daemon, model_repo):
    est = estimates(model_repo)
    room = est[4].activations + est[2].activations // 2  # one batch of 4 fits, never an 8
    assert est[8].activations > room
    d = start_daemon(fixed_budget(model_repo, room))
    results = asyncio.run(burst(d.url, "vibration", 64))
    assert not [r for r in results if isinstance(r, BaseException)]
    with d.client() as client:
        stats = client.stats("vibration")["model_stats"][0]
    sizes = {b["batch_size"] for b in stats["batch_stats"]}
    # Never an 8; whether a 4 forms depends on arrival timing (while a 2 is in flight, only
    # 2s fit the rest of the budget), so only the bound is asserted.
    assert sizes and sizes <= {2, 4}, sizes
    assert all(est[s].activations + est[s].kv_cache <= room for s in sizes)
    assert stats["inference_count"] == 64


def test_a_model_that_can_never_fit_is_refused_at_start_with_the_figures(tmp_path, model_repo):
    """Not ready with a model that can serve nothing: the start fails and says why."""
    est = estimates(model_repo)
    config = tmp_path / "config.toml"
    config.write_text(fixed_budget(model_repo, est[2].activations // 4))
    proc = subprocess.run([sys.executable, "-m", "edge_batcher.cli", "serve", "--config", str(config), "--models",
                           str(model_repo), "--unix-socket", str(tmp_path / "eb.sock")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert ("configuration error: model 'vibration': not even its smallest batch fits the memory budget: "
            "a batch of 2 needs") in proc.stderr and "MiB available" in proc.stderr
    assert "ready:" not in proc.stderr and "Traceback" not in proc.stderr


def test_a_request_that_cannot_fit_now_gets_a_clear_error(model_repo):
    """Memory taken by others after the model loaded: its smallest batch no longer fits, and the
    request is answered 503 with the figures (the daemon keeps serving)."""
    from edge_batcher.config import load_model_config
    from edge_batcher.errors import DoesNotFit
    from edge_batcher.memory.budget import MemoryBudget
    from edge_batcher.memory.probe import FixedProbe
    from edge_batcher.metrics import Metrics
    from edge_batcher.runtime import load_runner
    from edge_batcher.types import InferRequest

    probe = FixedProbe(64 * MiB)
    budget = MemoryBudget(probe, reserve_fraction=0.0, headroom_bytes=0, refresh_interval_s=0.0)
    runner = load_runner(load_model_config(model_repo / "vibration"), Metrics(), warmup=False, budget=budget)

    async def ask() -> BaseException | None:
        await runner.start()
        probe.free_bytes = 0  # another process took the memory
        try:
            await runner.infer(InferRequest("vibration", {"signal": np.zeros((1, 256), np.float32)}))
            return None
        except DoesNotFit as exc:
            return exc
        finally:
            await runner.close()

    error = asyncio.run(ask())
    assert error is not None and error.status == 503
    assert "does not fit in device memory" in error.message and "a batch of 2 needs" in error.message
    assert "MiB" in error.message


def test_metrics_show_the_budget_and_estimates(start_daemon, model_repo):
    est = estimates(model_repo)
    d = start_daemon(fixed_budget(model_repo, 64 * MiB))
    from tests.support import rawhttp

    _, text = rawhttp.request(d.socket, "GET", "/metrics")
    budget_line = next(line for line in text.splitlines() if line.startswith("edge_batcher_memory_budget_bytes "))
    assert 60 * MiB < float(budget_line.split()[1]) <= 64 * MiB
    assert (f'edge_batcher_memory_estimate_bytes{{model="vibration",batch="8",part="activations"}} '
            f'{est[8].activations}') in text


def test_out_of_memory_splits_the_batch_and_retries(start_daemon, model_repo):
    d = start_daemon('[models]\nload = ["oomy"]\n')
    results = asyncio.run(burst(d.url, "oomy", 8, seed=4))
    assert not [r for r in results if isinstance(r, BaseException)], results
    with d.client() as client:
        stats = client.stats("oomy")["model_stats"][0]
    from tests.support import rawhttp

    _, text = rawhttp.request(d.socket, "GET", "/metrics")
    assert 'edge_batcher_oom_retries_total{model="oomy"}' in text
    assert stats["inference_count"] == 8
    assert {b["batch_size"] for b in stats["batch_stats"]} <= {2, 4}
    assert "splitting it and retrying" in d.log_text()


def test_calibration_at_warm_up_measures_and_reports_the_factor(start_daemon):
    d = start_daemon('[models]\nload = ["vibration"]\n[memory]\ncalibrate_at_warmup = true\n')
    log = d.log_text()
    # The demo model's activations are far below what RSS can resolve, so the factor is
    # measured but, correctly, not applied; the log says why.
    assert "model vibration: activation estimate calibration 1.00 (not applied: measured run peak" in log
