"""Memory probes on real files: meminfo samples, cgroup directories and fake root trees."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import psutil
import pytest

from edge_batcher.errors import ConfigError, EdgeBatcherError
from edge_batcher.memory.cgroup import cgroup_memory_limit, own_cgroup_dirs
from edge_batcher.memory.gpu_probes import CudaProbe, NvmlProbe
from edge_batcher.memory.jetson import JetsonProbe, is_jetson, parse_l4t_release, parse_meminfo, read_jetson_info
from edge_batcher.memory.probe import CpuProbe, FixedProbe, MemoryProbe, detect_probe
from tests.fakes.fake_cuda_bindings import fake_cuda_module
from tests.fakes.fake_tensorrt import FakeCuda

KB = 1024
MiB = 1 << 20


def meminfo(
    *, total: int, free: int, available: int, swap_total: int, swap_free: int,
    nvmap: int | None,
) -> str:
    """An Orin-style /proc/meminfo (values in kB); NvMapMemUsed left out when nvmap is None."""
    lines = [
        f"MemTotal:        {total} kB",
        f"MemFree:         {free} kB",
        f"MemAvailable:    {available} kB",
        "Buffers:           30012 kB",
        "Cached:          612340 kB",
        "SwapCached:            0 kB",
        f"SwapTotal:       {swap_total} kB",
        f"SwapFree:        {swap_free} kB",
        "CommitLimit:     7620244 kB",
        "VmallocTotal:   263061440 kB",
    ]
    if nvmap is not None:
        lines += ["NvMapMemFree:      94784 kB", f"NvMapMemUsed:    {nvmap} kB"]
    lines += ["CmaTotal:  753664 kB", "HugePages_Total:       0", "Hugepagesize:   2048 kB"]
    return "\n".join(lines) + "\n"


def jetson_probe(tmp_path: Path, text: str) -> JetsonProbe:
    path = tmp_path / "meminfo"
    path.write_text(text)
    # an empty directory as the cgroup: no memory.max, so no container limit
    (tmp_path / "no-cgroup").mkdir(exist_ok=True)
    return JetsonProbe(path, cgroup_dir=tmp_path / "no-cgroup")


def test_parse_meminfo_converts_kb_and_keeps_counts() -> None:
    info = parse_meminfo("MemTotal:  100 kB\nHugePages_Total:       3\nbogus line\n")
    assert info == {"MemTotal": 100 * KB, "HugePages_Total": 3}


def test_jetson_idle_orin_nano(tmp_path: Path) -> None:
    # Orin Nano 8GB at idle, zram swap untouched:
    #   host_alloc = (7620244 - 5986120) - 171432 = 1462692 kB < SwapFree 3810120
    #   -> cuda_allocatable = cuda_remaining = 7620244 - 171432 = 7448812 kB
    #   free = min(7448812, MemAvailable 6642512) = 6642512 kB
    probe = jetson_probe(tmp_path, meminfo(
        total=7620244, free=5986120, available=6642512,
        swap_total=3810120, swap_free=3810120, nvmap=171432,
    ))
    snap = probe.read()
    assert snap.total_bytes == 7620244 * KB
    assert snap.free_bytes == 6642512 * KB
    assert snap.source == f"jetson:{tmp_path / 'meminfo'}"
    d = snap.details
    assert d["host_alloc"] == 1462692 * KB
    assert d["cuda_allocatable"] == d["cuda_remaining"] == 7448812 * KB
    assert d["memavailable"] == 6642512 * KB
    assert d["nvmap_used"] == 171432 * KB and d["nvmap_reported"] == 1
    assert "cgroup_limit" not in d


def test_jetson_loaded_with_swap_in_use(tmp_path: Path) -> None:
    # Loaded: 2.4 GB of nvmap (engines), swap 2.5 GB used, host_alloc >= SwapFree:
    #   host_alloc = (7620244 - 142316) - 2516480 = 4961448 kB >= SwapFree 1210044
    #   app note:       cuda_allocatable = 7620244 - (4961448 - 1210044) = 3868840 kB
    #   what is left:   cuda_remaining = 7620244 - 2516480 - 3751404 = 1352360 kB
    #                   (= MemFree + SwapFree = 142316 + 1210044)
    #   free = min(1352360, MemAvailable 398564) = 398564 kB
    probe = jetson_probe(tmp_path, meminfo(
        total=7620244, free=142316, available=398564,
        swap_total=3810120, swap_free=1210044, nvmap=2516480,
    ))
    snap = probe.read()
    assert snap.free_bytes == 398564 * KB
    assert snap.details["host_alloc"] == 4961448 * KB
    assert snap.details["cuda_allocatable"] == 3868840 * KB
    assert snap.details["cuda_remaining"] == 1352360 * KB


def test_jetson_without_swap_app_note_term_binds(tmp_path: Path) -> None:
    # Swap disabled, 4.4 GB of page cache (a model file just read):
    #   host_alloc = (7620244 - 812344) - 1048576 = 5759324 kB >= SwapFree 0
    #   cuda_allocatable = 7620244 - 5759324 = 1860920 kB
    #   cuda_remaining = 7620244 - 1048576 - 5759324 = 812344 kB (= MemFree)
    #   free = min(812344, MemAvailable 5302100) = 812344 kB: page cache is not counted
    probe = jetson_probe(tmp_path, meminfo(
        total=7620244, free=812344, available=5302100, swap_total=0, swap_free=0, nvmap=1048576,
    ))
    snap = probe.read()
    assert snap.free_bytes == 812344 * KB
    assert snap.details["cuda_allocatable"] == 1860920 * KB


def test_jetson_meminfo_without_nvmap(tmp_path: Path) -> None:
    # Old L4T kernel: no NvMapMemUsed, taken as 0.
    #   host_alloc = 7620244 - 5986120 - 0 = 1634124 kB < SwapFree 3810120
    #   cuda_allocatable = 7620244 kB; free = min(7620244, 6642512) = 6642512 kB
    probe = jetson_probe(tmp_path, meminfo(
        total=7620244, free=5986120, available=6642512,
        swap_total=3810120, swap_free=3810120, nvmap=None,
    ))
    snap = probe.read()
    assert snap.free_bytes == 6642512 * KB
    assert snap.details["nvmap_used"] == 0
    assert snap.details["nvmap_reported"] == 0
    assert snap.details["host_alloc"] == 1634124 * KB
    assert snap.details["cuda_allocatable"] == 7620244 * KB


def test_jetson_respects_a_container_limit(tmp_path: Path) -> None:
    cg = tmp_path / "cg"
    cg.mkdir()
    (cg / "memory.max").write_text(f"{1024 * MiB}\n")
    (cg / "memory.current").write_text(f"{256 * MiB}\n")
    path = tmp_path / "meminfo"
    path.write_text(meminfo(
        total=7620244, free=5986120, available=6642512,
        swap_total=3810120, swap_free=3810120, nvmap=171432,
    ))
    snap = JetsonProbe(path, cgroup_dir=cg).read()
    assert snap.free_bytes == 768 * MiB  # min(6642512 kB, 1024 MiB - 256 MiB)
    assert snap.total_bytes == 1024 * MiB


def test_jetson_rejects_a_file_that_is_not_meminfo(tmp_path: Path) -> None:
    path = tmp_path / "meminfo"
    path.write_text("MemTotal: 100 kB\n")
    with pytest.raises(EdgeBatcherError, match="MemFree"):
        JetsonProbe(path, cgroup_dir=tmp_path).read()


# --- cgroups ---------------------------------------------------------------------------------


def cgroup_v2(directory: Path, limit: str, current: int, inactive_file: int | None = None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "memory.max").write_text(limit + "\n")
    (directory / "memory.current").write_text(f"{current}\n")
    if inactive_file is not None:
        (directory / "memory.stat").write_text(
            f"anon 1234\nfile 99999\ninactive_file {inactive_file}\nactive_file 5\n"
        )
    return directory


def test_cpu_probe_bounded_by_cgroup_v2_limit(tmp_path: Path) -> None:
    if psutil.virtual_memory().available <= 512 * MiB:
        pytest.skip("needs more than 512 MiB available to show the cgroup bound")
    cg = cgroup_v2(tmp_path / "cg", str(512 * MiB), 100 * MiB)
    snap = CpuProbe(cgroup_dir=cg).read()
    assert snap.free_bytes == 412 * MiB  # 512 MiB limit - 100 MiB in use
    assert snap.total_bytes == 512 * MiB
    assert snap.source == "psutil+cgroup"
    assert snap.details["cgroup_remaining"] == 412 * MiB
    assert snap.details["psutil_available"] > snap.free_bytes


def test_cgroup_page_cache_is_not_counted_as_used(tmp_path: Path) -> None:
    # 100 MiB charged, 20 MiB of it inactive page cache: working set 80 MiB, 432 MiB left
    cg = cgroup_v2(tmp_path / "cg", str(512 * MiB), 100 * MiB, inactive_file=20 * MiB)
    assert cgroup_memory_limit(cg) == (512 * MiB, 100 * MiB, 80 * MiB)
    if psutil.virtual_memory().available > 512 * MiB:
        assert CpuProbe(cgroup_dir=cg).read().free_bytes == 432 * MiB


def test_cpu_probe_with_unlimited_cgroup(tmp_path: Path) -> None:
    cg = cgroup_v2(tmp_path / "cg", "max", 100 * MiB)
    snap = CpuProbe(cgroup_dir=cg).read()
    assert snap.source == "psutil"
    assert snap.free_bytes == snap.details["psutil_available"]
    assert snap.total_bytes == snap.details["psutil_total"] == psutil.virtual_memory().total
    assert "cgroup_limit" not in snap.details


def test_cgroup_v1_files(tmp_path: Path) -> None:
    cg = tmp_path / "v1"
    cg.mkdir()
    (cg / "memory.limit_in_bytes").write_text(f"{256 * MiB}\n")
    (cg / "memory.usage_in_bytes").write_text(f"{64 * MiB}\n")
    (cg / "memory.stat").write_text(f"cache 0\ntotal_inactive_file {16 * MiB}\n")
    assert cgroup_memory_limit(cg) == (256 * MiB, 64 * MiB, 48 * MiB)
    (cg / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    assert cgroup_memory_limit(cg) is None


def test_own_cgroup_dirs_walks_up_a_v2_hierarchy(tmp_path: Path) -> None:
    root = tmp_path / "sys-fs-cgroup"
    leaf = root / "system.slice" / "edge-batcher.service"
    leaf.mkdir(parents=True)
    proc = tmp_path / "cgroup"
    proc.write_text("0::/system.slice/edge-batcher.service\n")
    assert own_cgroup_dirs(proc, root) == [leaf, root / "system.slice", root]

    proc.write_text("0::/docker/abc\n")  # not visible inside the container's mount: its root
    assert own_cgroup_dirs(proc, root) == [root]

    proc.write_text("12:memory:/docker/abc\n0::/\n")  # hybrid: memory is on v1
    (root / "memory").mkdir()
    assert own_cgroup_dirs(proc, root) == [root / "memory"]


# --- Jetson detection, selection -------------------------------------------------------------


def test_is_jetson_on_fake_roots(tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    plain.mkdir()
    assert not is_jetson(plain)

    l4t = tmp_path / "l4t"
    (l4t / "etc").mkdir(parents=True)
    (l4t / "etc" / "nv_tegra_release").write_text("# R36 (release), REVISION: 4.0\n")
    assert is_jetson(l4t)

    dt = tmp_path / "dt"
    (dt / "proc" / "device-tree").mkdir(parents=True)
    (dt / "proc" / "device-tree" / "compatible").write_bytes(
        b"nvidia,p3768-0000+p3767-0005\x00nvidia,p3767-0005\x00nvidia,tegra234\x00"
    )
    assert is_jetson(dt)


def test_detect_probe_on_this_machine_is_cpu() -> None:
    if is_jetson() or any(importlib.util.find_spec(m) for m in ("pycuda", "pynvml")):
        pytest.skip("this machine has a Jetson or GPU probe available")
    probe = detect_probe()
    assert isinstance(probe, CpuProbe)
    assert isinstance(probe, MemoryProbe)
    assert probe.read().free_bytes > 0


def test_detect_probe_picks_jetson_on_a_jetson_root(tmp_path: Path) -> None:
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "nv_tegra_release").write_text("# R35\n")
    path = tmp_path / "meminfo"
    path.write_text(meminfo(
        total=7620244, free=5986120, available=6642512,
        swap_total=3810120, swap_free=3810120, nvmap=171432,
    ))
    probe = detect_probe("auto", root=tmp_path, meminfo_path=path, cgroup_dir=tmp_path / "none")
    assert isinstance(probe, JetsonProbe)
    assert probe.read().free_bytes == 6642512 * KB
    # CUDA and NVML memory figures are wrong on Jetson: refused outright.
    with pytest.raises(ConfigError, match="Jetson"):
        CudaProbe(root=tmp_path)
    with pytest.raises(ConfigError, match="Jetson"):
        NvmlProbe(root=tmp_path)


def test_detect_probe_by_name_and_bad_names() -> None:
    fixed = detect_probe("fixed", free_bytes=123, total_bytes=456)
    assert isinstance(fixed, FixedProbe)
    assert fixed.read().free_bytes == 123 and fixed.read().total_bytes == 456
    assert isinstance(detect_probe("cpu"), CpuProbe)
    with pytest.raises(ConfigError, match="auto, jetson, cuda, nvml, cpu, fixed"):
        detect_probe("tpu")
    with pytest.raises(ConfigError, match="free_bytes"):
        detect_probe("fixed")
    with pytest.raises(ConfigError, match="device_index"):
        detect_probe("cpu", device_index=0)
    with pytest.raises(ConfigError, match="free_bytes"):
        detect_probe("auto", free_bytes=1)
    with pytest.raises(ConfigError, match="total_bytes"):
        FixedProbe(100, total_bytes=50)
    with pytest.raises(ConfigError, match="device_index"):
        CudaProbe(-1)


def test_gpu_probes_say_what_is_missing(tmp_path: Path) -> None:
    bindings = [m for m in ("cuda.bindings", "pycuda") if _importable(m)]
    if not bindings:
        with pytest.raises(ConfigError, match="needs a CUDA Python binding.*cuda-python.*pycuda"):
            CudaProbe(root=tmp_path).read()
    elif not _cuda_driver_present():  # a binding without a driver (this CI): the error names both
        with pytest.raises(ConfigError, match="cannot open CUDA device 0 with (cuda-python|pycuda)"):
            CudaProbe(root=tmp_path).read()
    if importlib.util.find_spec("pynvml") is None:
        with pytest.raises(ConfigError, match="pynvml"):
            NvmlProbe(root=tmp_path).read()


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # the parent package is missing
        return False


def _cuda_driver_present() -> bool:
    return any(Path(d, "libcuda.so.1").exists() for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu",
                                                         "/usr/lib64", "/usr/local/cuda/compat"))


# --- CudaProbe over both CUDA bindings (fakes of the same fake GPU) ------------------------------


@pytest.mark.parametrize("binding", ["pycuda", "cuda-python"])
def test_cuda_probe_reads_free_and_total_through_either_binding(tmp_path: Path, binding: str) -> None:
    gpu = FakeCuda(total_memory=8 << 30)
    probe = CudaProbe(0, root=tmp_path, cuda_module=fake_cuda_module(binding, gpu))
    snap = probe.read()
    assert (snap.total_bytes, snap.free_bytes, snap.source) == (8 << 30, 8 << 30, "cuda:0")
    assert probe.binding == binding and gpu.primary_retained == 1
    # Memory another user of the device takes shows up in the next read.
    ctx = gpu.Device(0).retain_primary_context()
    ctx.push()
    gpu.mem_alloc(3 << 30)
    gpu.Context.pop()
    assert probe.read().free_bytes == 5 << 30
    assert gpu.Context.get_current() is None  # the probe pops what it pushed
    probe.close()
    ctx.detach()
    assert gpu.primary_retained == 0


@pytest.mark.parametrize("binding", ["pycuda", "cuda-python"])
def test_cuda_probe_on_a_missing_device_is_a_config_error(tmp_path: Path, binding: str) -> None:
    probe = CudaProbe(1, root=tmp_path, cuda_module=fake_cuda_module(binding, FakeCuda(device_count=1)))
    with pytest.raises(ConfigError, match=f"cannot open CUDA device 1 with {binding}"):
        probe.read()


# --- JetPack and Jetson modules -------------------------------------------------------------------


def jetson_root(tmp_path: Path, release: str, model: bytes) -> Path:
    (tmp_path / "etc").mkdir(parents=True)
    (tmp_path / "etc" / "nv_tegra_release").write_text(release)
    (tmp_path / "proc" / "device-tree").mkdir(parents=True)
    (tmp_path / "proc" / "device-tree" / "model").write_bytes(model)
    return tmp_path


@pytest.mark.parametrize(
    "release, model, jetpack, cuda, trt, python, module, memory_gib, dla",
    [
        ("# R36 (release), REVISION: 4.3, GCID: 38968081, BOARD: generic, EABI: aarch64\n",
         b"NVIDIA Jetson Orin Nano Engineering Reference Developer Kit Super\x00",
         "6.1/6.2", "12.6", "10.3", "3.10", "Jetson Orin Nano", None, 0),
        ("# R38 (release), REVISION: 2.0, GCID: 41844464, BOARD: generic, EABI: aarch64\n",
         b"NVIDIA Jetson AGX Thor Developer Kit\x00", "7.0/7.1", "13", "10.13-10.16", "3.12",
         "Jetson AGX Thor (T5000)", 128, 0),
        ("# R38 (release), REVISION: 4.0, GCID: 1, BOARD: generic, EABI: aarch64\n",
         b"NVIDIA Jetson T4000\x00", "7.0/7.1", "13", "10.13-10.16", "3.12", "Jetson Thor T4000", 64, 0),
        ("# R39 (release), REVISION: 0.0, GCID: 1, BOARD: generic, EABI: aarch64\n",
         b"NVIDIA Jetson AGX Orin Developer Kit\x00", "7.2", "13", "10.13-10.16", "3.12", "Jetson AGX Orin", None, 2),
    ],
)
def test_read_jetson_info_knows_jetpack_6_and_7(tmp_path: Path, release, model, jetpack, cuda, trt, python, module,
                                                 memory_gib, dla) -> None:
    info = read_jetson_info(jetson_root(tmp_path, release, model))
    assert info is not None and info.jetpack is not None and info.module is not None
    assert (info.jetpack.jetpack, info.jetpack.cuda, info.jetpack.tensorrt, info.jetpack.python) == (
        jetpack, cuda, trt, python)
    assert (info.module.name, info.module.memory_gib, info.module.dla_cores) == (module, memory_gib, dla)
    assert f"JetPack {jetpack}" in info.describe() and module in info.describe()


def test_jetson_info_off_jetson_and_unknown_releases(tmp_path: Path) -> None:
    assert read_jetson_info(tmp_path) is None
    info = read_jetson_info(jetson_root(tmp_path, "# R99 (release), REVISION: 1.0\n", b"Some future board\x00"))
    assert info is not None and info.l4t == (99, 1, 0) and info.jetpack is None and info.module is None
    assert info.describe() == "L4T R99.1.0, Some future board"
    assert parse_l4t_release("garbage") is None and parse_l4t_release("") is None


def test_jetson_thor_uses_the_jetson_probe_not_cuda(tmp_path: Path) -> None:
    root = jetson_root(tmp_path, "# R38 (release), REVISION: 2.0\n", b"NVIDIA Jetson AGX Thor Developer Kit\x00")
    with pytest.raises(ConfigError, match="Jetson"):
        CudaProbe(root=root)
    probe = detect_probe("auto", root=root, meminfo_path=_thor_meminfo(tmp_path), cgroup_dir=tmp_path / "none")
    assert isinstance(probe, JetsonProbe)
    assert probe.read().total_bytes == 128 * 1000**3 // KB * KB  # what /proc/meminfo says, not a table


def _thor_meminfo(tmp_path: Path) -> Path:
    path = tmp_path / "meminfo"
    total = 128 * 1000**3 // KB  # kB
    path.write_text(meminfo(total=total, free=total // 2, available=total // 2, swap_total=0, swap_free=0,
                            nvmap=1 << 20))
    return path
