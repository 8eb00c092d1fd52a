"""The worker's side of its gRPC front process: start it, start it again if it dies, stop it.

Runs in the worker's gevent hub: the process is watched with ``poll()`` every ``interval`` seconds
(no blocking wait); a front that exits while the worker serves is started again after a back-off
that doubles from 1 s to 30 s (reset once a front has lived a minute).
"""

from __future__ import annotations

import logging
import os
import subprocess
import time
from pathlib import Path

import gevent

from rmqfast.grpcfront.server import spawn

log = logging.getLogger("rmqfast.grpc")


class FrontKeeper:
    def __init__(self, runtime: Path, interval: float = 1.0) -> None:
        self.runtime = runtime
        self.interval = interval
        self.proc: subprocess.Popen[bytes] | None = None
        self._lifeline: int | None = None
        self._stopped = False
        self.restarts = 0
        self._greenlet: gevent.Greenlet | None = None

    def start(self) -> None:
        self._spawn()
        self._greenlet = gevent.spawn(self._watch)

    def _spawn(self) -> None:
        self.proc, self._lifeline = spawn(self.runtime)
        self._started = time.monotonic()

    def _close_lifeline(self) -> None:
        if self._lifeline is not None:
            os.close(self._lifeline)
            self._lifeline = None

    def _watch(self) -> None:
        backoff = 1.0
        while not self._stopped:
            gevent.sleep(self.interval)
            if self._stopped or self.proc is None or self.proc.poll() is None:
                continue
            lived = time.monotonic() - self._started
            log.error("gRPC front exited with %s after %.1f s; starting it again in %.0f s",
                      self.proc.returncode, lived, backoff)
            self._close_lifeline()
            backoff = 1.0 if lived > 60 else backoff
            gevent.sleep(backoff)
            backoff = min(30.0, backoff * 2)
            if not self._stopped:
                try:
                    self._spawn()
                except OSError as exc:  # no descriptors, no memory...: the old (exited) process stays; again later
                    log.error("gRPC front could not be started: %s", exc)
                    continue
                self.restarts += 1

    def stop(self, timeout: float = 5.0) -> None:
        """Ends the front (its lifeline closes: it stops accepting and finishes its calls)."""
        self._stopped = True
        self._close_lifeline()
        if self.proc is None:
            return
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            gevent.sleep(0.05)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
