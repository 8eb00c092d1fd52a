"""What the results say about the machine a run ran on."""

from __future__ import annotations

import contextlib
import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

from rmqfast import __version__
from rmqfast.bench.cbuild import Tools
from rmqfast.bench.common import REPO
from rmqfast.bench.haproxy import haproxy_version


def _git(*args: str) -> str:
    try:
        proc = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return proc.stdout.strip() if proc.returncode == 0 else ""


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return ""


def machine_info(tools: Tools, haproxy_exe: str | None) -> dict[str, Any]:
    """CPU model, cores, memory, kernel, Python and tool versions, git commit."""
    cpu_model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    mem_kib = 0
    with contextlib.suppress(OSError, ValueError, IndexError):
        mem_kib = int(Path("/proc/meminfo").read_text().split("\n", 1)[0].split()[1])
    from rmqfast import codec

    commit = _git("rev-parse", "HEAD")
    return {
        "hostname": platform.node(),
        "cpu_model": cpu_model or platform.processor(),
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)),
        "mem_total_mib": mem_kib // 1024,
        "kernel": platform.release(),
        "os": platform.platform(),
        "python": platform.python_version(),
        "rmqfast": __version__,
        "gevent": _version("gevent"),
        "cython": _version("Cython"),
        "compiled_scanner": codec.extension_built(),
        "haproxy": haproxy_version(haproxy_exe) if haproxy_exe else "",
        "cc": f"{os.environ.get('CC', 'gcc')} {tools.cc_version}",
        "git_commit": commit,
        "git_dirty": bool(_git("status", "--porcelain", "--untracked-files=no")) if commit else None,
    }
