"""Gray releases: the supervisor's backlog watch (rmqfast.gray.watch): the backlog metric, a promote
ended by its drain (the committed offsets of the gray queues at the marks taken when it was seen, while
the gray producers keep sending) or by the drain timeout, the outcome in the state file, the status and
over HTTP."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from rmqfast import config as config_mod
from rmqfast.config import HostPort
from rmqfast.errors import ConfigError
from rmqfast.gray.admin import render, view
from rmqfast.gray.config import parse_gray
from rmqfast.gray.rules import Phase, phase
from rmqfast.gray.state import mark_drain, read_commands, set_marks, write_command
from rmqfast.gray.watch import GrayWatch
from rmqfast.server.admin import AdminServer
from tests.test_gray import Clock

G = "orders-cg"
T = "orders"


class Brokers:
    """What gray_backlog would read: per gray queue its backlog, or an error."""

    def __init__(self) -> None:
        self.backlog = {("broker-a", 3): 5, ("broker-b", 3): 0}
        self.max: dict[tuple[str, int], int] = {}  # max offset per queue (default 100)
        self.error: str | None = None
        self.reads = 0

    def __call__(self, grp: Any, namesrvs: list[str]) -> dict[str, Any]:
        self.reads += 1
        assert namesrvs == ["127.0.0.1:9876"] and grp.group == G
        if self.error:
            return {"error": self.error, "queues": []}
        rows = [{"topic": T, "broker": b, "queue": q, "max": self.max.get((b, q), 100),
                 "committed": self.max.get((b, q), 100) - n, "backlog": n}
                for (b, q), n in sorted(self.backlog.items())]
        return {"queues": rows, "total": sum(self.backlog.values())}


def make(tmp_path: Path, **gray: Any) -> tuple[config_mod.Config, GrayWatch, Clock, Brokers]:
    g = {"settle": 5, "drain_timeout": 60, "backlog_interval": 10,
         "group": [{"group": G, "topics": [T], "clients": ["*@canary*"]}], **gray}
    cfg = config_mod.from_dict({"namesrv": {"upstreams": ["127.0.0.1:9876"]}, "proxy": {"state_dir": str(tmp_path)},
                                "gray": g})
    clock, brokers = Clock(), Brokers()
    return cfg, GrayWatch(lambda: cfg, backlog=brokers, clock=clock), clock, brokers


def samples(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(text.decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def backlog_of(text: bytes, broker: str) -> float:
    return samples(text)[("rmqfast_gray_backlog_messages",
                          (("broker", broker), ("group", G), ("queue", "3"), ("topic", T)))]


def test_backlog_metric_per_group_topic_broker_queue(tmp_path: Path) -> None:
    cfg, w, clock, brokers = make(tmp_path)
    text = w.metrics_text()
    assert samples(text)[("rmqfast_gray_backlog_read_age_seconds", (("group", G),))] == -1.0  # not read yet
    assert w.step() == 10.0  # no command under way: the configured interval
    clock.t += 2
    text = w.metrics_text()
    assert backlog_of(text, "broker-a") == 5.0 and backlog_of(text, "broker-b") == 0.0
    s = samples(text)
    assert s[("rmqfast_gray_backlog_read_age_seconds", (("group", G),))] == 2.0
    assert s[("rmqfast_gray_drain", (("group", G),))] == 0.0
    brokers.error = "cannot connect to 127.0.0.1:1: refused"  # a failed read keeps the last one, counted
    w.step()
    s = samples(w.metrics_text())
    assert s[("rmqfast_gray_backlog_read_errors_total", (("group", G),))] == 1.0
    assert backlog_of(w.metrics_text(), "broker-a") == 5.0
    assert w.view(G) == {"queues": w.view(G)["queues"], "total": 5, "age": 2.0}  # type: ignore[index]


def test_promote_ends_when_the_commits_reach_the_marks_while_gray_sends_go_on(tmp_path: Path) -> None:
    cfg, w, clock, brokers = make(tmp_path)
    path = tmp_path / "gray.json"
    write_command(path, G, "promote", now=clock.t)
    at = clock.t
    brokers.error = "cannot connect"  # no complete read: no marks yet
    clock.t = at + 0.5
    assert w.step() == 1.0  # a drain under way: read every second
    assert "marks" not in read_commands(path)[G]
    brokers.error = None
    brokers.backlog = {("broker-a", 3): 0, ("broker-b", 3): 0}
    clock.t = at + 1  # the first complete read: each gray queue's max offset is its mark
    w.step()
    c = read_commands(path)[G]
    assert c["marks"] == [{"topic": T, "broker": "broker-a", "queue": 3, "offset": 100},
                          {"topic": T, "broker": "broker-b", "queue": 3, "offset": 100}]
    assert "drain" not in c  # at the marks, but within the settle
    assert samples(w.metrics_text())[("rmqfast_gray_drain", (("group", G),))] == 1.0
    assert samples(w.metrics_text())[("rmqfast_gray_phase", (("group", G),))] == 1.0  # promoting
    brokers.max = {("broker-a", 3): 103, ("broker-b", 3): 100}  # the gray producers go on sending
    brokers.backlog = {("broker-a", 3): 5, ("broker-b", 3): 0}  # committed 98 < mark 100
    clock.t = at + 6
    w.step()
    c = read_commands(path)[G]
    assert "drain" not in c and phase("promote", at, clock.t, 5, None, 60) is Phase.PROMOTING  # past the settle
    v = view(cfg, now=clock.t, watch=w)["groups"][0]
    assert v["drain"] == "draining" and v["drain_left"] == 2 and v["drain_marks"] == c["marks"]
    assert "2 message(s) below the marks not committed" in render(view(cfg, now=clock.t, watch=w))
    brokers.max = {("broker-a", 3): 110, ("broker-b", 3): 104}
    brokers.backlog = {("broker-a", 3): 9, ("broker-b", 3): 4}  # never 0 while sends go on: committed 101, 100
    clock.t = at + 9
    w.step()
    c = read_commands(path)[G]
    assert c["drain"] == "drained" and c["drained_at"] == at + 9 and c["backlog"] == 0
    assert phase("promote", at, at + 8.9, 5, c["drained_at"], 60) is Phase.PROMOTING
    assert phase("promote", at, at + 9, 5, c["drained_at"], 60) is Phase.PROMOTED  # what the workers see
    assert samples(w.metrics_text())[("rmqfast_gray_drain", (("group", G),))] == 2.0
    assert samples(w.metrics_text())[("rmqfast_gray_phase", (("group", G),))] == 2.0  # promoted, from the file
    v = view(cfg, now=at + 9.5, watch=w)["groups"][0]
    assert v["phase"] == "promoted" and v["drain"] == "drained" and v["drained_after"] == 9.0
    assert "drained after 9.0 s" in render(view(cfg, now=at + 9.5, watch=w))
    assert w.step() == 10.0  # nothing under way any more


def test_a_marked_queue_not_read_holds_the_drain(tmp_path: Path) -> None:
    cfg, w, clock, brokers = make(tmp_path)
    path = tmp_path / "gray.json"
    write_command(path, G, "promote", now=clock.t)
    at = clock.t
    brokers.backlog = {("broker-a", 3): 0, ("broker-b", 3): 0}
    clock.t = at + 1
    w.step()
    del brokers.backlog[("broker-b", 3)]  # broker-b's queue missing from a read: not known to be committed
    clock.t = at + 6
    w.step()
    assert "drain" not in read_commands(path)[G]
    brokers.backlog = {("broker-a", 3): 0, ("broker-b", 3): 0, ("broker-c", 3): 7}  # a queue added later
    clock.t = at + 7
    w.step()
    assert read_commands(path)[G]["drain"] == "drained"  # its messages came after the marks


def test_promote_ends_at_the_drain_timeout_with_the_backlog_reported(tmp_path: Path) -> None:
    cfg, w, clock, brokers = make(tmp_path)
    path = tmp_path / "gray.json"
    write_command(path, G, "promote", now=clock.t)
    at = clock.t
    clock.t = at + 30
    w.step()
    assert phase("promote", at, clock.t, 5, None, 60) is Phase.PROMOTING
    v = view(cfg, now=clock.t)["groups"][0]
    assert v["drain"] == "draining" and v["drain_timeout_left"] == 30.0
    clock.t = at + 60
    w.step()
    c = read_commands(path)[G]
    assert c["drain"] == "timeout" and c["backlog"] == 5 and "drained_at" not in c
    assert phase("promote", at, clock.t, 5, None, 60) is Phase.PROMOTED  # the workers end it by time
    assert samples(w.metrics_text())[("rmqfast_gray_drain", (("group", G),))] == 3.0
    assert "drain timed out with 5 message(s) left" in render(view(cfg, now=clock.t))


def test_abort_drain_is_reported_and_changes_nothing(tmp_path: Path) -> None:
    cfg, w, clock, brokers = make(tmp_path)
    path = tmp_path / "gray.json"
    write_command(path, G, "abort", now=clock.t)
    at = clock.t
    clock.t = at + 6  # aborted: normal consumers take the gray queues; 5 messages left on broker-a
    w.step()
    assert "drain" not in read_commands(path)[G]
    brokers.backlog = {("broker-a", 3): 0, ("broker-b", 3): 0}
    clock.t = at + 8
    w.step()
    c = read_commands(path)[G]
    assert c["drain"] == "drained" and phase("abort", at, clock.t, 5, c["drained_at"], 60) is Phase.ABORTED
    assert phase("abort", at, at + 4, 5, at + 4, 60) is Phase.ABORTING  # a drain never shortens an abort


def test_a_newer_command_is_not_marked_by_an_older_drain(tmp_path: Path) -> None:
    path = tmp_path / "gray.json"
    write_command(path, G, "promote", now=100.0)
    write_command(path, G, None)  # reset
    assert not mark_drain(path, G, "promote", 100.0, "drained", 110.0, 0)
    write_command(path, G, "promote", now=200.0)
    assert not mark_drain(path, G, "promote", 100.0, "drained", 210.0, 0)  # another promote
    assert mark_drain(path, G, "promote", 200.0, "timeout", 330.0, 4)
    assert not mark_drain(path, G, "promote", 200.0, "drained", 331.0, 0)  # an outcome stays
    assert read_commands(path)[G] == {"action": "promote", "at": 200.0, "drain": "timeout", "backlog": 4}
    mark = [{"topic": T, "broker": "broker-a", "queue": 3, "offset": 7}]
    assert not set_marks(path, G, "promote", 200.0, mark)  # an outcome stays
    write_command(path, G, "promote", now=300.0)
    assert not set_marks(path, G, "promote", 200.0, mark)  # another promote
    assert set_marks(path, G, "promote", 300.0, mark)
    assert not set_marks(path, G, "promote", 300.0, [{**mark[0], "offset": 9}])  # marks are taken once
    assert read_commands(path)[G] == {"action": "promote", "at": 300.0, "marks": mark}
    path.write_text(json.dumps({"groups": {G: {"action": "promote", "at": 300.0, "marks": [{"topic": T}]}}}))
    assert read_commands(path)[G] == {"action": "promote", "at": 300.0}  # damaged marks: taken again
    with pytest.raises(ValueError, match="unknown drain outcome"):
        mark_drain(path, G, "promote", 200.0, "done", 1.0)


def test_watch_off_and_bad_settings(tmp_path: Path) -> None:
    cfg, w, clock, brokers = make(tmp_path, backlog_interval=0)
    assert w.step() == 0.0 and brokers.reads == 0  # off: promotes end at the drain timeout
    base = {"group": [{"group": G, "topics": [T], "clients": ["*@c*"]}]}
    with pytest.raises(ConfigError, match=r"gray.drain_timeout: 3 is not allowed; expected at least gray.settle"):
        parse_gray({**base, "settle": 8, "drain_timeout": 3})
    with pytest.raises(ConfigError, match="gray.backlog_interval: 0.1 is not allowed"):
        parse_gray({**base, "backlog_interval": 0.1})
    with pytest.raises(ConfigError, match="gray.drain_timeout"):
        parse_gray({**base, "drain_timeout": -1})


class Backend:
    """A stand-in supervisor: its metrics text is the workers' plus the watch's, as Supervisor.metrics_text."""

    def __init__(self, cfg: config_mod.Config, watch: GrayWatch) -> None:
        self.cfg = cfg
        self.gray_watch = watch

    def metrics_text(self) -> bytes:
        return b"# TYPE rmqfast_worker_up gauge\nrmqfast_worker_up 1.0\n" + self.gray_watch.metrics_text()

    def health(self) -> tuple[bool, dict[str, Any]]:
        return True, {}

    def ready(self) -> tuple[bool, str]:
        return True, "ok"

    def ready_detail(self) -> dict[str, Any]:
        return {}

    def limits_view(self) -> dict[str, Any]:
        return {}

    def admin_token(self) -> str:
        return ""


def test_backlog_scraped_over_http_and_shown_by_status(tmp_path: Path) -> None:
    cfg, w, clock, brokers = make(tmp_path)
    w.step()
    srv = AdminServer(HostPort("127.0.0.1", 0), Backend(cfg, w))  # type: ignore[arg-type]
    srv.start()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{srv.port}/metrics", timeout=10) as r:
            text = r.read()
        assert backlog_of(text, "broker-a") == 5.0 and backlog_of(text, "broker-b") == 0.0
        assert samples(text)[("rmqfast_worker_up", ())] == 1.0
        with urllib.request.urlopen(f"http://127.0.0.1:{srv.port}/gray", timeout=10) as r:
            v = json.loads(r.read())
        assert v["groups"][0]["backlog_last_read"]["total"] == 5 and v["groups"][0]["drain"] is None
    finally:
        srv.shutdown()


def test_supervisor_metrics_carry_the_watch_only_with_gray(tmp_path: Path) -> None:
    import shutil

    from rmqfast.server.supervisor import Supervisor

    gray = {"group": [{"group": G, "topics": [T], "clients": ["*@canary*"]}]}
    for raw, present in (({"gray": gray}, True), ({}, False)):
        cfg = config_mod.from_dict({"namesrv": {"upstreams": ["127.0.0.1:9876"]},
                                    "proxy": {"state_dir": str(tmp_path)}, **raw})
        sup = Supervisor(cfg, lambda c=cfg: c)  # type: ignore[misc]
        try:
            write_command(tmp_path / "gray.json", G, "abort", now=1.0)  # long ago: aborted
            s = samples(sup.metrics_text())
            assert (("rmqfast_gray_phase", (("group", G),)) in s) is present
            if present:
                assert s[("rmqfast_gray_phase", (("group", G),))] == 4.0
                assert s[("rmqfast_gray_backlog_read_age_seconds", (("group", G),))] == -1.0
        finally:
            shutil.rmtree(sup.runtime, ignore_errors=True)
