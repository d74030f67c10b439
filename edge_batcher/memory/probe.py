"""Device memory probes: how many bytes this daemon could still allocate right now.

The scheduler only admits a batch whose estimated footprint fits the free memory, so the one
number that matters is "free for us". :func:`detect_probe` picks the probe for the device:
:class:`~edge_batcher.memory.jetson.JetsonProbe` (unified memory, memory/jetson.py),
:class:`~edge_batcher.memory.gpu_probes.CudaProbe` or ``NvmlProbe`` (discrete GPU,
memory/gpu_probes.py), :class:`CpuProbe` (psutil bounded by the cgroup limit, memory/cgroup.py)
for CPU-only and NPU boxes, or :class:`FixedProbe` (a configured number, for tests and for
operators who want one). Nothing runs at import time; the CUDA bindings and pynvml are
imported only when their probe is used.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import psutil

from ..errors import ConfigError
from .cgroup import apply_cgroup
from .gpu_probes import CudaProbe, NvmlProbe
from .jetson import JetsonProbe, is_jetson
from .snapshot import MemoryProbe, MemorySnapshot

# Every probe detect_probe may return, and the interface, are importable from here as well.
__all__ = ["PROBE_KINDS", "CpuProbe", "CudaProbe", "FixedProbe", "JetsonProbe", "MemoryProbe", "MemorySnapshot",
           "NvmlProbe", "detect_probe", "is_jetson"]

PROBE_KINDS = ("auto", "jetson", "cuda", "nvml", "cpu", "fixed")


class CpuProbe:
    """Host RAM for CPU (and NPU) engines: psutil's ``available`` bounded by the cgroup limit.

    psutil.virtual_memory().available is the kernel's MemAvailable (page cache counted as
    reclaimable, swap not counted). Inside a container that number is the *host's*, so it is
    bounded by memory.max - working set of this process's cgroup (and of its parents): the OOM
    killer acts at the cgroup limit. "max" (or no memory controller) means unlimited.

    cgroup_dir: a directory holding memory.max/memory.current (tests, unusual mounts); None
    reads /proc/self/cgroup and looks under /sys/fs/cgroup.
    """

    name = "cpu"

    def __init__(self, *, cgroup_dir: str | os.PathLike[str] | None = None):
        self.cgroup_dir = Path(cgroup_dir) if cgroup_dir is not None else None

    def read(self) -> MemorySnapshot:
        vm = psutil.virtual_memory()
        details: dict[str, int] = {
            "psutil_total": int(vm.total),
            "psutil_available": int(vm.available),
        }
        free, total = apply_cgroup(int(vm.available), int(vm.total), self.cgroup_dir, details)
        source = "psutil+cgroup" if "cgroup_limit" in details else "psutil"
        return MemorySnapshot(total, free, source, details)


class FixedProbe:
    """A configured budget instead of a measurement.

    For operators who want a hard number (a device shared with other services) and for tests.
    The attributes are plain and may be changed; reads counts read() calls so a caller can see
    how often it is polled.
    """

    name = "fixed"

    def __init__(self, free_bytes: int, total_bytes: int | None = None):
        _check_bytes("free_bytes", free_bytes)
        if total_bytes is not None:
            _check_bytes("total_bytes", total_bytes)
            if total_bytes < free_bytes:
                raise ConfigError(f"total_bytes ({total_bytes}) is below free_bytes ({free_bytes})")
        self.free_bytes = free_bytes
        self.total_bytes = total_bytes if total_bytes is not None else free_bytes
        self.reads = 0

    def read(self) -> MemorySnapshot:
        self.reads += 1
        return MemorySnapshot(self.total_bytes, self.free_bytes, "fixed")


def _check_bytes(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{name} must be an integer number of bytes >= 0, got {value!r}")


# --------------------------------------------------------------------------------------------
# Selection

_OPTIONS: dict[str, tuple[str, ...]] = {
    "jetson": ("meminfo_path", "cgroup_dir"),
    "cuda": ("device_index", "root"),
    "nvml": ("device_index", "root"),
    "cpu": ("cgroup_dir",),
    "fixed": ("free_bytes", "total_bytes"),
}


def _cuda_has_device() -> bool:
    from ..engines.cuda_api import load_cuda_api  # noqa: PLC0415 - lazily

    try:
        api = load_cuda_api()
        api.init()
        return api.device_count() > 0
    except Exception:  # no binding, no driver, no device, broken install: all mean "not this probe"
        return False


def _nvml_works(device_index: int) -> bool:
    if importlib.util.find_spec("pynvml") is None:
        return False
    probe = NvmlProbe(device_index)
    try:
        probe.read()
        return True
    except Exception:  # NVMLError_* or a driver missing: fall through to the next probe
        return False
    finally:
        try:
            probe.close()
        except Exception:
            pass


def detect_probe(kind: str = "auto", **options: Any) -> MemoryProbe:
    """The probe for this machine (auto) or the one named.

    auto: jetson if is_jetson(); else cuda if a CUDA binding (cuda-python, else pycuda) imports and
    sees a device; else nvml if it
    imports and can read device memory; else cpu. fixed needs free_bytes.

    options are passed to the chosen probe's constructor (meminfo_path, cgroup_dir,
    device_index, free_bytes, total_bytes; root for the Jetson check). An option the kind
    cannot use is a ConfigError, so a typo in the config is not silently ignored.
    """
    if kind not in PROBE_KINDS:
        raise ConfigError(
            f"unknown memory probe {kind!r}; expected one of {', '.join(PROBE_KINDS)}"
        )
    allowed = (
        {o for opts in _OPTIONS.values() for o in opts} if kind == "auto" else set(_OPTIONS[kind])
    )
    if kind == "auto":
        allowed.discard("free_bytes")
        allowed.discard("total_bytes")
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise ConfigError(
            f"memory probe {kind!r} does not take option(s) {', '.join(unknown)}; "
            f"it takes {', '.join(sorted(allowed)) or 'none'}"
        )

    if kind == "auto":
        root = Path(options.get("root", "/"))
        if is_jetson(root):
            kind = "jetson"
        elif _cuda_has_device():
            kind = "cuda"
        elif _nvml_works(options.get("device_index", 0)):
            kind = "nvml"
        else:
            kind = "cpu"
        options = {k: v for k, v in options.items() if k in _OPTIONS[kind]}

    if kind == "jetson":
        return JetsonProbe(**options)
    if kind == "cuda":
        return CudaProbe(**options)
    if kind == "nvml":
        return NvmlProbe(**options)
    if kind == "cpu":
        return CpuProbe(**options)
    if "free_bytes" not in options:
        raise ConfigError("memory probe 'fixed' needs free_bytes")
    return FixedProbe(**options)
