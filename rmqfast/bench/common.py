"""What every bench mode shares: paths, the results schema, the error, a results file."""

from __future__ import annotations

import datetime as dt
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
BENCH_SRC = REPO / "bench"
DEFAULT_BUILD_DIR = REPO / "build" / "bench"
DEFAULT_RESULTS_DIR = Path("results") / "bench"
SCHEMA = "rmqfast-bench/1"


class BenchError(RuntimeError):
    """The benchmark cannot run (tool missing, build failed, target would not start)."""


def now_iso() -> str:
    """The ``ts`` of a results line."""
    return dt.datetime.now(dt.UTC).isoformat()


def results_file(results: Path, suffix: str, mode: str) -> tuple[str, Path, dict[str, Any]]:
    """(run id, results file path, fields every line carries) for a run starting now.

    ``suffix`` ends the run id (a commit, ``real``, ``clouds``); the folder is created.
    """
    run_id = f"{dt.datetime.now(dt.UTC):%Y%m%dT%H%M%SZ}-{suffix}"
    results.mkdir(parents=True, exist_ok=True)
    return run_id, results / f"bench-{run_id}.jsonl", {"schema": SCHEMA, "run_id": run_id, "mode": mode}


def guarded(label: str, body: Callable[[], int]) -> int:
    """``body()``'s exit status; a BenchError is printed after ``label`` (2), Ctrl-C is 130."""
    try:
        return body()
    except BenchError as exc:
        print(f"{label}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{label}: interrupted", file=sys.stderr)
        return 130


def wait_serving(proc: subprocess.Popen[bytes], admin: int, ports: list[int], what: str,
                 timeout: float = 60.0) -> None:
    """Wait until an ``rmqfast serve`` answers ``/healthz`` on ``admin`` and accepts connections on
    every one of ``ports`` (workers are alive before their listeners are bound).  No name server
    stands behind the bench's proxies, so ``/readyz`` never says ready."""
    deadline = time.monotonic() + timeout
    pending = [f"http://127.0.0.1:{admin}/healthz", *ports]
    while pending:
        probe = pending[0]
        try:
            if isinstance(probe, str):
                with urllib.request.urlopen(probe, timeout=2) as r:
                    ok = r.status == 200
            else:
                socket.create_connection(("127.0.0.1", probe), timeout=2).close()
                ok = True
        except OSError:
            ok = False
        if ok:
            pending.pop(0)
            continue
        if time.monotonic() > deadline or proc.poll() is not None:
            raise BenchError(f"{what} did not start serving (waiting for {probe})")
        time.sleep(0.1)
