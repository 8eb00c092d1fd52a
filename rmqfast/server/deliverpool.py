"""The supervisor's side of the deliver pool: start, restart and stop the deliver processes."""

from __future__ import annotations

import logging
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from rmqfast.log import ctx
from rmqfast.server.spawn import child_command, child_cwd, child_env

log = logging.getLogger("rmqfast.deliver")


class DeliverPool:
    """``count`` processes ``python -P -m rmqfast.deliver.process`` (rmqfast.server.spawn); restarted when they die."""

    def __init__(self, count: int, runtime: Path, env: dict[str, str],
                 on_dead: Callable[[int], None] | None = None) -> None:
        self.count = count
        self.runtime = runtime
        self.env = env
        self.on_dead = on_dead
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.restarts = 0
        self.stopping = False

    def start(self) -> None:
        for k in range(self.count):
            self._spawn(k)

    def _spawn(self, k: int) -> None:
        # isolated path and fixed cwd: the child imports exactly the supervisor's rmqfast
        cmd = child_command("rmqfast.deliver.process", "--runtime", str(self.runtime), "--index", str(k))
        self.procs[k] = subprocess.Popen(cmd, env=child_env(self.env), cwd=child_cwd(self.runtime))
        log.info("deliver process started", extra=ctx(deliver=k, deliver_pid=self.procs[k].pid))

    def reap(self) -> None:
        for k, p in list(self.procs.items()):
            code = p.poll()
            if code is None:
                continue
            if self.on_dead is not None:
                self.on_dead(p.pid)
            if self.stopping:
                del self.procs[k]
                continue
            log.warning("deliver process died; restarting it", extra=ctx(deliver=k, exit_code=code, deliver_pid=p.pid))
            self.restarts += 1
            self._spawn(k)

    def pids(self) -> list[int]:
        return [p.pid for p in list(self.procs.values())]

    def stop(self, timeout: float = 5.0) -> None:
        self.stopping = True
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for p in self.procs.values():
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.reap()
