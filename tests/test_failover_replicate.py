"""Sends the failover service moves are copied to remote clouds (``[clouds]`` / ``[replicate]``) like
relayed ones, with the same selection rules, once: a resent in-flight send was copied when the relay
first read it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gevent

from rmqfast.codec import codes as C
from rmqfast.deliver import protocol as P
from rmqfast.replicate.filter import ReplicateFilter
from rmqfast.replicate.replicator import Replicator
from tests.test_failover import _closed_port
from tests.test_failover_policy import moved  # noqa: F401  (fixture)
from tests.test_replicate import FakeDeliverer, make_cfg, send_frame, tmp, wait_for  # noqa: F401  (fixture)

ROUTE = {"queueDatas": [{"brokerName": "broker-a", "writeQueueNums": 4, "perm": 6},
                        {"brokerName": "broker-b", "writeQueueNums": 2, "perm": 6}]}


def _learn(svc: Any, topic: str, dead: str, live: str) -> None:
    svc.book.learn(topic, {"brokerDatas": [{"brokerName": "broker-a", "brokerAddrs": {0: dead}},
                                           {"brokerName": "broker-b", "brokerAddrs": {0: live}}], **ROUTE})


def _setup(d: Path, svc: Any, **replicate: Any) -> tuple[Replicator, FakeDeliverer]:
    cfg = make_cfg(d, **replicate)
    fake = FakeDeliverer(P.socket_path(d, 0))
    rep = Replicator(cfg, 0)
    svc.replicate = ReplicateFilter(cfg, rep, None)
    rep.start()
    return rep, fake


def test_moved_send_is_copied_once_with_the_relays_rules(moved: Any, tmp: Path) -> None:  # noqa: F811
    """Before, the moved send reached broker-b and no copy was taken; now the copy goes to cloud-b
    once broker-b stored it, a topic no rule selects is not copied, and a resend is not copied again."""
    live, dead, svc = moved
    for topic in ("T1", "Other"):
        _learn(svc, topic, dead, live.addr)
    rep, fake = _setup(tmp, svc, durability="durable", default="never")
    try:
        ans, to = svc.move(send_frame(7, idx=3).command(), dead)
        assert (ans.code, ans.opaque, to) == (C.SUCCESS, 7, live.addr)
        wait_for(lambda: len(fake.copies) == 1)
        rec = fake.copies[0][2]
        assert (fake.copies[0][1], rec.topic, rec.body) == ("cloud-b", "T1", b"body-3")
        assert svc.move(send_frame(8, topic="Other", idx=4).command(), dead)[0].code == C.SUCCESS  # no rule
        assert svc.move(send_frame(9, idx=5).command(), dead, relayed=True)[0].code == C.SUCCESS  # resent
        assert len(live.requests) == 3
        gevent.sleep(0.3)
        assert [c[2].body for c in fake.copies] == [b"body-3"]
        wait_for(lambda: rep.store.messages == 0 and not rep.inflight)
        assert rep.store.synced_messages == 1  # committed before the producer heard SUCCESS
    finally:
        rep.close()
        fake.close()


def test_moved_oneway_send_is_copied(moved: Any, tmp: Path) -> None:  # noqa: F811
    live, dead, svc = moved
    _learn(svc, "T1", dead, live.addr)
    rep, fake = _setup(tmp, svc)
    try:
        svc.move(send_frame(3, idx=1, oneway=True).command(), dead)
        wait_for(lambda: len(fake.copies) == 1)
        assert fake.copies[0][2].body == b"body-1"
    finally:
        rep.close()
        fake.close()


def test_send_no_broker_stored_is_not_copied(moved: Any, tmp: Path) -> None:  # noqa: F811
    """Every other broker unreachable: the producer gets an error and the copy is dropped."""
    live, dead, svc = moved
    _learn(svc, "T1", dead, _closed_port())
    rep, fake = _setup(tmp, svc, durability="durable")
    try:
        ans, to = svc.move(send_frame(4, idx=2).command(), dead)
        assert ans.code != C.SUCCESS and to.startswith("refused:"), (ans.code, to)
        wait_for(lambda: rep.store.messages == 0 and not rep.inflight)
        gevent.sleep(0.3)
        assert fake.copies == []
    finally:
        rep.close()
        fake.close()

