"""What a model really costs in the memory it runs in, measured, and kept within the budget.

On a GPU (or a Jetson's shared memory) the estimator's liveness figure is not what the device
loses: the CUDA context, cuBLAS/cuDNN workspaces and ONNX Runtime's arena, which keeps its
high-water mark, are not in it; on the host, the engine's copy of the weights, its arena and the
tokenizer are not either. A `Meter` reads the memory a model's engine allocates from: the
budget's probe for a device engine on a GPU or for any engine on a Jetson (unified memory), the
process's resident memory for a CPU engine. `DeviceLoad` reads it before a model's engines
load; `measure_device` records the growth across the load (fixed costs) and across the first
runs of every preferred size on every instance, on the instance's own thread, and refuses what
the budget cannot hold (docs/memory.md, "Device memory"). `DeviceProfile` is the result
admission plans with. Blocking: call it off the event loop.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import psutil
from numpy.typing import NDArray

from ..config import ModelConfig
from ..engines.base import DEVICE_PROVIDERS
from ..errors import ConfigError, OutOfMemory
from ..types import DATATYPE_TO_NUMPY, TensorSpec
from .budget import MemoryBudget
from .heap import trim_heap
from .snapshot import MemoryProbe

log = logging.getLogger(__name__)

MiB = 1 << 20

# Probes whose free memory is the device's: discrete GPU (cuda, nvml) and unified memory (jetson).
DEVICE_PROBES = frozenset({"cuda", "nvml", "jetson"})
# On these the host arrays of a batch (inputs assembled, outputs copied back) are device memory too.
UNIFIED_PROBES = frozenset({"jetson"})
# Before a size first runs, its growth is predicted from the liveness estimate times this (ONNX
# Runtime's per-shape pools hold 1.6-1.75x the liveness peak: docs/memory.md, "Calibration"), so
# a size the budget cannot hold is not run at all, also not once to find out.
PREDICTION_FACTOR = 2.0
# Loading an ONNX model into host memory peaks at about this times its file (DeviceLoad.held).
LOAD_PEAK_FACTOR = 2.0


class ModelDoesNotFit(ConfigError):
    """A model's measured memory does not fit the budget: it is not loaded (start-up fails)."""


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


class Meter(Protocol):
    """Bytes in use of the memory an engine allocates from."""

    name: str
    unified: bool  # a batch's host arrays are in this memory too

    def used(self) -> int: ...


class ProbeMeter:
    """The budget's probe as a meter: the device's memory in use (total - free), by everyone."""

    def __init__(self, probe: MemoryProbe):
        self.probe = probe
        self.name = probe.name
        self.unified = probe.name in UNIFIED_PROBES

    def used(self) -> int:
        return device_used(self.probe)


class ProcessMeter:
    """This process's resident memory: what a CPU engine takes from the host. The process's own
    figure, not the host's free memory, so other processes' churn is not counted as the model's."""

    name = "process"
    unified = True

    def __init__(self) -> None:
        self._process = psutil.Process()

    def used(self) -> int:
        return int(self._process.memory_info().rss)


def memory_in_use(probe: MemoryProbe) -> dict[str, int]:
    """What every meter that may measure a model reads now, by meter name: the process's
    resident memory, and the device's memory in use when the probe reads a device."""
    used = {ProcessMeter.name: ProcessMeter().used()}
    if measures_device(probe):
        used[probe.name] = device_used(probe)
    return used


def meter_for(probe: MemoryProbe, engine: Any) -> Meter | None:
    """The meter that sees what `engine` allocates, if the budget plans with that memory: the
    probe itself for a device engine on a GPU probe and for any engine on a Jetson (one memory);
    the process's resident memory for a host engine under the `cpu` probe. None (the estimate
    decides) for a `fixed` budget, which is a configured number, and for a device engine whose
    device the probe does not read."""
    if probe.name in UNIFIED_PROBES or (runs_on_device(engine) and probe.name in DEVICE_PROBES):
        return ProbeMeter(probe)
    if not runs_on_device(engine) and probe.name == "cpu":
        return ProcessMeter()
    return None


@dataclass(frozen=True)
class SizeMeasurement:
    """Memory growth around the first and the second run of one (size, bucket) on each
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
    """A model's measured memory. resident = load + every first run's growth: what the memory it
    runs in lost to this model, all instances, held for as long as it is loaded (arenas never
    give memory back). A measured size's batch reserves only its transient bytes. `failed`:
    the sizes not served, and why (out of memory, or more than the budget holds)."""

    load_bytes: int
    unified: bool
    sizes: dict[tuple[int, int], SizeMeasurement] = field(default_factory=dict)
    failed: dict[tuple[int, int], str] = field(default_factory=dict)
    meter: str = ""  # what measured it: a probe's name, or "process"
    budget_bytes: int = 0  # what the budget had available for this model before its load

    @property
    def arena_bytes(self) -> int:
        return sum(sum(m.held) for m in self.sizes.values())

    @property
    def resident(self) -> int:
        return max(0, self.load_bytes) + self.arena_bytes

    @property
    def fixed_bytes(self) -> int:
        """The load and the first measured size's growth: what the model costs whatever the
        batch (context, weights, per-thread workspaces), with that size's small arena on top."""
        first = next(iter(self.sizes.values()), None)
        return max(0, self.load_bytes) + (sum(first.held) if first is not None else 0)

    @property
    def over_budget(self) -> bool:
        """The measured sizes took more than the budget had for the model (its arenas hold it)."""
        return any(self.transient(s, b) is not None and self.resident + (self.transient(s, b) or 0) > self.budget_bytes
                   for s, b in self.sizes)

    @property
    def smallest_failed(self) -> int | None:
        """The smallest batch size that was not measured (out of memory or over the budget)."""
        return min((size for size, _ in self.failed), default=None)

    def refuses(self, size: int, bucket: int) -> bool:
        """True for a size that failed in its bucket, and for the larger ones never tried after it."""
        return any(b == bucket and s <= size for s, b in self.failed)

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
                "unified": self.unified, "meter": self.meter, "budget_bytes": self.budget_bytes,
                "sizes": [m.to_json() for m in self.sizes.values()],
                "failed": {f"{s}x{b}": why for (s, b), why in self.failed.items()}}


def load_need(config: ModelConfig, probe: MemoryProbe, instances: int) -> tuple[int, str] | None:
    """(bytes, how they were reckoned) that loading a model's instances takes at its peak,
    from its model file: in host memory about LOAD_PEAK_FACTOR x the file for a moment (ONNX
    Runtime holds the file's bytes and the weights it made of them at once: +142 MiB at the
    peak for MiniLM's 86 MiB, +97 MiB after); on a GPU the weights themselves. None where the
    file says nothing: a fixed budget (a configured number: the model file is not the weights),
    or no readable file (the engine's load says what is wrong with it)."""
    if probe.name == "fixed":
        return None
    try:
        weights = config.model_path.stat().st_size * instances
    except OSError:
        return None
    providers = [ep.name for ep in config.onnxruntime.execution_providers]
    on_device = bool(providers) and providers[0] in DEVICE_PROVIDERS and measures_device(probe) \
        and probe.name not in UNIFIED_PROBES
    if on_device:
        return weights, f"its weights: {weights / MiB:.1f} MiB, {instances} instance(s)"
    return int(weights * LOAD_PEAK_FACTOR), \
        f"{LOAD_PEAK_FACTOR:g}x its model file: {weights / MiB:.1f} MiB, {instances} instance(s)"


class DeviceLoad:
    """Memory around one model's load. Create it before the engines load, off the event loop (it
    gives the C heap's free pages back to the system, then reads the meters and what the budget
    has available), load the engines within `held`, pass each new engine to `prepare` before its
    load() (the engine's arena limit comes from the budget), and hand it to model_admission.
    Does nothing without a budget."""

    def __init__(self, budget: MemoryBudget | None, instances: int = 1, known_load_bytes: int | None = None):
        """known_load_bytes: what loading these instances and their first run took before (a
        reload: DeviceProfile.fixed_bytes), so that their arenas' cap leaves it out."""
        self.budget = budget
        self.instances = instances
        self.known_load_bytes = known_load_bytes
        self.available_before = 0
        self._used_before: dict[str, int] = {}
        if budget is not None:
            # What the process freed before (a version unloaded, an earlier load's transients)
            # back to the system first: a load that reused that heap would not show as growth
            # (a reloaded SmolLM2 measured 12 MiB of its ~160).
            trim_heap()
            budget.refresh()
            self.available_before = budget.available()
            self._used_before = memory_in_use(budget.probe)

    @contextmanager
    def held(self, config: ModelConfig) -> Iterator[None]:
        """Around the engines' load: refuse a model whose load alone would not fit (load_need)
        before loading it (the load would fail, or on unified memory meet the OOM killer, before
        anything could be measured), and hold what it needs in the budget until the block ends,
        so that batches and sequences of the models serving meanwhile (a load through the API,
        a reload) are not admitted against memory the load is about to take. What the load has
        taken shows in free memory too and is counted twice until then, as a batch's is: the
        safe side, for the load's seconds."""
        need = load_need(config, self.budget.probe, self.instances) if self.budget is not None else None
        if need is None:
            yield
            return
        assert self.budget is not None
        if need[0] > self.available_before or not self.budget.try_reserve(need[0]):
            raise ModelDoesNotFit(
                f"model {config.name!r}: loading it needs about {need[0] / MiB:.1f} MiB ({need[1]}), more "
                f"than the {min(self.available_before, self.budget.available()) / MiB:.1f} MiB the memory "
                "budget has; it was not loaded")
        try:
            yield
        finally:
            self.budget.release(need[0])

    @contextmanager
    def holding(self, nbytes: int) -> Iterator[None]:
        """`nbytes` reserved in the budget until the block ends: what a size's measuring runs
        are predicted to take (measure_device), which models serving meanwhile must not be
        admitted against. measure_device decides what fits by what the budget had before the
        load; this only keeps the others off it."""
        if self.budget is None or nbytes <= 0:
            yield
            return
        with self.budget.reservation(nbytes):
            yield

    def meter(self, engine: Any) -> Meter | None:
        """The meter for a loaded engine (meter_for), or None without a budget."""
        return meter_for(self.budget.probe, engine) if self.budget is not None else None

    def prepare(self, engine: Any) -> None:
        """Cap each instance's arena at its share of what the budget had available before the
        load, less what the load takes (the weights, or what a previous load of the model was
        measured to take), so that growing past it fails as out-of-memory instead of taking
        memory the budget promised elsewhere. ONNX Runtime's gpu_mem_limit caps the arena only:
        the context and library workspaces outside it are measured, and a size predicted not to
        fit is not run (measure_device); this cap is the backstop. Only engines that take a
        limit have the attribute."""
        if self.budget is None or not measures_device(self.budget.probe) or not hasattr(engine, "device_memory_limit"):
            return
        load = self.known_load_bytes
        if load is None:
            try:
                load = engine.config.model_path.stat().st_size * self.instances
            except (AttributeError, OSError):
                load = 0
        engine.device_memory_limit = max(1, (self.available_before - load) // self.instances)

    def load_bytes(self, meter: Meter) -> int:
        return meter.used() - self._used_before[meter.name]


def warmup_batch(specs: list[TensorSpec], config: ModelConfig, size: int, bucket: int) -> dict[str, NDArray[Any]]:
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


# run(instance, batch) -> outputs: one batch on that engine instance's own thread, waited for.
RunOnInstance = Callable[[int, dict[str, NDArray[Any]]], dict[str, NDArray[Any]]]
# activation_peak(size, seq_len or None) -> bytes: the liveness estimate, for predicting growth.
ActivationPeak = Callable[[int, "int | None"], int]


def measure_device(config: ModelConfig, specs: list[TensorSpec], run: RunOnInstance, instances: int,
                   load: DeviceLoad, meter: Meter, activation_peak: ActivationPeak | None = None) -> DeviceProfile:
    """Measure every preferred size of every bucket, smallest first, on every instance (through
    `run`, on the thread that will serve it): the growth around the size's first and second runs
    (logged, one line per size), then around a third run on the first instance.

    Within what the budget had for this model before its load (`load.available_before`): a
    load that took more raises ModelDoesNotFit; a size whose predicted growth (its liveness
    estimate above the largest measured so far, x PREDICTION_FACTOR) would not fit is not run,
    else held in the budget while it runs (DeviceLoad.holding); a size that runs out of
    memory, or that took the model past the budget all the same, ends its bucket (larger ones
    would too) and is in `failed`. The caller serves only the sizes below the smallest failed
    one, and reloads the engines when the profile is over budget (their arenas hold what that
    size took)."""
    room = load.available_before
    profile = DeviceProfile(load.load_bytes(meter), unified=meter.unified, meter=meter.name, budget_bytes=room)
    where = "device memory" if meter.name != "process" else "memory (the process's resident set)"
    log.info("model %s: %s at load: %.1f MiB (weights, engine state%s; %d instance(s)); the budget had %.1f MiB",
             config.name, where, profile.load_bytes / MiB, ", context, workspaces" if meter.name != "process" else "",
             instances, room / MiB)
    if profile.load_bytes > room:
        raise ModelDoesNotFit(
            f"model {config.name!r}: loading it took {profile.load_bytes / MiB:.1f} MiB of {where}, more than the "
            f"{room / MiB:.1f} MiB the memory budget had for it; raise [memory] budget_mb or free memory, or "
            f"leave the model out ([models] load)")
    buckets = config.sequence.buckets if config.sequence else [0]
    for bucket in buckets:
        for size in config.batching.preferred_batch_sizes:
            batch = warmup_batch(specs, config, size, bucket)
            label = f"batch {size}{f' x {bucket}' if bucket else ''}"
            predicted = _predicted_growth(profile, size, bucket, activation_peak) * instances
            if meter.unified:
                predicted += sum(int(a.nbytes) for a in batch.values())
            if profile.resident + predicted > room:
                profile.failed[(size, bucket)] = (
                    f"{label} would need about {predicted / MiB:.1f} MiB more; the budget has "
                    f"{max(0, room - profile.resident) / MiB:.1f} MiB left of {room / MiB:.1f} MiB")
                log.warning("model %s: not running %s: %s", config.name, label, profile.failed[(size, bucket)])
                break
            try:
                with load.holding(predicted):
                    first, second = [], []
                    for instance in range(instances):
                        before = meter.used()
                        outputs = run(instance, batch)
                        io_bytes = (sum(int(a.nbytes) for a in batch.values())
                                    + sum(int(o.nbytes) for o in outputs.values()))
                        del outputs  # host arrays: not the device's, except on unified memory (io_bytes)
                        middle = meter.used()
                        run(instance, batch)
                        first.append(middle - before)
                        second.append(meter.used() - middle)
                    before = meter.used()
                    run(0, batch)
                    repeat = meter.used() - before
            except OutOfMemory as exc:
                profile.failed[(size, bucket)] = str(exc)
                log.warning("model %s: %s ran out of memory while measuring: %s", config.name, label, exc)
                break
            m = SizeMeasurement(size, bucket, tuple(first), tuple(second), repeat, io_bytes)
            profile.sizes[(size, bucket)] = m
            log.info("model %s: %s: %s grew %s MiB on its first two runs, %.1f MiB on a third",
                     config.name, label, where, " + ".join(f"{g / MiB:.1f}" for g in m.held), repeat / MiB)
            if profile.over_budget:
                profile.failed[(size, bucket)] = (
                    f"{label} took the model to {profile.resident / MiB:.1f} MiB, more than the "
                    f"{room / MiB:.1f} MiB the budget had for it")
                log.warning("model %s: %s", config.name, profile.failed[(size, bucket)])
                break
    return profile


def _predicted_growth(profile: DeviceProfile, size: int, bucket: int, activation_peak: ActivationPeak | None) -> int:
    """What one instance's arena is expected to grow by at this size: its liveness estimate
    above the largest one measured so far (the arena already holds about that), scaled. 0
    without an estimate; the first run's one-time costs are not predicted (they are measured)."""
    if activation_peak is None:
        return 0
    held = max((activation_peak(s, b or None) for s, b in profile.sizes), default=0)
    return int(max(0, activation_peak(size, bucket or None) - held) * PREDICTION_FACTOR)


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
