"""The supervisor's /metrics reads every worker's prometheus-client file; a worker that is starting
has just created an empty one, which must not turn a scrape into an error."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from rmqfast.server.supervisor import _PromFiles


def test_an_empty_file_of_a_starting_worker_is_left_out(tmp_path: Path) -> None:
    code = (
        "from prometheus_client import Counter\n"
        "Counter('rmqfast_probe_total', 'x', ['a']).labels('1').inc(3)\n"
    )
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
    (tmp_path / "counter_424242.db").write_bytes(b"")  # created, not sized yet
    # what the supervisor used before fails on it
    from prometheus_client import CollectorRegistry

    reg = CollectorRegistry()
    MultiProcessCollector(reg, path=str(tmp_path))
    with pytest.raises(Exception, match="unpack_from"):
        generate_latest(reg)
    out = generate_latest(_PromFiles(tmp_path)).decode()  # type: ignore[arg-type]
    assert 'rmqfast_probe_total{a="1"} 3.0' in out
