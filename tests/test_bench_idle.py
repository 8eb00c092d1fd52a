"""``rmqfast bench --idle`` works end to end on a few connections (not a speed or memory test)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from rmqfast.bench import cli as bench_cli

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC", "gcc")) is None, reason="needs a C compiler")


def test_idle_bench_sets_up_holds_and_measures(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = bench_cli.main(["--idle", "--conns", "40", "--concurrency", "8", "--interval", "0.5", "--hold", "1.5",
                         "--targets", "direct,rmqfast", "--results", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    rows = [json.loads(line) for f in tmp_path.glob("*-idle.jsonl") for line in f.read_text().splitlines()]
    by = {r["target"]: r for r in rows if r["kind"] == "idle"}
    assert set(by) == {"direct", "rmqfast"}
    for r in by.values():
        assert r["set_up"] == 40 and r["errors"] == 0, r
        assert r["connects_per_s"] > 0 and r["setup_lat_ms"]["p99"] > 0
        # 40 connections, one request each per 0.5 s, for 1.5 s: about 120 answers
        assert 40 <= r["idle_requests"] <= 200, r
    assert by["rmqfast"]["rss_peak_kib"] > 0 and by["rmqfast"]["bytes_per_conn"] is not None
    assert "rmqfast worker RSS with 40 connections" in out
