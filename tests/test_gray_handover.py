"""The hand-over at a gray phase change (rmqfast/gray/handover.py, its hooks in rmqfast/gray/filter.py):
pulls held during the fence, NOTIFY_CONSUMER_IDS_CHANGED to the group's connections, the first pull
after it from max(committed offset, own position), the old owner's commits during the fence."""

from __future__ import annotations

from typing import Any

import pytest
from test_gray import FakeSession, G, T, frame_of, heartbeat, make_filter, pull

from rmqfast.codec import codes as C
from rmqfast.codec.command import FLAG_ONEWAY, FLAG_RESPONSE, RemotingCommand, decode_frame
from rmqfast.errors import ConfigError
from rmqfast.filters.api import Kind
from rmqfast.gray.config import parse_gray
from rmqfast.gray.handover import Handover
from rmqfast.gray.rules import Phase


class Conn(FakeSession):
    """A session as the worker's tick sees it: frames the proxy writes to the client are recorded."""

    def __init__(self, addr: str) -> None:
        super().__init__(client_addr=addr)
        self.closed = False
        self.to_client = object()
        self.written: list[RemotingCommand] = []

    @property
    def _state(self) -> dict[str, Any]:
        return self.state

    def answer(self, out: Any, data: bytes, request: bool) -> None:
        assert out is self.to_client and request is False
        self.written.append(decode_frame(data))


def commit(qid: int, offset: int, opaque: int = 90) -> Any:
    return frame_of(RemotingCommand(C.UPDATE_CONSUMER_OFFSET, opaque=opaque, flag=FLAG_ONEWAY, ext_fields={
        "consumerGroup": G, "topic": T, "queueId": str(qid), "commitOffset": str(offset)}))


def offset_answer(opaque: int, offset: int) -> Any:
    return frame_of(RemotingCommand(C.SUCCESS, opaque=opaque, flag=FLAG_RESPONSE, ext_fields={"offset": str(offset)}))


def promoted_with_two_consumers() -> tuple[Any, Any, Any, Conn, Conn, Conn]:
    f, clock, cmds = make_filter(k=1, queues=4, handover=2.0)
    normal, gray, other = Conn("127.0.0.1:50001"), Conn("127.0.0.1:50002"), Conn("127.0.0.1:50003")
    heartbeat(f, normal, "127.0.0.1@app-1")
    heartbeat(f, gray, "127.0.0.1@canary-1")
    other.state["gray_cid"] = "127.0.0.1@else"  # a connection of no gray group's consumer
    f.alive_at[G] = clock.t
    f.tick([normal, gray, other])  # first sight of the group: no hand-over
    assert not normal.written and not f.handover.fenced(G, clock.t)
    return f, clock, cmds, normal, gray, other


def test_phase_change_holds_pulls_notifies_the_group_and_answers_them_empty_after_the_fence() -> None:
    f, clock, cmds, normal, gray, other = promoted_with_two_consumers()
    assert f.on_request(normal, pull(0, opaque=5, offset=40)) is None  # a canary: relayed
    cmds.cmds[G] = ("promote", clock.t - 10)
    cmds.extra[G] = {"drained_at": clock.t - 1}  # the promote ended by its drain
    f.tick([normal, gray, other])  # the worker sees the change
    assert f.handover.fenced(G, clock.t) and f.phase(G) is Phase.PROMOTED
    # the pull the broker holds is answered by the proxy at once, no message; the broker's answer is dropped
    (cut,) = normal.written
    assert cut.code == C.PULL_NOT_FOUND and cut.opaque == 5 and cut.ext_fields["nextBeginOffset"] == "40"  # type: ignore[index]
    late = frame_of(RemotingCommand(C.SUCCESS, opaque=5, flag=FLAG_RESPONSE, ext_fields={
        "suggestWhichBrokerId": "0", "nextBeginOffset": "45", "minOffset": "0", "maxOffset": "90"}, body=b"msgs"))
    v = f.on_response(normal, late)
    assert v is not None and v.kind is Kind.DIVERT
    normal.written.clear()
    v = f.on_request(gray, pull(0, opaque=6, offset=33))
    assert v is not None and v.kind is Kind.DIVERT  # held: no message to anybody during the fence
    v = f.on_request(normal, pull(2, opaque=7, offset=12))
    assert v is not None and v.kind is Kind.DIVERT
    assert not normal.written and not gray.written
    clock.t += 0.5  # a quarter in: what was delivered before is consumed; the held pulls are answered
    f.tick([normal, gray, other])
    (r,) = gray.written
    assert r.code == C.PULL_NOT_FOUND and r.opaque == 6 and r.flag & FLAG_RESPONSE and r.body == b""
    assert r.ext_fields is not None and r.ext_fields["nextBeginOffset"] == "33"  # its own position: no change
    assert [(w.opaque, w.ext_fields["nextBeginOffset"]) for w in normal.written] == [(7, "12")]  # type: ignore[index]
    v = f.on_request(gray, pull(0, opaque=8, offset=33))  # it pulls again: held to the fence's end
    assert v is not None and v.kind is Kind.DIVERT
    clock.t += 0.5  # half-way: the group's connections are told to rebalance
    f.tick([normal, gray, other])
    for conn in (normal, gray):
        n = conn.written[-1]
        assert n.code == C.NOTIFY_CONSUMER_IDS_CHANGED and n.flag == FLAG_ONEWAY
        assert n.ext_fields == {"consumerGroup": G} and n.opaque > 0x40000000  # far from the broker's
    assert other.written == []
    clock.t += 0.9
    f.tick([normal, gray, other])
    assert len(gray.written) == 2  # the fence still runs
    clock.t += 0.2
    f.tick([normal, gray, other])
    r = gray.written[-1]
    assert r.code == C.PULL_NOT_FOUND and r.opaque == 8 and r.ext_fields["nextBeginOffset"] == "33"  # type: ignore[index]
    f.tick([normal, gray, other])
    assert len(gray.written) == 3  # answered once


def test_the_last_owner_of_a_queue_commits_its_consumed_offset_and_waits_for_the_fences_end() -> None:
    f, clock, cmds, normal, gray, other = promoted_with_two_consumers()
    owning(f, gray, 3, 60, 170)  # a canary: the gray consumer pulls gray queue 3
    cmds.cmds[G] = ("promote", clock.t - 10)
    cmds.extra[G] = {"drained_at": clock.t - 1}
    f.tick([normal, gray, other])
    assert [(w.code, w.opaque) for w in gray.written] == [(C.PULL_NOT_FOUND, 60)]  # its pull at the broker
    v = f.on_request(gray, pull_with_commit(3, 70, 175, 172))
    assert v is not None and v.kind is Kind.DIVERT  # held until a quarter in
    clock.t += 0.5
    f.tick([normal, gray, other])
    assert gray.written[-1].opaque == 70
    fr = pull_with_commit(3, 71, 175, 175)  # everything consumed by now: its final position
    v = f.on_request(gray, fr)
    assert v is not None and v.kind is Kind.REWRITE and fr.want_response
    c = decode_frame(v.data)
    assert c.code == C.UPDATE_CONSUMER_OFFSET and c.ext_fields["commitOffset"] == "175"  # type: ignore[index]
    v = f.on_response(gray, frame_of(RemotingCommand(C.SUCCESS, opaque=71, flag=FLAG_RESPONSE)))
    assert v is not None and v.kind is Kind.DIVERT  # promoted: it may keep the queue; its pull waits
    assert f.on_request(gray, pull_with_commit(3, 72, 175, 175)).kind is Kind.DIVERT  # type: ignore[union-attr]
    clock.t += 1.6
    f.tick([normal, gray, other])
    assert [w.opaque for w in gray.written if w.code == C.PULL_NOT_FOUND][-2:] == [71, 72]


def test_first_pull_after_the_fence_starts_from_the_later_of_committed_and_own_position() -> None:
    f, clock, cmds, normal, gray, other = promoted_with_two_consumers()
    cmds.cmds[G] = ("promote", clock.t - 10)
    cmds.extra[G] = {"drained_at": clock.t - 1}
    f.tick([normal, gray, other])
    clock.t += 2.1
    f.tick([normal, gray, other])
    # the new owner of gray queue 3: its position (from before the old owner's last commit) is behind
    fr = pull(3, opaque=20, offset=40)
    v = f.on_request(normal, fr)
    assert v is not None and v.kind is Kind.REWRITE and fr.want_response
    assert decode_frame(v.data).code == C.QUERY_CONSUMER_OFFSET
    v = f.on_response(normal, offset_answer(20, 55))
    r = decode_frame(v.data)  # type: ignore[union-attr]
    assert r.code == C.PULL_NOT_FOUND and r.ext_fields["nextBeginOffset"] == "55"  # type: ignore[index]
    assert f.on_request(normal, pull(3, opaque=21, offset=55)) is None  # from now on relayed
    # a client ahead of the committed offset (it kept its queue, its last commits not sent yet) goes on
    # from its own position: it was given what it pulled
    fr = pull(3, opaque=22, offset=70)
    v = f.on_request(gray, fr)
    assert v is not None and v.kind is Kind.REWRITE
    r = decode_frame(f.on_response(gray, offset_answer(22, 55)).data)  # type: ignore[union-attr]
    assert r.ext_fields["nextBeginOffset"] == "70"  # type: ignore[index]


def test_a_pull_the_broker_held_across_the_change_brings_no_message() -> None:
    f, clock, cmds, normal, gray, other = promoted_with_two_consumers()
    fr = pull(0, opaque=30, offset=40)
    assert f.on_request(normal, fr) is None and fr.want_response
    cmds.cmds[G] = ("abort", clock.t)
    f.phase(G)  # seen by a frame before the worker's tick answered the pulls in flight
    late = frame_of(RemotingCommand(C.SUCCESS, opaque=30, flag=FLAG_RESPONSE, ext_fields={
        "suggestWhichBrokerId": "0", "nextBeginOffset": "45", "minOffset": "0", "maxOffset": "90"}, body=b"msgs"))
    v = f.on_response(normal, late)
    assert v is not None and v.kind is Kind.REWRITE
    r = decode_frame(v.data)
    assert r.code == C.PULL_NOT_FOUND and r.body == b"" and r.ext_fields["nextBeginOffset"] == "40"  # type: ignore[index]


def test_the_old_owners_commits_count_during_the_fence_only() -> None:
    f, clock, cmds, normal, gray, other = promoted_with_two_consumers()
    cmds.cmds[G] = ("promote", clock.t - 10)
    cmds.extra[G] = {"drained_at": clock.t - 1}
    f.tick([normal, gray, other])
    clock.t += 3
    f.tick([normal, gray, other])
    assert f.on_request(gray, pull(0, opaque=40, offset=10)).kind is Kind.REWRITE  # type: ignore[union-attr]
    f.on_response(gray, offset_answer(40, 10))
    assert f.on_request(gray, pull(0, opaque=41, offset=10)) is None  # promoted: the gray consumer owns queue 0
    cmds.cmds.pop(G)  # reset: a canary again; normal queue 0 goes back to the normal side
    cmds.extra.pop(G)
    f.tick([normal, gray, other])
    assert f.on_request(gray, commit(0, 25)) is None  # the old owner's commit as it drops the queue: kept
    clock.t += 2.1
    f.tick([normal, gray, other])
    v = f.on_request(gray, commit(0, 26, opaque=91))
    assert v is not None and v.kind is Kind.DIVERT  # after the fence: not its queue, dropped


def test_no_handover_when_off_and_config_checked() -> None:
    f, clock, cmds = make_filter(k=1, queues=4, handover=0.0)
    s = Conn("127.0.0.1:50010")
    heartbeat(f, s, "127.0.0.1@app-1")
    f.tick([s])
    cmds.cmds[G] = ("abort", clock.t - 10)
    f.tick([s])
    clock.t += 1
    f.tick([s])
    assert s.written == [] and f.on_request(s, pull(0)) is None  # relayed as before
    with pytest.raises(ConfigError, match=r"gray.handover: 0.2 is not allowed; expected 0 .* or 0.5 to 60"):
        parse_gray({"handover": 0.2})
    assert parse_gray({"handover": 0}).handover == 0.0 and parse_gray({}).handover == 2.0


def test_notify_opaques_count_down_and_wrap_above_the_brokers() -> None:
    h = Handover(2.0)
    ops = [decode_frame(h.notify_frame("g")).opaque for _ in range(3)]
    assert ops == [0x7FFFFFFF, 0x7FFFFFFE, 0x7FFFFFFD]
    h._opaque = 0x40000000
    assert [decode_frame(h.notify_frame("g")).opaque for _ in range(2)] == [0x40000000, 0x7FFFFFFF]


def pull_with_commit(qid: int, opaque: int, offset: int, committed: int) -> Any:
    return frame_of(RemotingCommand(C.PULL_MESSAGE, opaque=opaque, ext_fields={
        "consumerGroup": G, "topic": T, "queueId": str(qid), "queueOffset": str(offset), "maxMsgNums": "32",
        "sysFlag": "3", "commitOffset": str(committed), "suspendTimeoutMillis": "15000", "subVersion": "1"}))


def owning(f: Any, conn: Conn, qid: int, opaque: int, offset: int) -> None:
    """``conn`` pulls queue ``qid`` in the current phase (its first pull since a hand-over is an offset fix)."""
    v = f.on_request(conn, pull(qid, opaque=opaque, offset=offset))
    if v is not None:
        assert v.kind is Kind.REWRITE
        f.on_response(conn, offset_answer(opaque, offset))
        assert f.on_request(conn, pull(qid, opaque=opaque + 1, offset=offset)) is None


def test_a_client_losing_a_queue_it_keeps_has_its_consumed_offset_committed() -> None:
    f, clock, cmds, normal, gray, other = promoted_with_two_consumers()
    cmds.cmds[G] = ("abort", clock.t - 10)  # aborted: the normal consumer pulls gray queue 3
    f.tick([normal, gray, other])
    clock.t += 2.1
    f.tick([normal, gray, other])
    owning(f, normal, 3, 50, 100)
    cmds.cmds.pop(G)  # reset: the gray side takes queue 3 back; the normal consumer keeps it (parked)
    f.tick([normal, gray, other])
    normal.written.clear()  # the abort's notification and answers, the reset's answer to its pull in flight
    v = f.on_request(normal, pull_with_commit(3, 52, 120, 118))
    assert v is not None and v.kind is Kind.DIVERT  # held until the notification
    clock.t += 0.5
    f.tick([normal, gray, other])
    assert [w.code for w in normal.written] == [C.PULL_NOT_FOUND]  # a quarter in: the held pulls are answered
    fr = pull_with_commit(3, 53, 120, 120)  # all consumed by now: its next pull carries the final offset
    v = f.on_request(normal, fr)
    assert v is not None and v.kind is Kind.REWRITE and fr.want_response
    c = decode_frame(v.data)
    assert c.code == C.UPDATE_CONSUMER_OFFSET and c.opaque == 53 and not c.flag & FLAG_ONEWAY
    assert c.ext_fields == {"consumerGroup": G, "topic": T, "queueId": "3", "commitOffset": "120"}
    v = f.on_response(normal, frame_of(RemotingCommand(C.SUCCESS, opaque=53, flag=FLAG_RESPONSE)))
    r = decode_frame(v.data)  # type: ignore[union-attr]
    assert r.code == C.SYSTEM_BUSY and r.opaque == 53  # its pull waits; the queue is the gray side's now
    # a client that keeps its queue is not losing it: held until the fence ends, nothing committed
    owning_normal = f.on_request(normal, pull_with_commit(0, 54, 10, 10))
    assert owning_normal is not None and owning_normal.kind is Kind.DIVERT
    clock.t += 1.6
    f.tick([normal, gray, other])
    assert decode_frame(f.on_request(normal, pull(3, opaque=55)).data).code == C.SYSTEM_BUSY  # type: ignore[union-attr]


def test_a_new_owners_commit_before_its_first_pull_does_not_undo_the_old_owners() -> None:
    f, clock, cmds, normal, gray, other = promoted_with_two_consumers()
    owning(f, gray, 3, 60, 170)  # a canary: the gray consumer pulls gray queue 3
    cmds.cmds[G] = ("promote", clock.t - 10)
    cmds.extra[G] = {"drained_at": clock.t - 1}
    f.tick([normal, gray, other])  # promoted: one group; the normal consumer gets queue 3 in its rebalance
    # it read queue 3's committed offset (179) before the gray consumer's drop commit (180) and persists it
    v = f.on_request(normal, commit(3, 179, opaque=62))
    assert v is not None and v.kind is Kind.DIVERT  # dropped: it has not pulled the queue since the change
    assert f.on_request(gray, commit(3, 180, opaque=63)) is None  # the old owner's drop commit: kept
    clock.t += 2.1
    f.tick([normal, gray, other])
    owning(f, normal, 3, 64, 180)  # its first pull starts it at the committed 180; from then on it commits
    assert f.on_request(normal, commit(3, 185, opaque=66)) is None


def test_the_workers_view_of_the_command_file_runs_a_lead_behind_it(tmp_path: Any) -> None:
    import os
    import time

    from rmqfast.gray.state import Commands, write_command

    path = tmp_path / "gray.json"
    write_command(path, G, "abort", now=100.0)
    os.utime(path, (time.time() - 10, time.time() - 10))  # written 10 s ago
    c = Commands(path, interval=0.0, lead=0.5)
    assert c.command(G) == {"action": "abort", "at": 100.0}
    write_command(path, G, "promote", now=200.0)  # just written: not yet in effect for any worker
    assert c.command(G) == {"action": "abort", "at": 100.0}
    os.utime(path, (time.time() - 0.6, time.time() - 0.6))  # as if written 0.6 s ago: in effect everywhere
    assert c.command(G) == {"action": "promote", "at": 200.0}
    assert Commands(path, interval=0.0).command(G) == {"action": "promote", "at": 200.0}  # no lead: at once
