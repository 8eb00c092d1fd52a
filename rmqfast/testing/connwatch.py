"""Which TCP ports the client processes of a test connect to (Linux ``/proc``), sampled while they run.

Used to prove that a client reached only the proxy: ``with ConnectionWatch() as w: ...`` records
the remote ports of every TCP socket held by the test's child processes (and their children:
JVMs, Go drivers), sampled every few milliseconds until the block ends.  Clients keep their
connections to brokers open (channel tables), so a connection to a real broker port is seen.
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from types import TracebackType


def _tcp_remote_ports() -> dict[str, int]:
    """socket inode -> remote port, for every TCP socket of this network namespace."""
    out: dict[str, int] = {}
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(path) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            out[parts[9]] = int(parts[2].rsplit(":", 1)[1], 16)
    return out


def _children() -> dict[int, int]:
    """pid -> parent pid of every process."""
    out: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        out[int(name)] = int(stat.rsplit(")", 1)[1].split()[1])
    return out


def descendants(root: int) -> set[int]:
    parents = _children()
    found: set[int] = set()
    frontier = {root}
    while frontier:
        nxt = {pid for pid, ppid in parents.items() if ppid in frontier and pid not in found}
        found |= nxt
        frontier = nxt
    return found


#: Command-line marks of the client programs the tests run.
GO_DRIVER = "godriver-"
JAVA_DRIVER = "io.rmqfast.driver.RmqDriver"
MQADMIN = "org.apache.rocketmq.tools.command.MQAdminStartup"


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode("utf-8", "replace")
    except OSError:
        return ""


class ConnectionWatch:
    """Remote ports the descendants of this process whose command line contains one of
    ``marks`` (the client programs, not the proxy or the cluster) connect to."""

    def __init__(self, marks: tuple[str, ...] = (GO_DRIVER, JAVA_DRIVER, MQADMIN), interval: float = 0.003,
                 refresh: float = 0.05) -> None:
        self.marks = marks
        self.interval = interval
        self.refresh = refresh  # how often the process tree is scanned for new clients
        self._cmd: dict[int, bool] = {}
        self._clients: set[int] = set()
        self._refreshed = 0.0
        self.ports: Counter[int] = Counter()  # remote port -> samples it was seen in
        self.pids: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="connwatch", daemon=True)

    def __enter__(self) -> ConnectionWatch:
        self._thread.start()
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()  # one last look

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def _refresh_clients(self) -> None:
        clients = set()
        for pid in descendants(os.getpid()):
            if not self._cmd.get(pid):  # re-read until it matches: a fresh fork has not exec'd yet
                cmd = _cmdline(pid)
                self._cmd[pid] = any(m in cmd for m in self.marks)
            if self._cmd[pid]:
                clients.add(pid)
        self._clients = clients
        self._refreshed = time.monotonic()

    def sample(self) -> None:
        if time.monotonic() - self._refreshed >= self.refresh:
            self._refresh_clients()
        pids = self._clients
        if not pids:
            return
        # the fd lists first, then the table: a socket opened in between is seen next time,
        # one closed in between is still in the table read after
        socks: dict[int, list[str]] = {}
        for pid in pids:
            try:
                fds = os.listdir(f"/proc/{pid}/fd")
            except OSError:
                continue
            inodes = []
            for fd in fds:
                try:
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if target.startswith("socket:["):
                    inodes.append(target[8:-1])
            socks[pid] = inodes
        table = _tcp_remote_ports()
        for pid, inodes in socks.items():
            seen = False
            for inode in inodes:
                port = table.get(inode)
                if port:  # 0: listening or unconnected
                    self.ports[port] += 1
                    seen = True
            if seen:
                self.pids.add(pid)

    def touched(self, ports: set[int]) -> set[int]:
        """The ports of ``ports`` some watched process connected to."""
        return {p for p in ports if self.ports[p]}

