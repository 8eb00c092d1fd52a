"""The Spark report (local mode): exact counts, percentiles within the documented error,
corrupt/partial files reported and skipped, benchmark comparison, real proxy records."""

from __future__ import annotations

import json
import math
import socketserver
import struct
import threading
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyspark")
np = pytest.importorskip("numpy")
pq = pytest.importorskip("pyarrow.parquet")

from spark_helpers import spark  # noqa: E402, F401

from rmqfast.analytics import analyze  # noqa: E402
from rmqfast.analytics.jobs import ACCURACY, HIST_REL_ERROR, LOG_BINS  # noqa: E402
from rmqfast.analytics.synth import write_aggregates, write_samples  # noqa: E402

pytestmark = pytest.mark.spark

N = 30_000


def _bench_line(run_id: str, scenario: str, target: str, rps: float, p99: float) -> str:
    return json.dumps({"schema": "rmqfast-bench/1", "run_id": run_id, "mode": "short", "kind": "summary",
                       "machine": {"git_commit": "c" + run_id[-1]}, "scenario": scenario, "target": target,
                       "rps": rps, "p50_us": 100.0, "p99_us": p99, "p999_us": 2 * p99, "errors": 0, "runs": 1})


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory, spark: Any) -> dict[str, Any]:  # noqa: F811
    d = tmp_path_factory.mktemp("records")
    files = write_samples(d, N, per_file=N // 3, span_s=600)
    write_aggregates(d, span_s=120, hosts=1, workers=2)
    # damage: a truncated Parquet file, garbage with a good name, a writer's leftover temporary
    good = files[0].read_bytes()
    (d / "sample" / "sample-v1-bad-w0-truncated.parquet").write_bytes(good[: len(good) // 2])
    (d / "sample" / "sample-v1-bad-w0-garbage.parquet").write_bytes(b"not parquet at all" * 10)
    (d / "sample" / ".sample-v1-bad-w0-crashed.parquet.tmp").write_bytes(good[:1000])
    # a JSON-lines sample file with one corrupt line (counted: 2 good rows)
    from rmqfast.records.schema import SAMPLE_COLUMNS

    names = [c.name for c in SAMPLE_COLUMNS]
    row = dict(zip(names, [1, 1.7e9 + 5, "jh", 0, "broker", "1.1.1.1:1", 310, "JsonTopic", "", 10, 5, 777, 0, "ok",
                           1.0], strict=True))
    (d / "sample" / "sample-v1-jh-w0-x.jsonl").write_text(json.dumps(row) + "\n{broken json\n" + json.dumps(row) + "\n")
    bench = d / "bench"
    bench.mkdir()
    lines = []
    for i, (rr, p99) in enumerate(((100000, 500), (102000, 480), (80000, 900))):  # third run regresses
        rid = f"2026010{i}T000000Z-abc{i}"
        lines += [_bench_line(rid, "send", "rmqfast", rr, p99), _bench_line(rid, "send", "direct", 200000, 300),
                  _bench_line(rid, "send", "haproxy", 125000, 400)]
    (bench / "bench-1.jsonl").write_text("\n".join(lines[:6]) + "\n")
    (bench / "bench-2.jsonl").write_text("\n".join(lines[6:]) + "\n{truncated line\n")
    out = d.parent / "report"
    summary = analyze([str(d)], out, spark=spark, quiet=True)
    tables = {p.stem: pq.read_table(p).to_pylist() for p in (out / "tables").glob("*.parquet")}
    return {"dir": d, "files": files, "summary": summary, "tables": tables, "out": out}


def _exact(values: Any, q: float) -> float:
    s = np.sort(np.asarray(values))
    return float(s[max(1, math.ceil(q * len(s))) - 1])


def test_report_files(generated: dict[str, Any]) -> None:
    out = generated["out"]
    html = (out / "report.html").read_text()
    assert "Input problems" in html and "Benchmarks" in html
    for name in ("agg_topic_msgs", "sample_topic", "latency_code", "agg_spill", "agg_limiter", "bench_send"):
        assert (out / "charts" / f"{name}.png").stat().st_size > 1000, name
        assert f"charts/{name}.png" in html
    assert (out / "tables" / "latency_by_code_topic.csv").read_text().startswith("code,topic,records")


def test_corrupt_and_partial_files_reported_and_skipped(generated: dict[str, Any]) -> None:
    probs = {Path(p["file"]).name: p["problem"] for p in generated["summary"]["problems"]}
    assert "footer" in probs["sample-v1-bad-w0-truncated.parquet"]
    assert "magic" in probs["sample-v1-bad-w0-garbage.parquet"]
    assert "incomplete" in probs[".sample-v1-bad-w0-crashed.parquet.tmp"]
    assert probs["sample-v1-jh-w0-x.jsonl"] == "1 corrupt sample line(s) skipped"
    assert probs["bench-2.jsonl"] == "1 corrupt benchmark line(s) skipped"
    assert len(probs) == 5


def test_sample_counts_exact(generated: dict[str, Any]) -> None:
    t, c = generated["tables"], generated["summary"]["counts"]
    assert c["sample_records"] == N + 2
    assert sum(r["records"] for r in t["sample_throughput_topic"]) == N + 2
    assert sum(r["records"] for r in t["sample_throughput_worker"]) == N + 2
    cols = pq.read_table(generated["files"]).to_pydict()
    codes, counts = np.unique(np.array(cols["code"]), return_counts=True)
    by_code: dict[int, int] = {}
    for r in t["sample_results_by_code"]:
        by_code[r["code"]] = by_code.get(r["code"], 0) + r["records"]
    expect = dict(zip(codes.tolist(), counts.tolist(), strict=True))
    expect[310] += 2
    assert by_code == expect
    errors = sum(1 for x in cols["result"] if x != "ok")
    assert sum(r["est_errors"] for r in t["sample_results_over_time"]) == errors


def test_sample_percentiles_within_documented_error(generated: dict[str, Any]) -> None:
    cols = pq.read_table(generated["files"]).to_pydict()
    code = np.array(cols["code"])
    lat = np.array(cols["latency_us"])
    topic = np.array(cols["topic"], dtype=object)
    rows = {(r["code"], r["topic"]): r for r in generated["tables"]["latency_by_code_topic"]}
    checked = 0
    for (c, tp), r in rows.items():
        sel = (code == c) & (topic == tp) & (lat >= 0)
        if tp == "JsonTopic":
            continue
        assert r["records"] == int(sel.sum())
        for q, col in ((0.5, "p50_us"), (0.99, "p99_us"), (0.999, "p999_us")):
            exact = _exact(lat[sel], q)
            assert abs(r[col] - exact) <= max(1.0, exact * HIST_REL_ERROR), (c, tp, q, r[col], exact)
            checked += 1
    assert checked > 100 and LOG_BINS == 200


def test_approx_percentiles_rank_error(generated: dict[str, Any], spark: Any, tmp_path: Path) -> None:  # noqa: F811
    s = analyze([str(p) for p in generated["files"]], tmp_path, spark=spark, quiet=True, percentiles="approx")
    assert s["counts"]["sample_records"] == N
    lat = np.array(pq.read_table(generated["files"]).to_pydict()["latency_us"])
    lat = np.sort(lat[lat >= 0])
    (overall,) = pq.read_table(tmp_path / "tables" / "latency_overall.parquet").to_pylist()
    n = len(lat)
    for q, col in ((0.5, "p50_us"), (0.99, "p99_us"), (0.999, "p999_us")):
        lo = lat[max(0, math.floor((q - 1 / ACCURACY) * n) - 1)]
        hi = lat[min(n - 1, math.ceil((q + 1 / ACCURACY) * n))]
        assert lo <= overall[col] <= hi, (q, overall[col], lo, hi)


def test_aggregate_counts_exact(generated: dict[str, Any]) -> None:
    t = generated["tables"]
    agg = pq.read_table(list((generated["dir"] / "agg").glob("*.parquet"))).to_pydict()
    kind = np.array(agg["kind"])
    msgs = np.array(agg["messages"])
    assert sum(r["messages"] for r in t["agg_throughput_topic"]) == int(msgs[kind == "topic"].sum())
    req = np.array(agg["count"])[kind == "request"].sum()
    assert sum(r["count"] for r in t["agg_requests_by_code"]) == int(req)
    rej = np.array(agg["limiter_rejected"]).sum()
    assert sum(r["limiter_rejected"] for r in t["agg_limiter_over_time"]) == int(rej)
    assert t["agg_spill_over_time"] and all(r["spill_backlog"] > 0 for r in t["agg_spill_over_time"])
    (h,) = t["agg_latency_hist"]
    # bucket mass 5% <=100, 20% <=250, 40% <=500, 20% <=1000, 10% <=2500, 3% <=5000, 1% <=10000 ...:
    # p50 in (250, 500]; p99 at the 99 % boundary after the <=10000 bucket: (5000, 25000]
    assert h["code"] == 310 and 250 < h["p50_us"] <= 500 and 5000 < h["p99_us"] <= 25000


def test_bench_side_by_side_and_regressions(generated: dict[str, Any]) -> None:
    t = generated["tables"]
    side = {(r["run_id"][-1], r["target"]): r for r in t["bench_side_by_side"]}
    assert side[("0", "rmqfast")]["vs_direct"] == pytest.approx(0.5)
    assert side[("0", "rmqfast")]["vs_best_haproxy"] == pytest.approx(0.8)
    flagged = [(r["run_id"][-1], r["target"]) for r in t["bench_history"] if r["regression"]]
    assert flagged == [("2", "rmqfast")]
    (r,) = [r for r in t["bench_history"] if r["regression"]]
    assert "throughput -21%" in r["regression"] and "p99" in r["regression"]


# Real records from a short proxy run --------------------------------------------------------


class _FakeNamesrv(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


class _Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        from rmqfast.codec.command import decode_frame, encode, make_response

        sock = self.request
        buf = b""
        while True:
            data = sock.recv(65536)
            if not data:
                return
            buf += data
            while len(buf) >= 4:
                (n,) = struct.unpack(">i", buf[:4])
                if len(buf) < 4 + n:
                    break
                frame, buf = buf[: 4 + n], buf[4 + n:]
                cmd = decode_frame(frame)
                sock.sendall(encode(make_response(cmd, 0)))


def test_real_records_from_proxy_run(tmp_path: Path, spark: Any) -> None:  # noqa: F811
    from rmqfast.codec.command import RemotingCommand, encode
    from rmqfast.testing.proxy import ProxyProcess

    srv = _FakeNamesrv(("127.0.0.1", 0), _Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    rec_dir = tmp_path / "records"
    sent = 60
    try:
        with ProxyProcess([f"127.0.0.1:{srv.server_address[1]}"], workers=1,
                          records={"dir": str(rec_dir), "rotate_seconds": 1, "sample_rate": 0.5}) as proxy:
            import socket

            with socket.create_connection(("127.0.0.1", proxy.namesrv_port), timeout=10) as c:
                for i in range(sent):
                    c.sendall(encode(RemotingCommand(code=101, opaque=i + 1,
                                                     ext_fields={"namespace": "N", "key": f"k{i}"})))
                    hdr = b""
                    while len(hdr) < 4:
                        hdr += c.recv(4 - len(hdr))
                    (n,) = struct.unpack(">i", hdr)
                    got = 0
                    while got < n:
                        got += len(c.recv(n - got))
            assert proxy.stop() == 0
            s = analyze([str(rec_dir)], tmp_path / "report", spark=spark, quiet=True)
    finally:
        srv.shutdown()
    assert s["problems"] == []
    t = {p.stem: pq.read_table(p).to_pylist() for p in (tmp_path / "report" / "tables").glob("*.parquet")}
    req = {(r["role"], r["code"]): r["count"] for r in t["agg_requests_by_code"]}
    assert req[("namesrv", 101)] == sent
    resp = {(r["role"], r["code"]): r["count"] for r in t["agg_responses_by_code"]}
    assert resp[("namesrv", 0)] == sent
    # the scanners timed every request (C counters -> per-second histogram rows) ...
    hist = [r for r in t["agg_latency_hist"] if r["role"] == "namesrv" and r["code"] == 101]
    assert sum(r["count"] for r in hist) == sent
    # ... and picked one in two as a per-request record, with the client's address
    assert s["counts"]["sample_records"] == sent // 2
    (client,) = t["sample_top_clients"]
    assert client["client"].startswith("127.0.0.1:")
    (lat,) = [r for r in t["latency_by_code"] if r["code"] == 101]
    assert 0 < lat["p50_us"] <= lat["p99_us"] < 1_000_000


def test_spark3_semantics_kept_on_spark4(spark: Any) -> None:  # noqa: F811
    """Spark 4 turned ANSI mode on by default, under which one overflowing value in a damaged
    file aborts the whole job; the session keeps Spark 3's semantics (the value does not raise)."""
    from pyspark.sql import functions as F

    from rmqfast.analytics.jobs import _bucket_col

    df = spark.createDataFrame([(float("inf"),), (7.0,)], "ts double")
    rows = df.select(_bucket_col(F.col("ts"), 5).alias("b")).collect()  # raised ARITHMETIC_OVERFLOW
    assert len(rows) == 2 and rows[1]["b"] == 5


@pytest.mark.parametrize("percentiles", ["hist", "approx"])  # hist: the small-input path; approx: the general one
def test_records_whose_timestamp_is_not_a_time_are_reported_and_skipped(
        tmp_path: Path, spark: Any, percentiles: str) -> None:  # noqa: F811
    from rmqfast.analytics.synth import sample_columns
    from rmqfast.records.parquet import write_table
    from rmqfast.records.schema import SAMPLE_COLUMNS, SAMPLE_VERSION, schema_tag

    d = tmp_path / "records"
    write_samples(d, 2000, per_file=2000, span_s=60)
    cols = sample_columns(10, seed=9, span_s=60)
    cols["ts"][:4] = [float("inf"), float("nan"), -float("inf"), 1e300]  # a damaged file's values
    write_table(d / "sample" / f"sample-v{SAMPLE_VERSION}-bad-w0-00001.parquet", SAMPLE_COLUMNS, cols,
                codec="gzip", metadata={"rmqfast.schema": schema_tag("sample")})
    s = analyze([str(d)], tmp_path / "report", spark=spark, quiet=True, percentiles=percentiles)
    assert s["problems"] == [{"file": "sampled records", "problem": "4 sampled record(s) whose timestamp is not a "
                              "time (NaN, infinite, negative or past 1e+10 s) skipped"}]
    assert s["counts"]["sample_records"] == 2006
    t = {p.stem: pq.read_table(p).to_pylist() for p in (tmp_path / "report" / "tables").glob("*.parquet")}
    assert sum(r["records"] for r in t["sample_throughput_topic"]) == 2006
    assert all(0 <= r["bucket"] <= 2e9 for r in t["sample_throughput_topic"])
    assert sum(r["records"] for r in t["latency_by_code"]) <= 2006
