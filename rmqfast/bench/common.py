"""What every bench mode shares: paths, the results schema, the error, a results file."""

from __future__ import annotations

import datetime as dt
import sys
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
