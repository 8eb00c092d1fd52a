"""``rmqfast bench --hostile`` works end to end in its smallest form (not a speed or memory test),
and what it computes from its probes (silences, the truth of health, RSS budget) is right."""

from __future__ import annotations

import json
import os
import shutil
import socket
import threading
import time
from pathlib import Path

import pytest

from rmqfast.bench import cli as bench_cli
from rmqfast.bench import hostile_report as rep
from rmqfast.bench.hostile import grpc_available
from rmqfast.bench.hostile_attack import Attacker, Plan

needs_cc = pytest.mark.skipif(shutil.which(os.environ.get("CC", "gcc")) is None, reason="needs a C compiler")


@needs_cc
def test_hostile_bench_smallest_form(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = bench_cli.main(["--hostile", "--rate", "1000", "--steady-conns", "2", "--duration", "1.5", "--warmup", "0.3",
                         "--idle-conns", "30", "--idle-per-process", "15", "--exhaust", "20", "--slowloris", "6",
                         "--half-prefaces", "6", "--admin-clients", "2", "--admin-rate", "40", "--recovery", "1",
                         "--results", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc in (0, 1), out  # 1: a goal missed on this (loaded) machine; 2 would be a bench that could not run
    rows = [json.loads(line) for f in tmp_path.glob("*-hostile.jsonl") for line in f.read_text().splitlines()]
    (s,) = [r for r in rows if r["kind"] == "hostile-summary"]
    goals = [r for r in rows if r["kind"] == "hostile-goal"]
    assert [g["what"] for g in goals] == [g["what"] for g in s["goals"]] and len(goals) >= 8
    assert all(g["met"] in (True, False, None) for g in goals)
    kinds = {a["kind"]: a for a in s["attackers"]}
    want = {"idle", "exhaust", "slowloris", "http-slowloris", "admin-flood"} | ({"half-preface"}
                                                                               if grpc_available() else set())
    assert set(kinds) == want
    assert sum(a["opened"] for a in s["attackers"] if a["kind"] == "idle") == 30
    for a in s["attackers"]:
        assert a["opened"] > 0, a
    assert kinds["admin-flood"]["codes"], kinds["admin-flood"]
    listeners = {"broker", "namesrv", "admin"} | ({"grpc"} if grpc_available() else set())
    assert set(s["listeners"]) == listeners
    for name, phases in s["listeners"].items():
        assert phases["quiet"]["answered"] > 0, (name, phases)
        assert phases["recovery"]["probes"] > 0, (name, phases)
    for run in ("quiet", "attack", "quiet_after"):
        assert s["steady"][run]["sent"] > 0 and s["steady"][run]["ok"] > 0, s["steady"][run]
    assert s["healthz"]["probes"] > 0 and s["readyz"]["probes"] > 0
    assert s["rss"]["peak_rss_mib"] > 0 and s["rss"]["max_fds"] > s["rss"]["base_fds"]
    assert "goals:" in out and ("PASS" in out or "FAIL" in out)


def test_silent_gap_and_recovery() -> None:
    # probes [start, answered at | None, status]: answers at 0.1, 0.2, then none until 1.7
    recs = [[0.05, 0.1, "frame"], [0.15, 0.2, "frame"], [0.3, None, "timeout"], [0.8, None, "timeout"],
            [1.65, 1.7, "frame"], [1.95, None, "unfinished"]]
    g = rep.silent_gap(recs, 0.0, 2.0)
    assert g["longest_silent_s"] == pytest.approx(1.5) and g["silent_from"] == pytest.approx(0.2)
    assert g["probes"] == 5 and g["answered"] == 3 and g["unanswered_by_reason"] == {"timeout": 2}
    assert rep.recovery_s(recs, 0.5) == pytest.approx(1.2)
    assert rep.recovery_s(recs, 1.8) is None
    # nothing answered at all: the whole window is one silence
    assert rep.silent_gap([[0.1, None, "connect: ECONNREFUSED"]], 0.0, 3.0)["longest_silent_s"] == 3.0


def test_health_truth() -> None:
    alive = [(0.0, True), (5.0, False)]
    hz = [[1.0, 1.01, [200, "{}"]], [2.0, 2.01, [503, '{"error": "too many"}']], [3.0, None, "timeout"],
          [6.0, 6.01, [200, "{}"]]]
    h = rep.healthz_truth(hz, alive, 0.0, 10.0)
    assert h == {"probes": 4, "ok_200": 2, "refused_or_503": 1, "unanswered": 1, "false": 3}
    broker = [[t / 10, t / 10 + 0.01, "frame"] for t in range(0, 20)]
    broker += [[t / 10, None, "timeout"] for t in range(20, 40)]
    ready = [[1.0, 1.01, [200, '{"ready": true}']], [3.0, 3.01, [200, '{"ready": true}']],
             [3.5, 3.51, [503, '{"ready": false, "reason": "cannot accept"}']],
             [1.5, 1.51, [503, '{"error": "too many admin connections"}']]]
    r = rep.readyz_truth(ready, {"broker": broker}, 0.0, 10.0)
    assert (r["ready"], r["not_ready"], r["false_ready"], r["false_not_ready"]) == (2, 2, 1, 1)
    assert r["present"] is True and r["reasons"] == {"cannot accept": 1, "refused: too many admin connections": 1}
    assert rep.readyz_truth([[1.0, 1.01, [404, "{}"]]], {"broker": broker}, 0.0, 10.0)["present"] is False


def test_rss_budget() -> None:
    base = 100
    ok = [{"t": 1.0, "rss_kib": 50 * 1024, "fds": base}, {"t": 2.0, "rss_kib": 60 * 1024, "fds": base + 20000}]
    v = rep.rss_verdict(ok, base)
    assert v["worst"]["over_bytes"] < 0 and v["peak_rss_mib"] == 60.0
    bad = [*ok, {"t": 3.0, "rss_kib": 80 * 1024, "fds": base + 2000}]  # 1,000 held: budget ~63.1 MiB
    v = rep.rss_verdict(bad, base)
    assert v["worst"]["held_conns"] == 1000 and v["worst"]["over_bytes"] > 0


def test_attacker_counts_what_the_server_closes() -> None:
    """A half-preface attacker against a server that closes every connection after 0.3 s: each close is
    counted with how long the connection lived, and the attacker connects again."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)
    srv.settimeout(0.2)
    stop = threading.Event()
    got: list[bytes] = []

    def serve() -> None:
        held: list[tuple[float, socket.socket]] = []
        while not stop.is_set():
            try:
                c, _ = srv.accept()
                c.settimeout(1.0)
                got.append(c.recv(64))
                held.append((time.monotonic(), c))
            except OSError:
                pass
            for t, c in [h for h in held if time.monotonic() - h[0] >= 0.3]:
                c.close()
                held.remove((t, c))
        for _t, c in held:
            c.close()

    th = threading.Thread(target=serve, daemon=True)
    th.start()
    try:
        res = Attacker(Plan("half-preface", [srv.getsockname()[1]], 3, ["127.0.0.81"], 2.0, retry=0.1)).run()
    finally:
        stop.set()
        th.join(5)
        srv.close()
    assert res["final"] and res["opened"] >= 6 and res["peer_closed"] >= 3, res
    assert 0.25 <= res["closed_after_s"]["p50"] <= 1.5, res
    assert got and all(g == b"PRI * HTTP" for g in got if g)


def _lg(responses: int, *, bad: int = 0, lost: int = 0, skipped: int = 0, outstanding: int = 0) -> dict:
    lat = {"p50": 300.0, "p99": 900.0, "p999": 2000.0, "max": 5000.0}
    return {"sent": responses + lost + outstanding, "responses": responses, "rate": 1000.0, "skipped": skipped,
            "outstanding_at_end": outstanding, "rps": responses / 10, "errors": bad + lost, "resp_codes": {},
            "error_detail": {"bad_code": bad, "lost": lost, "conn_closed": 0, "protocol": 0, "unmatched": 0},
            "lat_us": lat}


def test_steady_success_counts_every_way_a_request_fails() -> None:
    # the normal in-flight tail (under one second of the rate) is no failure
    assert rep.steady(_lg(10000, outstanding=40))["success"] == 1.0
    # answered with an error code, lost, or never sent on a dead connection: all failures
    s = rep.steady(_lg(10000, bad=10, lost=5, skipped=5))
    assert s["failed"] == 20 and s["success"] == pytest.approx(9990 / 10010)
    # stalled at the end: what is in flight beyond one second's worth of the rate fails
    s = rep.steady(_lg(10000, outstanding=3000))
    assert s["failed"] == 2000 and s["success"] == pytest.approx(10000 / 12000)
    assert s["p99_ms"] == 0.9
