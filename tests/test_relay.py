"""The relay session against an in-process fake broker (unit level; the real broker is in
tests/integration).  Runs with both scanner implementations."""

from __future__ import annotations

import struct

import gevent
import gevent.event
import gevent.queue
import pytest
from gevent import socket
from gevent.server import StreamServer

from rmqfast import codec
from rmqfast.codec import codes as C
from rmqfast.codec.command import RemotingCommand, decode_frame, encode, make_response
from rmqfast.config import HostPort
from rmqfast.filters.api import FilterChain
from rmqfast.filters.deny import DenyAdminCodes
from rmqfast.proxy import relay
from rmqfast.proxy.relay import RelaySettings, Session
from rmqfast.testing.wire import read_frame

# (scanner, stats, compiled pump?): the Python pump runs with both scanners, the C pump with its own.


@pytest.fixture
def impl(relay_twin):
    """(scanner class, stats class, compiled pump?) of each way a relay session runs (the
    ``relay_twin`` fixture of tests/conftest.py)."""
    return relay_twin.FrameScanner, relay_twin.ScanStats, relay_twin.pump




class FakeBroker:
    """Answers every request with SUCCESS (same opaque); on code 34 also sends a check-back (39)."""

    def __init__(self) -> None:
        self.seen: list[RemotingCommand] = []
        self.ended = 0  # connections the proxy closed
        self.server = StreamServer(("127.0.0.1", 0), self.handle)
        self.server.start()

    @property
    def addr(self) -> HostPort:
        return HostPort("127.0.0.1", self.server.server_port)

    def handle(self, sock: socket.socket, _addr: tuple) -> None:
        while True:
            data = read_frame(sock)
            if data is None:
                self.ended += 1
                return
            cmd = decode_frame(data)
            self.seen.append(cmd)
            if cmd.is_response or cmd.is_oneway:
                continue
            resp = make_response(cmd, C.SUCCESS, ext_fields={"msgId": "X", "queueId": "0", "MSG_REGION": "R"})
            out = encode(resp)
            if cmd.code == C.HEART_BEAT:
                out += encode(RemotingCommand(code=C.CHECK_TRANSACTION_STATE, opaque=777, flag=C.FLAG_ONEWAY,
                                              ext_fields={"topic": "T"}, body=b"msg"))
            sock.sendall(out)


class Events:
    def __init__(self) -> None:
        self.errors = 0

    def upstream_error(self, role: str) -> None:
        self.errors += 1

    def upstream_ok(self, session: Session, hp: HostPort) -> None:
        pass


@pytest.fixture
def proxy(impl, monkeypatch):
    Scanner, Stats, c_pump = impl
    monkeypatch.setattr(relay, "FrameScanner", Scanner)
    if not c_pump:
        monkeypatch.setattr(relay, "Pump", None)

    def wrong_pump(*args):
        raise AssertionError(f"this parametrization must not run {'the Python' if c_pump else 'the C'} pump")

    monkeypatch.setattr(Session, "_pump_py" if c_pump else "_pump_c", wrong_pump)
    broker = FakeBroker()
    stats = Stats()
    events = Events()
    chain = FilterChain([DenyAdminCodes(C.BROKER_DATA_PLANE_CODES)])
    settings = RelaySettings(4096, 16 << 20, 1 << 16, 1.0, 30.0)  # frames up to 16 MiB (large PULL answers)
    upstreams = [broker.addr]

    sessions: set[Session] = set()

    def handle(sock, addr):
        session = Session("broker", sock, f"{addr[0]}:{addr[1]}", upstreams, chain, stats, settings, events)
        sessions.add(session)
        try:
            session.run()
        finally:
            sessions.discard(session)

    server = StreamServer(("127.0.0.1", 0), handle)
    server.start()
    yield server.server_port, broker, stats, events, upstreams, sessions
    server.stop(timeout=1)
    broker.server.stop(timeout=1)


def send_frame(opaque: int, body: bytes = b"hello", code: int = C.SEND_MESSAGE_V2, flag: int = 0) -> bytes:
    return encode(RemotingCommand(code=code, opaque=opaque, flag=flag, version=401,
                                  ext_fields={"a": "PG", "b": "TopicR", "e": "-1"}, body=body))


def connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    return s


def test_pipelined_frames_split_anywhere_arrive_verbatim(proxy):
    port, broker, stats, _, _, sessions = proxy
    frames = [send_frame(i, b"x" * (i * 37 % 9000)) for i in range(200)]  # some larger than the buffer
    data = b"".join(frames)
    s = connect(port)
    for i in range(0, len(data), 1013):  # odd-sized writes split frames and headers
        s.sendall(data[i : i + 1013])
    got = {}
    with gevent.Timeout(10):
        while len(got) < 200:
            r = decode_frame(read_frame(s))
            got[r.opaque] = r
    assert sorted(got) == list(range(200)) and all(r.code == 0 for r in got.values())
    assert [encode(c) for c in broker.seen] == frames  # byte-identical upstream
    topics = {t: v for t, *v in stats.topics()}
    assert topics[b"TopicR"][0] == 200
    s.close()


def test_admin_code_answered_locally_and_not_relayed(proxy):
    port, broker, _, _, _, sessions = proxy
    s = connect(port)
    s.sendall(send_frame(1, code=C.UPDATE_BROKER_CONFIG, body=b"brokerPermission=0") + send_frame(2))
    with gevent.Timeout(5):
        a = decode_frame(read_frame(s))
        b = decode_frame(read_frame(s))
    assert (a.opaque, a.code) == (1, C.NO_PERMISSION) and "request code 25" in a.remark
    assert (b.opaque, b.code) == (2, C.SUCCESS)
    assert [c.code for c in broker.seen] == [C.SEND_MESSAGE_V2]
    s.close()


def test_broker_to_client_requests_and_oneway_flow(proxy):
    port, broker, _, _, _, sessions = proxy
    s = connect(port)
    s.sendall(send_frame(5, code=C.HEART_BEAT, body=b"{}") + send_frame(6, code=C.END_TRANSACTION, flag=C.FLAG_ONEWAY))
    with gevent.Timeout(5):
        resp = decode_frame(read_frame(s))
        check = decode_frame(read_frame(s))
    assert resp.opaque == 5 and check.code == C.CHECK_TRANSACTION_STATE and check.body == b"msg"
    with gevent.Timeout(5):
        while len(broker.seen) < 2:
            gevent.sleep(0.01)
    assert broker.seen[1].code == C.END_TRANSACTION and broker.seen[1].is_oneway
    s.close()


@pytest.mark.parametrize("garbage", [b"\x00\x00\x00\x02\x00\x00", b"\x7f\xff\xff\xff\x00\x00\x00\x10",
                                     struct.pack(">ii", 20, 9 << 24 | 4) + b"x" * 16,
                                     struct.pack(">ii", 14, 10) + b"{not json}"])
def test_garbage_closes_only_that_connection(proxy, garbage):
    port, _, stats, _, _, sessions = proxy
    good = connect(port)
    bad = connect(port)
    bad.sendall(garbage)
    with gevent.Timeout(5):
        assert bad.recv(100) == b""
    good.sendall(send_frame(9))
    with gevent.Timeout(5):
        assert decode_frame(read_frame(good)).opaque == 9
    assert stats.protocol_errors == 1
    good.close()


def test_upstream_down_answers_system_error(proxy):
    port, broker, _, events, upstreams, sessions = proxy
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    upstreams[:] = [HostPort("127.0.0.1", dead.getsockname()[1])]  # bound, not listening: refused
    s = connect(port)
    s.sendall(send_frame(3) + send_frame(4, flag=C.FLAG_ONEWAY))
    with gevent.Timeout(5):
        r = decode_frame(read_frame(s))
        assert s.recv(10) == b""
    assert r.opaque == 3 and r.code == C.SYSTEM_ERROR and "upstream unreachable" in r.remark
    assert events.errors == 1
    dead.close()


def test_namesrv_failover_to_the_next_upstream(proxy):
    port, broker, _, events, upstreams, sessions = proxy
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    upstreams[:] = [HostPort("127.0.0.1", dead.getsockname()[1]), broker.addr]
    s = connect(port)
    s.sendall(send_frame(11))
    with gevent.Timeout(5):
        assert decode_frame(read_frame(s)).code == C.SUCCESS
    assert events.errors == 1
    s.close()
    dead.close()


def wait_until(cond, timeout: float = 5.0) -> None:
    with gevent.Timeout(timeout):
        while not cond():
            gevent.sleep(0.01)


def test_client_close_closes_the_upstream_connection(proxy):
    port, broker, _, _, _, sessions = proxy
    s = connect(port)
    s.sendall(send_frame(1))
    with gevent.Timeout(5):
        assert decode_frame(read_frame(s)).code == C.SUCCESS
    s.close()  # the upstream pump is waiting for the broker: it must wake and close its side
    wait_until(lambda: broker.ended == 1)
    wait_until(lambda: not sessions)


def test_upstream_close_closes_the_client_connection(proxy):
    port, _, _, _, upstreams, sessions = proxy
    quitter = StreamServer(("127.0.0.1", 0), lambda sock, addr: sock.close())
    quitter.start()
    upstreams[:] = [HostPort("127.0.0.1", quitter.server_port)]
    s = connect(port)
    with gevent.Timeout(5):
        assert s.recv(10) == b""
    wait_until(lambda: not sessions)
    quitter.stop(timeout=1)


def test_idle_sessions_are_closed_and_busy_ones_kept(proxy):
    port, broker, _, _, _, sessions = proxy
    idle, busy = connect(port), connect(port)
    for s in (idle, busy):
        s.sendall(send_frame(1))
        with gevent.Timeout(5):
            assert decode_frame(read_frame(s)).code == C.SUCCESS
    wait_until(lambda: len(sessions) == 2)
    gevent.sleep(0.3)
    busy.sendall(send_frame(2))
    with gevent.Timeout(5):
        assert decode_frame(read_frame(busy)).opaque == 2
    assert relay.close_idle(sessions, 0.25) == 1
    with gevent.Timeout(5):
        assert idle.recv(10) == b""
    busy.sendall(send_frame(3))
    with gevent.Timeout(5):
        assert decode_frame(read_frame(busy)).opaque == 3
    busy.close()


def test_a_connection_with_no_first_frame_is_closed_after_first_frame_timeout(proxy, caplog):
    """Half-open and slowloris clients cannot hold a connection (and a cap's slot): no frame
    within ``first_frame_timeout``, closed; a client that sent one is kept."""
    import logging
    import time

    caplog.set_level(logging.INFO)
    port, _, _, _, _, sessions = proxy
    talker, silent, partial = connect(port), connect(port), connect(port)
    talker.sendall(send_frame(1))
    with gevent.Timeout(5):
        assert decode_frame(read_frame(talker)).opaque == 1
    partial.sendall(send_frame(2)[:3])  # not even a frame's length word
    wait_until(lambda: len(sessions) == 3 and all(s.c2u is not None for s in sessions))
    settings = next(iter(sessions)).settings
    assert settings.first_frame_timeout == 10.0  # RelaySettings' default
    assert relay.close_idle(sessions, 1000, now=time.monotonic() + 9) == 0
    assert relay.close_idle(sessions, 1000, now=time.monotonic() + 11) == 2
    for c in (silent, partial):
        with gevent.Timeout(5):
            try:
                assert c.recv(10) == b""
            except ConnectionResetError:  # closed with the partial frame's bytes unread: a reset
                pass
        c.close()
    assert any("no first frame in time" in r.getMessage() for r in caplog.records)
    talker.sendall(send_frame(3))
    with gevent.Timeout(5):
        assert decode_frame(read_frame(talker)).opaque == 3
    settings.first_frame_timeout = 0  # no deadline
    late = connect(port)
    wait_until(lambda: len(sessions) == 2 and all(s.c2u is not None for s in sessions))
    assert relay.close_idle(sessions, 1000, now=time.monotonic() + 100) == 0
    late.close()
    talker.close()


def test_slow_upstream_reader_backpressure_keeps_every_byte(proxy):
    """The upstream stops reading: the relay must wait for buffer space, not drop or reorder."""
    port, _, _, _, upstreams, sessions = proxy
    got = bytearray()
    release = gevent.event.Event()

    def sluggish(sock, addr):
        release.wait(10)
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                return
            got.extend(chunk)

    slow = StreamServer(("127.0.0.1", 0), sluggish)
    slow.start()
    upstreams[:] = [HostPort("127.0.0.1", slow.server_port)]
    frames = b"".join(send_frame(i, bytes([i % 251]) * 8000, flag=C.FLAG_ONEWAY) for i in range(1200))  # ~9.6 MB
    s = connect(port)
    sender = gevent.spawn(s.sendall, frames)
    gevent.sleep(0.5)
    assert not sender.ready()  # kernel buffers are full on both hops: the relay is waiting
    release.set()
    sender.join(timeout=20)
    assert sender.successful()
    s.close()
    wait_until(lambda: len(got) == len(frames), timeout=20)
    assert bytes(got) == frames
    slow.stop(timeout=1)


def test_requests_are_timed_and_their_results_counted(proxy):
    port, broker, stats, _, _, sessions = proxy
    s = connect(port)
    oneway = send_frame(3, code=C.END_TRANSACTION, flag=C.FLAG_ONEWAY)
    s.sendall(send_frame(1) + send_frame(2, code=C.UPDATE_BROKER_CONFIG, body=b"x=1") + oneway)
    with gevent.Timeout(5):
        assert {decode_frame(read_frame(s)).opaque for _ in range(2)} == {1, 2}
    wait_until(lambda: len(broker.seen) == 2)
    results = {(codec.slot_code(slot), codec.RESULTS[r]): n for slot, r, n in stats.results()}
    assert results == {(C.SEND_MESSAGE_V2, "success"): 1, (C.UPDATE_BROKER_CONFIG, "no_permission"): 1,
                       (C.END_TRANSACTION, "oneway"): 1}
    ((slot, buckets, total_ns),) = stats.latencies()
    assert codec.slot_code(slot) == C.SEND_MESSAGE_V2 and sum(buckets) == 1 and 0 < total_ns < 5e9
    # a request still waiting when the connection closes ends as "unanswered"
    s.sendall(send_frame(4, code=C.HEART_BEAT, body=b"{}"))
    with gevent.Timeout(5):  # the heartbeat's answer, then the check-back request the fake broker sends
        assert decode_frame(read_frame(s)).opaque == 4
        assert decode_frame(read_frame(s)).code == C.CHECK_TRANSACTION_STATE
    (session,) = sessions
    session.inflight.track(0, 999, codec.code_slot(C.PULL_MESSAGE), 0)  # as if a long poll were pending
    s.close()
    wait_until(lambda: not sessions)
    results = {(codec.slot_code(slot), codec.RESULTS[r]): n for slot, r, n in stats.results()}
    assert results[(C.PULL_MESSAGE, "unanswered")] == 1 and results[(C.HEART_BEAT, "success")] == 1


def test_only_marked_responses_reach_the_filter(proxy, monkeypatch):
    """A filter marks the sends it wants answers to; the scanner stops at those answers only,
    and on_close tells the filter about the connection going away."""
    from rmqfast.filters.api import Filter, slots_of

    class Marker(Filter):
        wants_marked_responses = True

        def __init__(self) -> None:
            self.answers: list[int] = []
            self.closed = 0

        def request_slots(self) -> set[int]:
            return slots_of([C.SEND_MESSAGE_V2])

        def on_request(self, session, frame):
            frame.want_response = frame.opaque % 2 == 0
            return None

        def on_response(self, session, frame):
            self.answers.append(frame.opaque)
            return None

        def on_close(self, session) -> None:
            self.closed += 1

    port, broker, _, _, _, sessions = proxy
    marker = Marker()
    chain = FilterChain([marker])
    assert not chain.response_policy
    monkeypatch.setattr(Session, "__init__", _with_chain(Session.__init__, chain))
    s = connect(port)
    s.sendall(b"".join(send_frame(i) for i in range(1, 11)))
    with gevent.Timeout(5):
        got = sorted(decode_frame(read_frame(s)).opaque for _ in range(10))
    assert got == list(range(1, 11))
    assert sorted(marker.answers) == [2, 4, 6, 8, 10]
    s.close()
    wait_until(lambda: marker.closed == 1)


def _with_chain(init, chain):
    def patched(self, role, client, client_addr, upstreams, _chain, *args, **kwargs):
        init(self, role, client, client_addr, upstreams, chain, *args, **kwargs)

    return patched


# Frame-atomic writes and drain accounting ------------------------------------------------------


class Dribbler:
    """An upstream that answers a PULL with one large response, sent in pieces: each piece only
    when the test releases it (``go``), so the test knows the relay is in the middle of the frame."""

    def __init__(self, body_size: int, pieces: int) -> None:
        self.body = bytes(i * 7 % 251 for i in range(997)) * (body_size // 997 + 1)
        self.body = self.body[:body_size]
        self.pieces = pieces
        self.go: gevent.queue.Queue = gevent.queue.Queue()
        self.response = b""
        self.server = StreamServer(("127.0.0.1", 0), self.handle)
        self.server.start()

    @property
    def addr(self) -> HostPort:
        return HostPort("127.0.0.1", self.server.server_port)

    def handle(self, sock: socket.socket, _addr: tuple) -> None:
        while True:
            data = read_frame(sock)
            if data is None:
                return
            cmd = decode_frame(data)
            if cmd.code != C.PULL_MESSAGE:
                sock.sendall(encode(make_response(cmd, C.SUCCESS, ext_fields={"x": "y"})))
                continue
            self.response = encode(make_response(cmd, C.SUCCESS, ext_fields={"suggestWhichBrokerId": "0"},
                                                 body=self.body))
            step = -(-len(self.response) // self.pieces)
            for i in range(0, len(self.response), step):
                if self.go.get() is None:
                    return
                sock.sendall(self.response[i : i + step])


class Reader:
    """Reads everything the proxy sends to a client socket, in the background."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.got = bytearray()
        self.eof = False
        self.paused = gevent.event.Event()
        self.paused.set()
        self.greenlet = gevent.spawn(self._run)

    def _run(self) -> None:
        while True:
            self.paused.wait()
            try:
                chunk = self.sock.recv(1 << 16)
            except OSError:  # the test closed the socket
                chunk = b""
            if not chunk:
                self.eof = True
                return
            self.got += chunk

    def whole_frames(self) -> int:
        """How many whole frames the stream holds so far, if it is well formed (-1 if not)."""
        n, pos, data = 0, 0, bytes(self.got)
        while pos + 4 <= len(data):
            (length,) = struct.unpack_from(">i", data, pos)
            if length < 4:
                return -1
            if pos + 4 + length > len(data):
                break
            n += 1
            pos += 4 + length
        return n

    def frames(self) -> list:
        """The stream split into frames; fails on any frame that is not well formed."""
        out, pos, data = [], 0, bytes(self.got)
        while pos < len(data):
            (length,) = struct.unpack_from(">i", data, pos)
            assert 4 <= length <= len(data) - pos - 4, f"frame at {pos} claims {length} bytes: stream corrupted"
            out.append(decode_frame(data[pos : pos + 4 + length]))
            pos += 4 + length
        return out


def settle(cond, timeout: float = 10.0) -> None:
    """Wait for ``cond``; on a timeout go on, so that the assertions after it say what is wrong."""
    try:
        wait_until(cond, timeout)
    except gevent.Timeout:
        pass


def pull_frame(opaque: int) -> bytes:
    return encode(RemotingCommand(code=C.PULL_MESSAGE, opaque=opaque, version=401,
                                  ext_fields={"consumerGroup": "G", "topic": "TopicR", "queueId": "0"}))


def denied_frame(opaque: int) -> bytes:
    return send_frame(opaque, code=C.UPDATE_BROKER_CONFIG, body=b"brokerPermission=0")


def no_permission_count(stats) -> int:
    return sum(n for slot, r, n in stats.results()
               if codec.slot_code(slot) == C.UPDATE_BROKER_CONFIG and codec.RESULTS[r] == "no_permission")


def test_local_answers_never_split_a_forwarded_frame(proxy):
    """A slow upstream dribbles a 6 MB PULL answer while the client's denied admin requests are
    answered by the proxy: each answer comes before or after the large frame, never inside it."""
    port, _, stats, _, upstreams, sessions = proxy
    up = Dribbler(6_000_000, pieces=24)
    upstreams[:] = [up.addr]
    s = connect(port)
    reader = Reader(s)
    s.sendall(send_frame(1))  # a plain send first: its answer is a whole frame before the PULL's
    wait_until(lambda: len(reader.got) > 0)
    s.sendall(pull_frame(2))
    answers = 0
    with gevent.Timeout(30):
        for piece in range(up.pieces):
            up.go.put(True)
            wait_until(lambda p=piece: len(reader.got) > len(up.response) * p // up.pieces, timeout=10)
            if piece < 6:  # the relay is now in the middle of the large frame
                s.sendall(denied_frame(100 + piece))
                answers += 1
                wait_until(lambda n=answers: no_permission_count(stats) == n)
    settle(lambda: reader.whole_frames() >= 2 + answers)
    frames = reader.frames()  # fails on the first frame that is not well formed
    assert [f.opaque for f in frames if f.code == C.NO_PERMISSION] == list(range(100, 100 + answers))
    pulls = [f for f in frames if f.opaque == 2]
    assert len(pulls) == 1 and pulls[0].body == up.body
    assert len(frames) == 2 + answers
    s.close()
    up.go.put(None)
    up.server.stop(timeout=1)


def test_local_answer_waits_while_the_relay_is_blocked_mid_frame(proxy):
    """The client stops reading: the relay waits for buffer space in the middle of the large
    frame (holding the client socket's write lock); an answer made meanwhile goes after it."""
    port, _, stats, _, upstreams, sessions = proxy
    up = Dribbler(8_000_000, pieces=1)
    upstreams[:] = [up.addr]
    s = connect(port)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
    reader = Reader(s)
    reader.paused.clear()
    s.sendall(pull_frame(2))
    up.go.put(True)
    wait_until(lambda: len(sessions) == 1)
    (session,) = sessions
    wait_until(lambda: session.client in session._outs)  # the session registers before it sets up its writers
    out = session._outs[session.client]
    wait_until(lambda: out.lock.locked(), timeout=10)  # the pump waits for the client mid-frame
    s.sendall(denied_frame(7))
    wait_until(lambda: no_permission_count(stats) == 1)
    assert out.queue  # held back: the stream to the client is inside the PULL answer
    reader.paused.set()
    settle(lambda: reader.whole_frames() >= 2)
    frames = reader.frames()
    assert [(f.opaque, f.code) for f in frames] == [(2, C.SUCCESS), (7, C.NO_PERMISSION)]
    assert frames[0].body == up.body
    s.close()
    up.server.stop(timeout=1)


def _drain(sessions, timeout: float):
    """Worker.drain over the fixture's sessions (the part of a worker it uses)."""
    from types import SimpleNamespace

    from rmqfast.proxy.health import FailoverSection
    from rmqfast.server.worker import Worker

    fake = SimpleNamespace(draining=False, listeners={}, sessions=sessions, index=0, records=None, shaper=None,
                           replication=None, delay=None, publish=lambda: None,
                           failover=SimpleNamespace(stopping=False), health_metrics=None,
                           cfg=SimpleNamespace(proxy=SimpleNamespace(drain_timeout=timeout),
                                               failover=FailoverSection()))
    return gevent.spawn(Worker.drain, fake)


def test_drain_does_not_wait_for_requests_answered_locally(proxy):
    port, _, _, _, _, sessions = proxy
    s = connect(port)
    s.sendall(denied_frame(1) + send_frame(2))
    with gevent.Timeout(5):
        assert {decode_frame(read_frame(s)).opaque for _ in range(2)} == {1, 2}
    (session,) = sessions
    assert session.in_flight == 0
    drain = _drain(sessions, timeout=60)
    drain.join(timeout=10)  # far below the drain timeout: nothing is in flight
    assert drain.successful()
    with gevent.Timeout(5):
        assert s.recv(10) == b""
    s.close()


def test_drain_waits_for_the_last_byte_of_a_response(proxy, monkeypatch):
    """A response counted at its header is still in flight until its last byte is written:
    a drain must not cut it."""
    port, _, _, _, upstreams, sessions = proxy
    up = Dribbler(3_000_000, pieces=6)
    upstreams[:] = [up.addr]
    s = connect(port)
    reader = Reader(s)
    s.sendall(pull_frame(5))
    up.go.put(True)
    wait_until(lambda: len(reader.got) > 0)  # the header went out: the scanner counted the response
    (session,) = sessions
    assert session.in_flight == 1
    checks = []
    monkeypatch.setattr(relay.Session, "in_flight", property(lambda self: checks.append(1) or _in_flight(self)))
    drain = _drain(sessions, timeout=60)
    for _piece in range(1, up.pieces):
        n = len(checks)
        wait_until(lambda n=n: len(checks) >= n + 2)  # the drain looked at the session twice meanwhile
        assert not session.closed and not drain.ready()
        up.go.put(True)
    settle(lambda: reader.whole_frames() >= 1)
    drain.join(timeout=10)
    assert drain.successful()
    (frame,) = reader.frames()
    assert frame.opaque == 5 and frame.body == up.body
    with gevent.Timeout(5):
        reader.greenlet.join()
    assert reader.eof
    s.close()
    up.server.stop(timeout=1)


_in_flight = relay.Session.in_flight.fget


def test_health_probe_connect_and_close_is_quiet(proxy, caplog, capfd):
    """A TCP health probe (connect, close) must not log a traceback: at most a debug line."""
    import logging

    port, broker, _, _, _, sessions = proxy
    caplog.set_level(logging.DEBUG)
    for _ in range(20):
        probe = connect(port)
        probe.close()
    wait_until(lambda: broker.ended == 20 and not sessions)
    s = connect(port)  # the proxy still works
    s.sendall(send_frame(1))
    with gevent.Timeout(5):
        assert decode_frame(read_frame(s)).code == C.SUCCESS
    s.close()
    wait_until(lambda: not sessions)
    noisy = [r for r in caplog.records if r.name.startswith("rmqfast") and (r.exc_info or r.levelno > logging.DEBUG)]
    assert noisy == []
    assert "Traceback" not in capfd.readouterr().err


# Memory after hostile traffic: buffer budget, shrinking, frame-completion deadline ------------


def test_frames_held_whole_are_bounded_by_the_buffer_budget(proxy, monkeypatch, caplog):
    port, broker, _, _, _, sessions = proxy
    monkeypatch.setattr(relay.BUDGET, "limit", 1 << 20)
    big_denied = send_frame(1, code=C.UPDATE_BROKER_CONFIG, body=b"p" * 3_000_000)  # policy reads it whole
    hog = connect(port)
    hog.sendall(big_denied)
    with gevent.Timeout(10):
        try:
            while hog.recv(65536):  # closed by the proxy, without relaying or answering
                pass
        except ConnectionResetError:  # closed with our bytes unread
            pass
    assert any("buffer budget" in r.getMessage() for r in caplog.records)
    wait_until(lambda: not sessions)
    assert relay.BUDGET.used == 0
    # frames no policy holds stream through whatever their size; small policy frames need no budget
    s = connect(port)
    s.sendall(send_frame(2, body=b"s" * 3_000_000) + send_frame(3, code=C.UPDATE_BROKER_CONFIG, body=b"x=1"))
    with gevent.Timeout(10):
        got = {decode_frame(read_frame(s)).opaque: None for _ in range(2)}
    assert set(got) == {2, 3} and broker.seen[-1].body == b"s" * 3_000_000
    s.close()


def test_buffer_goes_back_to_its_base_size_after_a_big_frame(proxy):
    port, _, _, _, _, sessions = proxy
    s = connect(port)
    s.sendall(send_frame(1, code=C.UPDATE_BROKER_CONFIG, body=b"p" * 2_000_000))
    with gevent.Timeout(10):
        assert decode_frame(read_frame(s)).code == C.NO_PERMISSION
    (session,) = sessions
    pump = session._outs[session.upstream].pump
    wait_until(lambda: relay.BUDGET.used == 0)  # while the connection stays open
    if hasattr(pump, "capacity"):
        assert pump.capacity == session.settings.buffer_size
    s.sendall(send_frame(2))
    with gevent.Timeout(5):
        assert decode_frame(read_frame(s)).opaque == 2
    s.close()


def test_a_frame_that_stops_arriving_is_closed_after_frame_timeout(proxy, caplog):
    import time

    port, _, _, _, _, sessions = proxy
    healthy = connect(port)
    healthy.sendall(send_frame(1))
    with gevent.Timeout(5):
        assert decode_frame(read_frame(healthy)).opaque == 1
    held = send_frame(2, code=C.UPDATE_BROKER_CONFIG, body=b"p" * 100_000)  # waits whole for policy
    streamed = send_frame(3, body=b"s" * 100_000)  # forwarded as it arrives
    stalled = []
    for frame in (held, streamed):
        c = connect(port)
        c.sendall(frame[: len(frame) // 2])
        stalled.append(c)
    wait_until(lambda: len(sessions) == 3)
    wait_until(lambda: sum(s.stalled_for(time.monotonic_ns())[1] > 0 for s in sessions) == 2)
    settings = next(iter(sessions)).settings
    later = time.monotonic() + 31
    settings.first_frame_timeout = 0  # a first frame never finished: this test looks at frame_timeout
    settings.frame_timeout = 0  # no deadline
    assert relay.close_idle(sessions, 1000, now=later) == 0
    settings.frame_timeout = 30
    assert relay.close_idle(sessions, 1000, now=time.monotonic() + 20) == 0
    assert relay.close_idle(sessions, 1000, now=later) == 2
    for c in stalled:
        with gevent.Timeout(5):
            assert c.recv(10) == b""
        c.close()
    assert any("a frame stopped arriving" in r.getMessage() for r in caplog.records)
    healthy.sendall(send_frame(4))
    with gevent.Timeout(5):
        assert decode_frame(read_frame(healthy)).opaque == 4
    healthy.close()
