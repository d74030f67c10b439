"""Jetson boards: detection, which L4T/JetPack and module this is, and the unified-memory probe.

CPU and GPU share one DRAM pool on a Jetson. ``cudaMemGetInfo`` and NVML give wrong or
unsupported answers there (NVML memory is "Not Supported" on JetPack 6; vLLM crashes on it,
vllm#9728), so :class:`JetsonProbe` reads ``/proc/meminfo`` and never touches CUDA.
:func:`read_jetson_info` says which Jetson and JetPack this is (L4T release, module, DLA cores),
JetPack 5 to 7 (L4T 35, 36, 38 for Thor, 39 for Thor and Orin); the self-test reports it and
refuses DLA where the module has none (Jetson Thor, Orin Nano).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import EdgeBatcherError
from .cgroup import apply_cgroup
from .snapshot import MemorySnapshot

log = logging.getLogger(__name__)


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
        free, total = apply_cgroup(free, total, self.cgroup_dir, details)
        return MemorySnapshot(total, free, f"jetson:{self.meminfo_path}", details)
