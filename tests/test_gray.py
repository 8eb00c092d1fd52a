"""Gray releases: the decisions (rmqfast.gray.rules), the [gray] section, the command file and the
filter on frames (heartbeat, consumer list, pull, offset commit, send)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from rmqfast import codec
from rmqfast import config as config_mod
from rmqfast.codec import ACTION_POLICY, EV_FORWARD, EV_POLICY, code_slot
from rmqfast.codec import codes as C
from rmqfast.codec.command import FLAG_ONEWAY, FLAG_RESPONSE, RemotingCommand, decode_frame, encode
from rmqfast.codec.properties import format_properties
from rmqfast.codec.sendheader import send_fields
from rmqfast.errors import ConfigError
from rmqfast.filters.api import FilterChain, Frame, Kind
from rmqfast.filters.gray import GrayFilter
from rmqfast.gray.config import GrayGroup, GraySection, parse_gray
from rmqfast.gray.rules import (
    ANY,
    GRAY,
    NOBODY,
    NORMAL,
    Marker,
    Phase,
    consumer_ids_for,
    is_gray_queue,
    may_commit,
    may_pull,
    owner,
    phase,
    send_queue,
)
from rmqfast.gray.state import Commands, read_commands, write_command
from rmqfast.proxy.failover import KeepSendsInFlight

G = "orders-cg"
T = "orders"


def group(**kw: Any) -> GrayGroup:
    base: dict[str, Any] = {"group": G, "topics": [T], "gray_queues": 1, "clients": ["*@canary*"],
                            "cidrs": ["10.9.0.0/16"], "producer_groups": ["pg-canary"], "property": "gray=true"}
    base.update(kw)
    return GrayGroup(**base)


# rules ------------------------------------------------------------------------------------------------


def test_gray_queues_are_the_last_k_and_need_a_normal_one() -> None:
    assert [q for q in range(8) if is_gray_queue(q, 8, 2)] == [6, 7]
    assert not any(is_gray_queue(q, 2, 2) for q in range(2))  # no normal queue left: not split
    assert not is_gray_queue(8, 8, 2)  # outside the topic


def test_send_queue_active_keeps_each_side_on_its_share() -> None:
    for q in range(8):
        g = send_queue(q, 8, 2, True, Phase.ACTIVE)
        n = send_queue(q, 8, 2, False, Phase.ACTIVE)
        assert g in (6, 7) and n in range(6)
    assert send_queue(3, 8, 2, False, Phase.ACTIVE) == 3  # a normal queue id stays
    assert send_queue(5, 4, 1, True, Phase.ACTIVE) == 3  # queue id out of range still lands in the gray share


@pytest.mark.parametrize("ph", [Phase.ABORTING, Phase.ABORTED])
def test_send_queue_abort_keeps_gray_queues_empty(ph: Phase) -> None:
    assert all(send_queue(q, 8, 2, gray, ph) < 6 for q in range(8) for gray in (True, False))


def test_send_queue_promote_drain_keeps_each_side_on_its_share() -> None:
    """Until a promote ends the gray version alone consumes the gray queues: its sends keep going there
    (on a normal queue the old version would skip a tag only the gray version subscribes to)."""
    for q in range(8):
        assert send_queue(q, 8, 2, True, Phase.PROMOTING) == send_queue(q, 8, 2, True, Phase.ACTIVE) in (6, 7)
        assert send_queue(q, 8, 2, False, Phase.PROMOTING) == send_queue(q, 8, 2, False, Phase.ACTIVE) < 6


def test_send_queue_promoted_and_too_few_queues_unchanged() -> None:
    assert [send_queue(q, 8, 2, True, Phase.PROMOTED) for q in range(8)] == list(range(8))
    assert send_queue(1, 2, 2, True, Phase.ACTIVE) == 1


def test_phase_from_commands() -> None:
    assert phase(None, 0, 100, 8) is Phase.ACTIVE
    assert phase("promote", 100, 104, 8) is Phase.PROMOTING
    assert phase("promote", 100, 108, 8) is Phase.PROMOTED
    assert phase("abort", 100, 107.9, 8) is Phase.ABORTING
    assert phase("abort", 100, 109, 8) is Phase.ABORTED


def test_owner_and_pull_rights() -> None:
    assert owner(Phase.ACTIVE, True, True) == GRAY
    assert owner(Phase.ACTIVE, True, False) == NORMAL  # every gray consumer gone past the grace period
    assert owner(Phase.ACTIVE, False, True) == NORMAL
    assert owner(Phase.PROMOTING, True, True) == GRAY
    assert owner(Phase.ABORTING, True, True) == NOBODY
    assert owner(Phase.ABORTED, True, True) == NORMAL
    assert owner(Phase.PROMOTED, True, True) == ANY
    # exactly one side pulls a queue, except after a promote (one group again) and during an abort's settle
    for ph in Phase:
        for gq in (True, False):
            for alive in (True, False):
                sides = [s for s in (GRAY, NORMAL) if may_pull(s, ph, gq, alive)]
                expected = 2 if ph is Phase.PROMOTED else 0 if (ph is Phase.ABORTING and gq) else 1
                assert len(sides) == expected, (ph, gq, alive, sides)
    assert not may_pull(GRAY, Phase.ABORTED, True, True) and not may_pull(GRAY, Phase.ABORTING, False, True)
    # an abort's settle: the gray side's last commits of gray queues still count, nobody pulls them
    assert may_commit(GRAY, Phase.ABORTING, True, True) and not may_commit(NORMAL, Phase.ABORTING, True, True)


def test_marker_kinds() -> None:
    m = Marker(group())
    assert m.client_is_gray("10.0.0.5@canary-1") and m.client_is_gray("10.0.0.5@canary-1@unit")
    assert m.client_is_gray("10.9.3.4@12345#99")  # IP of the client id in a gray network
    assert not m.client_is_gray("10.0.0.5@12345#99")
    assert m.send_is_gray("pg-canary", {}, None, "10.0.0.1")
    assert m.send_is_gray("pg", {"gray": "true"}, None, "10.0.0.1")
    assert not m.send_is_gray("pg", {"gray": "false"}, None, "10.0.0.1")
    assert m.send_is_gray("pg", {}, "10.0.0.1@canary", "10.0.0.1")
    assert m.send_is_gray("pg", {}, None, "10.9.0.7")
    assert not m.send_is_gray("pg", {}, "10.0.0.1@app", "10.0.0.1")


def test_consumer_ids_per_side() -> None:
    m = Marker(group())
    ids = ["1.1.1.1@a", "1.1.1.1@canary-1", "1.1.1.2@b", "1.1.1.2@canary-2"]
    assert consumer_ids_for(ids, GRAY, Phase.ACTIVE, m) == ["1.1.1.1@canary-1", "1.1.1.2@canary-2"]
    assert consumer_ids_for(ids, NORMAL, Phase.ABORTED, m) == ["1.1.1.1@a", "1.1.1.2@b"]
    assert consumer_ids_for(ids, NORMAL, Phase.PROMOTED, m) == ids


# config and command file --------------------------------------------------------------------------------


def test_config_section_round_trip() -> None:
    raw = {"namesrv": {"upstreams": ["127.0.0.1:9876"]}, "gray": {"settle": 5, "grace": 10, "group": [
        {"group": G, "topics": [T], "gray_queues": 2, "clients": ["*@canary*"], "property": "gray=true"}]}}
    cfg = config_mod.from_dict(raw)
    assert cfg.gray.enabled and cfg.gray.groups[0].gray_queues == 2 and cfg.gray.settle == 5.0
    back = config_mod.from_json(cfg.to_json())
    assert back.gray == cfg.gray


@pytest.mark.parametrize(("raw", "needle"), [
    ({"group": [{"group": G, "topics": [T], "gray_queues": 0, "clients": ["x"]}]}, "gray_queues"),
    ({"group": [{"group": G, "topics": [], "clients": ["x"]}]}, "topics"),
    ({"group": [{"group": G, "topics": [T]}]}, "names no gray client"),
    ({"group": [{"group": G, "topics": [T], "cidrs": ["10.0.0.300/8"]}]}, "not an IP network"),
    ({"group": [{"group": G, "topics": [T], "property": "gray"}]}, "KEY=VALUE"),
    ({"group": [{"group": G, "topics": [T], "clients": ["x"]},
                {"group": "other", "topics": [T], "clients": ["x"]}]}, "split by group"),
    ({"grace": -1}, "gray.grace"),
    ({"bogus": 1}, "gray.bogus"),
])
def test_config_errors_name_the_key(raw: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        parse_gray(raw)


def test_command_file(tmp_path: Path) -> None:
    p = tmp_path / "s" / "gray.json"
    assert read_commands(p) == {}
    write_command(p, G, "abort", now=1000.0)
    write_command(p, "other", "promote", now=1001.0)
    assert read_commands(p) == {G: {"action": "abort", "at": 1000.0}, "other": {"action": "promote", "at": 1001.0}}
    c = Commands(p, interval=0)
    assert c.get(G) == ("abort", 1000.0)
    write_command(p, G, None)
    assert c.get(G) == (None, 0.0) and c.get("other")[0] == "promote"
    p.write_text("{not json")
    assert read_commands(p) == {}
    with pytest.raises(ValueError):
        write_command(p, G, "rollback")


# the filter on frames --------------------------------------------------------------------------------


@dataclass
class FakeSession:
    role: str = "broker"
    client_addr: str = "127.0.0.1:50000"
    upstream_addr: str = "10.0.0.1:10911"
    state: dict[str, Any] = field(default_factory=dict)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class FakeCommands:
    def __init__(self) -> None:
        self.cmds: dict[str, tuple[str | None, float]] = {}
        self.extra: dict[str, dict[str, Any]] = {}  # drain outcomes (rmqfast.gray.watch)

    def get(self, group: str) -> tuple[str | None, float]:
        return self.cmds.get(group, (None, 0.0))

    def command(self, group: str) -> dict[str, Any] | None:
        c = self.cmds.get(group)
        return None if c is None else {"action": c[0], "at": c[1], **self.extra.get(group, {})}


def make_filter(k: int = 1, queues: int = 4, handover: float = 0.0) -> tuple[GrayFilter, Clock, FakeCommands]:
    """No hand-over fence unless asked (tests/test_gray_handover.py tests it)."""
    clock = Clock()
    cmds = FakeCommands()
    cfg = GraySection(settle=5, grace=20, handover=handover, groups=[group(gray_queues=k)])
    f = GrayFilter(cfg, lambda topic, broker: queues if broker == "broker-a" else None, cmds,  # type: ignore[arg-type]
                   broker_name=lambda addr, topic: "broker-a", clock=clock)
    return f, clock, cmds


def frame_of(cmd: RemotingCommand) -> Frame:
    data = encode(cmd)
    return Frame(data, cmd.code, cmd.flag, cmd.opaque)


def heartbeat(f: GrayFilter, s: FakeSession, cid: str) -> None:
    body = json.dumps({"clientID": cid, "consumerDataSet": [{"groupName": G}], "producerDataSet": []}).encode()
    assert f.on_request(s, frame_of(RemotingCommand(C.HEART_BEAT, opaque=1, body=body))) is None
    assert s.state["gray_cid"] == cid


def pull(qid: int, opaque: int = 7, offset: int = 40) -> Frame:
    return frame_of(RemotingCommand(C.PULL_MESSAGE, opaque=opaque, ext_fields={
        "consumerGroup": G, "topic": T, "queueId": str(qid), "queueOffset": str(offset), "maxMsgNums": "32",
        "sysFlag": "3", "commitOffset": "30", "suspendTimeoutMillis": "15000", "subscription": "*",
        "subVersion": "1"}))


def test_consumer_list_answer_shows_the_requesters_side_only() -> None:
    f, clock, _ = make_filter()
    s = FakeSession()
    heartbeat(f, s, "127.0.0.1@canary-1")
    req = frame_of(RemotingCommand(C.GET_CONSUMER_LIST_BY_GROUP, opaque=9, ext_fields={"consumerGroup": G}))
    assert f.on_request(s, req) is None and req.want_response
    ids = ["127.0.0.1@app-1", "127.0.0.1@canary-1", "127.0.0.1@app-2", "127.0.0.1@canary-2"]
    resp = frame_of(RemotingCommand(C.SUCCESS, opaque=9, flag=FLAG_RESPONSE,
                                    body=json.dumps({"consumerIdList": ids}).encode()))
    v = f.on_response(s, resp)
    assert v is not None and v.kind is Kind.REWRITE
    assert json.loads(decode_frame(v.data).body) == {"consumerIdList": ["127.0.0.1@canary-1", "127.0.0.1@canary-2"]}
    assert f.alive_at[G] == clock.t


def test_pulls_parked_and_handed_over_from_the_committed_offset() -> None:
    f, clock, cmds = make_filter(k=1, queues=4)
    normal = FakeSession()
    heartbeat(f, normal, "127.0.0.1@app-1")
    assert f.on_request(normal, pull(0)) is None  # a normal queue: relayed
    v = f.on_request(normal, pull(3))  # the gray queue while gray consumers live: parked
    assert v is not None and v.kind is Kind.REPLY and decode_frame(v.data).code == C.SYSTEM_BUSY
    # the parked client's commits of that queue are dropped (its position is stale)
    commit = frame_of(RemotingCommand(C.UPDATE_CONSUMER_OFFSET, opaque=11, flag=FLAG_ONEWAY, ext_fields={
        "consumerGroup": G, "topic": T, "queueId": "3", "commitOffset": "12"}))
    assert f.on_request(normal, commit).kind is Kind.DIVERT  # type: ignore[union-attr]
    # every gray consumer gone past the grace period: the normal side takes the gray queue
    clock.t += 21
    fr = pull(3, opaque=8, offset=5)
    v = f.on_request(normal, fr)
    assert v is not None and v.kind is Kind.REWRITE and fr.want_response
    q = decode_frame(v.data)
    assert q.code == C.QUERY_CONSUMER_OFFSET and q.opaque == 8
    assert q.ext_fields == {"consumerGroup": G, "topic": T, "queueId": "3", "setZeroIfNotFound": "false"}
    ans = frame_of(RemotingCommand(C.SUCCESS, opaque=8, flag=FLAG_RESPONSE, ext_fields={"offset": "77"}))
    v = f.on_response(normal, ans)
    assert v is not None and v.kind is Kind.REWRITE
    r = decode_frame(v.data)
    assert r.code == C.PULL_NOT_FOUND and r.opaque == 8 and r.ext_fields is not None
    assert r.ext_fields["nextBeginOffset"] == "77" and r.ext_fields["suggestWhichBrokerId"] == "0"
    assert f.on_request(normal, pull(3, opaque=12, offset=77)) is None  # from now on relayed
    # abort: during the settle nobody pulls the gray queue; the gray side's commits still count
    gray = FakeSession(client_addr="127.0.0.1:50001")
    heartbeat(f, gray, "127.0.0.1@canary-1")
    f.alive_at[G] = clock.t
    cmds.cmds[G] = ("abort", clock.t)
    assert f.on_request(gray, pull(3, opaque=13)).kind is Kind.REPLY  # type: ignore[union-attr]
    gcommit = frame_of(RemotingCommand(C.UPDATE_CONSUMER_OFFSET, opaque=14, flag=FLAG_ONEWAY, ext_fields={
        "consumerGroup": G, "topic": T, "queueId": "3", "commitOffset": "90"}))
    assert f.on_request(gray, gcommit) is None
    assert f.on_request(normal, pull(3, opaque=15)).kind is Kind.REPLY  # type: ignore[union-attr]
    clock.t += 6  # aborted: normal consumers on every queue, gray ones on none
    assert f.on_request(normal, pull(3, opaque=16)).kind is Kind.REWRITE  # type: ignore[union-attr]  # offset fix
    assert f.on_request(gray, pull(0, opaque=17)).kind is Kind.REPLY  # type: ignore[union-attr]


def test_query_not_found_keeps_the_clients_position() -> None:
    f, clock, _ = make_filter()
    s = FakeSession()
    heartbeat(f, s, "127.0.0.1@app-1")
    f.on_request(s, pull(3))
    clock.t += 21
    f.on_request(s, pull(3, opaque=20, offset=55))
    v = f.on_response(s, frame_of(RemotingCommand(22, opaque=20, flag=FLAG_RESPONSE)))
    assert v is not None and decode_frame(v.data).ext_fields["nextBeginOffset"] == "55"  # type: ignore[index]


def test_unidentified_client_pulls_nothing() -> None:
    f, _, _ = make_filter()
    v = f.on_request(FakeSession(), pull(0))
    assert v is not None and v.kind is Kind.REPLY and b"no heartbeat" in decode_frame(v.data).remark.encode()  # type: ignore[union-attr]


def send(qid: int, props: dict[str, str], pgroup: str = "pg", v2: bool = True) -> Frame:
    if v2:
        ext = {"a": pgroup, "b": T, "c": "TBW102", "d": "4", "e": str(qid), "f": "0", "g": "1", "h": "0",
               "i": format_properties(props), "j": "0", "k": "false", "m": "false", "n": "broker-a"}
        return frame_of(RemotingCommand(C.SEND_MESSAGE_V2, opaque=30, ext_fields=ext, body=b"hello"))
    ext = {"producerGroup": pgroup, "topic": T, "defaultTopic": "TBW102", "defaultTopicQueueNums": "4",
           "queueId": str(qid), "sysFlag": "0", "bornTimestamp": "1", "flag": "0",
           "properties": format_properties(props), "reconsumeTimes": "0", "unitMode": "false"}
    return frame_of(RemotingCommand(C.SEND_MESSAGE, opaque=31, ext_fields=ext, body=b"hello"))


@pytest.mark.parametrize("v2", [True, False])
def test_sends_rewritten_to_their_share(v2: bool) -> None:
    f, clock, cmds = make_filter(k=1, queues=4)
    s = FakeSession()
    key = "e" if v2 else "queueId"
    fr = send(3, {"KEYS": "k1"}, v2=v2)  # a normal send to the gray queue: moved to a normal one
    assert f.on_request(s, fr) is None
    cmd = decode_frame(fr.data)
    assert cmd.ext_fields[key] == "0" and cmd.body == b"hello"  # type: ignore[index]
    before = decode_frame(send(3, {"KEYS": "k1"}, v2=v2).data).ext_fields
    assert {k: v for k, v in cmd.ext_fields.items() if k != key} == {k: v for k, v in before.items() if k != key}  # type: ignore[union-attr]
    fr = send(1, {"gray": "true"}, v2=v2)  # a gray send: to the gray queue
    assert f.on_request(s, fr) is None and decode_frame(fr.data).ext_fields[key] == "3"  # type: ignore[index]
    fr = send(2, {}, pgroup="pg-canary", v2=v2)
    f.on_request(s, fr)
    assert decode_frame(fr.data).ext_fields[key] == "3"  # type: ignore[index]
    fr = send(2, {}, v2=v2)  # a normal send to a normal queue: the frame is untouched
    data = fr.data
    assert f.on_request(s, fr) is None and fr.data is data
    cmds.cmds[G] = ("promote", clock.t - 1)  # a promote's drain: gray sends stay on the gray queue
    fr = send(1, {"gray": "true"}, v2=v2)
    f.on_request(s, fr)
    assert f.phase(G) is Phase.PROMOTING and decode_frame(fr.data).ext_fields[key] == "3"  # type: ignore[index]
    fr = send(3, {}, v2=v2)
    f.on_request(s, fr)
    assert decode_frame(fr.data).ext_fields[key] == "0"  # type: ignore[index]
    cmds.cmds[G] = ("abort", 0.0)  # after an abort gray sends go to normal queues
    fr = send(1, {"gray": "true"}, v2=v2)
    f.on_request(s, fr)
    assert decode_frame(fr.data).ext_fields[key] == "1"  # type: ignore[index]


def test_signed_send_that_would_move_is_refused() -> None:
    f, _, _ = make_filter()
    fr = send(0, {"gray": "true"})
    cmd = decode_frame(fr.data)
    assert cmd.ext_fields is not None
    cmd.ext_fields["AccessKey"] = "ak"
    cmd.ext_fields["Signature"] = "sig"
    fr = frame_of(cmd)
    v = f.on_request(FakeSession(), fr)
    assert v is not None and v.kind is Kind.REPLY and decode_frame(v.data).code == C.NO_PERMISSION


def test_other_groups_and_topics_pass() -> None:
    f, _, _ = make_filter()
    s = FakeSession()
    other = frame_of(RemotingCommand(C.PULL_MESSAGE, opaque=3, ext_fields={"consumerGroup": "x", "topic": T,
                                                                             "queueId": "3", "queueOffset": "0"}))
    assert f.on_request(s, other) is None
    fr = send(3, {})
    cmd = decode_frame(fr.data)
    assert cmd.ext_fields is not None
    cmd.ext_fields["b"] = "other-topic"
    fr = frame_of(cmd)
    data = fr.data
    assert f.on_request(s, fr) is None and fr.data is data


# admin endpoint and command line -------------------------------------------------------------------


class AdminBackend:
    """A stand-in supervisor with a [gray] configuration and some gray counters."""

    def __init__(self, cfg: config_mod.Config, token: str = "") -> None:
        self.cfg = cfg
        self.token = token

    def health(self) -> tuple[bool, dict[str, Any]]:
        return True, {"status": "ok"}

    def ready(self) -> tuple[bool, str]:
        return True, "ok"

    def ready_detail(self) -> dict[str, Any]:
        return {}

    def metrics_text(self) -> bytes:
        return (b'# TYPE rmqfast_gray_pulls_parked_total counter\n'
                b'rmqfast_gray_pulls_parked_total{group="orders-cg",side="normal"} 7.0\n')

    def limits_view(self) -> dict[str, Any]:
        return {}

    def admin_token(self) -> str:
        return self.token

    def change_limits(self, change: Any) -> bool:
        return True


def test_admin_endpoint_and_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from rmqfast.cli import main
    from rmqfast.config import HostPort
    from rmqfast.server.admin import AdminServer

    cfg = config_mod.from_dict({"namesrv": {"upstreams": ["127.0.0.1:9876"]}, "proxy": {"state_dir": str(tmp_path)},
                                "gray": {"settle": 30, "group": [{"group": G, "topics": [T], "clients": ["*@c*"]}]}})
    srv = AdminServer(HostPort("127.0.0.1", 0), AdminBackend(cfg, token="s3cret"))  # type: ignore[arg-type]
    srv.start()
    try:
        admin = ["gray", "--admin", f"http://127.0.0.1:{srv.port}", "--token", "s3cret"]
        assert main([*admin, "status"]) == 0
        out = capsys.readouterr().out
        assert f"{G}: active" in out and "pulls_parked_total{normal} 7" in out
        assert main([*admin, "abort", G]) == 0
        assert f"{G}: aborting" in capsys.readouterr().out
        assert read_commands(tmp_path / "gray.json")[G]["action"] == "abort"  # what the workers read
        assert main([*admin, "--json", "promote", G]) == 0
        v = json.loads(capsys.readouterr().out)
        assert v["groups"][0]["phase"] == "promoting" and v["groups"][0]["settle_left"] > 0
        assert main([*admin, "reset", G]) == 0 and read_commands(tmp_path / "gray.json") == {}
        capsys.readouterr()
        assert main([*admin, "abort", "nope"]) == 1
        assert "unknown gray group 'nope'" in capsys.readouterr().err
        assert main(["gray", "--admin", f"http://127.0.0.1:{srv.port}", "abort", G]) == 1  # no token
        assert "HTTP 401" in capsys.readouterr().err
    finally:
        srv.shutdown()


def test_held_pull_answered_after_the_queue_changed_hands_brings_no_message() -> None:
    f, clock, cmds = make_filter(k=1, queues=4)
    normal = FakeSession()
    heartbeat(f, normal, "127.0.0.1@app-1")
    cmds.cmds[G] = ("abort", clock.t - 10)  # aborted: normal consumers pull the gray queue
    fr = pull(3, opaque=40, offset=70)
    assert f.on_request(normal, fr) is None and fr.want_response  # relayed, its answer checked
    ok = frame_of(RemotingCommand(C.SUCCESS, opaque=40, flag=FLAG_RESPONSE, ext_fields={
        "suggestWhichBrokerId": "0", "nextBeginOffset": "72", "minOffset": "0", "maxOffset": "90"}, body=b"msgs"))
    assert f.on_response(normal, ok) is None  # still the owner: the messages go through
    fr = pull(3, opaque=41, offset=72)
    f.on_request(normal, fr)
    cmds.cmds.pop(G)  # back to a canary while the broker holds the pull: the gray side owns the queue
    late = frame_of(RemotingCommand(C.SUCCESS, opaque=41, flag=FLAG_RESPONSE, ext_fields={
        "suggestWhichBrokerId": "0", "nextBeginOffset": "75", "minOffset": "0", "maxOffset": "91"}, body=b"msgs"))
    v = f.on_response(normal, late)
    assert v is not None and v.kind is Kind.REWRITE
    r = decode_frame(v.data)
    assert r.code == C.PULL_NOT_FOUND and r.body == b"" and r.ext_fields is not None
    assert r.ext_fields["nextBeginOffset"] == "72" and r.ext_fields["maxOffset"] == "91"
    assert f.on_request(normal, pull(3, opaque=42, offset=72)).kind is Kind.REPLY  # type: ignore[union-attr]


def test_pull_carries_the_clients_own_subscription() -> None:
    f, _, _ = make_filter(k=1, queues=4)
    s = FakeSession()
    body = json.dumps({"clientID": "127.0.0.1@canary-1", "consumerDataSet": [
        {"groupName": G, "subscriptionDataSet": [{"topic": T, "subString": "TagA || TagG", "expressionType": "TAG",
                                                  "subVersion": 5, "tagsSet": ["TagA", "TagG"]}]},
        {"groupName": "not-gray", "subscriptionDataSet": [{"topic": T, "subString": "X"}]}]}).encode()
    f.on_request(s, frame_of(RemotingCommand(C.HEART_BEAT, opaque=1, body=body)))
    # a 5.x heartbeat repeating the last one carries no subscriptions: what was learnt stays
    again = json.dumps({"clientID": "127.0.0.1@canary-1", "consumerDataSet": [
        {"groupName": G, "subscriptionDataSet": []}]}).encode()
    f.on_request(s, frame_of(RemotingCommand(C.HEART_BEAT, opaque=2, body=again)))
    fr = frame_of(RemotingCommand(C.PULL_MESSAGE, opaque=7, ext_fields={
        "consumerGroup": G, "topic": T, "queueId": "3", "queueOffset": "4", "sysFlag": "3", "commitOffset": "3",
        "subVersion": "5"}))  # commit offset + suspend: what a push consumer sends
    before = decode_frame(fr.data).ext_fields
    assert f.on_request(s, fr) is None  # relayed, rewritten in place
    ext = decode_frame(fr.data).ext_fields
    assert ext is not None and before is not None
    assert ext["sysFlag"] == "7" and ext["subscription"] == "TagA || TagG" and ext["expressionType"] == "TAG"
    assert {k: v for k, v in ext.items() if k not in ("sysFlag", "subscription", "expressionType")} == \
        {k: v for k, v in before.items() if k != "sysFlag"}
    fr = frame_of(RemotingCommand(C.PULL_MESSAGE, opaque=8, ext_fields={
        "consumerGroup": G, "topic": T, "queueId": "3", "queueOffset": "4", "sysFlag": "7", "subscription": "Z"}))
    data = fr.data
    assert f.on_request(s, fr) is None and fr.data is data  # names its subscription already: untouched
    fr = frame_of(RemotingCommand(C.PULL_MESSAGE, opaque=9, ext_fields={
        "consumerGroup": G, "topic": T, "queueId": "3", "queueOffset": "4", "sysFlag": "5", "subscription": "Z"}))
    data = fr.data
    assert f.on_request(s, fr) is None and fr.data is data  # subscription flag (4) without suspend: untouched


def test_failover_moves_keep_the_share() -> None:
    f, _, cmds = make_filter(k=1, queues=4)
    moved = decode_frame(send(3, {}).data)  # a normal send the failover service aimed at queue 3 of broker-b
    out = f.place(moved, "broker-b", 8, "10.0.0.1")
    assert out.ext_fields is not None and out.ext_fields["e"] == "3"  # 8 queues there: 3 is a normal one
    out = f.place(decode_frame(send(3, {}).data), "broker-b", 4, "10.0.0.1")
    assert out.ext_fields is not None and out.ext_fields["e"] == "0"
    out = f.place(decode_frame(send(1, {}).data), "broker-b", 4, "10.9.0.5")  # a gray client network
    assert out.ext_fields is not None and out.ext_fields["e"] == "3"
    cmds.cmds[G] = ("promote", 0.0)  # promoted: unchanged
    out = f.place(decode_frame(send(3, {}).data), "broker-b", 4, "10.0.0.1")
    assert out.ext_fields is not None and out.ext_fields["e"] == "3"


def test_backlog_of_the_gray_queues_asked_of_the_brokers() -> None:
    """A stand-in name server and broker: route (2 brokers, 4 queues), max offsets, committed offsets."""
    import socketserver
    import threading

    from rmqfast.codec.command import make_response
    from rmqfast.gray.backlog import gray_backlog
    from rmqfast.testing.wire import read_frame

    ports: dict[str, int] = {}

    class Handler(socketserver.BaseRequestHandler):
        def handle(self) -> None:
            while (data := read_frame(self.request)) is not None:
                cmd = decode_frame(data)
                ext = cmd.ext_fields or {}
                if cmd.code == C.GET_ROUTEINFO_BY_TOPIC:
                    body = json.dumps({"brokerDatas": [
                        {"brokerName": n, "cluster": "c", "brokerAddrs": {"0": f"127.0.0.1:{ports['b']}"}}
                        for n in ("broker-a", "broker-b")], "queueDatas": [
                        {"brokerName": n, "readQueueNums": 4, "writeQueueNums": 4, "perm": 6} for n in
                        ("broker-a", "broker-b")]}).encode()
                    resp = make_response(cmd, C.SUCCESS, body=body)
                elif cmd.code == C.GET_MAX_OFFSET:
                    resp = make_response(cmd, C.SUCCESS, ext_fields={"offset": str(100 + int(ext["queueId"]))})
                elif cmd.code == C.QUERY_CONSUMER_OFFSET and ext.get("consumerGroup") == G:
                    resp = make_response(cmd, C.SUCCESS, ext_fields={"offset": "90"})
                else:
                    resp = make_response(cmd, 22, remark="not found")
                self.request.sendall(encode(resp))

    srv = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
    srv.daemon_threads = True
    ports["b"] = srv.server_address[1]
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        b = gray_backlog(group(gray_queues=1), [f"127.0.0.1:{ports['b']}"])
        assert b["total"] == 26 and [(r["broker"], r["queue"], r["backlog"]) for r in b["queues"]] == [
            ("broker-a", 3, 13), ("broker-b", 3, 13)]
        b = gray_backlog(group(group="other-cg", gray_queues=2), [f"127.0.0.1:{ports['b']}"])
        assert b["total"] == 2 * (102 + 103)  # never committed: from 0
        assert "error" in gray_backlog(group(), ["127.0.0.1:1"], timeout=0.5)
    finally:
        srv.shutdown()
        srv.server_close()


# the scanner hands over the sends of split topics only -------------------------------------------------

@pytest.fixture
def scanner(twin: Any) -> tuple[Any, Any]:
    """(scanner class, stats class) of each twin (the ``twin`` fixture of tests/conftest.py)."""
    return twin.FrameScanner, twin.ScanStats


def other_send(topic: str = "unsplit") -> Frame:
    ext = {"a": "pg-canary", "b": topic, "c": "TBW102", "d": "4", "e": "3", "f": "0", "g": "1", "h": "0",
           "i": format_properties({"gray": "true"}), "j": "0", "k": "false", "m": "false", "n": "broker-a"}
    return frame_of(RemotingCommand(C.SEND_MESSAGE_V2, opaque=32, ext_fields=ext, body=b"hello"))


def test_only_sends_of_split_topics_leave_the_fast_path(scanner: tuple[Any, Any]) -> None:
    scanner_cls, stats_cls = scanner
    f, _, _ = make_filter(k=1, queues=4)
    keep = KeepSendsInFlight()  # sees the sends other filters hand to Python (passive)
    chain = FilterChain([f, keep])
    split = [f"%RETRY%{G}".encode(), T.encode()]  # and the gray group's retry topic (a gray consumer's retries)
    assert f.send_topics() == split and chain.policy_topics == split
    for code in (C.SEND_MESSAGE, C.SEND_MESSAGE_V2, C.SEND_BATCH_MESSAGE):
        assert chain.request_actions[code_slot(code)] != ACTION_POLICY  # not every send
        assert chain._by_slot[code_slot(code)] == (f, keep)  # those handed over: as before, in chain order
    for code in GrayFilter.CODES:
        assert chain.request_actions[code_slot(code)] == ACTION_POLICY
    sc = scanner_cls(stats_cls(), actions=chain.request_actions)  # as the relay sets up its scanner
    sc.policy_topics = chain.policy_topics
    for fr in (other_send(), other_send(T + "-x"), send(3, {"KEYS": "k1"}, v2=True)):
        held = decode_frame(fr.data).ext_fields["b"] == T  # type: ignore[index]
        assert sc.scan(fr.data, 0, len(fr.data))[0] == (EV_POLICY if held else EV_FORWARD)
    fr = send(3, {"KEYS": "k1"}, v2=False)
    assert sc.scan(fr.data, 0, len(fr.data)) == (EV_POLICY, 0, len(fr.data))
    s = FakeSession()
    handed = Frame(fr.data, sc.code, sc.flag, sc.opaque, sc.limited)
    assert chain.on_request(s, handed).kind is Kind.PASS
    assert decode_frame(handed.data).ext_fields["queueId"] == "0"  # type: ignore[index]  # moved to a normal queue
    assert s.state["kept"][31] == handed.data  # the filters after gray see the send it rewrote
    # a send of an unsplit topic that reaches Python anyway (another filter asked for sends): passed unchanged
    fr = other_send()
    data = fr.data
    s = FakeSession()
    assert chain.on_request(s, fr).kind is Kind.PASS and fr.data is data and s.state["kept"][32] == data


@pytest.mark.usefixtures("in_process_metrics")
def test_a_reload_reaches_the_scanners_of_live_sessions(tmp_path: Path) -> None:
    from rmqfast.server.worker import Worker

    def cfg(gray: dict[str, Any] | None) -> Any:
        # send answers' msgIds left alone: this scanner has no in-flight table to track sends with
        # (a relay's does), and the same frame is scanned again below
        raw: dict[str, Any] = {"namesrv": {"listen": "127.0.0.1:1", "upstreams": ["127.0.0.1:2"]},
                               "proxy": {"state_dir": str(tmp_path)}, "policy": {"message_addresses": "records"}}
        if gray is not None:
            raw["gray"] = gray
        return config_mod.from_dict(raw)

    def gray(*topics: str) -> dict[str, Any]:
        return {"group": [{"group": G, "topics": list(topics), "gray_queues": 1, "producer_groups": ["pg"]}]}

    first = cfg(gray("a"))
    w = Worker(first, 0, lambda status: None)
    w.listeners[first.namesrv.listen] = SimpleNamespace(server=None)  # reload binds nothing
    chain = w.chains["broker"]
    retry = f"%RETRY%{G}".encode()
    assert chain.policy_topics == [retry, b"a"] and chain.request_actions[code_slot(C.SEND_MESSAGE_V2)] != ACTION_POLICY

    class LiveSession:
        role = "broker"

    s = LiveSession()
    s.c2u = codec.FrameScanner(codec.ScanStats(), actions=chain.request_actions)  # type: ignore[attr-defined]
    s.c2u.policy_topics = chain.policy_topics  # type: ignore[attr-defined]
    s.chain = chain  # type: ignore[attr-defined]
    w.sessions.add(s)  # type: ignore[arg-type]
    fr = other_send("b")
    assert s.c2u.scan(fr.data, 0, len(fr.data))[0] == EV_FORWARD  # type: ignore[attr-defined]
    w.reload(cfg(gray("b", "c")))
    assert s.c2u.policy_topics == [retry, b"b", b"c"] and s.chain is w.chains["broker"]  # type: ignore[attr-defined]
    assert s.c2u.scan(fr.data, 0, len(fr.data))[0] == EV_POLICY  # type: ignore[attr-defined]
    w.reload(cfg(None))  # [gray] off
    assert s.c2u.policy_topics is None  # type: ignore[attr-defined]
    assert s.c2u.scan(fr.data, 0, len(fr.data))[0] == EV_FORWARD  # type: ignore[attr-defined]


@pytest.mark.parametrize("v2", [True, False])
def test_reply_messages_of_split_topics_are_rewritten_like_sends(v2: bool) -> None:
    """SEND_REPLY_MESSAGE(_V2) carries a send header and the broker stores the message in the header's
    topic and queue: a reply to a split topic's gray queue is moved like a send."""
    f, _, _ = make_filter(k=1, queues=4)
    fr = send(3, {"KEYS": "k1"}, v2=v2)
    cmd = decode_frame(fr.data)
    cmd = RemotingCommand(C.SEND_REPLY_MESSAGE_V2 if v2 else C.SEND_REPLY_MESSAGE, opaque=33,
                          ext_fields=cmd.ext_fields, body=cmd.body)
    fr = frame_of(cmd)
    assert f.on_request(FakeSession(), fr) is None
    assert decode_frame(fr.data).ext_fields["e" if v2 else "queueId"] == "0"  # type: ignore[index]


def _raw_send(header: bytes) -> Frame:
    body = b"hello"
    data = (4 + len(header) + len(body)).to_bytes(4, "big") + len(header).to_bytes(4, "big") + header + body
    return Frame(data, C.SEND_MESSAGE_V2, 0, 30)


@pytest.mark.parametrize("header", [
    # the topic written with spaces (fastjson and the scanner read it), a plain decoy in a nested
    # object of a top-level field the broker ignores
    b'{"code":310,"flag":0,"opaque":30,"x":{"b":"decoy"},"extFields":{"a":"pg","b" : "orders","e":"3","n":"broker-a"}}',
    b'{"code":310,"flag":0,"opaque":30,"b":"decoy","extFields":{"a":"pg","b" :"orders","e":"3","n":"broker-a"}}',
])
def test_send_topic_decoys_do_not_skip_the_rewrite(header: bytes) -> None:
    """The split topic the broker reads is the one the filter decides on, whatever a quick byte search
    of the header finds."""
    f, _, _ = make_filter(k=1, queues=4)
    fr = _raw_send(header)
    cmd = decode_frame(fr.data)
    assert send_fields(cmd.code, cmd.ext_fields)["b"] == T  # the codec reads what the broker reads
    assert f.on_request(FakeSession(), fr) is None
    assert decode_frame(fr.data).ext_fields["e"] == "0"  # type: ignore[index]


@pytest.mark.parametrize("v2", [True, False])
def test_reply_messages_of_split_topics_reach_the_filter_through_the_chain(scanner: tuple[Any, Any],
                                                                          v2: bool) -> None:
    """The scanner hands a split topic's reply message to policy and the chain gives it to the gray
    filter (not only the send codes): it leaves the gray queue like a send."""
    scanner_cls, stats_cls = scanner
    f, _, _ = make_filter(k=1, queues=4)
    chain = FilterChain([f, KeepSendsInFlight()])
    cmd = decode_frame(send(3, {"KEYS": "k1"}, v2=v2).data)
    code = C.SEND_REPLY_MESSAGE_V2 if v2 else C.SEND_REPLY_MESSAGE
    fr = frame_of(RemotingCommand(code, opaque=34, ext_fields=cmd.ext_fields, body=cmd.body))
    sc = scanner_cls(stats_cls(), actions=chain.request_actions)
    sc.policy_topics = chain.policy_topics
    assert sc.scan(fr.data, 0, len(fr.data)) == (EV_POLICY, 0, len(fr.data))
    handed = Frame(fr.data, sc.code, sc.flag, sc.opaque, sc.limited)
    assert chain.on_request(FakeSession(), handed).kind is Kind.PASS
    assert decode_frame(handed.data).ext_fields["e" if v2 else "queueId"] == "0"  # type: ignore[index]


def send_back(origin_topic: str = T, grp: str = G, opaque: int = 50, language: str = "JAVA") -> Frame:
    return frame_of(RemotingCommand(C.CONSUMER_SEND_MSG_BACK, opaque=opaque, language=language, ext_fields={
        "group": grp, "originTopic": origin_topic, "offset": "1234", "delayLevel": "0", "originMsgId": "AB",
        "maxReconsumeTimes": "16"}))


def retry_send(opaque: int = 60) -> Frame:
    ext = {"a": "CLIENT_INNER_PRODUCER", "b": f"%RETRY%{G}", "c": "TBW102", "d": "4", "e": "0", "f": "0",
           "g": "1", "h": "0", "i": format_properties({"RETRY_TOPIC": T, "DELAY": "3"}), "j": "1", "k": "false"}
    return frame_of(RemotingCommand(C.SEND_MESSAGE_V2, opaque=opaque, ext_fields=ext, body=b"again"))


def test_gray_consumers_retries_stay_with_them_while_the_gray_side_owns_its_queues() -> None:
    f, clock, cmds = make_filter(k=1, queues=4)
    gray, normal = FakeSession(), FakeSession()
    heartbeat(f, gray, "127.0.0.1@canary-1")
    heartbeat(f, normal, "127.0.0.1@app-1")
    for fr in (send_back(), retry_send()):  # a running canary: refused, the client consumes it again itself
        v = f.on_request(gray, fr)
        assert v is not None and v.kind is Kind.REPLY
        r = decode_frame(v.data)
        assert r.code == C.NO_PERMISSION and r.opaque == fr.opaque and "stays with it" in (r.remark or "")
        assert f.on_request(normal, fr) is None  # the normal side's retries: to the retry topic
    # rocketmq-client-go counts any answer as "sent back": its send-back is left unanswered (it times out)
    v = f.on_request(gray, send_back(language="GO"))
    assert v is not None and v.kind is Kind.DIVERT
    assert f.on_request(gray, send_back(language="CPP")) is None  # unknown whether it retries locally: passed
    assert f.on_request(gray, send_back(origin_topic="other")) is None  # other topics: the normal side's
    assert f.on_request(gray, send_back(grp="not-gray")) is None
    assert f.on_request(FakeSession(), send_back()) is None  # no heartbeat seen: the broker decides
    cmds.cmds[G] = ("promote", clock.t - 1)  # a promote's drain: the gray side still owns its queues
    assert f.on_request(gray, send_back()).kind is Kind.REPLY  # type: ignore[union-attr]
    cmds.cmds[G] = ("abort", clock.t - 1)  # an abort: the normal side takes the retries
    assert f.on_request(gray, send_back()) is None and f.on_request(gray, retry_send()) is None
    cmds.cmds[G] = ("promote", clock.t - 1000)  # promoted: one group
    assert f.on_request(gray, send_back()) is None
