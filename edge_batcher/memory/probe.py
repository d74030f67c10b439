"""Device memory probes: how many bytes this daemon could still allocate right now.

The scheduler only admits a batch whose estimated footprint fits the free memory, so the one
number that matters is "free for us". Where that number comes from depends on the device:

* Jetson (unified memory): CPU and GPU share one DRAM pool. ``cudaMemGetInfo`` and NVML give
  wrong or unsupported answers there (NVML memory is "Not Supported" on JetPack 6; vLLM crashes
  on it, vllm#9728), so :class:`JetsonProbe` reads ``/proc/meminfo`` and never touches CUDA.
* Discrete NVIDIA GPU: :class:`CudaProbe` (``cuMemGetInfo`` through cuda-python or pycuda,
  engines/cuda_api.py) or :class:`NvmlProbe`.
* CPU-only / NPU boxes: :class:`CpuProbe`, psutil bounded by the cgroup memory limit, because a
  container killed by the OOM killer at ``memory.max`` does not care how much RAM the host has.
* :class:`FixedProbe`: a configured number, for tests and for operators who want one.

:func:`read_jetson_info` says which Jetson and JetPack this is (L4T release, module, DLA cores),
JetPack 5 to 7 (L4T 35, 36, 38 for Thor, 39 for Thor and Orin); the self-test reports it and
refuses DLA where the module has none (Jetson Thor, Orin Nano).

Nothing here runs at import time; the CUDA bindings and pynvml are imported only when their
probe is used.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping, Protocol, runtime_checkable

import psutil

from ..errors import ConfigError, EdgeBatcherError

log = logging.getLogger(__name__)

PROBE_KINDS = ("auto", "jetson", "cuda", "nvml", "cpu", "fixed")

# cgroup v1 reports "no limit" as a huge page-rounded number (9223372036854771712), not "max".
_CGROUP_V1_UNLIMITED = 1 << 62


@dataclass(frozen=True)
class MemorySnapshot:
    """One reading of a probe.

    free_bytes is what the daemon may still allocate (the probe decides what that means for
    its device, see each probe's docstring); total_bytes is the size of the pool it comes from.
    details holds the raw figures the decision was made from, so operators (and the /metrics
    endpoint) can see *why* free_bytes is what it is. It is read-only and not compared.
    """

    total_bytes: int
    free_bytes: int
    source: str
    details: Mapping[str, int] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "details", MappingProxyType(dict(self.details)))


@runtime_checkable
class MemoryProbe(Protocol):
    """Anything that can report free device memory. read() must be cheap enough to call
    about once a second and after each model load/unload."""

    name: str

    def read(self) -> MemorySnapshot: ...


# --------------------------------------------------------------------------------------------
# Jetson


def is_jetson(root: Path = Path("/")) -> bool:
    """True on an NVIDIA Tegra/Jetson board (L4T).

    /etc/nv_tegra_release exists on every L4T root file system; the device-tree check also
    catches containers that mount /proc but not the host's /etc.
    """
    root = Path(root)
    if (root / "etc" / "nv_tegra_release").exists():
        return True
    try:
        compatible = (root / "proc" / "device-tree" / "compatible").read_bytes()
    except OSError:
        return False
    return b"nvidia,tegra" in compatible.lower()


def parse_meminfo(text: str) -> dict[str, int]:
    """/proc/meminfo as {key: bytes}. Values with a "kB" unit are converted to bytes; unit-less
    lines (HugePages_Total and friends are page counts) are kept as they are."""
    values: dict[str, int] = {}
    for line in text.splitlines():
        key, sep, rest = line.partition(":")
        if not sep:
            continue
        parts = rest.split()
        if not parts:
            continue
        try:
            number = int(parts[0])
        except ValueError:
            continue
        if len(parts) > 1 and parts[1].lower() == "kb":
            number *= 1024
        values[key.strip()] = number
    return values


@dataclass(frozen=True)
class JetPackRelease:
    """What NVIDIA ships with one L4T release line (from NVIDIA's JetPack release notes)."""

    jetpack: str
    cuda: str
    tensorrt: str
    python: str
    modules: str  # which Jetson families this JetPack supports


# (L4T major, minor or None for any) -> the JetPack it belongs to. TensorRT 11 ships with none of them.
JETPACK_RELEASES: dict[tuple[int, int | None], JetPackRelease] = {
    (35, None): JetPackRelease("5.1", "11.4", "8.5", "3.8", "Xavier, Orin"),
    (36, 2): JetPackRelease("6.0 DP", "12.2", "8.6", "3.10", "Orin"),
    (36, 3): JetPackRelease("6.0", "12.2", "8.6", "3.10", "Orin"),
    (36, 4): JetPackRelease("6.1/6.2", "12.6", "10.3", "3.10", "Orin"),
    (38, None): JetPackRelease("7.0/7.1", "13", "10.13-10.16", "3.12", "Thor"),
    (39, None): JetPackRelease("7.2", "13", "10.13-10.16", "3.12", "Thor, Orin"),
}


def parse_l4t_release(text: str) -> tuple[int, int, int] | None:
    """'# R36 (release), REVISION: 4.3, ...' (/etc/nv_tegra_release) -> (36, 4, 3); None if unreadable."""
    first = text.strip().splitlines()[0] if text.strip() else ""
    if not first.startswith("# R"):
        return None
    try:
        major = int(first[3:].split()[0])
        revision = first.split("REVISION:")[1].split(",")[0].strip().split(".")
        return major, int(revision[0]), int(revision[1]) if len(revision) > 1 else 0
    except (IndexError, ValueError):
        return None


def jetpack_for_l4t(major: int, minor: int) -> JetPackRelease | None:
    return JETPACK_RELEASES.get((major, minor)) or JETPACK_RELEASES.get((major, None))


@dataclass(frozen=True)
class JetsonModule:
    """A Jetson module family: name, memory in GiB (None: several sizes), DLA cores (None: depends)."""

    name: str
    memory_gib: int | None
    dla_cores: int | None


# Matched in order against /proc/device-tree/model. Jetson Thor has no DLA (its accelerator is the
# PVA); Orin Nano has none either; Orin NX 8 GB has 1, 16 GB and AGX Orin have 2.
JETSON_MODULES: tuple[tuple[str, JetsonModule], ...] = (
    ("T4000", JetsonModule("Jetson Thor T4000", 64, 0)),
    ("Thor", JetsonModule("Jetson AGX Thor (T5000)", 128, 0)),
    ("AGX Orin", JetsonModule("Jetson AGX Orin", None, 2)),
    ("Orin NX", JetsonModule("Jetson Orin NX", None, None)),
    ("Orin Nano", JetsonModule("Jetson Orin Nano", None, 0)),
    ("Xavier", JetsonModule("Jetson Xavier", None, None)),
)


@dataclass(frozen=True)
class JetsonInfo:
    """This board, as far as the root file system tells: L4T release, JetPack, module."""

    l4t: tuple[int, int, int] | None
    jetpack: JetPackRelease | None
    model: str  # /proc/device-tree/model, '' when absent
    module: JetsonModule | None

    def describe(self) -> str:
        parts = [f"L4T R{'.'.join(map(str, self.l4t))}" if self.l4t else "L4T release unknown"]
        if self.jetpack:
            parts.append(f"JetPack {self.jetpack.jetpack} (CUDA {self.jetpack.cuda}, TensorRT {self.jetpack.tensorrt}, "
                         f"Python {self.jetpack.python})")
        if self.module:
            parts.append(self.module.name)
        elif self.model:
            parts.append(self.model)
        return ", ".join(parts)


def read_jetson_info(root: Path = Path("/")) -> JetsonInfo | None:
    """The Jetson this is (None off Jetson): /etc/nv_tegra_release and /proc/device-tree/model."""
    root = Path(root)
    if not is_jetson(root):
        return None
    try:
        l4t = parse_l4t_release((root / "etc" / "nv_tegra_release").read_text())
    except OSError:
        l4t = None
    try:
        model = (root / "proc" / "device-tree" / "model").read_bytes().rstrip(b"\x00").decode(errors="replace").strip()
    except OSError:
        model = ""
    module = next((m for key, m in JETSON_MODULES if key.lower() in model.lower()), None)
    return JetsonInfo(l4t, jetpack_for_l4t(l4t[0], l4t[1]) if l4t else None, model, module)


class JetsonProbe:
    """Free memory of a Jetson's unified DRAM, from /proc/meminfo (never CUDA, never NVML).

    free_bytes = min(cuda_remaining, MemAvailable), bounded by this process's cgroup limit:
    MemAvailable protects the host side, cuda_remaining (the CUDA-for-Tegra app note's device
    allocatable memory, minus what NvMap already holds) refuses to plan on swapping. The raw
    figures go into details (cuda_allocatable, nvmap_reported, ...). docs/memory.md ("Probes")
    explains the formula, why the minimum, and its price.
    """

    name = "jetson"

    def __init__(
        self,
        meminfo_path: str | os.PathLike[str] = "/proc/meminfo",
        *,
        cgroup_dir: str | os.PathLike[str] | None = None,
    ):
        self.meminfo_path = Path(meminfo_path)
        self.cgroup_dir = Path(cgroup_dir) if cgroup_dir is not None else None
        self._warned_nvmap = False

    def read(self) -> MemorySnapshot:
        try:
            info = parse_meminfo(self.meminfo_path.read_text())
        except OSError as e:
            raise EdgeBatcherError(f"cannot read {self.meminfo_path}: {e}") from e
        missing = [k for k in ("MemTotal", "MemFree", "MemAvailable") if k not in info]
        if missing:
            raise EdgeBatcherError(f"{self.meminfo_path} lacks {', '.join(missing)}")
        mem_total = info["MemTotal"]
        mem_free = info["MemFree"]
        mem_available = info["MemAvailable"]
        swap_free = info.get("SwapFree", 0)
        nvmap_reported = "NvMapMemUsed" in info
        nvmap_used = info.get("NvMapMemUsed", 0)
        if not nvmap_reported and not self._warned_nvmap:
            self._warned_nvmap = True
            log.warning(
                "%s has no NvMapMemUsed (old L4T kernel?); counting device memory as host memory",
                self.meminfo_path,
            )

        host_alloc = (mem_total - mem_free) - nvmap_used
        if host_alloc < swap_free:
            cuda_allocatable = mem_total - nvmap_used
        else:
            cuda_allocatable = mem_total - (host_alloc - swap_free)
        cuda_remaining = mem_total - nvmap_used - max(0, host_alloc - swap_free)
        free = max(0, min(cuda_remaining, mem_available))
        total = mem_total

        details: dict[str, int] = {
            "memtotal": mem_total,
            "memfree": mem_free,
            "memavailable": mem_available,
            "swapfree": swap_free,
            "nvmap_used": nvmap_used,
            "nvmap_reported": int(nvmap_reported),
            "host_alloc": host_alloc,
            "cuda_allocatable": cuda_allocatable,
            "cuda_remaining": cuda_remaining,
        }
        free, total = _apply_cgroup(free, total, self.cgroup_dir, details)
        return MemorySnapshot(total, free, f"jetson:{self.meminfo_path}", details)


# --------------------------------------------------------------------------------------------
# Discrete GPUs


def _import_optional(module: str, probe: str, hint: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(
            f"memory probe {probe!r} needs the Python module {module!r} ({hint}): {e}"
        ) from e


def _refuse_on_jetson(probe: str, root: Path) -> None:
    if is_jetson(root):
        raise ConfigError(
            f"memory probe {probe!r} is not supported on Jetson (unified memory: "
            "cudaMemGetInfo/NVML report wrong or no figures there); use 'jetson' or 'auto'"
        )


class CudaProbe:
    """Free/total memory of one CUDA device from ``cuMemGetInfo``, through cuda-python when it is
    installed, else pycuda (edge_batcher/engines/cuda_api.py; `cuda_module` passes a binding in).

    cuMemGetInfo needs a current context. We retain the device's *primary* context (the one
    the CUDA runtime, TensorRT and ONNX Runtime's CUDA EP share) instead of creating our own,
    which would cost a few hundred MB of device memory and would not be the context the
    engines allocate in. It is retained on the first read and released by close().
    """

    name = "cuda"

    def __init__(self, device_index: int = 0, *, root: str | os.PathLike[str] = "/", cuda_module: Any = None):
        if isinstance(device_index, bool) or not isinstance(device_index, int) or device_index < 0:
            raise ConfigError(f"device_index must be an integer >= 0, got {device_index!r}")
        _refuse_on_jetson(self.name, Path(root))
        self.device_index = device_index
        self._cuda_module = cuda_module
        self._api: Any = None
        self._context: Any = None

    def read(self) -> MemorySnapshot:
        if self._context is None:
            from ..engines.cuda_api import cuda_api_from, load_cuda_api  # noqa: PLC0415 - lazily

            try:
                api = load_cuda_api() if self._cuda_module is None else cuda_api_from(self._cuda_module)
            except ImportError as e:
                raise ConfigError(f"memory probe 'cuda' needs a CUDA Python binding: {e}") from e
            try:
                api.init()
                self._context = api.open_device(self.device_index)
            except Exception as e:  # each binding raises its own error types
                raise ConfigError(
                    f"memory probe 'cuda': cannot open CUDA device {self.device_index} with {api.name}: {e}"
                ) from e
            self._api = api
        self._context.push()
        try:
            free, total = self._api.mem_get_info()
        finally:
            self._context.pop()
        return MemorySnapshot(
            int(total), int(free), f"cuda:{self.device_index}", {"device_index": self.device_index}
        )

    @property
    def binding(self) -> str:
        """The CUDA binding in use ('' before the first read)."""
        return self._api.name if self._api is not None else ""

    def close(self) -> None:
        """Release the primary context reference taken by read()."""
        if self._context is not None:
            self._context.release()
            self._context = None


class NvmlProbe:
    """Free/total memory of one GPU from NVML (the nvidia-ml-py package, module pynvml).

    Unlike CudaProbe it needs no CUDA context, so it costs no device memory. NVML is
    initialised on the first read and shut down by close().
    """

    name = "nvml"

    def __init__(self, device_index: int = 0, *, root: str | os.PathLike[str] = "/"):
        if isinstance(device_index, bool) or not isinstance(device_index, int) or device_index < 0:
            raise ConfigError(f"device_index must be an integer >= 0, got {device_index!r}")
        _refuse_on_jetson(self.name, Path(root))
        self.device_index = device_index
        self._nvml: Any = None
        self._handle: Any = None

    def read(self) -> MemorySnapshot:
        if self._handle is None:
            nvml = _import_optional("pynvml", self.name, "pip install nvidia-ml-py")
            nvml.nvmlInit()
            self._nvml = nvml
            self._handle = nvml.nvmlDeviceGetHandleByIndex(self.device_index)
        info = self._nvml.nvmlDeviceGetMemoryInfo(self._handle)
        return MemorySnapshot(
            int(info.total), int(info.free), f"nvml:{self.device_index}",
            {"device_index": self.device_index, "used": int(info.used)},
        )

    def close(self) -> None:
        if self._nvml is not None:
            self._nvml.nvmlShutdown()
            self._nvml = None
            self._handle = None


# --------------------------------------------------------------------------------------------
# CPU and cgroups


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _read_stat(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def cgroup_memory_limit(cgroup_dir: Path) -> tuple[int, int, int] | None:
    """(limit, usage, working_set) of one cgroup directory, or None when it has no limit.

    cgroup v2 (memory.max / memory.current / memory.stat inactive_file) and v1
    (memory.limit_in_bytes / memory.usage_in_bytes / memory.stat total_inactive_file) are both
    understood: JetPack 5 (Ubuntu 20.04) still mounts v1.

    working_set = usage - inactive file pages, the figure Kubernetes and Docker use: usage
    includes page cache (a model file we just read) that the kernel reclaims before it
    OOM-kills anyone, so the raw usage would make the limit look nearer than it is.
    """
    if (cgroup_dir / "memory.max").exists():
        limit = _read_int(cgroup_dir / "memory.max")
        usage = _read_int(cgroup_dir / "memory.current")
        inactive = _read_stat(cgroup_dir / "memory.stat", "inactive_file")
    elif (cgroup_dir / "memory.limit_in_bytes").exists():
        limit = _read_int(cgroup_dir / "memory.limit_in_bytes")
        usage = _read_int(cgroup_dir / "memory.usage_in_bytes")
        inactive = _read_stat(cgroup_dir / "memory.stat", "total_inactive_file")
        if limit is not None and limit >= _CGROUP_V1_UNLIMITED:
            limit = None
    else:
        return None
    if limit is None:
        return None
    usage = usage or 0
    working_set = usage - inactive if inactive <= usage else usage
    return limit, usage, working_set


def own_cgroup_dirs(
    proc_cgroup: Path = Path("/proc/self/cgroup"), cgroup_root: Path = Path("/sys/fs/cgroup")
) -> list[Path]:
    """The memory cgroup directories that limit this process, innermost first.

    v2: the "0::<path>" line of /proc/self/cgroup under cgroup_root, then each parent up to the
    root, since a parent slice's memory.max limits its children too. v1: the "memory"
    controller's directory. Inside a container without a cgroup namespace the listed path does
    not exist in the container's mount, whose root *is* the container's cgroup: fall back to it.
    """
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return []
    v2_path: str | None = None
    v1_path: str | None = None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            v2_path = path
        elif "memory" in controllers.split(","):
            v1_path = path
    if v1_path is not None:
        base = cgroup_root / "memory"
        leaf = base / v1_path.lstrip("/")
        return [leaf if leaf.is_dir() else base]
    if v2_path is not None:
        leaf = cgroup_root / v2_path.lstrip("/")
        if not leaf.is_dir():
            leaf = cgroup_root
        dirs = [leaf]
        while leaf != cgroup_root and cgroup_root in leaf.parents:
            leaf = leaf.parent
            dirs.append(leaf)
        return dirs
    return []


def _apply_cgroup(
    free: int, total: int, cgroup_dir: Path | None, details: dict[str, int]
) -> tuple[int, int]:
    """Bound (free, total) by the tightest cgroup limit; record it in details."""
    dirs = [cgroup_dir] if cgroup_dir is not None else own_cgroup_dirs()
    best: tuple[int, int, int] | None = None
    for d in dirs:
        found = cgroup_memory_limit(d)
        if found is not None and (best is None or found[0] - found[2] < best[0] - best[2]):
            best = found
    if best is None:
        return free, total
    limit, usage, working_set = best
    remaining = max(0, limit - working_set)
    details.update(
        cgroup_limit=limit, cgroup_usage=usage, cgroup_working_set=working_set,
        cgroup_remaining=remaining,
    )
    return min(free, remaining), min(total, limit)


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
        free, total = _apply_cgroup(int(vm.available), int(vm.total), self.cgroup_dir, details)
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
