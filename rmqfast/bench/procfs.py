"""CPU and memory of processes and of the machine, read from /proc."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path

_CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of a process, all its threads; (0, 0) if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0, 0.0
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "; comm may hold spaces
    return int(fields[11]) / _CLK_TCK, int(fields[12]) / _CLK_TCK


def total_cpu(pids: Sequence[int]) -> tuple[float, float]:
    """(user, system) CPU seconds of several processes together."""
    user = system = 0.0
    for pid in pids:
        u, s = cpu_seconds(pid)
        user += u
        system += s
    return user, system


def memory_kib(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (peak RSS) of a process in KiB, from /proc/PID/status."""
    out: dict[str, int] = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0])
    except OSError:
        pass
    return out


def machine_cpu() -> dict[str, float]:
    """CPU seconds of the whole machine so far, from /proc/stat: ``task`` (user, nice,
    system: time charged to processes), ``irq`` (irq + softirq, e.g. loopback TCP receive
    work, which the kernel charges to no process) and ``steal`` (taken by the hypervisor)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]] + [0] * 8
    # user nice system idle iowait irq softirq steal
    return {"task": (v[0] + v[1] + v[2]) / _CLK_TCK, "irq": (v[5] + v[6]) / _CLK_TCK, "steal": v[7] / _CLK_TCK}


def wait_idle(pids: Sequence[int], timeout: float = 15.0, threshold: float = 0.05) -> None:
    """Wait until the processes use less than ``threshold`` of a core (a proxy draining the
    backlog of an overloaded open-loop run must not steal CPU from the next run)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        before = sum(total_cpu(pids))
        time.sleep(0.1)
        if sum(total_cpu(pids)) - before < threshold * 0.1:
            return


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (e.g. a supervisor's workers)."""
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(name))
            except (OSError, ValueError, IndexError):
                pass  # gone since the listing, or not a process we can read
    return out
