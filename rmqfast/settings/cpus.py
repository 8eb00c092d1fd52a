"""How many CPUs this process may use: what ``proxy.workers = 0`` (one worker per CPU) counts.

``os.cpu_count()`` is the machine's count. In a container, or under systemd's ``CPUQuota=`` or
``taskset``, the process gets less: its affinity mask can name fewer CPUs, and its cgroup can cap
the CPU time (a Kubernetes CPU limit of 2 on a 64-core node is 2 CPUs' worth of time). One worker
per node CPU there means dozens of workers sharing two CPUs' time, each with its own buffers and
spill. So the count is the affinity mask's size, capped by the cgroup's quota rounded up (cgroup
v2 ``cpu.max``, v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``, the smallest along the path from
the process's cgroup to the root of the cgroup file system it sees), as Java and Go read it.

Worked out once per process (:func:`usable_cpus_at_start`): the worker count does not follow a
limit changed while the proxy runs (a pod resized in place, ``taskset -p``); a restart does.  A
quota set above the root of a container's cgroup namespace is not visible from inside it (the
JDK and Go see no more); a layout this module does not know counts as no quota (v1 hierarchies
are looked for under /sys/fs/cgroup by their controllers' names, not through
/proc/self/mountinfo).
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable
from pathlib import Path


@functools.cache
def usable_cpus_at_start() -> int:
    """:func:`usable_cpus`, worked out on the first call and the same for the process's life."""
    return usable_cpus()


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
    None when no quota is set or none can be read (no cgroup file system, an unknown layout, an
    unreadable or undecodable file: this runs when the supervisor starts, and never raises)."""
    try:
        return _quota(Path(proc_cgroup), Path(cgroup_root))
    except (OSError, ValueError):  # (UnicodeDecodeError is a ValueError)
        return None


def _quota(proc_cgroup: Path, root: Path) -> float | None:
    limits: list[float] = []
    for line in proc_cgroup.read_text().splitlines():
        hier, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        # ".." parts: a cgroup outside the namespace's root, whose files are not visible here
        if not path.startswith("/") or ".." in path.split("/"):
            continue
        if hier == "0" and controllers == "":  # cgroup v2 (the unified hierarchy)
            limits += _along(root, path, _v2_limit)
        elif "cpu" in controllers.split(","):  # cgroup v1: mounted as cpu, cpu,cpuacct or cpuacct,cpu
            for mount in (controllers, "cpu,cpuacct", "cpuacct,cpu", "cpu"):
                if (root / mount).is_dir():
                    limits += _along(root / mount, path, _v1_limit)
                    break
    return min(limits) if limits else None


def _along(mount: Path, path: str, read: Callable[[Path], float | None]) -> list[float]:
    """The limits set on ``path`` and on each of its parents up to the mount's root."""
    found: list[float] = []
    parts = [p for p in path.split("/") if p]
    for depth in range(len(parts), -1, -1):
        limit = read(mount.joinpath(*parts[:depth]))
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
