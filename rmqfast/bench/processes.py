"""Ports and the end of the processes the bench starts itself."""

from __future__ import annotations

import signal
import socket
import subprocess
import time
from typing import Any

from rmqfast.bench.common import BenchError


def free_port() -> int:
    """A loopback port the OS had free a moment ago (for HAProxy's listener)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, proc: subprocess.Popen[Any], timeout: float = 10.0) -> None:
    """Wait until something accepts on 127.0.0.1:``port``; BenchError if ``proc`` exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise BenchError(f"{proc.args!r} exited with {proc.returncode} before listening on {port}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise BenchError(f"nothing listens on 127.0.0.1:{port} after {timeout}s")


def stop_process(proc: subprocess.Popen[Any] | None, timeout: float = 10.0) -> None:
    """SIGTERM one process we started (by its pid), SIGKILL if it does not exit."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
