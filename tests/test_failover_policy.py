"""Sends the failover service moves obey ``[limits]`` and ``[delay]`` like relayed ones; resent ones
(already through the relay's filter chain) are not charged nor held twice."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import gevent
import pytest
from gevent import socket

from rmqfast import config as config_mod
from rmqfast.codec import codes as C
from rmqfast.codec.command import RemotingCommand, decode_frame, encode
from rmqfast.delay.service import HELD_QUEUE_OFFSET, DelayService
from rmqfast.delay.settings import parse_delay
from rmqfast.delay.store import Held
from rmqfast.limits import SHM_NAME, create_shared
from rmqfast.limits.rules import parse_limits
from rmqfast.limits.worker import WorkerLimits
from rmqfast.proxy.failover import FailoverService, RouteBook
from rmqfast.proxy.health import BrokerHealth
from rmqfast.spill.store import SpillStore
from tests.test_failover import FAST, FakeBroker, _closed_port, _read_frame, _send_v2


@pytest.fixture
def moved(tmp_path: Path) -> Any:
    """A failover service whose dead broker-a's sends go to the live broker-b (a fake broker)."""
    live = FakeBroker()
    dead = _closed_port()
    health = BrokerHealth(FAST)
    health.connect_failed(dead, "refused")
    book = RouteBook(lambda: [])
    for topic in ("T", "Delayed"):
        book.learn(topic, {"brokerDatas": [{"brokerName": "broker-a", "brokerAddrs": {0: dead}},
                                           {"brokerName": "broker-b", "brokerAddrs": {0: live.addr}}],
                           "queueDatas": [{"brokerName": "broker-a", "writeQueueNums": 4, "perm": 6},
                                          {"brokerName": "broker-b", "writeQueueNums": 2, "perm": 6}]})
    svc = FailoverService(FAST, health, book)
    yield live, dead, svc
    health.close()
    live.kill()


def _limits(tmp_path: Path, rules: list[dict[str, Any]]) -> WorkerLimits:
    create_shared(tmp_path)
    return WorkerLimits(tmp_path / SHM_NAME, parse_limits({"rule": rules}))


def test_moved_sends_take_tokens_and_over_the_limit_get_system_busy(moved: Any, tmp_path: Path) -> None:
    """Without the limits applied here, every send of a dead broker's clients reached the other broker
    whatever [limits] said: with a burst of 2, the third send is answered SYSTEM_BUSY and not moved."""
    live, dead, svc = moved
    svc.limits = _limits(tmp_path, [{"topic": "T", "rate": 0.01, "burst": 2}])
    answers = [svc.move(_send_v2(opaque=i), dead) for i in range(3)]
    assert [a.code for a, _ in answers] == [C.SUCCESS, C.SUCCESS, C.SYSTEM_BUSY]
    assert answers[2][0].opaque == 2 and "topic T is over its limit" in (answers[2][0].remark or "")
    assert answers[2][1] == "refused:send_limit"
    assert len(live.requests) == 2
    # the tokens are the relay's: the limiter's counters (published as rmqfast_limit_*) saw them
    assert svc.limits.counters() == [("T", "", 2, 1)]


def test_moved_sends_are_limited_by_their_tag(moved: Any, tmp_path: Path) -> None:
    """A topic+tag rule reads the tag from the send's properties, as the relay's scanner does."""
    live, dead, svc = moved
    svc.limits = _limits(tmp_path, [{"topic": "T", "tag": "TagA", "rate": 0.01, "burst": 1}])
    tag_a = "TAGS\x01TagA\x02UNIQ_KEY\x01x\x02"
    codes = [svc.move(_send_v2(props=p, opaque=i), dead)[0].code
             for i, p in enumerate([tag_a, tag_a, "TAGS\x01TagB\x02UNIQ_KEY\x01y\x02"])]
    assert codes == [C.SUCCESS, C.SYSTEM_BUSY, C.SUCCESS]
    assert len(live.requests) == 2


def test_resent_sends_are_not_charged_twice(moved: Any, tmp_path: Path) -> None:
    """A send resent because its broker died with it in flight took its tokens when the relay's scanner
    read it: the resend goes out even with the bucket empty, and takes nothing."""
    live, dead, svc = moved
    svc.limits = _limits(tmp_path, [{"topic": "T", "rate": 0.01, "burst": 1}])
    assert svc.move(_send_v2(opaque=1), dead)[0].code == C.SUCCESS  # the only token
    ans, to = svc.move(_send_v2(opaque=2), dead, relayed=True)
    assert ans.code == C.SUCCESS and to == live.addr and len(live.requests) == 2
    assert svc.limits.counters() == [("T", "", 1, 0)]  # the resend was not decided by the limiter at all


def test_serve_charges_the_clients_frame_size(moved: Any, tmp_path: Path) -> None:
    """Through the service's own connection loop: a byte-rate rule charges the client's whole frame
    (what the relay charges), so a frame over the byte burst is refused and a small one passes."""
    live, dead, svc = moved
    small = _send_v2(opaque=1)
    size = len(encode(small))
    svc.limits = _limits(tmp_path, [{"topic": "T", "rate": 1000, "burst": 1000, "bytes_rate": 1,
                                     "bytes_burst": size + 10}])
    a, b = socket.socketpair()
    g = gevent.spawn(svc.serve, b, "127.0.0.1:5", dead)
    try:
        buf = bytearray()
        a.sendall(encode(small))
        f = _read_frame(a, buf)
        assert f is not None and decode_frame(f).code == C.SUCCESS
        big = RemotingCommand(code=small.code, opaque=2, version=small.version, ext_fields=small.ext_fields,
                              body=b"x" * 40)
        a.sendall(encode(big))
        f = _read_frame(a, buf)
        assert f is not None and decode_frame(f).code == C.SYSTEM_BUSY and decode_frame(f).opaque == 2
        assert len(live.requests) == 1
    finally:
        a.close()
        g.join(timeout=5)


def test_shape_rule_without_a_shaper_answers_system_busy(moved: Any, tmp_path: Path) -> None:
    live, dead, svc = moved
    svc.limits = _limits(tmp_path, [{"topic": "T", "rate": 0.01, "burst": 1, "mode": "shape"}])
    assert svc.move(_send_v2(opaque=1), dead)[0].code == C.SUCCESS
    ans, to = svc.move(_send_v2(opaque=2), dead)
    assert ans.code == C.SYSTEM_BUSY and "shaping is unavailable" in (ans.remark or "") and to == "refused:shaped"
    assert len(live.requests) == 1


@pytest.fixture
def delay(tmp_path: Path) -> Any:
    cfg = parse_delay({"topics": ["Delayed"]})
    spill = SpillStore(tmp_path / "spill")
    svc = DelayService(cfg, spill.db, 0, state_dir=str(tmp_path / "state"), path=str(spill.path), publish=False)
    yield svc
    svc.close()
    spill.close()


def test_moved_delayed_send_is_held_for_the_live_master(moved: Any, delay: DelayService) -> None:
    """A send asking for proxy-held delay used to be moved to the other broker at once (the broker
    delivered it immediately or by its own timer); now it is held, addressed to the live master it
    would have gone to (that broker's name and queue), and answered as a held send."""
    live, dead, svc = moved
    svc.delay = delay
    due = int(time.time() * 1000) + 3_600_000
    cmd = _send_v2(topic="Delayed", qid=3, props=f"TIMER_DELIVER_MS\x01{due}\x02UNIQ_KEY\x01ABC\x02", opaque=9)
    ans, to = svc.move(cmd, dead)
    assert to == "held" and ans.code == C.SUCCESS and ans.opaque == 9
    ext = ans.ext_fields or {}
    assert ext["msgId"] == "ABC" and int(ext["queueOffset"]) == HELD_QUEUE_OFFSET and ext["queueId"] == "1"  # 3 % 2
    assert live.requests == [] and delay.accepted == 1
    held = [Held.decode(v) for _k, v in delay.store.scan()]
    assert [(h.addr, h.record.broker_name, h.record.queue_id, h.record.topic) for h in held] == \
        [(live.addr, "broker-b", 1, "Delayed")]
    assert "TIMER_DELIVER_MS" not in held[0].record.properties and held[0].record.body == b"hello"
    # a send of the delay topic without a delivery time is moved as before
    ans, to = svc.move(_send_v2(topic="Delayed", opaque=10), dead)
    assert ans.code == C.SUCCESS and to == live.addr and len(live.requests) == 1


def test_moved_oneway_delayed_send_is_held(moved: Any, delay: DelayService) -> None:
    """A oneway send (no answer is written) asking for proxy-held delay is held too, and not counted as
    refused."""
    live, dead, svc = moved
    svc.delay = delay
    due = int(time.time() * 1000) + 3_600_000
    cmd = _send_v2(topic="Delayed", props=f"TIMER_DELIVER_MS\x01{due}\x02UNIQ_KEY\x01ONE\x02", opaque=3)
    cmd.flag |= C.FLAG_ONEWAY
    _ans, to = svc.move(cmd, dead)
    assert to == "held" and svc.refused == 0 and live.requests == []
    deadline = time.monotonic() + 30
    while delay.accepted < 1:  # the store's group commit answers a oneway send in the background
        assert time.monotonic() < deadline, "the oneway send was not stored"
        gevent.sleep(0.01)
    assert [Held.decode(v).msg_id for _k, v in delay.store.scan()] == ["ONE"]


def test_limits_come_before_the_hold(moved: Any, tmp_path: Path, delay: DelayService) -> None:
    """The relay's chain order: a delayed send over its limit is refused, not held."""
    live, dead, svc = moved
    svc.delay = delay
    svc.limits = _limits(tmp_path, [{"topic": "Delayed", "rate": 0.01, "burst": 1}])
    due = int(time.time() * 1000) + 3_600_000
    props = f"TIMER_DELIVER_MS\x01{due}\x02UNIQ_KEY\x01ABC\x02"
    assert svc.move(_send_v2(topic="Delayed", props=props, opaque=1), dead)[1] == "held"
    ans, to = svc.move(_send_v2(topic="Delayed", props=props, opaque=2), dead)
    assert ans.code == C.SYSTEM_BUSY and to == "refused:send_limit" and delay.accepted == 1
    assert live.requests == []


def test_resent_delayed_send_is_not_held(moved: Any, delay: DelayService) -> None:
    """A resend went through the relay's delay filter already (which would have held it, had it asked for
    proxy-held delay then): it is moved as it is."""
    live, dead, svc = moved
    svc.delay = delay
    due = int(time.time() * 1000) + 3_600_000
    cmd = _send_v2(topic="Delayed", props=f"TIMER_DELIVER_MS\x01{due}\x02UNIQ_KEY\x01ABC\x02", opaque=9)
    ans, to = svc.move(cmd, dead, relayed=True)
    assert ans.code == C.SUCCESS and to == live.addr and delay.accepted == 0 and len(live.requests) == 1


@pytest.mark.usefixtures("in_process_metrics")
def test_worker_gives_the_failover_service_its_limits_and_delay(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                                ) -> None:
    """The worker wires [limits] and [delay] into the failover service (and again on reload), and its
    resend of sends in flight says they were relayed."""
    from rmqfast.server import worker as worker_mod

    raw: dict[str, Any] = {"namesrv": {"listen": "127.0.0.1:1", "upstreams": ["127.0.0.1:2"]},
                           "proxy": {"state_dir": str(tmp_path / "state")}, "failover": {"enabled": True},
                           "limits": {"rule": [{"topic": "T", "rate": 10, "burst": 10}]},
                           "delay": {"topics": ["Delayed"]}}
    cfg = config_mod.from_dict(raw)
    create_shared(tmp_path)
    w = worker_mod.Worker(cfg, 0, lambda status: None, runtime=tmp_path)
    try:
        assert w.failover.limits is w.limits is not None
        assert w.failover.delay is w.delay is not None
        assert w.failover.replicate is None  # no [clouds]: nothing to copy moved sends to
        w.listeners[cfg.namesrv.listen] = SimpleNamespace(server=None)  # reload binds nothing
        w.reload(config_mod.from_dict({k: v for k, v in raw.items() if k != "delay"}))
        assert w.failover.limits is w.limits and w.failover.delay is w.delay
        seen: dict[str, Any] = {}

        def move(cmd: Any, addr: str, peer: str = "", **kw: Any) -> Any:
            seen.update(kw)
            return cmd, "x"

        monkeypatch.setattr(w.failover, "move", move)
        data = encode(_send_v2())
        monkeypatch.setattr(worker_mod, "answer_in_flight",
                            lambda session, remark, resend, timeout: (resend(data), (0, 0, 0))[1])
        w._answer_in_flight(SimpleNamespace(client_addr="127.0.0.1:5"), "127.0.0.1:9", "gone")  # type: ignore[arg-type]
        assert seen == {"relayed": True}
    finally:
        w.health.close()
        if w.delay is not None:
            w.delay.close()


def test_a_moved_send_s_answer_has_its_offset_ids_mapped(moved: Any) -> None:
    """The answer of a moved send comes from another broker through Python, never through the relay's
    scanner: with message_addresses = "all" its msgId is mapped here (what the worker hooks in)."""
    live, dead, svc = moved
    seen: list[str] = []

    def offset_ids(value: str) -> str | None:
        seen.append(value)
        return "7F000001000075310000000000000007"

    svc.offset_ids = offset_ids
    answer, where = svc.move(_send_v2(opaque=5), dead)
    assert answer.code == C.SUCCESS and where == live.addr and answer.opaque == 5
    assert seen == ["AB"]  # the fake broker's msgId, handed to the mapping
    assert (answer.ext_fields or {})["msgId"] == "7F000001000075310000000000000007"
    assert (answer.ext_fields or {})["queueOffset"] == "7"  # the rest as the broker answered
    svc.offset_ids = lambda value: None  # nothing to map: the answer as it came
    answer, _ = svc.move(_send_v2(opaque=6), dead)
    assert (answer.ext_fields or {})["msgId"] == "AB"
