"""What `rmqfast demo` prints from its figures: send latency beside the counts, and the route
query vs route rewrite gap explained (the traffic itself is exercised by the integration tests)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rmqfast.demo import print_metrics, print_traffic, send_latency


def _summary(tmp_path: Path) -> dict[str, str]:
    tables = tmp_path / "tables"
    tables.mkdir()
    (tables / "latency_by_code_topic.csv").write_text(
        "code,topic,records,p50_us,p90_us,p99_us,p999_us\n"
        "310,DemoTopic5Sync,2000,1500.0,4000.0,9000.0,20000.0\n"
        "11,DemoTopic5Sync,900,8000.0,50000.0,400000.0,700000.0\n"  # pulls: not sends
        "320,DemoTopic5Batch,200,2500.0,6000.0,12000.0,13000.0\n"
        "105,DemoTopic5Batch,30,3000.0,3000.0,3000.0,3000.0\n")
    (tmp_path / "report.html").write_text("<html>")
    return {"report": str(tmp_path / "report.html")}


def test_send_latency_from_the_report_table(tmp_path: Path) -> None:
    lat = send_latency(_summary(tmp_path))
    assert set(lat) == {"DemoTopic5Sync", "DemoTopic5Batch"}
    assert lat["DemoTopic5Sync"]["p90_us"] == 4000.0 and lat["DemoTopic5Batch"]["p99_us"] == 12000.0
    assert send_latency(None) == {}


def test_traffic_table_has_percentiles_beside_counts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    r = {"sent": [{}] * 2000, "consumed": {"distinct": 2000}, "lost": [], "duplicates": [], "mismatched": [],
         "ok": True}
    ok = print_traffic([("5", "sync", "DemoTopic5Sync", r, 12.0), ("4", "async", "DemoTopic4Async", r, 9.0)],
                       send_latency(_summary(tmp_path)))
    out = capsys.readouterr().out
    assert ok
    header, sync_row, async_row = [ln for ln in out.splitlines() if ln.startswith(("client", "5.x", "4.x"))]
    assert "p50" in header and "p90" in header and "p99" in header
    assert sync_row.split()[-3:] == ["1.50", "4.00", "9.00"]  # ms
    assert async_row.split()[-3:] == ["-", "-", "-"]  # no records for that topic: said, not invented


def test_route_gap_explained(capsys: pytest.CaptureFixture[str]) -> None:
    def key(name: str, **labels: str) -> tuple[str, tuple[tuple[str, str], ...]]:
        return name, tuple(sorted(labels.items()))

    metrics = {
        key("rmqfast_requests_total", role="namesrv", code="105", result="success"): 127.0,
        key("rmqfast_route_rewrites_total", code="105"): 90.0,
        key("rmqfast_responses_total", role="namesrv", code="17"): 37.0,
        key("rmqfast_responses_total", role="namesrv", code="0"): 90.0,
    }
    print_metrics(metrics)
    out = capsys.readouterr().out
    lines = {ln.strip().rsplit(None, 1)[0].strip(): ln.rsplit(None, 1)[1] for ln in out.splitlines()
             if ln.strip() and ln.rstrip()[-1].isdigit()}
    assert lines["route queries"] == "127"
    assert lines["rewritten (brokers -> rmqfast endpoints)"] == "90"
    assert lines["answered TOPIC_NOT_EXIST (17), unchanged"] == "37"
    assert "TOPIC_NOT_EXIST" in out and "normal, not errors" in out
