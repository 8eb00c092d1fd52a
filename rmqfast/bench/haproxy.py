"""HAProxy as a bench target: finding (or installing) it, its config, its process."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import IO, Any

from rmqfast.bench.common import BenchError
from rmqfast.bench.processes import free_port, stop_process, wait_port


def ensure_haproxy(install: bool) -> str | None:
    """Path of haproxy; installs Debian's package with apt-get if missing and allowed."""
    exe = shutil.which("haproxy") or (shutil.which("haproxy", path="/usr/sbin:/sbin"))
    if exe or not install:
        return exe
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        print("bench: haproxy is not installed and cannot be installed here (needs root and apt-get)", file=sys.stderr)
        return None
    print("bench: installing haproxy with apt-get ...", file=sys.stderr, flush=True)
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    cmd = ["apt-get", "install", "-y", "--no-install-recommends", "haproxy"]
    if subprocess.run(cmd, env=env, capture_output=True).returncode != 0:
        subprocess.run(["apt-get", "update"], env=env, capture_output=True)
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"bench: apt-get install haproxy failed:\n{proc.stderr[-2000:]}", file=sys.stderr)
            return None
    return shutil.which("haproxy") or shutil.which("haproxy", path="/usr/sbin:/sbin")


def haproxy_version(exe: str) -> str:
    out = subprocess.run([exe, "-v"], capture_output=True, text=True).stdout
    return out.splitlines()[0].strip() if out else ""


class HAProxyTarget:
    """HAProxy in TCP mode in front of the null broker, from a generated config."""

    def __init__(self, exe: str, upstream_port: int, nbthread: int, name: str) -> None:
        self.name = name
        self.exe = exe
        self.nbthread = nbthread
        self.upstream_port = upstream_port
        self._port = 0
        self.workdir = Path(tempfile.mkdtemp(prefix="rmqfast-bench-haproxy-"))
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def port(self) -> int:
        return self._port

    @staticmethod
    def maxconn() -> int:
        # HAProxy wants 2 fds per connection and refuses to start if it cannot raise its fd
        # limit that far; the bench needs at most a few hundred connections.
        import resource

        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        return max(256, min(10000, (hard - 200) // 2)) if hard != resource.RLIM_INFINITY else 10000

    def config(self) -> str:
        # Plain L4 relay, defaults otherwise (no splicing, 16 KiB buffers): what a team would
        # put in front of a broker.  Long client/server timeouts: pulls are held for 15 s.
        return f"""global
    nbthread {self.nbthread}
    maxconn {self.maxconn()}

defaults
    mode tcp
    timeout connect 5s
    timeout client 5m
    timeout server 5m

listen rocketmq
    bind 127.0.0.1:{self._port}
    server nullbroker 127.0.0.1:{self.upstream_port}
"""

    def start(self) -> None:
        self._port = free_port()
        cfg = self.workdir / "haproxy.cfg"
        cfg.write_text(self.config())
        self._log = open(self.workdir / "haproxy.log", "ab")
        # -db: foreground, one process (threads inside), so its pid is all the CPU there is.
        self.proc = subprocess.Popen([self.exe, "-f", str(cfg), "-db"], stdout=self._log, stderr=subprocess.STDOUT)
        try:
            wait_port(self._port, self.proc)
        except BenchError as exc:
            log = (self.workdir / "haproxy.log").read_text(errors="replace")[-2000:]
            raise BenchError(f"{self.name}: {exc}\n{log}") from None

    def pids(self) -> list[int]:
        return [self.proc.pid] if self.proc else []

    def info(self) -> dict[str, Any]:
        return {"nbthread": self.nbthread, "version": haproxy_version(self.exe)}

    def stop(self) -> None:
        stop_process(self.proc)
        if self._log:
            self._log.close()
        shutil.rmtree(self.workdir, ignore_errors=True)
