"""Order of cross-cloud copies per source queue: the sender's lanes through a remote outage and a
missing route, the deliver process's hold across a worker crash, and the worker's replay
announcement (hello ``replaying`` + ``D``) on a real Unix socket and a real RocksDB spill."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gevent
import pytest
from gevent import socket
from gevent.server import StreamServer

from rmqfast import config as config_mod
from rmqfast.clouds.remoting import RemoteError
from rmqfast.codec.command import RemotingCommand
from rmqfast.deliver import protocol as P
from rmqfast.deliver.hold import OrderHold
from rmqfast.deliver.sender import QUERY_MESSAGE, QUERY_NOT_FOUND, Item, RemoteSender, _Route, uniq_key
from rmqfast.replicate.filter import ReplicateFilter
from rmqfast.replicate.replicator import Replicator
from rmqfast.spill.record import CopyRecord


def wait_for(pred: Any, timeout: float = 10.0) -> None:
    with gevent.Timeout(timeout, AssertionError(f"condition not met within {timeout} s")):
        while not pred():
            gevent.sleep(0.005)


class FakeRemote:
    """Stands in for the remote name server and broker of a RemoteSender: ``no_route`` (the name
    server has no route: B's broker is gone from it), ``down`` (sends fail: the broker died),
    ``fail_once`` (these copies fail once: the broker died with them in flight)."""

    def __init__(self) -> None:
        self.down = False
        self.no_route = False
        self.stored: list[tuple[int, int]] = []  # (remote queue id, index) in B's order
        self.fail_once: set[int] = set()
        self.lose_answer: set[int] = set()  # stored, but the answer is lost (broker killed after storing)
        self.queries = 0
        self.requests = 0
        self.away = 0  # attempts while away

    def route(self, topic: str, *, force: bool = False) -> _Route:
        if self.no_route:
            self.away += 1
            raise RemoteError("remote name server 127.0.0.1:1 has no route (test)")
        return _Route({"broker-b": "127.0.0.1:2"}, [("broker-b", q) for q in range(4)], 0.0)

    def request(self, addr: str, code: int, ext: dict[str, str], body: bytes, *, timeout: float = 3.0
                ) -> RemotingCommand:
        self.requests += 1
        if self.down:
            self.away += 1
            raise RemoteError(f"connection to {addr} refused (test)")
        if code == QUERY_MESSAGE:
            self.queries += 1
            assert ext["_UNIQUE_KEY_QUERY"] == "true" and ext["topic"] == "T1"
            found = any(f"U{i}" == ext["key"] for _, i in self.stored)
            return RemotingCommand(code=0 if found else QUERY_NOT_FOUND, opaque=0, flag=1)
        idx = int(body.decode().split("-")[1])
        if idx in self.fail_once:
            self.fail_once.discard(idx)
            raise RemoteError(f"connection to {addr} reset (test)")
        self.stored.append((int(ext["e"]), idx))
        if idx in self.lose_answer:
            self.lose_answer.discard(idx)
            raise RemoteError(f"{addr}: connection closed before the answer (test)")
        return RemotingCommand(code=0, opaque=0, flag=1)


def record(idx: int, queue: int) -> CopyRecord:
    return CopyRecord(topic="T1", body=f"body-{idx}".encode(), queue_id=queue, broker_name="broker-a",
                      properties=f"KEYS\x01k{idx}\x02UNIQ_KEY\x01U{idx}\x02")


@pytest.fixture
def remote_sender() -> Iterator[tuple[RemoteSender, FakeRemote]]:
    s = RemoteSender("cloud-b", ["127.0.0.1:1"], "cloud-a", retry_initial=0.001, retry_max=0.005)
    fake = FakeRemote()
    s.route = fake.route  # type: ignore[method-assign]
    s.pool.request = fake.request  # type: ignore[method-assign]
    yield s, fake
    s.close()


def test_copies_submitted_without_a_route_keep_their_place_behind_older_ones(remote_sender: Any) -> None:
    """The bug of issue 32: copies submitted while B had no route went to a lane of their own and
    raced the older ones once B was back.  Lanes are per source queue, whatever the route."""
    sender, fake = remote_sender
    acked: list[int] = []

    def submit(i: int) -> None:
        sender.submit(Item(i, record(i, i % 2), b"", lambda s, st: acked.append(s), lambda: True))

    fake.fail_once = {1}  # the broker dies with this one in flight...
    submit(0)
    submit(1)
    wait_for(lambda: fake.requests >= 2)
    fake.down = True  # ...and stays away: the copies already submitted retry
    for i in range(2, 6):
        submit(i)
    wait_for(lambda: fake.away >= 4)
    fake.no_route = True  # then its route is gone too: new copies find no route
    fake.away = 0
    for i in range(6, 40):
        submit(i)
    wait_for(lambda: fake.away >= 10)
    fake.down = fake.no_route = False
    wait_for(lambda: len(acked) == 40)
    for q in (0, 1):
        got = [i for qq, i in fake.stored if qq == q]
        assert got == [i for i in range(40) if i % 2 == q], f"remote queue {q}: {got}"
    assert set(sender.lanes) == {("T1", "broker-a", 0), ("T1", "broker-a", 1)}
    assert sender.up and sender.retries >= 10  # the outage was seen, and its end


def test_a_lane_skips_the_copies_of_a_worker_that_went_away(remote_sender: Any) -> None:
    sender, fake = remote_sender
    acked: list[int] = []
    alive = {"old": True}
    for i in range(3):
        sender.submit(Item(i, record(i, 0), b"", lambda s, st: acked.append(s), lambda: alive["old"]))
    alive["old"] = False  # the worker's link broke: it sends them again
    for i in range(3):
        sender.submit(Item(10 + i, record(i, 0), b"", lambda s, st: acked.append(s), lambda: True))
    wait_for(lambda: len(acked) == 3)
    assert [i for _, i in fake.stored] == [0, 1, 2]
    assert acked == [10, 11, 12]


class Recorder:
    def __init__(self) -> None:
        self.order: list[Any] = []

    def submit(self, sender: Any, item: Any) -> None:
        self.order.append(item)


def test_hold_parks_other_workers_until_the_replay_was_handed_over() -> None:
    rec = Recorder()
    hold = OrderHold(30.0, rec.submit)
    hold.admit(1, None, "w1-a")
    hold.lost(0)
    hold.admit(1, None, "w1-b")  # the producer moved to worker 1: parked
    hold.admit(1, None, "w1-c")
    hold.hello(0, True)  # the replacement replays its spill
    hold.admit(0, None, "w0-old-1")
    hold.admit(0, None, "w0-old-2")
    assert rec.order == ["w1-a", "w0-old-1", "w0-old-2"] and len(hold.parked) == 2
    hold.replayed(0)
    assert rec.order == ["w1-a", "w0-old-1", "w0-old-2", "w1-b", "w1-c"]
    assert not hold.held and not hold.parked and hold.released == 1 and hold.timed_out == 0


def test_a_replacement_with_nothing_to_replay_releases_at_hello() -> None:
    rec = Recorder()
    hold = OrderHold(30.0, rec.submit)
    hold.lost(0)
    hold.admit(1, None, "x")
    assert rec.order == []
    hold.hello(0, False)
    assert rec.order == ["x"]


def test_a_hold_is_bounded_and_counted() -> None:
    rec = Recorder()
    hold = OrderHold(0.05, rec.submit)
    hold.lost(3)
    hold.admit(1, None, "x")
    assert rec.order == []
    wait_for(lambda: rec.order == ["x"])
    assert hold.timed_out == 1 and not hold.held


def test_no_hold_when_disabled() -> None:
    rec = Recorder()
    hold = OrderHold(0.0, rec.submit)
    hold.lost(0)
    hold.admit(1, None, "x")
    assert rec.order == ["x"]


class HelloRecorder:
    """A deliver process stand-in recording hellos, copies and replay announcements in order."""

    def __init__(self, path: Path, unlink: bool = False) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        if unlink:
            path.unlink()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen(8)
        self.events: list[Any] = []
        self.kinds: list[int] = []
        self.server = StreamServer(self.sock, self._handle)
        self.server.start()

    def _handle(self, s: socket.socket, _addr: Any) -> None:
        reader = P.FrameReader()
        while True:
            try:
                data = s.recv(65536)
            except OSError:
                return
            if not data:
                return
            for kind, payload in reader.feed(data):
                if kind == P.HELLO:
                    self.events.append(("hello", json.loads(payload)["replaying"]))
                elif kind == P.REPLAYED:
                    self.events.append(("replayed",))
                elif kind in (P.COPY, P.RESEND):
                    seq, _remote, raw = P.parse_copy(memoryview(payload))
                    self.events.append(("copy", CopyRecord.decode(raw).body))
                    self.kinds.append(kind)
                    s.sendall(P.ack_frame(seq, P.ACK_DELIVERED))

    def close(self) -> None:
        self.server.close()


def test_a_worker_with_an_inherited_spill_announces_its_replay() -> None:
    with tempfile.TemporaryDirectory(prefix="ro") as d:  # a Unix socket path must fit 107 bytes
        tmp = Path(d)
        cfg = config_mod.from_dict({
            "proxy": {"state_dir": str(tmp)},
            "namesrv": {"upstreams": ["127.0.0.1:9876"]},
            "clouds": {"local": "cloud-a", "remote": [{"name": "cloud-b", "namesrv": ["127.0.0.1:1"]}]},
            "replicate": {"durability": "durable", "topic": [{"name": "T1", "replicate": "always"}]},
        })
        from test_replicate import FakeSession, response, send_frame

        rep = Replicator(cfg, 0)
        flt = ReplicateFilter(cfg, rep, None)
        sess = FakeSession()
        for i in range(5):
            flt.on_request(sess, send_frame(i, idx=i))
            flt.on_response(sess, response(i))
        rep.close()  # killed with 5 copies in its spill (durable: all synced)
        fake = HelloRecorder(P.socket_path(tmp, 0))
        rep2 = Replicator(cfg, 0)
        flt2 = ReplicateFilter(cfg, rep2, None)
        rep2.start()
        try:
            for i in range(5, 8):  # newer sends taken by the replacement while it replays
                flt2.on_request(sess, send_frame(i, idx=i))
                flt2.on_response(sess, response(i))
            wait_for(lambda: ("replayed",) in fake.events and len([e for e in fake.events if e[0] == "copy"]) == 8)
            assert fake.events[0] == ("hello", True)
            copies = [e[1] for e in fake.events if e[0] == "copy"]
            assert copies == [f"body-{i}".encode() for i in range(8)]
            r = fake.events.index(("replayed",))
            assert [e[1] for e in fake.events[:r] if e[0] == "copy"][:5] == [f"body-{i}".encode() for i in range(5)]
            assert not rep2.replaying
            # the inherited copies may have reached B before the crash: B is asked before sending them
            assert fake.kinds == [P.RESEND] * 5 + [P.COPY] * 3
        finally:
            rep2.close()
            fake.close()
        fake = HelloRecorder(P.socket_path(tmp, 0), unlink=True)
        rep3 = Replicator(cfg, 2)  # a worker with an empty spill has nothing to replay (deliver 2 mod 1)
        rep3.start()
        try:
            wait_for(lambda: bool(fake.events))
            assert fake.events == [("hello", False)]
        finally:
            rep3.close()
            fake.close()


def test_order_hold_max_is_checked_and_travels_to_the_deliver_processes() -> None:
    from rmqfast.errors import ConfigError

    base = {"namesrv": {"upstreams": ["127.0.0.1:9876"]}}
    with pytest.raises(ConfigError,
                       match=r"replicate.order_hold_max: -1 is not allowed; expected a duration from 0ms to 1h"):
        config_mod.from_dict({**base, "replicate": {"order_hold_max": -1}})
    assert config_mod.from_dict(base).replicate.order_hold_max == 30.0
    cfg = config_mod.from_dict({**base, "replicate": {"order_hold_max": 5}})
    assert config_mod.from_json(cfg.to_json()).replicate.order_hold_max == 5.0


def test_a_copy_stored_without_an_answer_is_not_stored_twice(remote_sender: Any) -> None:
    """B's broker killed after storing a copy, before answering: the retry asks B for the copy's
    UNIQ_KEY first and does not send it again; a copy handed over again after a crash (RESEND)
    is looked up too, and sent when B does not have it."""
    sender, fake = remote_sender
    acked: list[tuple[int, int]] = []
    fake.lose_answer = {1}
    for i in range(4):
        sender.submit(Item(i, record(i, 0), b"", lambda s, st: acked.append((s, st)), lambda: True))
    wait_for(lambda: len(acked) == 4)
    assert [i for _, i in fake.stored] == [0, 1, 2, 3]  # 1 once
    assert sender.skipped == 1 and fake.queries == 1 and acked == [(i, 0) for i in range(4)]
    sender.submit(Item(9, record(2, 0), b"", lambda s, st: acked.append((s, st)), lambda: True, maybe_stored=True))
    sender.submit(Item(10, record(7, 0), b"", lambda s, st: acked.append((s, st)), lambda: True, maybe_stored=True))
    wait_for(lambda: len(acked) == 6)
    assert [i for _, i in fake.stored] == [0, 1, 2, 3, 7] and sender.skipped == 2 and fake.queries == 3


def test_uniq_key_is_read_from_the_properties_only_as_a_whole_key() -> None:
    assert uniq_key("a\x01b\x02UNIQ_KEY\x01ABC\x02") == "ABC"
    assert uniq_key("UNIQ_KEY\x01ABC") == "ABC"
    assert uniq_key("XUNIQ_KEY\x01ABC\x02") is None
    assert uniq_key("") is None


def test_a_copy_read_before_a_dead_workers_end_of_file_is_still_held() -> None:
    """The race seen on a loaded machine: the deliver process serves the surviving worker's socket
    before the dead worker's end-of-file.  The copy must be parked all the same."""
    from rmqfast.deliver.process import Deliverer

    with tempfile.TemporaryDirectory(prefix="rd") as d:
        cfg = config_mod.from_dict({
            "proxy": {"state_dir": d},
            "namesrv": {"upstreams": ["127.0.0.1:9876"]},
            "clouds": {"local": "cloud-a", "remote": [{"name": "cloud-b", "namesrv": ["127.0.0.1:1"]}]},
            "replicate": {"durability": "durable", "topic": [{"name": "T1", "replicate": "always"}]},
        })
        dl = Deliverer(cfg, 0)
        queued: list[Any] = []
        dl.hold.submit = lambda sender, item: queued.append(item)  # type: ignore[method-assign]
        dl.start()
        try:
            w0 = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            w1 = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            for i, w in enumerate((w0, w1)):
                w.connect(str(P.socket_path(d, 0)))
                w.sendall(P.json_frame(P.HELLO, {"worker": i, "pid": 1, "replaying": False}))
            wait_for(lambda: sorted(x.worker for x in dl.links) == [0, 1])
            for i in range(3):  # live links are never taken for closed ones
                w0.sendall(P.copy_frame(100 + i, "cloud-b", record(100 + i, 1).encode()))
                w1.sendall(P.copy_frame(200 + i, "cloud-b", record(200 + i, 0).encode()))
            wait_for(lambda: len(queued) == 6)
            assert not dl.hold.held and not dl.hold.parked and all(x.alive for x in dl.links)
            queued.clear()
            # worker 0 dies; worker 1's copy is already waiting when the deliver process next runs
            real_lost = dl.hold.lost
            seen: list[int] = []
            dl.hold.lost = lambda w: (seen.append(w), real_lost(w))  # type: ignore[method-assign]
            w0.close()
            w1.sendall(P.copy_frame(7, "cloud-b", record(7, 0).encode()))
            wait_for(lambda: len(dl.hold.parked) + len(queued) == 1 and seen)
            assert [it.seq for _, it in dl.hold.parked] == [7] and queued == [] and seen[0] == 0
            w2 = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            w2.connect(str(P.socket_path(d, 0)))
            w2.sendall(P.json_frame(P.HELLO, {"worker": 0, "pid": 3, "replaying": False}))
            wait_for(lambda: [it.seq for it in queued] == [7])
            assert seen.count(0) == 1  # the end-of-file of the dead link is not a second loss
            w1.close()
            w2.close()
        finally:
            dl.stop()
