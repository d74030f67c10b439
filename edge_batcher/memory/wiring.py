"""A model's memory at load: the daemon's budget, where a model's footprint comes from, its
calibration, and its admission control, wired up in one call.

`build_budget` turns [memory] into a MemoryBudget (once per daemon). `model_admission` is what
loading one model does for memory: it picks the footprint source (the engine's own figures,
else the ONNX liveness estimator), calibrates the estimate when asked, computes and publishes
every batch's footprint, and counts the weights as resident. On a device (an engine on the
CUDA EP, a probe that measures the device) it measures instead what the model really took
(device.py): the load and every size's first run, all of it resident, and calibrates the
estimate with it. Blocking (the estimator reads the model file, calibration runs subprocesses,
device measurement runs batches): call it off the event loop, as the loader does.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ..config import MemorySettings, ModelConfig
from ..engines.base import Engine
from ..errors import ConfigError
from ..metrics import Metrics
from .admission import Admission
from .budget import MemoryBudget
from .device import DeviceLoad, RunOnInstance, measure_device
from .estimator import Footprint, OnnxFootprintEstimator
from .probe import detect_probe

log = logging.getLogger(__name__)

MiB = 1 << 20

FootprintFn = Callable[[int, "int | None"], Footprint]


def build_budget(settings: MemorySettings) -> MemoryBudget:
    """The memory budget from [memory]: a probe of the device's free memory, with margins.
    probe = "fixed" measures nothing: budget_mb is then the whole budget, without margins."""
    fixed = int(settings.budget_mb * MiB) if settings.budget_mb > 0 else None
    if settings.probe == "fixed":
        if fixed is None:
            raise ConfigError("[memory] probe = \"fixed\" needs budget_mb > 0")
        return MemoryBudget(detect_probe("fixed", free_bytes=fixed), reserve_fraction=0.0, headroom_bytes=0,
                            fixed_bytes=fixed, refresh_interval_s=settings.refresh_interval_s)
    return MemoryBudget(
        detect_probe(settings.probe),
        reserve_fraction=settings.reserve_fraction,
        headroom_bytes=int(settings.headroom_mb * MiB),
        fixed_bytes=fixed,
        refresh_interval_s=settings.refresh_interval_s,
    )


def footprint_source(
    config: ModelConfig, engine: Engine
) -> tuple[Callable[[int, int | None], Footprint] | None, OnnxFootprintEstimator | None]:
    """Where a model's memory figures come from: (footprint function, estimator or None).
    The engine itself when it knows them exactly (TensorRT), else the ONNX liveness estimator,
    else nothing (no admission control)."""
    memory_footprint = engine.memory_footprint
    if memory_footprint is not None:
        # TensorRT allocates weights, activations and I/O buffers once at load: all of it is
        # resident, and a batch itself allocates nothing more (per_batch, normally 0).
        def from_engine(batch: int, seq_len: int | None) -> Footprint:
            f = memory_footprint(batch, seq_len)
            return Footprint(weights=f["resident"], activations=f["per_batch"], kv_cache=0)

        return from_engine, None
    if config.model_path.suffix == ".onnx":
        seq = config.sequence
        estimator = OnnxFootprintEstimator(
            config.model_path, sequence_axes={name: seq.axis for name in seq.inputs} if seq else None
        )
        return estimator.estimate, estimator
    return None, None


def model_admission(config: ModelConfig, engines: list[Engine], metrics: Metrics, budget: MemoryBudget | None,
                    calibrate: bool = False, load: DeviceLoad | None = None,
                    run: RunOnInstance | None = None) -> tuple[Admission | None, int]:
    """(admission control, resident bytes) for a model's loaded instances `engines`: (None, 0)
    without a budget or a footprint source. `load` (created before the engines loaded) and
    `run` (a batch on an instance's own thread) turn on measurement where a meter sees what the
    engine allocates (device.py: the device, a Jetson's memory, the process's for a CPU engine);
    a model the budget cannot hold raises ModelDoesNotFit. The resident bytes are already
    counted in the budget; give them back (`release_resident`) when the model is unloaded."""
    if budget is None:
        return None, 0
    engine = engines[0]
    footprint, estimator = footprint_source(config, engine)
    if footprint is None:
        return None, 0
    device = None
    meter = load.meter(engine) if load is not None else None
    if meter is not None and run is not None and load is not None and engine.memory_footprint is None:
        # TensorRT (memory_footprint) knows its sizes exactly; everything else is measured.
        device = measure_device(config, engine.batch_inputs or engine.inputs, run, len(engines), load, meter,
                                estimator.activation_peak if estimator is not None else None)
    if estimator is not None and calibrate and (device is None or device.meter == "process"):
        from .calibration import calibrate_model  # asked for, and the measurement was not a device's

        calibrate_model(config, estimator)
    elif estimator is not None and device is not None:
        from .calibration import calibrate_on_device

        calibrate_on_device(config, estimator, device)
    admission = Admission(config.name, budget, footprint, estimator, device)
    return admission, publish_estimates(config, admission, metrics, budget)


def release_resident(budget: MemoryBudget, resident: int) -> None:
    """An unloaded model's weights leave the budget."""
    if resident:
        budget.resident -= resident
        budget.refresh()


def publish_estimates(config: ModelConfig, admission: Admission, metrics: Metrics, budget: MemoryBudget) -> int:
    """Compute (and cache) the footprint of every preferred size and bucket now, at load,
    count the weights as resident, and publish the figures as metrics. Returns the resident bytes."""
    buckets = config.sequence.buckets if config.sequence else [0]
    weights = 0
    for size in config.batching.preferred_batch_sizes:
        for bucket in buckets:
            f = admission.footprint(size, bucket)
            weights = f.weights
            label = str(size) if not bucket else f"{size}x{bucket}"
            for part, value in (("weights", f.weights), ("activations", f.activations), ("kv_cache", f.kv_cache)):
                metrics.memory_estimate_bytes.set(value, model=config.name, batch=label, part=part)
    device = admission.device
    resident = device.resident if device is not None else weights * config.instances
    budget.resident += resident
    budget.refresh()
    if device is not None:
        log.info(
            "model %s: %.1f MiB of %s measured (load %.1f MiB, runs %.1f MiB, %d instance(s)), "
            "resident; largest batch needs %.1f MiB more; budget available %.1f MiB",
            config.name, resident / MiB, "device memory" if device.meter != "process" else "process memory",
            device.load_bytes / MiB, device.arena_bytes / MiB, config.instances,
            admission.batch_bytes(config.batching.preferred_batch_sizes[-1], buckets[-1]) / MiB,
            budget.available() / MiB,
        )
        return resident
    log.info(
        "model %s: weights %.1f MiB x %d instance(s); largest batch needs %.1f MiB; budget available %.1f MiB",
        config.name, weights / MiB, config.instances,
        admission.batch_bytes(config.batching.preferred_batch_sizes[-1], buckets[-1]) / MiB, budget.available() / MiB,
    )
    return resident
