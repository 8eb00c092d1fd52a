"""Broker health, send failover decisions and the failover service, against fake brokers (gevent)."""

from __future__ import annotations

import contextlib
import dataclasses
import struct
import time
import types
from collections.abc import Iterator
from typing import Any

import gevent
import gevent.event
import pytest
from gevent import socket
from gevent.server import StreamServer

from rmqfast.codec import codes as C
from rmqfast.codec.command import RemotingCommand, decode_frame, encode, make_response
from rmqfast.config import HostPort
from rmqfast.filters.api import Frame
from rmqfast.filters.goaway import V5_3_1, GoAway
from rmqfast.proxy.failover import (
    SERVICE_NOT_AVAILABLE,
    FailoverService,
    RouteBook,
    SendInfo,
    answer_in_flight,
    candidates,
    ordered_reason,
    retarget,
    send_info,
)
from rmqfast.proxy.health import BrokerHealth, FailoverSection
from tests.test_relay import Events as RelayEvents
from tests.test_relay import connect as relay_connect
from tests.test_relay import (
    impl,  # noqa: F401  (the relay_twin's classes, for the proxy fixture and the tests below)
    proxy,  # noqa: F401  (the relay fixture: a session per parametrized pump)
    send_frame,
    wait_until,
)

_I32 = struct.Struct(">i")


def _read_frame(sock: socket.socket, buf: bytearray) -> bytes | None:
    while True:
        if len(buf) >= 4:
            (n,) = _I32.unpack_from(buf, 0)
            if len(buf) >= 4 + n:
                frame = bytes(buf[: 4 + n])
                del buf[: 4 + n]
                return frame
        chunk = sock.recv(65536)
        if not chunk:
            return None
        buf += chunk


class FakeBroker:
    """Answers every request: sends with SUCCESS (or ``answer_code``) and a queueId, others SUCCESS."""

    def __init__(self, answer_code: int = C.SUCCESS) -> None:
        self.answer_code = answer_code
        self.hung = False
        self.requests: list[RemotingCommand] = []
        self.server = StreamServer(("127.0.0.1", 0), self._handle)
        self.server.start()
        self.conns: list[socket.socket] = []

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.server.server_port}"

    def _handle(self, sock: socket.socket, _addr: Any) -> None:
        self.conns.append(sock)
        buf = bytearray()
        while True:
            try:
                frame = _read_frame(sock, buf)
            except OSError:
                return
            if frame is None:
                return
            cmd = decode_frame(frame)
            self.requests.append(cmd)
            if self.hung:
                continue  # reads, never answers (a SIGSTOPped or wedged broker keeps its sockets)
            ext = {"msgId": "AB", "queueId": (cmd.ext_fields or {}).get("e", "0"), "queueOffset": "7"}
            code = self.answer_code if cmd.code in (C.SEND_MESSAGE, C.SEND_MESSAGE_V2) else C.SUCCESS
            sock.sendall(encode(make_response(cmd, code, None, ext_fields=ext)))

    def kill(self) -> None:
        """Like kill -9: the listener and every connection close."""
        self.server.stop(timeout=0)
        for c in self.conns:
            try:
                c.close()
            except OSError:
                pass


def _closed_port() -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens: connects are refused
    return f"127.0.0.1:{port}"


def _wait(cond: Any, timeout: float = 10.0) -> None:
    with gevent.Timeout(timeout):
        while not cond():
            gevent.sleep(0.01)


def _send_v2(topic: str = "T", qid: int = 3, bname: str | None = "broker-a", props: str = "UNIQ_KEY\x01x\x02",
             sys_flag: int = 0, opaque: int = 11, version: int = 479) -> RemotingCommand:
    ext = {"a": "PG", "b": topic, "c": "TBW102", "d": "4", "e": str(qid), "f": str(sys_flag), "g": "1", "h": "0",
           "i": props, "j": "0", "k": "false", "l": "16", "m": "false"}
    if bname is not None:
        ext["n"] = bname
    return RemotingCommand(code=C.SEND_MESSAGE_V2, opaque=opaque, version=version, ext_fields=ext, body=b"hello")


FAST = FailoverSection(probe_interval=0.2, probe_interval_down=0.05, probe_timeout=0.5, send_timeout=2.0)


# Decisions -----------------------------------------------------------------------------------------


def test_send_info_reads_v1_and_v2() -> None:
    v2 = send_info(_send_v2())
    assert v2 == SendInfo("T", 3, "broker-a", "UNIQ_KEY\x01x\x02", 0, True)
    v1 = send_info(RemotingCommand(code=C.SEND_MESSAGE, ext_fields={
        "topic": "T1", "queueId": "2", "properties": "", "sysFlag": "4", "bname": "b"}))
    assert v1 == SendInfo("T1", 2, "b", "", 4, False)
    assert send_info(RemotingCommand(code=C.PULL_MESSAGE, ext_fields={"topic": "T"})) is None


def test_ordered_sends_are_recognised() -> None:
    cfg = FailoverSection(ordered_topics=["Order*"])
    assert ordered_reason(send_info(_send_v2("OrderTopic")), cfg)  # type: ignore[arg-type]
    assert ordered_reason(send_info(_send_v2(props="a\x01b\x02__SHARDINGKEY\x01k\x02")), cfg)  # type: ignore[arg-type]
    assert ordered_reason(send_info(_send_v2(props="__SHARDINGKEY\x01k")), cfg)  # type: ignore[arg-type]
    assert ordered_reason(send_info(_send_v2(sys_flag=4)), cfg)  # type: ignore[arg-type]
    assert ordered_reason(send_info(_send_v2()), cfg) is None  # type: ignore[arg-type]
    assert ordered_reason(send_info(_send_v2(props="X__SHARDINGKEY\x01k")), cfg) is None  # type: ignore[arg-type]


def test_candidates_and_retarget() -> None:
    route = ({"broker-a": "a:1", "broker-b": "b:1", "broker-c": "c:1"},
             [("broker-a", 4, 6), ("broker-b", 8, 6), ("broker-c", 4, 4)])
    assert candidates(route, set(), "broker-a", "a:1") == [("broker-b", "b:1", 8)]  # c is read-only
    assert candidates(route, {"b:1"}, "broker-a", "a:1") == []
    cmd = _send_v2(qid=11)
    out = retarget(cmd, send_info(cmd), "broker-b", 8)  # type: ignore[arg-type]
    assert out.ext_fields is not None and out.ext_fields["e"] == "3" and out.ext_fields["n"] == "broker-b"
    assert {k: v for k, v in out.ext_fields.items() if k not in "en"} == \
        {k: v for k, v in (cmd.ext_fields or {}).items() if k not in "en"}
    assert out.body == cmd.body and out.opaque == cmd.opaque
    v1 = RemotingCommand(code=C.SEND_MESSAGE, ext_fields={"topic": "T", "queueId": "5", "bname": "broker-a"})
    o1 = retarget(v1, send_info(v1), "broker-b", 4)  # type: ignore[arg-type]
    assert o1.ext_fields == {"topic": "T", "queueId": "1", "bname": "broker-b"}


# Health ---------------------------------------------------------------------------------------------


def test_health_sees_kill_at_once_and_recovery() -> None:
    broker = FakeBroker()
    h = BrokerHealth(FAST)
    changes: list[tuple[str, bool]] = []
    h.on_change(lambda a, up: changes.append((a, up)))
    try:
        h.watch([broker.addr])
        _wait(lambda: len(broker.requests) >= 1)
        assert not h.is_down(broker.addr)
        port = broker.server.server_port
        broker.kill()
        _wait(lambda: h.is_down(broker.addr), timeout=5)
        assert changes == [(broker.addr, False)]
        # the broker restarts on the same port
        broker2 = FakeBroker.__new__(FakeBroker)
        broker2.answer_code = C.SUCCESS
        broker2.hung = False
        broker2.requests = []
        broker2.conns = []
        broker2.server = StreamServer(("127.0.0.1", port), broker2._handle)
        broker2.server.start()
        _wait(lambda: not h.is_down(broker.addr), timeout=5)
        assert changes == [(broker.addr, False), (broker.addr, True)]
        broker2.kill()
    finally:
        h.close()


def test_killed_broker_is_back_for_a_new_client_before_the_next_probe() -> None:
    """A restarted broker serves new clients at once: still_down() connects, and on an accepted
    connect probes now, instead of answering "broker seen dead" until the next scheduled probe."""
    broker = FakeBroker()
    slow = FailoverSection(probe_interval=60, probe_interval_down=60, probe_timeout=2.0)
    h = BrokerHealth(slow)
    try:
        h.watch([broker.addr])
        _wait(lambda: len(broker.requests) >= 1)
        port = broker.server.server_port
        broker.kill()
        _wait(lambda: h.is_down(broker.addr), timeout=5)
        assert h.still_down(broker.addr)  # nothing listens: still down, and no wait for it
        broker2 = FakeBroker.__new__(FakeBroker)
        broker2.answer_code, broker2.hung, broker2.requests, broker2.conns = C.SUCCESS, False, [], []
        broker2.server = StreamServer(("127.0.0.1", port), broker2._handle)
        broker2.server.start()
        try:
            assert h.is_down(broker.addr)  # the next scheduled probe is a minute away
            assert not h.still_down(broker.addr)
            assert not h.is_down(broker.addr) and broker2.requests  # the probe ran and was answered
        finally:
            broker2.kill()
    finally:
        h.close()


def test_hung_broker_is_not_declared_back_by_an_accepted_connect() -> None:
    broker = FakeBroker()
    cfg = FailoverSection(probe_interval=0.05, probe_interval_down=60, probe_timeout=0.3)
    h = BrokerHealth(cfg)
    try:
        h.watch([broker.addr])
        _wait(lambda: len(broker.requests) >= 1)
        broker.hung = True
        _wait(lambda: h.is_down(broker.addr), timeout=5)
        n = len(broker.requests)
        assert h.still_down(broker.addr)  # its port accepts, which proves nothing about a hang
        assert len(broker.requests) == n  # and no probe was forced
    finally:
        h.close()
        broker.kill()


def test_hung_broker_is_down_after_two_unanswered_probes() -> None:
    broker = FakeBroker()
    cfg = FailoverSection(probe_interval=0.05, probe_interval_down=0.05, probe_timeout=0.3)
    h = BrokerHealth(cfg)
    try:
        h.watch([broker.addr])
        _wait(lambda: len(broker.requests) >= 1)
        broker.hung = True
        n = len(broker.requests)
        _wait(lambda: len(broker.requests) >= n + 1)  # one probe unanswered...
        assert not h.is_down(broker.addr)  # ...is not enough (a slow moment of a loaded machine)
        _wait(lambda: h.is_down(broker.addr), timeout=5)
        assert len(broker.requests) >= n + 2
        broker.hung = False
        _wait(lambda: not h.is_down(broker.addr), timeout=5)
    finally:
        h.close()
        broker.kill()


def test_connect_failed_marks_down_until_a_probe_answers() -> None:
    dead = _closed_port()
    h = BrokerHealth(FAST)
    try:
        h.connect_failed(dead, "refused")
        assert h.is_down(dead) and h.down() == {dead}
        gevent.sleep(0.3)
        assert h.is_down(dead)  # probes keep failing
    finally:
        h.close()


# The service ---------------------------------------------------------------------------------------


@pytest.fixture
def cluster() -> Any:
    live = FakeBroker()
    dead = _closed_port()
    health = BrokerHealth(FAST)
    health.connect_failed(dead, "refused")
    book = RouteBook(lambda: [])
    book.learn("T", {"brokerDatas": [{"brokerName": "broker-a", "brokerAddrs": {0: dead}},
                                     {"brokerName": "broker-b", "brokerAddrs": {0: live.addr}}],
                     "queueDatas": [{"brokerName": "broker-a", "writeQueueNums": 4, "perm": 6},
                                    {"brokerName": "broker-b", "writeQueueNums": 2, "perm": 6}]})
    svc = FailoverService(FAST, health, book)
    yield live, dead, health, svc
    health.close()
    live.kill()


def _serve_pair(svc: FailoverService, dead: str) -> tuple[socket.socket, Any]:
    a, b = socket.socketpair()
    g = gevent.spawn(svc.serve, b, "client:1", dead)
    return a, g


def test_send_to_dead_broker_is_moved_and_answered_with_client_opaque(cluster: Any) -> None:
    live, dead, _health, svc = cluster
    client, g = _serve_pair(svc, dead)
    buf = bytearray()
    client.sendall(encode(_send_v2(qid=3, opaque=101)) + encode(_send_v2(qid=2, opaque=102)))
    answers = {}
    for _ in range(2):
        f = _read_frame(client, buf)
        assert f is not None
        cmd = decode_frame(f)
        answers[cmd.opaque] = cmd
    assert set(answers) == {101, 102} and all(a.code == C.SUCCESS for a in answers.values())
    assert [r.ext_fields["n"] for r in live.requests] == ["broker-b", "broker-b"]  # type: ignore[index]
    assert sorted(r.ext_fields["e"] for r in live.requests) == ["0", "1"]  # type: ignore[index]  # 3%2, 2%2
    assert all(r.body == b"hello" for r in live.requests)
    assert svc.moved == 2
    # a pull is not moved: SYSTEM_ERROR naming the dead broker
    client.sendall(encode(RemotingCommand(code=C.PULL_MESSAGE, opaque=103, ext_fields={"topic": "T"})))
    f = _read_frame(client, buf)
    assert f is not None and decode_frame(f).code == C.SYSTEM_ERROR and dead in (decode_frame(f).remark or "")
    client.close()
    g.join(timeout=5)
    assert g.dead


def test_ordered_send_gets_retryable_error_not_moved(cluster: Any) -> None:
    live, dead, _health, svc = cluster
    svc.cfg = FailoverSection(**{**FAST.__dict__, "ordered_topics": ["T"]})
    client, g = _serve_pair(svc, dead)
    client.sendall(encode(_send_v2(opaque=5)))
    f = _read_frame(client, bytearray())
    assert f is not None
    ans = decode_frame(f)
    assert ans.code == SERVICE_NOT_AVAILABLE and ans.opaque == 5 and "ordered_topics" in (ans.remark or "")
    assert live.requests == []
    client.close()
    g.join(timeout=5)


def test_connection_closes_once_broker_is_back(cluster: Any) -> None:
    _live, dead, health, svc = cluster
    client, g = _serve_pair(svc, dead)
    gevent.sleep(0.1)
    assert not g.dead
    health._set(health._watches[dead], True, "")  # what a successful probe does
    g.join(timeout=5)
    assert g.dead
    assert client.recv(10) == b""  # closed: the client reconnects to its own broker


def test_next_broker_tried_after_retryable_answer() -> None:
    busy, ok = FakeBroker(answer_code=C.SYSTEM_BUSY), FakeBroker()
    dead = _closed_port()
    health = BrokerHealth(FAST)
    health.connect_failed(dead, "refused")
    book = RouteBook(lambda: [])
    book.learn("T", {"brokerDatas": [{"brokerName": n, "brokerAddrs": {0: a}} for n, a in
                                     (("a", dead), ("b", busy.addr), ("c", ok.addr))],
                     "queueDatas": [{"brokerName": n, "writeQueueNums": 4, "perm": 6} for n in "abc"]})
    svc = FailoverService(FAST, health, book)
    try:
        for i in range(4):
            ans, to = svc.move(_send_v2(bname="a", opaque=i), dead)
            assert ans.code == C.SUCCESS and ans.opaque == i and to == ok.addr
    finally:
        health.close()
        busy.kill()
        ok.kill()


def test_go_away_only_for_clients_that_reconnect_on_it() -> None:
    f = GoAway()

    class S:
        role = "broker"
        client_addr = "c"
        upstream_addr = "u"
        state: dict[str, Any] = {}

    new = encode(_send_v2(opaque=9, version=V5_3_1 + 2))
    v = f.on_request(S(), Frame(new, C.SEND_MESSAGE_V2, 0, 9))
    assert v is not None and getattr(v.kind, "value", v.kind) == "reply"
    ans = decode_frame(v.data)
    assert ans.code == C.GO_AWAY and ans.opaque == 9 and ans.is_response
    old = encode(_send_v2(opaque=9, version=401))  # 4.9.4
    assert f.on_request(S(), Frame(old, C.SEND_MESSAGE_V2, 0, 9)) is None
    oneway = encode(RemotingCommand(code=C.SEND_MESSAGE_V2, flag=C.FLAG_ONEWAY, version=V5_3_1 + 4, ext_fields={}))
    assert f.on_request(S(), Frame(oneway, C.SEND_MESSAGE_V2, C.FLAG_ONEWAY, 0)) is None


# In-flight requests of a connection (what the relay answers when its upstream dies) ------------------


def test_inflight_waiting_is_the_same_in_both_twins() -> None:
    import random

    from rmqfast import codec

    twins = [codec.InFlightPy] + ([codec.InFlightC] if codec.InFlightC is not None else [])
    rng = random.Random(7)
    ops = [(rng.randrange(2), rng.randrange(-2**31, 2**31), rng.randrange(60), rng.randrange(10**6),
            rng.random() < 0.3) for _ in range(3000)]
    got = []
    for cls in twins:
        table = cls(500)
        for d, o, slot, t, take in ops:
            if take:
                table.take(d, o)
            else:
                table.track(d, o, slot, t)
        got.append((table.waiting(0), table.waiting(1)))
    assert all(g == got[0] for g in got)
    assert got[0][0] and got[0][1]
    for cls in twins:  # oldest first; negative opaques come back as they went in
        t = cls(8)
        t.track(0, 5, 3, 100)
        t.track(0, -7, 4, 50)
        t.track(1, 9, 2, 10)
        t.track(0, 2**31 - 1, 1, 200)
        assert t.waiting(0) == [(-7, 4), (5, 3), (2**31 - 1, 1)] and t.waiting(1) == [(9, 2)]


def test_answering_in_flight_requests_of_a_client_that_went_raises_nothing() -> None:
    """The broker and then the client went: the answers cannot be written (broken pipe), and the
    close that follows must not see an error (it was logged as a failed hook before)."""
    from rmqfast import codec

    class Out:
        queue = ()

        def at_boundary(self) -> bool:
            return True

    class Stats:
        def __init__(self) -> None:
            self.results: list[tuple[int, int]] = []

        def count_result(self, slot: int, idx: int) -> None:
            self.results.append((slot, idx))

    class GoneClient:
        def __init__(self) -> None:
            self.inflight = codec.InFlightPy(8)
            self.to_client = Out()
            self.stats = Stats()
            self.state: dict[str, Any] = {}
            self.writes = 0

        def answer(self, out: Any, data: bytes, at_boundary: bool) -> None:
            self.writes += 1
            raise BrokenPipeError(32, "Broken pipe")

    s = GoneClient()
    for opaque in (1, 2, 3):
        s.inflight.track(0, opaque, 3, 100)
    answered, sends, resent = answer_in_flight(s, "gone")
    assert (answered, resent) == (0, 0) and s.writes == 1  # stopped at the first failed write


def test_relay_answers_requests_in_flight_when_the_broker_connection_dies(proxy: Any) -> None:  # noqa: F811
    """The broker reads two sends and closes its connection without answering (a kill -9): the
    client gets SYSTEM_ERROR for both, with their opaques, before its connection closes."""
    port, _broker, stats, events, upstreams, sessions = proxy
    seen: list[int] = []

    def swallow(sock: socket.socket, _addr: Any) -> None:
        buf = bytearray()
        while len(seen) < 2:
            f = _read_frame(sock, buf)
            if f is None:
                return
            seen.append(decode_frame(f).opaque)
        sock.close()

    dying = StreamServer(("127.0.0.1", 0), swallow)
    dying.start()
    upstreams[:] = [HostPort("127.0.0.1", dying.server_port)]
    lost: list[tuple[int, int]] = []
    events.upstream_lost = lambda session: lost.append(answer_in_flight(session, "rmqfast: broker gone; send again"))
    s = relay_connect(port)
    s.sendall(send_frame(41) + send_frame(42))
    buf = bytearray()
    answers = []
    with gevent.Timeout(10):
        while (f := _read_frame(s, buf)) is not None:
            answers.append(decode_frame(f))
    assert sorted(a.opaque for a in answers) == [41, 42]
    assert all(a.code == C.SYSTEM_ERROR and a.is_response and "send again" in (a.remark or "") for a in answers)
    assert lost == [(2, 2, 0)]  # answered, sends among them, resent (nothing kept here)
    wait_until(lambda: not sessions)
    dying.stop(timeout=1)


def _answers_until_closed(s: socket.socket) -> list[RemotingCommand]:
    """The frames the relay writes to the client until it closes (a reset counts as the close)."""
    buf = bytearray()
    answers = []
    with gevent.Timeout(10):
        try:
            while (f := _read_frame(s, buf)) is not None:
                answers.append(decode_frame(f))
        except ConnectionResetError:
            pass
    return answers


def _relay_mode(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from rmqfast.proxy import relay

    monkeypatch.setattr(relay, "USE_REACTOR", mode != "watchers")
    monkeypatch.setattr(relay, "USE_URING", mode == "reactor-io_uring")
    monkeypatch.setattr(relay, "_reactors", {})  # a reactor of this mode for this test
    if mode == "reactor-io_uring" and relay.Pump is not None and not relay.reactor_of(gevent.get_hub()).uring:
        pytest.skip("io_uring is not available here")


@contextlib.contextmanager
def _broker_holding_the_first_send(relayed: Any) -> Iterator[tuple[socket.socket, list[socket.socket], list[Any]]]:
    """A relayed connection to a broker that reads one frame and then holds its connection open,
    silent.  Yields (the client's socket, the broker's side of the connection, what each
    ``upstream_lost`` returned) once the broker has the client's first send (opaque 41)."""
    port, _broker, stats, events, upstreams, sessions = relayed
    conns: list[socket.socket] = []
    got_first = gevent.event.Event()
    done = gevent.event.Event()

    def hold(sock: socket.socket, _addr: Any) -> None:
        conns.append(sock)
        if _read_frame(sock, bytearray()) is not None:
            got_first.set()
        done.wait(30)

    broker = StreamServer(("127.0.0.1", 0), hold)
    broker.start()
    upstreams[:] = [HostPort("127.0.0.1", broker.server_port)]
    lost: list[Any] = []
    events.upstream_lost = lambda session: lost.append(answer_in_flight(session, "rmqfast: broker gone; send again"))
    s = relay_connect(port)
    try:
        s.sendall(send_frame(41))
        with gevent.Timeout(10):
            got_first.wait()
        yield s, conns, lost
    finally:
        done.set()
        s.close()
        broker.stop(timeout=1)


@pytest.mark.parametrize("mode", ["reactor-io_uring", "reactor-syscalls", "watchers"])
def test_a_send_failing_on_a_live_broker_connection_ends_the_session_answering_what_is_in_flight(
        proxy: Any, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """Sends to the broker fail (here: the relay's own side of the connection is shut for writing)
    while the broker's side stays open and silent: the upstream pump never meets an end.  After
    UPSTREAM_END_WAIT the session ends as that pump would have: both requests, the one the broker
    had and the one whose send failed, are answered SYSTEM_ERROR, once, and the session closes."""
    from rmqfast.proxy import relay

    _relay_mode(mode, monkeypatch)
    monkeypatch.setattr(relay, "UPSTREAM_END_WAIT", 0.3)
    sessions = proxy[5]
    with _broker_holding_the_first_send(proxy) as (s, _conns, lost):
        (session,) = sessions
        session.upstream.shutdown(socket.SHUT_WR)  # the relay's next send to it fails (EPIPE)
        s.sendall(send_frame(42))
        answers = _answers_until_closed(s)
        assert sorted(a.opaque for a in answers) == [41, 42]
        assert all(a.code == C.SYSTEM_ERROR and "send again" in (a.remark or "") for a in answers), answers
        assert lost == [(2, 2, 0)]  # once
        wait_until(lambda: not sessions)


@pytest.mark.parametrize("mode", ["reactor-io_uring", "reactor-syscalls", "watchers"])
def test_a_send_failing_on_a_reset_broker_connection_still_answers_what_is_in_flight(
        proxy: Any, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """The broker reads a send and resets its connection (a kill -9 with bytes unread) just after
    the client's next send arrived, so the relay may fail sending that one before it reads the
    reset.  The first send, which the broker had, is answered SYSTEM_ERROR all the same (and the
    second one if the relay had read it), not dropped with the connection: a client whose close
    notice loses a race waits out its whole send timeout."""
    _relay_mode(mode, monkeypatch)
    sessions = proxy[5]
    with _broker_holding_the_first_send(proxy) as (s, conns, lost):
        # No switch from here until both are in the kernel: the client's next send first, then
        # the reset (SO_LINGER 0), so one poll of the relay finds both.
        s.sendall(send_frame(42))
        conns[0].setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conns[0].close()
        answers = _answers_until_closed(s)
        opaques = sorted(a.opaque for a in answers)
        # [41] alone: the relay met the reset before it read 42 (then it closes with 42 unread,
        # which resets the client's connection after the answer)
        assert opaques in ([41], [41, 42]), opaques
        assert all(a.code == C.SYSTEM_ERROR and "send again" in (a.remark or "") for a in answers), answers
        assert lost == [(len(answers), len(answers), 0)]
        wait_until(lambda: not sessions)


def test_draining_session_close_rule() -> None:
    from rmqfast.filters.goaway import QUIET, may_close

    class S:
        def __init__(self, **state: Any) -> None:
            self.state = state

    assert may_close(S(go_away=1), 0.0)  # told to go away: it reconnects
    assert may_close(S(go_away_capable=False), 0.0)  # an old client: nothing better than closing when idle
    assert not may_close(S(), 0.0) and may_close(S(), QUIET + 0.1)  # not heard from yet: a quiet moment first
    assert not may_close(S(go_away_capable=True), 0.1)  # its next request gets GO_AWAY


def test_a_draining_worker_makes_one_go_away_chain_per_chain_not_per_session() -> None:
    """A drain puts GoAway first in every open session's chain; sessions of a role share its chain,
    so 10,000 sessions get one new chain each role (not 10,000: seconds of a blocked event loop)."""
    from rmqfast.codec import ACTION_POLICY, CODE_SLOTS
    from rmqfast.filters.api import FilterChain
    from rmqfast.filters.deny import DenyAdminCodes
    from rmqfast.filters.goaway import go_away_from_now_on

    broker, namesrv = FilterChain([DenyAdminCodes(C.BROKER_DATA_PLANE_CODES)]), FilterChain([])

    class Scanner:
        def __init__(self) -> None:
            self.actions: bytes | None = None

        def set_actions(self, actions: bytes) -> None:
            self.actions = actions

    def session(chain: FilterChain, closed: bool = False) -> Any:
        return types.SimpleNamespace(chain=chain, closed=closed, c2u=Scanner(), role="broker")

    sessions = [session(broker) for _ in range(50)] + [session(namesrv) for _ in range(3)]
    was = {id(s): s.chain for s in sessions}
    gone = session(broker, closed=True)
    go_away_from_now_on([*sessions, gone], GoAway())
    assert len({id(s.chain) for s in sessions}) == 2
    for s in sessions:
        assert isinstance(s.chain.filters[0], GoAway) and s.chain.filters[1:] == was[id(s)].filters
        assert s.c2u.actions == s.chain.request_actions == bytes([ACTION_POLICY]) * CODE_SLOTS
    assert gone.chain is broker and gone.c2u.actions is None


def test_failover_config_parses_checks_and_survives_the_worker_handoff() -> None:
    import json

    from rmqfast import config
    from rmqfast.errors import ConfigError

    base = {"namesrv": {"upstreams": ["127.0.0.1:9876"]}}
    cfg = config.from_dict({**base, "failover": {"ordered_topics": ["Orders*"], "probe_timeout": 0.5,
                                                 "hang_timeout": 0.3, "go_away": False}})
    assert cfg.failover.ordered_topics == ["Orders*"] and cfg.failover.probe_timeout == 0.5
    assert cfg.failover.hang_timeout == 0.3
    assert cfg.failover.is_ordered_topic("OrdersEU") and not cfg.failover.is_ordered_topic("Audit")
    assert config.from_json(cfg.to_json()).failover == cfg.failover
    assert json.loads(cfg.to_json())["failover"]["go_away"] is False
    for bad, says in (({"bogus": 1}, "unknown key"), ({"probe_timeout": 0}, "seconds"),
                      ({"ordered_topics": "Orders"}, "list"), ({"enabled": "yes"}, "true or false")):
        with pytest.raises(ConfigError, match=says):
            config.from_dict({**base, "failover": bad})


def test_signed_send_is_not_moved(cluster: Any) -> None:
    """A send signed with an AccessKey (ACL) is refused retryably: the signature covers the broker name
    and queue id a move would change."""
    live, dead, _health, svc = cluster
    cmd = _send_v2(opaque=77)
    cmd.ext_fields = {**(cmd.ext_fields or {}), "AccessKey": "ak", "Signature": "sig"}
    ans, to = svc.move(cmd, dead)
    assert ans.code == SERVICE_NOT_AVAILABLE and ans.opaque == 77 and to == "refused:signed"
    assert live.requests == []


def test_send_fields_read_by_code_as_the_broker_does() -> None:
    """A SEND_MESSAGE (V1) frame that also carries V2 short names is read by its V1 names (the broker
    reads it so): the topic checked for order is the one the broker stores to."""
    cfg = FailoverSection(ordered_topics=["Ord*"])
    v1 = RemotingCommand(code=C.SEND_MESSAGE, ext_fields={"topic": "OrdA", "queueId": "5", "b": "Plain", "e": "1"})
    info = send_info(v1)
    assert info is not None and info.topic == "OrdA" and info.queue_id == 5 and not info.v2
    assert ordered_reason(info, cfg)
    out = retarget(v1, info, "broker-b", 4)
    assert out.ext_fields is not None and out.ext_fields["queueId"] == "1" and out.ext_fields["e"] == "1"
    v2 = RemotingCommand(code=C.SEND_MESSAGE_V2, ext_fields={"topic": "OrdA", "b": "Plain", "e": "2"})
    assert send_info(v2) == SendInfo("Plain", 2, None, "", 0, True)


def test_requests_held_at_once_are_bounded_in_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """1024 requests of a max-size frame each would be gigabytes: reading pauses at
    MAX_IN_FLIGHT_BYTES too, and every request is still answered."""
    import rmqfast.proxy.failover as fo

    monkeypatch.setattr(fo, "MAX_IN_FLIGHT_BYTES", 3 * 1024 * 1024)
    health = BrokerHealth(FAST)
    svc = FailoverService(FAST, health, RouteBook(lambda: []))
    release = gevent.event.Event()
    busy = [0, 0]  # now, most at once

    def move(cmd: RemotingCommand, dead_addr: str, peer: str = "", **kw: Any) -> tuple[RemotingCommand, str]:
        busy[0] += 1
        busy[1] = max(busy)
        release.wait(timeout=30)
        busy[0] -= 1
        return make_response(cmd, C.SUCCESS, ""), "x"

    svc.move = move  # type: ignore[method-assign]
    health.connect_failed("127.0.0.1:1", "refused")
    client, g = _serve_pair(svc, "127.0.0.1:1")
    try:
        big = [dataclasses.replace(_send_v2(qid=0, opaque=i), body=b"z" * (1 << 20)) for i in range(8)]
        sender = gevent.spawn(client.sendall, b"".join(encode(c) for c in big))
        deadline = time.monotonic() + 20
        while busy[1] < 2 and time.monotonic() < deadline:
            gevent.sleep(0.05)
        gevent.sleep(0.5)  # the reader had time to take more if it were not bounded
        assert busy[1] == 2, busy  # 2 frames of 1 MiB and a bit fit in 3 MiB, a third does not
        release.set()
        buf = bytearray()
        got = {decode_frame(_read_frame(client, buf)).opaque for _ in range(8)}  # type: ignore[arg-type]
        assert got == set(range(8))
        sender.join(timeout=5)
    finally:
        release.set()
        client.close()
        g.join(timeout=5)
        health.close()


def test_hung_broker_with_stalled_sends_is_down_well_before_two_probe_timeouts() -> None:
    """Relayed sends stalled (the sweep's report) and a probe unanswered for hang_timeout / 2: down,
    long before the second unanswered probe_timeout."""
    broker = FakeBroker()
    cfg = FailoverSection(probe_interval=30, probe_interval_down=30, probe_timeout=5.0, hang_timeout=0.4)
    h = BrokerHealth(cfg)
    reporting = True

    def sweep() -> None:
        t0 = None
        while reporting:
            gevent.sleep(0.05)
            if broker.hung:
                t0 = t0 or time.monotonic()
                h.stalled(broker.addr, time.monotonic() - t0)

    g = gevent.spawn(sweep)
    try:
        h.watch([broker.addr])
        _wait(lambda: len(broker.requests) >= 1)
        n = len(broker.requests)
        t = time.monotonic()
        broker.hung = True
        _wait(lambda: h.is_down(broker.addr), timeout=10)
        took = time.monotonic() - t
        assert len(broker.requests) >= n + 1  # the probe the stall asked for, unanswered
        assert took < 3.0, took  # probe_timeout is 5 s: two of them would be 10 s
    finally:
        reporting = False
        g.kill()
        h.close()
        broker.kill()


def test_slow_but_alive_broker_is_not_declared_dead_by_stalled_sends() -> None:
    """Relayed sends stall (a slow store) but the broker answers its probe: never down."""
    broker = FakeBroker()
    cfg = FailoverSection(probe_interval=30, probe_interval_down=30, probe_timeout=5.0, hang_timeout=0.2)
    h = BrokerHealth(cfg)
    try:
        h.watch([broker.addr])
        _wait(lambda: len(broker.requests) >= 1)
        n = len(broker.requests)
        for k in range(20):
            h.stalled(broker.addr, 0.3 + k * 0.1)
            gevent.sleep(0.05)
        assert len(broker.requests) > n  # each report of a stall asked a probe...
        assert not h.is_down(broker.addr)  # ...which was answered
    finally:
        h.close()
        broker.kill()


def test_unread_probe_answer_in_the_socket_is_not_a_hang() -> None:
    """A worker starved of CPU has not read the probe's answer yet: the answer waiting in the socket
    counts as answered, whatever the stall reports say."""
    from rmqfast.proxy import health as health_mod

    a, b = socket.socketpair()
    try:
        assert not health_mod._readable(a)
        b.sendall(b"\x00\x00\x00\x04")
        _wait(lambda: health_mod._readable(a), timeout=2)
    finally:
        a.close()
        b.close()


def test_stalled_sends_counts_only_sends_waiting_with_nothing_read_back() -> None:
    from rmqfast import codec
    from rmqfast.codec import code_slot
    from rmqfast.proxy.failover import stalled_sends

    twins = [codec.InFlightPy] + ([codec.InFlightC] if codec.InFlightC is not None else [])
    for cls in twins:
        def session(addr: str, heard: float, tracked: list[tuple[int, int]], role: str = "broker",
                    cls: Any = cls) -> Any:
            t = cls(64)
            for k, (opaque, code) in enumerate(tracked):
                t.track(0, opaque, code_slot(code), k)
            return type("S", (), {"role": role, "closed": False, "inflight": t, "upstream_addr": addr,
                                  "heard": [heard]})()

        now = 100.0
        send, pull = C.SEND_MESSAGE_V2, C.PULL_MESSAGE
        hung = session("b1:1", 0.0, [(1, pull), (2, send)])
        talking = session("b2:1", 100.0, [(3, send)])  # the broker sent something back since
        polling = session("b3:1", 0.0, [(4, pull)])  # a long-polled pull is not a stall
        ns = session("n:1", 0.0, [(5, send)], role="namesrv")
        all_ = [hung, talking, polling, ns]
        assert stalled_sends(all_, now) == {}  # first sight: nothing has waited yet
        talking.heard[0] = now + 0.45
        got = stalled_sends(all_, now + 0.5)
        assert got == {"b1:1": 0.5, "b2:1": pytest.approx(0.05)}, got
        hung.inflight.take(0, 2)
        hung.inflight.track(0, 6, code_slot(send), 9)  # a newer send: its wait starts now
        assert stalled_sends(all_, now + 0.7).get("b1:1") is None
        assert stalled_sends(all_, now + 0.9)["b1:1"] == pytest.approx(0.2)


def test_stalled_sends_does_not_look_at_sessions_without_requests_in_flight() -> None:
    """The sweep runs ten times a second over every session of the worker: sessions with no table
    yet or an empty one are passed over without reading anything else of them."""
    from rmqfast import codec
    from rmqfast.codec import code_slot
    from rmqfast.proxy.failover import stalled_sends

    class Untouchable:
        def __init__(self, inflight: Any) -> None:
            self.inflight = inflight

        def __getattr__(self, name: str) -> Any:
            raise AssertionError(f"the sweep read {name} of a session with nothing in flight")

    twins = [codec.InFlightPy] + ([codec.InFlightC] if codec.InFlightC is not None else [])
    for cls in twins:
        emptied = cls(64)
        emptied.track(0, 1, code_slot(C.SEND_MESSAGE_V2), 0)
        emptied.take(0, 1)
        t = cls(64)
        t.track(0, 2, code_slot(C.SEND_MESSAGE_V2), 0)
        busy = type("S", (), {"role": "broker", "closed": False, "inflight": t, "upstream_addr": "b:1",
                              "heard": [0.0]})()
        sessions = {Untouchable(None), Untouchable(cls(64)), Untouchable(emptied), busy}
        assert stalled_sends(sessions, 10.0) == {}
        assert stalled_sends(sessions, 10.5) == {"b:1": 0.5}


def test_unknown_topic_route_lookups_are_cached_briefly(monkeypatch: pytest.MonkeyPatch) -> None:
    from rmqfast.clouds import remoting
    from rmqfast.proxy import failover as fo

    asked: list[str] = []
    known: dict[str, Any] = {}

    def fetch(_pool: Any, _ns: list[str], topic: str, timeout: float = 3.0) -> Any:
        asked.append(topic)
        return known.get(topic)

    monkeypatch.setattr(remoting, "fetch_route", fetch)
    book = RouteBook(lambda: ["127.0.0.1:1"])
    clock = [1000.0]
    monkeypatch.setattr(fo, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))  # this module's clock
    assert book.get("Nope") is None and book.get("Nope") is None
    assert asked == ["Nope"]  # the second send of an unknown topic did not ask again
    clock[0] += fo.UNKNOWN_TTL + 0.1
    known["Nope"] = ({"broker-b": "127.0.0.1:2"}, [("broker-b", 4, 6)])
    assert book.get("Nope") == known["Nope"]  # asked again once the short memory expired: now known
    assert book.get("Nope") == known["Nope"] and asked == ["Nope", "Nope"]


@pytest.mark.parametrize("mode", ["all", "policy-alone", "policy-with-other"])
def test_kept_sends_in_flight_are_resent_when_the_broker_connection_dies(
        relay_twin: Any, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The broker reads two sends and closes (a kill -9).  Kept sends are resent (here: a fake move
    answering SUCCESS with a queue id of its own) and the client gets those answers with its
    opaques; a send not kept (``policy`` with no other filter taking sends to Python) gets
    SYSTEM_ERROR, as before."""
    from rmqfast.filters.api import Filter as PolicyFilter
    from rmqfast.filters.api import FilterChain, Verdict
    from rmqfast.filters.deny import DenyAdminCodes
    from rmqfast.proxy import relay
    from rmqfast.proxy.failover import KeepSendsInFlight
    from rmqfast.proxy.relay import RelaySettings, Session

    scanner, stats_cls, c_pump = relay_twin.FrameScanner, relay_twin.ScanStats, relay_twin.pump
    monkeypatch.setattr(relay, "FrameScanner", scanner)
    if not c_pump:
        monkeypatch.setattr(relay, "Pump", None)

    class SeesSends(PolicyFilter):  # another filter that takes sends to Python (an allowlist, say)
        def request_slots(self) -> set[int]:
            from rmqfast.codec import code_slot
            return {code_slot(C.SEND_MESSAGE_V2)}

        def on_request(self, session: Any, frame: Any) -> Verdict | None:
            return None

    keeper = KeepSendsInFlight(everything=mode == "all")
    others: list[Any] = [SeesSends()] if mode == "policy-with-other" else []
    chain = FilterChain([DenyAdminCodes(C.BROKER_DATA_PLANE_CODES), *others, keeper])
    seen: list[int] = []

    def swallow(sock: socket.socket, _addr: Any) -> None:
        buf = bytearray()
        while len(seen) < 2:
            f = _read_frame(sock, buf)
            if f is None:
                return
            seen.append(decode_frame(f).opaque)
        sock.close()

    dying = StreamServer(("127.0.0.1", 0), swallow)
    dying.start()
    resent: list[bytes] = []

    def resend(data: bytes) -> RemotingCommand:
        resent.append(data)
        cmd = decode_frame(data)
        gevent.sleep(0.05)  # a round trip to the other broker
        return make_response(cmd, C.SUCCESS, None, ext_fields={"queueId": "1", "msgId": "M"})

    results: list[tuple[int, int, int]] = []

    class Ev(RelayEvents):
        def upstream_lost(self, session: Any) -> None:
            results.append(answer_in_flight(session, "rmqfast: broker gone; send again", resend, 5.0))

    def handle(sock: socket.socket, addr: Any) -> None:
        Session("broker", sock, f"{addr[0]}:{addr[1]}", [HostPort("127.0.0.1", dying.server_port)], chain,
                stats_cls(), RelaySettings(4096, 16 << 20, 1 << 16, 1.0, 30.0), Ev()).run()

    server = StreamServer(("127.0.0.1", 0), handle)
    server.start()
    try:
        s = relay_connect(server.server_port)
        frames = [send_frame(41), send_frame(42)]
        s.sendall(frames[0] + frames[1])
        buf = bytearray()
        answers = []
        with gevent.Timeout(10):
            while (f := _read_frame(s, buf)) is not None:
                answers.append(decode_frame(f))
        assert sorted(a.opaque for a in answers) == [41, 42]
        if mode == "policy-alone":  # nothing takes sends to Python: nothing kept, SYSTEM_ERROR as before
            assert not resent and results == [(2, 2, 0)]
            assert all(a.code == C.SYSTEM_ERROR for a in answers)
        else:
            assert sorted(resent) == sorted(frames)  # the very bytes the broker was sent
            assert results == [(2, 2, 2)]
            assert all(a.code == C.SUCCESS and a.ext_fields["queueId"] == "1" for a in answers), answers
        assert keeper.held == 0  # nothing kept once the connection closed
    finally:
        server.stop(timeout=1)
        dying.stop(timeout=1)


def test_keeper_is_bounded_and_forgets_answered_sends() -> None:
    from rmqfast import codec
    from rmqfast.codec import code_slot
    from rmqfast.proxy import failover as fo
    from rmqfast.proxy.failover import KeepSendsInFlight

    keeper = KeepSendsInFlight(everything=True)
    table = codec.InFlightPy(1000)
    session = type("S", (), {"state": {}, "inflight": table})()

    def send(opaque: int, size: int = 100) -> None:
        data = send_frame(opaque, b"x" * size)
        keeper.on_request(session, Frame(data, C.SEND_MESSAGE_V2, 0, opaque))
        table.track(0, opaque, code_slot(C.SEND_MESSAGE_V2), opaque)

    for o in range(fo.KEEP_PER_CONNECTION + 5):
        send(o)
    assert len(session.state["kept"]) == fo.KEEP_PER_CONNECTION  # the rest were not kept
    for o in range(fo.KEEP_PER_CONNECTION + 5):
        table.take(0, o)  # answered (the scanner took them)
    send(1000)
    assert list(session.state["kept"]) == [1000]  # answered sends forgotten at the next send
    assert keeper.held == session.state["kept_bytes"] == len(send_frame(1000, b"x" * 100))
    table.take(0, 1000)
    send(1001, fo.KEEP_BYTES_PER_CONNECTION)  # over the per-connection bytes: not kept
    assert session.state["kept"] == {} and keeper.held == 0
    keeper.on_close(session)
    assert keeper.held == 0


def test_resend_policy_leaves_the_fast_path_as_it_is() -> None:
    """``resend = "policy"``: the scanner's action table is the one without the keeper (sends stay
    on the compiled path); ``"all"`` hands sends to Python."""
    from rmqfast.codec import code_slot
    from rmqfast.filters.api import FilterChain
    from rmqfast.filters.deny import DenyAdminCodes
    from rmqfast.proxy.failover import KeepSendsInFlight

    base = FilterChain([DenyAdminCodes(C.BROKER_DATA_PLANE_CODES)])
    policy = FilterChain([DenyAdminCodes(C.BROKER_DATA_PLANE_CODES), KeepSendsInFlight(everything=False)])
    everything = FilterChain([DenyAdminCodes(C.BROKER_DATA_PLANE_CODES), KeepSendsInFlight(everything=True)])
    assert policy.request_actions == base.request_actions
    slot = code_slot(C.SEND_MESSAGE_V2)
    assert everything.request_actions[slot] != base.request_actions[slot]
