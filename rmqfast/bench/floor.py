"""The ``relay-floor`` target: ``bench/relayfloor.c``, a minimal TCP relay (one thread, epoll, one
plain read and one plain write per readable socket, a 64 KiB buffer, no parsing) in front of
the null broker.

It measures what one more user-space hop costs on the machine at hand: its wake-ups and copies,
with nothing else done.  A proxy that matches it on a latency figure adds nothing measurable of
its own there; a goal it misses is a goal the machine, not the proxy, decides.  (It is not a
lower bound on CPU: batching system calls, as rmqfast does with io_uring, costs less.)
"""

from __future__ import annotations

import contextlib
import subprocess
from typing import Any

from rmqfast.bench.cbuild import Tools
from rmqfast.bench.common import BenchError
from rmqfast.bench.processes import stop_process


class FloorTarget:
    """``relayfloor --upstream PORT --port 0`` (the OS picks its port; it prints it)."""

    def __init__(self, tools: Tools, upstream_port: int, name: str = "relay-floor") -> None:
        if tools.relayfloor is None:
            raise BenchError("relay-floor: bench/relayfloor.c was not built")
        self.name = name
        self.cmd = [str(tools.relayfloor), "--upstream", str(upstream_port), "--port", "0"]
        self.proc: subprocess.Popen[str] | None = None
        self._port = 0

    @property
    def port(self) -> int:
        return self._port

    def start(self) -> None:
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # "listening 127.0.0.1:PORT"
        if not line.startswith("listening "):
            code = self.proc.poll()
            if not line:  # its stdout closed: it is exiting, its status comes in a moment
                with contextlib.suppress(subprocess.TimeoutExpired):
                    code = self.proc.wait(timeout=10)
            self.stop()
            raise BenchError(f"{self.name} did not start: {line!r} (exit {code})")
        self._port = int(line.rsplit(":", 1)[1])

    def pids(self) -> list[int]:
        return [self.proc.pid] if self.proc else []

    def info(self) -> dict[str, Any]:
        return {"threads": 1}

    def stop(self) -> None:
        if self.proc is None:
            return
        stop_process(self.proc)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self.proc = None
