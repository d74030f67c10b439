"""cgroup memory limits: how much a container (or systemd slice) still lets this process allocate.

A process killed by the OOM killer at ``memory.max`` does not care how much RAM the host has,
so every host-memory probe (CPU, Jetson) bounds its figure with :func:`apply_cgroup`. cgroup v2
and v1 are both read (JetPack 5 still mounts v1).
"""

from __future__ import annotations

from pathlib import Path

# cgroup v1 reports "no limit" as a huge page-rounded number (9223372036854771712), not "max".
CGROUP_V1_UNLIMITED = 1 << 62


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
        if limit is not None and limit >= CGROUP_V1_UNLIMITED:
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


def apply_cgroup(
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
