"""``proxy.workers = 0`` counts the CPUs the process may use: its affinity mask, capped by its
cgroup's CPU quota (``rmqfast.settings.cpus``), read here from cgroup trees made in a temporary
directory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rmqfast import config as config_mod
from rmqfast.settings import cpus
from rmqfast.settings.cpus import cgroup_cpu_quota, usable_cpus


def _v2(tmp_path: Path, path: str, limits: dict[str, str]) -> tuple[Path, Path]:
    """A cgroup v2 tree: ``limits`` maps a cgroup path ("" is the root) to its cpu.max."""
    root = tmp_path / "cgroup"
    for cg, cpu_max in limits.items():
        d = root / cg.strip("/")
        d.mkdir(parents=True, exist_ok=True)
        (d / "cpu.max").write_text(cpu_max + "\n")
    (root / path.strip("/")).mkdir(parents=True, exist_ok=True)
    proc = tmp_path / "proc_cgroup"
    proc.write_text(f"0::{path}\n")
    return proc, root


@pytest.mark.parametrize("cpu_max, want", [
    ("200000 100000", 2.0),     # a Kubernetes limit of 2
    ("150000 100000", 1.5),
    ("50000 100000", 0.5),
    ("max 100000", None),       # no limit
    ("garbage", None),
])
def test_cgroup_v2_quota(tmp_path: Path, cpu_max: str, want: float | None) -> None:
    proc, root = _v2(tmp_path, "/kubepods/pod1/c1", {"/kubepods/pod1/c1": cpu_max})
    assert cgroup_cpu_quota(proc, root) == want


def test_the_smallest_quota_on_the_way_to_the_root_wins(tmp_path: Path) -> None:
    proc, root = _v2(tmp_path, "/a/b/c", {"": "max 100000", "/a": "300000 100000", "/a/b": "100000 100000",
                                          "/a/b/c": "max 100000"})
    assert cgroup_cpu_quota(proc, root) == 1.0


def test_cgroup_v1_quota(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    d = root / "cpu,cpuacct" / "docker" / "abc"
    d.mkdir(parents=True)
    (d / "cpu.cfs_quota_us").write_text("250000\n")
    (d / "cpu.cfs_period_us").write_text("100000\n")
    parent = root / "cpu,cpuacct" / "docker"
    (parent / "cpu.cfs_quota_us").write_text("-1\n")   # no quota on the parent
    (parent / "cpu.cfs_period_us").write_text("100000\n")
    proc = tmp_path / "proc_cgroup"
    proc.write_text("12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n0::/\n")
    assert cgroup_cpu_quota(proc, root) == 2.5


def test_no_cgroup_file_system_means_no_quota(tmp_path: Path) -> None:
    assert cgroup_cpu_quota(tmp_path / "missing", tmp_path) is None
    proc = tmp_path / "proc_cgroup"
    proc.write_text("0::/\n")
    assert cgroup_cpu_quota(proc, tmp_path / "no-such-root") is None


def test_a_container_without_a_cgroup_namespace_reads_its_own_cgroup_at_the_mount_root(tmp_path: Path) -> None:
    """v1 in a container without a cgroup namespace: /proc/self/cgroup names the host's path,
    which does not exist under the container's mount; the walk ends at the mount's root, which
    is the container's own cgroup.  The mount may be named cpuacct,cpu too."""
    root = tmp_path / "cgroup"
    mount = root / "cpuacct,cpu"
    mount.mkdir(parents=True)
    (mount / "cpu.cfs_quota_us").write_text("200000\n")
    (mount / "cpu.cfs_period_us").write_text("100000\n")
    proc = tmp_path / "proc_cgroup"
    proc.write_text("3:cpu,cpuacct:/kubepods/burstable/pod9/abcdef\n")
    assert cgroup_cpu_quota(proc, root) == 2.0


def test_what_cannot_be_read_counts_as_no_quota(tmp_path: Path) -> None:
    """A cgroup outside the namespace's root ("/../.."), an undecodable file: no quota, no error."""
    proc, root = _v2(tmp_path, "/x", {"": "100000 100000", "/x": "max 100000"})
    proc.write_text("0::/../../other\n")
    assert cgroup_cpu_quota(proc, root) is None
    proc.write_bytes(b"0::/\xff\xfe\n")
    assert cgroup_cpu_quota(proc, root) is None


def test_usable_cpus_is_the_affinity_mask_capped_by_the_quota_rounded_up(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))  # an 8-CPU mask on any machine
    assert usable_cpus(tmp_path / "missing", tmp_path) == 8
    for cpu_max, want in (("150000 100000", 2), ("50000 100000", 1), ("6400000 100000", 8)):
        proc, root = _v2(tmp_path / cpu_max.split()[0], "/x", {"/x": cpu_max})
        assert usable_cpus(proc, root) == want


def test_workers_zero_is_worked_out_once_per_process(monkeypatch) -> None:
    """``workers = 0``: the usable CPUs when first asked, and the same number afterwards even if
    the limit changes (the supervisor compares and reports against the workers it started)."""
    usable = [5]
    monkeypatch.setattr(cpus, "usable_cpus", lambda: usable[0])
    cpus.usable_cpus_at_start.cache_clear()
    try:
        cfg = config_mod.Config()
        assert cfg.proxy.workers == 0 and cfg.worker_count == 5
        usable[0] = 7
        assert cfg.worker_count == 5 and config_mod.Config().worker_count == 5
        cfg.proxy.workers = 3
        assert cfg.worker_count == 3
    finally:
        cpus.usable_cpus_at_start.cache_clear()
