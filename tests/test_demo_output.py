"""What `rmqfast demo` prints from its figures: send latency beside the counts, and the route
query vs route rewrite gap explained (the traffic itself is exercised by the integration tests)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rmqfast.demo import (
    print_metrics,
    print_traffic,
    report_route_counts,
    route_counts,
    send_latency,
    settled_metrics,
)


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


def key(name: str, **labels: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    return name, tuple(sorted(labels.items()))


ROUTE_METRICS = {
    key("rmqfast_requests_total", role="namesrv", code="105", result="success"): 127.0,
    key("rmqfast_route_rewrites_total", code="105"): 90.0,
    key("rmqfast_responses_total", role="namesrv", code="17"): 37.0,
    key("rmqfast_responses_total", role="namesrv", code="0"): 90.0,
}


def _report(tmp_path: Path, queries: int, absent: int) -> dict[str, str]:
    tables = tmp_path / "tables"
    tables.mkdir(exist_ok=True)
    (tables / "agg_requests_by_code.csv").write_text(
        f"role,code,count,bytes\nnamesrv,105,{queries},9000\nbroker,310,4000,100\nnamesrv,106,3,10\n")
    (tables / "agg_responses_by_code.csv").write_text(
        f"role,code,count,errors,expected\nnamesrv,17,{absent},0,{absent}\nnamesrv,0,90,0,0\nbroker,17,5,5,0\n")
    (tmp_path / "report.html").write_text("<html>")
    return {"report": str(tmp_path / "report.html")}


def _rows(out: str) -> dict[str, list[str]]:
    """Route table rows: name -> [count, report, counter...]."""
    rows = {}
    for ln in out.splitlines():
        for name in ("route queries", "rewritten (brokers -> rmqfast endpoints)",
                     "answered TOPIC_NOT_EXIST (17), unchanged", "other answers (not rewritten, not 17)"):
            if ln.strip().startswith(name):
                rows[name] = ln.strip()[len(name):].split()
    return rows


def test_route_counts_add_up_name_their_counters_and_match_the_report(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert print_metrics(ROUTE_METRICS, _report(tmp_path, 127, 37))
    out = capsys.readouterr().out
    rows = _rows(out)
    assert rows["route queries"][:3] == ["127", "127", 'rmqfast_requests_total{role="namesrv",code="105"}']
    assert rows["rewritten (brokers -> rmqfast endpoints)"][:3] == [
        "90", "-", 'rmqfast_route_rewrites_total{code="105"}']
    assert rows["answered TOPIC_NOT_EXIST (17), unchanged"][:3] == [
        "37", "37", 'rmqfast_responses_total{role="namesrv",code="17"}']
    assert rows["other answers (not rewritten, not 17)"][:2] == ["0", "-"]  # 90 + 37 + 0 == 127
    assert "one scrape after the traffic stopped" in out
    assert "by result (the result label of rmqfast_requests_total): success 127" in out
    assert "TOPIC_NOT_EXIST" in out and "normal, not errors" in out and "DISAGREES" not in out


def test_a_report_that_disagrees_is_said_and_fails_the_demo(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    assert not print_metrics(ROUTE_METRICS, _report(tmp_path, 129, 37))  # the report counted 2 more
    assert "THE REPORT DISAGREES" in capsys.readouterr().out
    assert print_metrics(ROUTE_METRICS, None)  # no report: the scrape alone, nothing to compare
    assert _rows(capsys.readouterr().out)["route queries"][:2] == ["127", "-"]


def test_counts_come_from_one_scrape_after_every_worker_published_twice() -> None:
    """The scrape: counters keep moving until the workers published after the traffic stopped;
    the figures are all read from the first scrape in which each worker published twice since."""
    scrapes = []

    def scrape() -> dict:
        n = len(scrapes)
        m = {
            key("rmqfast_worker_publishes_total", worker="0"): float(10 + n),
            key("rmqfast_worker_publishes_total", worker="1"): float(20 + n // 2),  # slower
            key("rmqfast_requests_total", role="namesrv", code="105"): float(100 + min(n, 3)),
            key("rmqfast_route_rewrites_total", code="105"): float(70 + min(n, 3)),
            key("rmqfast_responses_total", role="namesrv", code="17"): 30.0,
        }
        scrapes.append(m)
        return m

    got = settled_metrics(scrape, timeout=30.0, poll=0.0)
    assert got is scrapes[-1] and len(scrapes) == 5  # worker 1 published twice since the first scrape
    counts = route_counts(got)
    assert counts == {"route queries": 103.0, "rewritten (brokers -> rmqfast endpoints)": 73.0,
                      "answered TOPIC_NOT_EXIST (17), unchanged": 30.0}


def test_settled_metrics_gives_up_after_its_timeout(capsys: pytest.CaptureFixture[str]) -> None:
    frozen = {key("rmqfast_worker_publishes_total", worker="0"): 3.0}
    assert settled_metrics(lambda: frozen, timeout=0.0, poll=0.0) is frozen
    assert "did not publish twice" in capsys.readouterr().out


def test_report_route_counts_reads_the_report_tables(tmp_path: Path) -> None:
    assert report_route_counts(_report(tmp_path, 112, 29)) == {
        "route queries": 112.0, "answered TOPIC_NOT_EXIST (17), unchanged": 29.0}
    assert report_route_counts(None) == {}
