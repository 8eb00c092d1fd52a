"""Traffic record writers: the Parquet encoder, rotation, atomic rename, schema, sampling."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest

from rmqfast import config as config_mod
from rmqfast.codec import ScanStatsPy, code_slot
from rmqfast.config import RecordsSection
from rmqfast.errors import ConfigError
from rmqfast.records import AGG_COLUMNS, SAMPLE_COLUMNS, StatsDelta, TrafficRecorder
from rmqfast.records.parquet import Column, ParquetWriter, check_file, write_table
from rmqfast.records.recorder import _Sampler
from rmqfast.records.writer import RotatingWriter, read_jsonl

pq = pytest.importorskip("pyarrow.parquet")

COLS = [Column("i", "int32"), Column("l", "int64"), Column("d", "double"), Column("s", "string"),
        Column("nd", "double", nullable=True), Column("ns", "string", nullable=True)]


@pytest.mark.parametrize("codec", ["gzip", "none"])
def test_parquet_round_trip(tmp_path: Path, codec: str) -> None:
    n = 1000
    data = {"i": [i - 500 for i in range(n)], "l": [i * 2**33 for i in range(n)], "d": [i / 3 for i in range(n)],
            "s": [f"topic-{i % 7}-é" for i in range(n)], "nd": [None if i % 3 else float(i) for i in range(n)],
            "ns": [None if i % 5 == 0 else str(i) for i in range(n)]}
    p = tmp_path / "t.parquet"
    write_table(p, COLS, data, codec=codec, metadata={"rmqfast.schema": "x/1"}, row_group_rows=300)
    f = pq.ParquetFile(p)
    assert f.metadata.num_rows == n and f.metadata.num_row_groups == 4
    assert f.schema_arrow.metadata[b"rmqfast.schema"] == b"x/1"
    assert [str(t) for t in f.schema_arrow.types] == ["int32", "int64", "double", "string", "double", "string"]
    assert f.read().to_pydict() == data


def test_incomplete_parquet_is_detected(tmp_path: Path) -> None:
    p = tmp_path / "open.parquet"
    with open(p, "wb") as fh:
        w = ParquetWriter(fh, COLS[:2])
        w.write_row_group({"i": [1, 2], "l": [3, 4]})
        fh.flush()
        raw = p.read_bytes()
        assert check_file(raw[:4], raw[-8:], len(raw)) is not None  # no footer yet
        w.close()
    raw = p.read_bytes()
    assert check_file(raw[:4], raw[-8:], len(raw)) is None
    cut = raw[: len(raw) // 2]
    assert "footer" in (check_file(cut[:4], cut[-8:], len(cut)) or "")


def test_rotation_by_bytes_and_atomic_rename(tmp_path: Path) -> None:
    w = RotatingWriter(tmp_path, "agg-test", COLS[:4], rotate_bytes=2000, rotate_seconds=3600, batch_rows=100)
    for i in range(1000):
        w.add((i, i, float(i), f"s{i}"))
    deadline = time.monotonic() + 60  # a bound for a hang of the writer thread
    while len(w.files_written) < 3 and time.monotonic() < deadline:  # the 4th stays open until close()
        time.sleep(0.02)
    # while a file is open only its hidden temporary exists
    tmps = list(tmp_path.glob(".*.tmp"))
    assert all(t.name.startswith(".agg-test-") for t in tmps)
    w.close()
    assert not list(tmp_path.glob(".*"))  # every temporary renamed
    files = sorted(tmp_path.glob("agg-test-*.parquet"))
    assert len(files) >= 4 and files == sorted(w.files_written)
    rows = [r for f in files for r in pq.read_table(f).to_pylist()]
    assert [r["i"] for r in rows] == list(range(1000))  # nothing lost, nothing twice, in order
    assert w.rows_written == 1000 and w.dropped == 0


def test_rotation_by_time(tmp_path: Path) -> None:
    w = RotatingWriter(tmp_path, "sample-t", COLS[:2], rotate_seconds=0.3, fmt="jsonl")
    w.add((1, 1))
    w.tick()
    assert not list(tmp_path.glob("sample-t-*"))  # not due yet: nothing visible
    time.sleep(0.35)
    w.tick()
    deadline = time.monotonic() + 60
    while not w.files_written and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(w.files_written) == 1
    w.add((2, 2))
    w.close()
    files = sorted(tmp_path.glob("sample-t-*.jsonl"))
    assert len(files) == 2
    assert [read_jsonl(f) for f in files] == [[{"i": 1, "l": 1}], [{"i": 2, "l": 2}]]


def _section(tmp_path: Path, **kw: object) -> RecordsSection:
    return RecordsSection(enabled=True, dir=str(tmp_path), **kw)  # type: ignore[arg-type]


def test_aggregates_schema_and_deltas(tmp_path: Path) -> None:
    st = ScanStatsPy()
    rec = TrafficRecorder(_section(tmp_path), 3, host="h1")
    delta = StatsDelta("broker", st)
    s310 = code_slot(310)
    st.request_counts[s310] += 10
    st.request_bytes[s310] += 12000
    st.response_counts[code_slot(0)] += 9
    st.response_counts[code_slot(2)] += 1
    st._topic_slot(b"TopicA")[:] = [10, 12, 0, 12000]
    st.frames, st.bytes = 20, 15000
    rec.add_aggregates(delta.take(), now=1000.0)
    st.request_counts[s310] += 5
    st.request_bytes[s310] += 6000
    rec.add_aggregates(delta.take(), now=1001.0)
    rec.add_aggregates(delta.take(), now=1002.0)  # nothing new: no rows
    rec.latency("broker", 310, "TopicA", 420)
    rec.latency("broker", 310, "TopicA", 40_000_000)
    st.observe(code_slot(11), 2_000_000, 0)  # a pull timed by the scanner: 2 ms
    rec.add_aggregates(delta.take(), now=1003.0)
    rec.close()
    (f,) = (tmp_path / "agg").glob("agg-v1-h1-w3-*.parquet")
    t = pq.read_table(f)
    assert t.column_names == [c.name for c in AGG_COLUMNS]
    assert pq.ParquetFile(f).schema_arrow.metadata[b"rmqfast.schema"] == b"rmqfast-records/agg/1"
    rows = t.to_pylist()
    assert all(r["v"] == 1 and r["host"] == "h1" and r["worker"] == 3 for r in rows)
    req = [(r["ts"], r["count"], r["bytes"]) for r in rows if r["kind"] == "request"]
    assert req == [(1000, 10, 12000), (1001, 5, 6000)]
    resp = {r["code"]: (r["count"], r["errors"]) for r in rows if r["kind"] == "response"}
    assert resp == {0: (9, 0), 2: (1, 1)}
    (top,) = [r for r in rows if r["kind"] == "topic"]
    assert (top["topic"], top["count"], top["messages"], top["bytes"]) == ("TopicA", 10, 12, 12000)
    (lat,) = [r for r in rows if r["kind"] == "latency" and r["topic"] == "TopicA"]
    assert lat["count"] == 2 and lat["lat_le_500"] == 1 and lat["lat_le_inf"] == 1
    (pull,) = [r for r in rows if r["kind"] == "latency" and r["code"] == 11]
    assert pull["count"] == 1 and pull["lat_le_2500"] == 1 and pull["ts"] == 1003
    assert {r["ts"] for r in rows} == {1000, 1001, 1003}


def test_sampling_rate_honoured() -> None:
    for rate in (0.01, 0.2):
        s = _Sampler(rate, random.Random(7))
        n = 200_000
        hits = 0
        for _ in range(n):
            s.left -= 1
            if s.left <= 0:
                s.left = s._gap()
                hits += 1
        sigma = (n * rate * (1 - rate)) ** 0.5
        assert abs(hits - n * rate) < 5 * sigma, (rate, hits)


def test_sample_records(tmp_path: Path) -> None:
    rec = TrafficRecorder(_section(tmp_path, sample_rate=0.5), 0, host="h", rng=random.Random(1))
    chosen = 0
    for i in range(2000):
        if rec.want_sample():
            chosen += 1
            rec.sample(role="broker", client="10.0.0.1:5000", code=310, topic="T", tag="a", req_size=i,
                       resp_size=10, latency_us=100 + i, resp_code=0, result="ok", ts=1000.0 + i)
    rec.close()
    assert 850 < chosen < 1150
    files = list((tmp_path / "sample").glob("sample-v1-h-w0-*.parquet"))
    t = pq.read_table(files)
    assert t.column_names == [c.name for c in SAMPLE_COLUMNS]
    rows = t.to_pylist()
    assert len(rows) == chosen
    assert all(r["sample_rate"] == 0.5 and r["latency_us"] == 100 + r["req_size"] for r in rows)


def test_no_samples_when_rate_zero(tmp_path: Path) -> None:
    rec = TrafficRecorder(_section(tmp_path), 0)
    assert not any(rec.want_sample() for _ in range(10000))
    rec.close()
    assert not (tmp_path / "sample").exists()
    assert not list((tmp_path / "agg").iterdir())  # no rows: no empty files


def test_records_config() -> None:
    base = {"namesrv": {"upstreams": ["10.0.0.1:9876"]}}
    cfg = config_mod.from_dict({**base, "records": {"enabled": True, "dir": "/x", "sample_rate": 0.25,
                                                    "format": "jsonl", "rotate_seconds": 30, "rotate_bytes": 1 << 20}})
    assert cfg.records == RecordsSection(True, "/x", 30.0, 1 << 20, 0.25, "jsonl")
    assert config_mod.from_json(cfg.to_json()).records == cfg.records
    assert json.loads(cfg.to_json())["records"]["sample_rate"] == 0.25
    for bad, msg in (({"sample_rate": 2}, "records.sample_rate: 2 is not allowed; expected a number from 0"),
                     ({"format": "csv"}, 'records.format: "csv" is not allowed; expected one of parquet, jsonl'),
                     ({"enabled": "yes"}, 'records.enabled: "yes" is not allowed; expected true or false'),
                     ({"rotate_seconds": 0}, "records.rotate_seconds: 0 is not allowed"),
                     ({"colour": 1}, "records.colour: unknown key")):
        with pytest.raises(ConfigError, match=msg.replace("(", r"\(").replace(")", r"\)")):
            config_mod.from_dict({**base, "records": bad})


def test_benchmark_charts_skip_records_without_a_scenario(tmp_path: Path) -> None:
    """Summary rows of other bench modes may lack a scenario: the charts skip them, not crash."""
    pytest.importorskip("matplotlib")
    from rmqfast.analytics.jobs import Result
    from rmqfast.analytics.report import charts

    res = Result(tables={"bench_side_by_side": [
        {"run_id": "r1", "scenario": "send-16x32", "target": "rmqfast", "rps": 1000.0},
        {"run_id": "r1", "scenario": None, "target": "durable", "rps": 900.0},
    ]})
    made = charts(res, tmp_path)
    assert "bench_send_16x32" in made and (tmp_path / "bench_send_16x32.png").exists()
