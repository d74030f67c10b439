"""What a model really costs on the device it runs on, measured with the budget's own probe.

On a GPU (or a Jetson's shared memory) the estimator's liveness figure is not what the device
loses: the CUDA context, cuBLAS/cuDNN workspaces and ONNX Runtime's arena, which keeps its
high-water mark, are not in it. `DeviceLoad` reads the probe before a model's engines load;
`measure_device` then records the growth of device memory across the load (fixed costs) and
across the first run of every preferred size on every instance (the arena growing), and
`DeviceProfile` is the result admission plans with (docs/memory.md, "Device memory"). Used
only when the engine runs on a device provider and the probe measures that device; the CPU
execution provider keeps the estimator and calibration. Blocking: call it off the event loop.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..config import ModelConfig
from ..errors import OutOfMemory
from ..types import DATATYPE_TO_NUMPY, TensorSpec
from .budget import MemoryBudget
from .snapshot import MemoryProbe

log = logging.getLogger(__name__)

MiB = 1 << 20

# Execution providers whose memory is device memory (not the process's heap).
DEVICE_PROVIDERS = frozenset({"CUDAExecutionProvider", "TensorrtExecutionProvider", "NvTensorRTRTXExecutionProvider"})
# Probes whose free memory is the device's: discrete GPU (cuda, nvml) and unified memory (jetson).
DEVICE_PROBES = frozenset({"cuda", "nvml", "jetson"})
# On these the host arrays of a batch (inputs assembled, outputs copied back) are device memory too.
UNIFIED_PROBES = frozenset({"jetson"})


def measures_device(probe: MemoryProbe) -> bool:
    return probe.name in DEVICE_PROBES


def runs_on_device(engine: Any) -> bool:
    """True when the engine's first (preferred) provider allocates device memory."""
    providers = getattr(engine, "providers", None) or []
    return bool(providers) and providers[0] in DEVICE_PROVIDERS


def device_used(probe: MemoryProbe) -> int:
    """Bytes of the device in use now, by everyone (total - free), read from the probe itself."""
    snapshot = probe.read()
    return snapshot.total_bytes - snapshot.free_bytes


@dataclass(frozen=True)
class SizeMeasurement:
    """Device-memory growth around the first and the second run of one (size, bucket) on each
    instance, and around a third run on the first instance. With ONNX Runtime's memory pattern
    on, the second run grows too: the pattern, planned on a shape's first run, is allocated as
    one more block (measured on an H200: +94 MiB at 32 x 128 on the encoder, on top of the first
    run's +156 MiB; the backend turns it off on the CUDA EP). Both are held by the arena; the
    third is normally 0."""

    size: int
    bucket: int
    first_run: tuple[int, ...]  # per instance
    second_run: tuple[int, ...]  # per instance
    repeat_run: int  # the third run, first instance: what is still growing
    io_bytes: int  # the batch's inputs + outputs on the host

    @property
    def held(self) -> tuple[int, ...]:
        """What each instance's arena (and one-time workspaces) grew by for this size."""
        return tuple(a + b for a, b in zip(self.first_run, self.second_run))

    def to_json(self) -> dict[str, Any]:
        return {"size": self.size, "bucket": self.bucket, "first_run": list(self.first_run),
                "second_run": list(self.second_run), "repeat_run": self.repeat_run, "io_bytes": self.io_bytes}


@dataclass
class DeviceProfile:
    """A model's measured device memory. resident = load + every first run's growth: what the
    device lost to this model, all instances, held for as long as it is loaded (arenas never
    give memory back). A measured size's batch reserves only its transient bytes."""

    load_bytes: int
    unified: bool
    sizes: dict[tuple[int, int], SizeMeasurement] = field(default_factory=dict)
    failed: dict[tuple[int, int], str] = field(default_factory=dict)  # out of memory at that size

    @property
    def arena_bytes(self) -> int:
        return sum(sum(m.held) for m in self.sizes.values())

    @property
    def resident(self) -> int:
        return max(0, self.load_bytes) + self.arena_bytes

    def transient(self, size: int, bucket: int) -> int | None:
        """Bytes one batch of a measured size still needs beyond the resident memory (None: not
        measured): what a third run still grew by (it did not settle: reserve it every time, on
        the safe side), and on unified memory the batch's host arrays, device memory there."""
        m = self.sizes.get((size, bucket))
        if m is None:
            return None
        return max(0, m.repeat_run) + (m.io_bytes if self.unified else 0)

    def growth_above_smallest(self, bucket: int) -> tuple[int, int, int] | None:
        """(smallest size, largest size, what the first instance's arena grew by between them)
        in one bucket: the activations' part of the growth, without the one-time costs that the
        first run pays (library workspaces). None when fewer than two sizes ran, or when the
        arena did not grow at the smallest (it held more already: the difference would be low)."""
        measured = sorted(s for (s, b) in self.sizes if b == bucket)
        if len(measured) < 2 or self.sizes[(measured[0], bucket)].held[0] <= 0:
            return None
        grown = sum(self.sizes[(s, bucket)].held[0] for s in measured[1:])
        return measured[0], measured[-1], grown

    def to_json(self) -> dict[str, Any]:
        return {"load_bytes": self.load_bytes, "arena_bytes": self.arena_bytes, "resident": self.resident,
                "unified": self.unified, "sizes": [m.to_json() for m in self.sizes.values()],
                "failed": {f"{s}x{b}": why for (s, b), why in self.failed.items()}}


class DeviceLoad:
    """Device memory around one model's load. Create it before the engines load (it reads the
    probe then), pass each new engine to `prepare` before its load() (the engine's arena limit
    comes from the budget), and hand it to model_admission. Does nothing for a budget whose
    probe does not measure a device."""

    def __init__(self, budget: MemoryBudget | None):
        # Kept only when it measures the device: without it every method does nothing.
        self.budget = budget if budget is not None and measures_device(budget.probe) else None
        self.active = self.budget is not None
        self.used_before = device_used(self.budget.probe) if self.budget is not None else 0

    def prepare(self, engine: Any) -> None:
        """Cap the engine's arena at what the budget has available now less the weights it is
        about to load, so that growing past it fails as out-of-memory (the split-and-retry path)
        instead of taking memory the budget promised elsewhere. The cap is the arena's only
        (ONNX Runtime's gpu_mem_limit): the context and library workspaces are outside it, and
        measured. Only engines that take a limit have the attribute."""
        budget = self.budget
        if budget is not None and hasattr(engine, "device_memory_limit"):
            budget.refresh()
            try:
                weights = engine.config.model_path.stat().st_size
            except (AttributeError, OSError):
                weights = 0
            engine.device_memory_limit = max(1, budget.available() - weights)

    def load_bytes(self) -> int:
        if self.budget is None:
            return 0
        return device_used(self.budget.probe) - self.used_before


def warmup_batch(specs: list[TensorSpec], config: ModelConfig, size: int, bucket: int) -> dict[str, np.ndarray]:
    """Zeros for every batch input: `size` rows, the sequence axis at the bucket length, other
    dynamic dimensions 1 (as the runner's warm-up builds them)."""
    seq = config.sequence
    batch = {}
    for spec in specs:
        seq_axis = seq.axis % len(spec.shape) if seq and spec.name in seq.inputs else None
        shape = [size] + [bucket if axis == seq_axis else (d if d > 0 else 1)
                          for axis, d in enumerate(spec.shape) if axis > 0]
        dtype = DATATYPE_TO_NUMPY[spec.datatype]
        batch[spec.name] = np.full(shape, b"", dtype=object) if dtype.kind == "O" else np.zeros(shape, dtype=dtype)
    return batch


def measure_device(config: ModelConfig, engines: list[Any], load: DeviceLoad) -> DeviceProfile:
    """Measure every preferred size of every bucket, smallest first, on every instance: the
    device's growth around the size's first and second runs (logged, one line per size), then
    around a third run on the first instance. A size that runs out of memory ends its bucket
    (larger ones would too); the runner's warm-up then caps the sizes as it does without a device."""
    if load.budget is None:
        raise ValueError("measure_device needs a DeviceLoad whose budget measures the device (load.active)")
    probe = load.budget.probe
    profile = DeviceProfile(load.load_bytes(), unified=probe.name in UNIFIED_PROBES)
    log.info("model %s: device memory at load: %.1f MiB (context, weights, workspaces; %d instance(s))",
             config.name, profile.load_bytes / MiB, len(engines))
    buckets = config.sequence.buckets if config.sequence else [0]
    specs = engines[0].batch_inputs or engines[0].inputs
    for bucket in buckets:
        for size in config.batching.preferred_batch_sizes:
            batch = warmup_batch(specs, config, size, bucket)
            try:
                first, second = [], []
                for engine in engines:
                    before = device_used(probe)
                    outputs = engine.infer(batch)
                    io_bytes = sum(int(a.nbytes) for a in batch.values()) + sum(int(o.nbytes) for o in outputs.values())
                    del outputs  # host arrays: not the device's, except on unified memory (io_bytes)
                    middle = device_used(probe)
                    engine.infer(batch)
                    first.append(middle - before)
                    second.append(device_used(probe) - middle)
                before = device_used(probe)
                engines[0].infer(batch)
                repeat = device_used(probe) - before
            except OutOfMemory as exc:
                profile.failed[(size, bucket)] = str(exc)
                log.warning("model %s: batch %d%s ran out of device memory while measuring: %s",
                            config.name, size, f" x {bucket}" if bucket else "", exc)
                break
            m = SizeMeasurement(size, bucket, tuple(first), tuple(second), repeat, io_bytes)
            profile.sizes[(size, bucket)] = m
            log.info("model %s: batch %d%s: device memory grew %s MiB on its first two runs, %.1f MiB on a third",
                     config.name, size, f" x {bucket}" if bucket else "",
                     " + ".join(f"{g / MiB:.1f}" for g in m.held), repeat / MiB)
    return profile


def measure_fresh_engine(config: ModelConfig, probe: MemoryProbe, size: int, bucket: int) -> dict[str, Any] | None:
    """One size on a fresh engine (`edge-batcher estimate --measure` on a device): the device's
    growth around the engine's load and its first three runs, in bytes. None when the
    engine does not run on a device provider (the CPU EP is measured by RSS, measure.py).
    Loads a whole engine: blocking, seconds."""
    from ..engines.registry import create_engine

    before = device_used(probe)
    engine = create_engine(config)
    engine.load()
    try:
        if not runs_on_device(engine):
            return None
        loaded = device_used(probe)
        batch = warmup_batch(engine.batch_inputs or engine.inputs, config, size, bucket)
        after = []
        for _ in range(3):
            engine.infer(batch)
            after.append(device_used(probe))
    except OutOfMemory as exc:
        return {"load_bytes": 0, "first_run": 0, "second_run": 0, "repeat_run": 0, "out_of_memory": str(exc),
                "providers": list(getattr(engine, "providers", []))}
    finally:
        engine.close()
    return {"load_bytes": loaded - before, "first_run": after[0] - loaded, "second_run": after[1] - after[0],
            "repeat_run": after[2] - after[1], "providers": list(getattr(engine, "providers", []))}
