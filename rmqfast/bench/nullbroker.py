"""The null broker (``bench/nullbroker.c``): answers like a broker, stores nothing."""

from __future__ import annotations

import contextlib
import json
import subprocess
from typing import Any

from rmqfast.bench.cbuild import Tools
from rmqfast.bench.common import BenchError
from rmqfast.bench.processes import stop_process

#: What the null broker puts in every pull answer (16 store records of 1 KiB).
PULL_MSGS = 16
PULL_BODY = 1024


class NullBroker:
    """``bench/nullbroker`` on a free loopback port; ``with NullBroker(tools) as nb: nb.port``."""

    def __init__(self, tools: Tools, *, threads: int = 1, pull_msgs: int = PULL_MSGS,
                 pull_body: int = PULL_BODY) -> None:
        self.cmd = [str(tools.nullbroker), "--port", "0", "--threads", str(threads),
                    "--pull-msgs", str(pull_msgs), "--pull-body", str(pull_body)]
        self.proc: subprocess.Popen[str] | None = None
        self.port = 0
        self.final_stats: dict[str, Any] = {}

    def start(self) -> NullBroker:
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # "listening 127.0.0.1:PORT"
        if not line.startswith("listening "):
            stop_process(self.proc)
            raise BenchError(f"nullbroker did not start: {line!r}")
        self.port = int(line.rsplit(":", 1)[1])
        return self

    @property
    def pids(self) -> list[int]:
        return [self.proc.pid] if self.proc else []

    def stop(self) -> None:
        if self.proc is None:
            return
        stop_process(self.proc)
        assert self.proc.stdout is not None
        out = self.proc.stdout.read().strip()
        self.proc.stdout.close()
        if out:
            with contextlib.suppress(ValueError):
                self.final_stats = json.loads(out.splitlines()[-1])

    def __enter__(self) -> NullBroker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
