"""Loopback ports for test processes (proxies, RocketMQ JVMs) that must be told a port number.

Why not "probe, then let the process bind": the kernel hands ports in its ephemeral range
(``/proc/sys/net/ipv4/ip_local_port_range``, usually 32768-60999) to every outgoing connection,
so a probed-free port there can be taken before the process binds it, and with thousands of
TIME-WAIT sockets on a busy machine a free block may not exist at all.  So:

* ports are picked **below** the ephemeral range (:data:`PROXY_RANGE`, :data:`CLUSTER_RANGE`),
  where only programs that choose a port explicitly bind;
* every process of ours that picks ports (any test run, the demo, the benchmarks, by any user
  of this machine's ``/tmp``) takes an exclusive ``flock`` on one file per port and holds it
  while the ports are in use, so two of our helpers never pick the same port, in one process or
  in concurrent ones, and a crashed holder releases its locks with its file descriptors;
* a port some other program binds can still appear after the check: callers retry with new
  ports when their process reports "Address already in use" (:func:`is_bind_error`).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import socket
import tempfile
import threading
from pathlib import Path
from typing import IO

#: The proxy helper's ports (name-server listener, admin, broker endpoint range, static endpoints).
PROXY_RANGE = (10000, 20000)
#: The RocketMQ cluster helper's ports (name server; broker P-2, P, P+1).
CLUSTER_RANGE = (20000, 32000)

_EPHEMERAL_DEFAULT = (32768, 60999)
_lock_dir_made = threading.Lock()


class PortsUnavailable(RuntimeError):
    """No block of free ports could be reserved."""


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for automatically assigned local ports (Linux), or the usual default."""
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return _EPHEMERAL_DEFAULT


def _lock_dir() -> Path:
    d = Path(tempfile.gettempdir()) / f"rmqfast-ports-{os.getuid()}"
    with _lock_dir_made:
        d.mkdir(mode=0o700, exist_ok=True)
    return d


def bindable(port: int, hosts: tuple[str, ...] = ("127.0.0.1", "0.0.0.0")) -> bool:
    """True if nothing listens on or holds ``port`` on those hosts right now.

    SO_REUSEADDR like the real listeners (rmqfast workers, Netty), so TIME-WAIT connections
    left on the port by an earlier user do not count as taken.  Only a hint: see the module doc.
    """
    for host in hosts:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError:
                return False
    return True


class PortLease:
    """Ports reserved for one process: held until :meth:`release` (idempotent) or garbage collection."""

    def __init__(self, ports: list[int], files: list[IO[bytes]]) -> None:
        self.ports = ports
        self._files = files

    @property
    def base(self) -> int:
        return self.ports[0]

    def release(self) -> None:
        files, self._files = self._files, []
        for f in files:
            with contextlib.suppress(OSError):
                f.close()  # closing the only descriptor drops the flock

    def __del__(self) -> None:
        self.release()

    def __enter__(self) -> PortLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _lock_port(port: int) -> IO[bytes] | None:
    f = open(_lock_dir() / f"{port}.lock", "ab")  # noqa: SIM115 - held by the lease
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        return None
    return f


def reserve(
    offsets: list[int] | range,
    port_range: tuple[int, int] = PROXY_RANGE,
    *,
    attempts: int = 400,
    hosts: tuple[str, ...] = ("127.0.0.1", "0.0.0.0"),
) -> PortLease:
    """Reserves ``base + o`` for every offset ``o``, for a random ``base`` such that all of them lie in
    ``port_range``, are locked by no other user of this module and are bindable now.

    ``reserve(range(22))`` is a contiguous block of 22; ``reserve([0, 5000])`` two ports 5000 apart.
    """
    offsets = sorted(set(offsets))
    lo, hi = port_range
    span = offsets[-1] - offsets[0]
    if not (1024 <= lo and hi - lo > span):
        raise ValueError(f"port range {lo}-{hi} cannot hold ports at offsets {offsets}")
    rng = random.Random(os.getpid() ^ threading.get_ident() ^ int.from_bytes(os.urandom(4), "little"))
    for _ in range(attempts):
        base = rng.randrange(lo - offsets[0], hi - offsets[-1])
        ports = [base + o for o in offsets]
        files: list[IO[bytes]] = []
        for p in ports:
            f = _lock_port(p)
            if f is None:
                break
            files.append(f)
        lease = PortLease(ports, files)
        if len(files) == len(ports) and all(bindable(p, hosts) for p in ports):
            return lease
        lease.release()
    raise PortsUnavailable(
        f"could not reserve {len(offsets)} loopback ports in {lo}-{hi} after {attempts} tries: "
        f"too many are in use (see `ss -ltn`) or locked in {_lock_dir()} by running tests"
    )


def is_bind_error(text: str) -> bool:
    """True if a process's output says it could not bind a port (Python, Java, or errno form)."""
    return any(s in text for s in ("Address already in use", "EADDRINUSE", "Errno 98", "BindException"))
