"""How many CPUs this process may use: what ``proxy.workers = 0`` (one worker per CPU) counts.

``os.cpu_count()`` is the machine's count. In a container, or under systemd's ``CPUQuota=`` or
``taskset``, the process gets less: its affinity mask can name fewer CPUs, and its cgroup can cap
the CPU time (a Kubernetes CPU limit of 2 on a 64-core node is 2 CPUs' worth of time). One worker
per node CPU there means dozens of workers sharing two CPUs' time, each with its own buffers and
spill. So the count is the affinity mask's size, capped by the cgroup's quota rounded up (cgroup
v2 ``cpu.max``, v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``, the smallest along the path from
the process's cgroup to the root), as Java and Go read it.
"""

from __future__ import annotations

import math
import os
from pathlib import Path


def usable_cpus(proc_cgroup: str | Path = "/proc/self/cgroup", cgroup_root: str | Path = "/sys/fs/cgroup") -> int:
    """CPUs this process may use (at least 1); the arguments are for tests."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    quota = cgroup_cpu_quota(proc_cgroup, cgroup_root)
    if quota is not None:
        n = min(n, max(1, math.ceil(quota)))
    return max(1, n)


def cgroup_cpu_quota(proc_cgroup: str | Path = "/proc/self/cgroup",
                     cgroup_root: str | Path = "/sys/fs/cgroup") -> float | None:
    """The CPU time the process's cgroup allows, in CPUs (1.5: one and a half CPUs' worth), or
    None when no quota is set or none can be read (no cgroup file system, an unknown layout)."""
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    root = Path(cgroup_root)
    limits: list[float] = []
    for line in lines:
        hier, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if not path.startswith("/"):
            continue
        if hier == "0" and controllers == "":  # cgroup v2 (the unified hierarchy)
            limits += _along(root, path, _v2_limit)
        elif "cpu" in controllers.split(","):  # cgroup v1: mounted as cpu, or cpu,cpuacct
            for mount in (controllers, "cpu,cpuacct", "cpu"):
                if (root / mount).is_dir():
                    limits += _along(root / mount, path, _v1_limit)
                    break
    return min(limits) if limits else None


def _along(mount: Path, path: str, read: object) -> list[float]:
    """The limits set on ``path`` and on each of its parents up to the mount's root."""
    found: list[float] = []
    parts = [p for p in path.split("/") if p]
    for depth in range(len(parts), -1, -1):
        limit = read(mount.joinpath(*parts[:depth]))  # type: ignore[operator]
        if limit is not None:
            found.append(limit)
    return found


def _v2_limit(d: Path) -> float | None:
    """``cpu.max`` is ``QUOTA PERIOD`` or ``max PERIOD`` (no limit)."""
    try:
        quota, period = (d / "cpu.max").read_text().split()[:2]
        if quota == "max":
            return None
        q, p = int(quota), int(period)
    except (OSError, ValueError):
        return None
    return q / p if q > 0 and p > 0 else None


def _v1_limit(d: Path) -> float | None:
    """``cpu.cfs_quota_us`` is -1 when no quota is set."""
    try:
        q = int((d / "cpu.cfs_quota_us").read_text())
        p = int((d / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return q / p if q > 0 and p > 0 else None
