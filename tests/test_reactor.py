"""The compiled pumps parked in the process's reactor (one epoll set stepped in C per event-loop
turn) relay the same bytes as pumps waiting on watchers of their own, and a session closing
takes its pumps out of it."""

from __future__ import annotations

import time

import gevent
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

pytestmark = pytest.mark.skipif(codec.Pump is None or not codec.is_compiled(codec.FrameScanner),
                                reason="the reactor drives the compiled pump only")


class Echo:
    """A broker that answers every request SUCCESS with its opaque and records the bytes it read."""

    def __init__(self) -> None:
        self.raw = bytearray()
        self.server = StreamServer(("127.0.0.1", 0), self.handle)
        self.server.start()

    def handle(self, sock: socket.socket, _addr: tuple) -> None:
        while True:
            data = read_frame(sock)
            if data is None:
                return
            self.raw += data
            cmd = decode_frame(data)
            if not cmd.is_oneway:
                sock.sendall(encode(make_response(cmd, C.SUCCESS, ext_fields={"msgId": "X", "queueId": "0"})))


class Events:
    def upstream_error(self, role: str) -> None:
        pass

    def upstream_ok(self, session: Session, hp: HostPort) -> None:
        pass


@pytest.fixture(params=["uring", "syscalls", None], ids=["reactor-io_uring", "reactor-syscalls", "watchers"])
def proxy(request, monkeypatch):
    """The relay with its pumps in a reactor (whose receives and sends go through io_uring, or
    are plain system calls), or on libev watchers of their own (None)."""
    monkeypatch.setattr(relay, "USE_REACTOR", request.param is not None)
    monkeypatch.setattr(relay, "USE_URING", request.param == "uring")
    made: dict = {}
    monkeypatch.setattr(relay, "_reactors", made)  # a reactor of this mode for this test
    if request.param == "uring":
        reactor = relay.reactor_of(gevent.get_hub())
        if not reactor.uring:
            pytest.skip(f"io_uring is not available here: {reactor.uring_off}")
    broker = Echo()
    chain = FilterChain([DenyAdminCodes(C.BROKER_DATA_PLANE_CODES)])
    settings = RelaySettings(4096, 16 << 20, 1 << 16, 1.0, 30.0)
    stats = codec.ScanStats()
    sessions: list[Session] = []

    def handle(sock, addr):
        session = Session("broker", sock, f"{addr[0]}:{addr[1]}", [HostPort("127.0.0.1", broker.server.server_port)],
                          chain, stats, settings, Events())
        sessions.append(session)
        session.run()

    server = StreamServer(("127.0.0.1", 0), handle)
    server.start()
    yield server.server_port, broker, sessions, request.param is not None
    server.stop(timeout=1)
    broker.server.stop(timeout=1)
    for _reactor, watcher in made.values():
        watcher.stop()


def send(opaque: int, body: bytes) -> bytes:
    return encode(RemotingCommand(code=C.SEND_MESSAGE_V2, opaque=opaque, version=401,
                                  ext_fields={"a": "PG", "b": "TopicR", "e": "-1"}, body=body))


def test_frames_relay_byte_identical_and_parked_pumps_need_no_python(proxy):
    port, broker, sessions, reactor_on = proxy
    frames = [send(i, b"x" * (i * 53 % 7000)) for i in range(300)]
    denied = encode(RemotingCommand(code=C.UPDATE_BROKER_CONFIG, opaque=10_000, version=401, body=b"a=b"))
    data = b"".join(frames[:150]) + denied + b"".join(frames[150:])
    reactor = relay.reactor_of(gevent.get_hub()) if reactor_on else None
    before = (reactor.steps, reactor.wakeups, reactor.submits, reactor.ring_ops) if reactor is not None else (0,) * 4
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s, gevent.Timeout(20):
        for i in range(0, len(data), 777):  # writes split frames and headers anywhere
            s.sendall(data[i : i + 777])
        got = {}
        while len(got) < 301:
            r = decode_frame(read_frame(s))
            got[r.opaque] = r.code
    assert bytes(broker.raw) == b"".join(frames)  # the denied frame was not relayed, the rest verbatim
    assert got.pop(10_000) == C.NO_PERMISSION and set(got.values()) == {C.SUCCESS}
    if reactor is not None:
        steps, wakeups = reactor.steps - before[0], reactor.wakeups - before[1]
        assert steps > 0  # the reactor stepped the pumps
        # Python ran for the policy frame and a few other statuses, not per receive.
        assert wakeups < steps
        submits, ops = reactor.submits - before[2], reactor.ring_ops - before[3]
        if reactor.uring:  # each io_uring_enter issued queued operations (none when each poll found one source)
            assert ops >= submits
        else:
            assert submits == ops == 0


def test_close_takes_the_pumps_out_of_the_reactor(proxy):
    port, _broker, sessions, reactor_on = proxy
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s, gevent.Timeout(10):
        s.sendall(send(1, b"hi"))
        assert decode_frame(read_frame(s)).code == C.SUCCESS
        (session,) = sessions
        pumps = list(session._parked)
        assert len(pumps) == (2 if reactor_on else 0)
        session.close()  # from outside both pumps, while they are parked: they wake and end
        assert read_frame(s) is None
    assert session._parked == []
    if reactor_on:
        reactor = relay.reactor_of(gevent.get_hub())
        assert all(reactor.detach(p) is None for p in pumps)  # already out


def test_receives_in_the_reactor_count_as_activity(proxy):
    port, _broker, sessions, _ = proxy
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s, gevent.Timeout(10):
        s.sendall(send(1, b"hi"))
        assert decode_frame(read_frame(s)).code == C.SUCCESS
        (session,) = sessions
        session.last_activity -= 1000  # as if nothing had been seen for a long time
        s.sendall(send(2, b"hi"))
        assert decode_frame(read_frame(s)).code == C.SUCCESS
        assert session.idle_for(time.monotonic()) < 100


@pytest.mark.parametrize("cut", [0, 7, 40], ids=["no-bytes", "half-head", "half-frame"])
def test_a_close_that_arrives_with_the_last_bytes_is_seen(cut):
    """Edge-triggered: when the peer's last bytes and its close arrive before one turn, that turn
    is the only report of both; the pump must read on to the close rather than take its short
    read for "drained" (it then waited forever for an edge that never comes)."""
    from rmqfast._speedups import P_EOF, Reactor
    from tests.test_pump import actions, nonblocking_pair
    from tests.test_reactor_edges import Wake

    scanner = codec.FrameScannerC(codec.ScanStatsC(), actions=actions())
    src_peer, src = nonblocking_pair()
    dst, dst_peer = nonblocking_pair()
    pump = codec.Pump(scanner, src.fileno(), dst.fileno(), 4096)
    reactor = Reactor()
    reactor.attach(pump, lambda: False)
    wake = Wake()
    try:
        assert reactor.park(pump, wake) == -1  # nothing there yet: parked
        reactor.turn()
        frame = send(1, b"body")
        src_peer.sendall(frame[:cut])
        src_peer.shutdown(socket.SHUT_WR)  # both before the reactor's next turn
        for _ in range(3):
            reactor.turn()
            if wake.got:
                break
        assert wake.got == [P_EOF]
    finally:
        reactor.detach(pump)
        for s in (src_peer, src, dst, dst_peer):
            s.close()
