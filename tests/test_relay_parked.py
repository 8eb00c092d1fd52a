"""Sessions that serve from the reactor without a greenlet (``Session.serve``).

With the compiled pumps parked in the worker's reactor, ``serve`` returns once both are parked;
a status that needs Python (a policy frame, a wait for the destination, the end) makes a greenlet
that runs the pump until it parks again or ends, and ``on_end`` runs once both directions have
ended.  Each way a parked pump is woken is driven here on real sockets: the answers and bytes
must be the same as with a greenlet per pump, every greenlet made must end, and every session
must end exactly once (a lost wake-up is a connection that never closes: the bounded waits fail).
"""

from __future__ import annotations

import gevent
import gevent.event
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
from rmqfast.server.worker import RelayServer
from rmqfast.testing.wire import read_frame

pytestmark = pytest.mark.skipif(codec.Pump is None or not codec.is_compiled(codec.FrameScanner),
                                reason="sessions serve from the reactor with the compiled pump only")


def send(opaque: int, body: bytes = b"hi") -> bytes:
    return encode(RemotingCommand(code=C.SEND_MESSAGE_V2, opaque=opaque, version=401,
                                  ext_fields={"a": "PG", "b": "TopicR", "e": "-1"}, body=body))


DENIED = encode(RemotingCommand(code=C.UPDATE_BROKER_CONFIG, opaque=777, version=401, body=b"a=b"))


class Broker:
    """Answers every request SUCCESS; ``gate`` (when set) holds its reading until released;
    ``close_after`` closes the connection after that many frames."""

    def __init__(self) -> None:
        self.raw = bytearray()
        self.gate: gevent.event.Event | None = None
        self.close_after = 0
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # accepted sockets: a small window
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        self.server = StreamServer(listener, self.handle)
        self.server.start()

    def handle(self, sock: socket.socket, _addr: tuple) -> None:
        if self.gate is not None:
            self.gate.wait()
        n = 0
        while True:
            data = read_frame(sock)
            if data is None:
                return
            self.raw += data
            cmd = decode_frame(data)
            if not cmd.is_oneway:
                sock.sendall(encode(make_response(cmd, C.SUCCESS)))
            n += 1
            if self.close_after and n >= self.close_after:
                return


class Events:
    def __init__(self) -> None:
        self.lost = 0

    def upstream_error(self, role: str) -> None:
        pass

    def upstream_ok(self, session: Session, hp: HostPort) -> None:
        pass

    def upstream_lost(self, session: Session) -> None:
        self.lost += 1


class Rig:
    """A listener that serves sessions like the worker does (``serve`` + ``RelayServer``)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.broker = Broker()
        self.events = Events()
        self.sessions: list[Session] = []
        self.ended: list[Session] = []
        self.returned: list[bool] = []  # serve returned with the session still running
        self.before_serve: gevent.event.Event | None = None
        self.drives = [0, 0]  # greenlets made for parked pumps: started, finished
        chain = FilterChain([DenyAdminCodes(C.BROKER_DATA_PLANE_CODES)])
        settings = RelaySettings(4096, 16 << 20, 1 << 16, 1.0, 30.0)
        stats = codec.ScanStats()
        drive = Session._drive

        def counted(session: Session, job: object, st: int) -> None:
            if session not in self.sessions:  # a session of an earlier test still ending
                drive(session, job, st)
                return
            self.drives[0] += 1
            try:
                drive(session, job, st)
            finally:
                self.drives[1] += 1

        monkeypatch.setattr(Session, "_drive", counted)

        def handle(sock: socket.socket, addr: tuple) -> None:  # a plain socket (RelayServer)
            s = Session("broker", sock, f"{addr[0]}:{addr[1]}",
                        [HostPort("127.0.0.1", self.broker.server.server_port)], chain, stats, settings, self.events)
            self.sessions.append(s)
            if self.before_serve is not None:
                self.before_serve.wait()
            s.serve(lambda: self.ended.append(s))  # the session closes the socket on every path
            self.returned.append(not s.closed)

        self.server = RelayServer(("127.0.0.1", 0), handle)
        self.server.start()
        self.port = self.server.server_port

    def wait_ended(self, n: int = 1) -> None:
        with gevent.Timeout(10, AssertionError(f"sessions ended: {len(self.ended)} of {n}")):
            while len(self.ended) < n:
                gevent.sleep(0.01)

    def stop(self) -> None:
        self.server.stop(timeout=1)
        self.broker.server.stop(timeout=1)


@pytest.fixture
def rig(monkeypatch):
    monkeypatch.setattr(relay, "USE_REACTOR", True)
    r = Rig(monkeypatch)
    yield r
    r.stop()


def test_serve_returns_with_both_pumps_parked_and_ends_once(rig):
    with socket.create_connection(("127.0.0.1", rig.port), timeout=5) as s, gevent.Timeout(10):
        s.sendall(send(1))
        assert decode_frame(read_frame(s)).code == C.SUCCESS
        assert rig.returned == [True]  # the handler's greenlet is gone; the session goes on
        (session,) = rig.sessions
        assert len(session._parked) == 2  # attached to the reactor
        assert rig.drives == [0, 0]  # relayed frames needed no Python at all
        s.sendall(send(2))
        assert decode_frame(read_frame(s)).code == C.SUCCESS
        assert not rig.ended
    rig.wait_ended()
    assert rig.ended == [session] and session.closed
    assert session._parked == [] and rig.drives[0] == rig.drives[1]  # detached
    assert session.client.fileno() == -1 and session.upstream.fileno() == -1  # closed by the session


def test_a_policy_frame_wakes_a_greenlet_that_ends_when_the_pump_parks_again(rig):
    with socket.create_connection(("127.0.0.1", rig.port), timeout=5) as s, gevent.Timeout(10):
        s.sendall(send(1) + DENIED + send(2))
        got = {}
        while len(got) < 3:
            r = decode_frame(read_frame(s))
            got[r.opaque] = r.code
        assert got == {1: C.SUCCESS, 777: C.NO_PERMISSION, 2: C.SUCCESS}
        gevent.sleep(0.05)
        assert rig.drives[0] >= 1 and rig.drives[0] == rig.drives[1]  # woken, and parked again
        s.sendall(send(3))  # still relayed from the reactor
        assert decode_frame(read_frame(s)).code == C.SUCCESS
    rig.wait_ended()
    assert bytes(rig.broker.raw) == send(1) + send(2) + send(3)


def test_bytes_that_need_python_before_the_pumps_start(rig):
    """The client's first frame is a policy frame already there when the pump is attached: the
    first park steps it at once and a greenlet handles it (scheduled, not in the handler)."""
    rig.before_serve = gevent.event.Event()
    with socket.create_connection(("127.0.0.1", rig.port), timeout=5) as s, gevent.Timeout(10):
        s.sendall(DENIED + send(5))
        with gevent.Timeout(5):
            while not rig.sessions:
                gevent.sleep(0.01)
        gevent.sleep(0.05)  # the bytes are in the proxy's socket before serve attaches the pump
        rig.before_serve.set()
        got = {}
        while len(got) < 2:
            r = decode_frame(read_frame(s))
            got[r.opaque] = r.code
        assert got == {777: C.NO_PERMISSION, 5: C.SUCCESS}
    rig.wait_ended()


def test_close_from_outside_while_parked_ends_the_session_once(rig):
    with socket.create_connection(("127.0.0.1", rig.port), timeout=5) as s, gevent.Timeout(10):
        s.sendall(send(1))
        assert decode_frame(read_frame(s)).code == C.SUCCESS
        (session,) = rig.sessions
        session.close()  # the idle sweep or a drain: both pumps are parked, no greenlet to wake
        rig.wait_ended()
        assert read_frame(s) is None  # the client's socket was closed by the session
    gevent.sleep(0.05)
    assert rig.ended == [session] and session._parked == []
    assert rig.drives[0] == rig.drives[1] == 2  # each parked pump woke once to end


def test_last_bytes_and_close_together_while_parked(rig):
    """The client's last frame and its close arrive in one edge: the frame is relayed and
    answered, and the session ends."""
    s = socket.create_connection(("127.0.0.1", rig.port), timeout=5)
    with gevent.Timeout(10):
        s.sendall(send(1))
        assert decode_frame(read_frame(s)).code == C.SUCCESS
        s.sendall(send(2))
        s.shutdown(socket.SHUT_WR)
        rig.wait_ended()
    s.close()
    assert bytes(rig.broker.raw) == send(1) + send(2)


def test_upstream_that_closes_while_parked_is_reported_and_ends_the_session(rig):
    rig.broker.close_after = 1
    with socket.create_connection(("127.0.0.1", rig.port), timeout=5) as s, gevent.Timeout(10):
        s.sendall(send(1))
        assert decode_frame(read_frame(s)).code == C.SUCCESS
        rig.wait_ended()
        assert read_frame(s) is None
    assert rig.events.lost == 1


def test_a_destination_that_pushes_back_is_waited_for_by_a_greenlet(rig):
    """The broker does not read for a while: the client's pump meets a full socket buffer, a
    greenlet waits for the destination, everything arrives intact, and the pump parks again."""
    rig.broker.gate = gevent.event.Event()
    frames = [send(i, bytes([i % 251]) * 20000) for i in range(400)]  # ~8 MB: more than the buffers
    data = b"".join(frames)
    with socket.create_connection(("127.0.0.1", rig.port), timeout=5) as s, gevent.Timeout(30):
        sender = gevent.spawn(s.sendall, data)
        with gevent.Timeout(10):
            while rig.drives[0] == rig.drives[1]:  # a greenlet is waiting for the destination
                gevent.sleep(0.01)
        rig.broker.gate.set()
        sender.get()
        got = 0
        while got < len(frames):
            assert decode_frame(read_frame(s)).code == C.SUCCESS
            got += 1
        gevent.sleep(0.05)
        assert rig.drives[0] == rig.drives[1]  # parked again: no greenlet left
    rig.wait_ended()
    assert bytes(rig.broker.raw) == data


def test_the_listener_hands_over_plain_sockets_and_leaves_them_open():
    """The worker's listener gives its handler a plain non-blocking socket (no gevent socket object
    and its watchers) and does not close it when the handler returns: the handler closes it, or the
    session it started does when it ends."""
    import _socket

    got: list[object] = []
    server = RelayServer(("127.0.0.1", 0), lambda sock, addr: got.append(sock))
    server.start()
    try:
        with socket.create_connection(("127.0.0.1", server.server_port), timeout=5) as c, gevent.Timeout(10):
            while not got:
                gevent.sleep(0.01)
            (sock,) = got
            assert type(sock) is _socket.socket and sock.gettimeout() == 0.0
            gevent.sleep(0.05)  # the handler's greenlet has ended
            assert sock.fileno() != -1
            sock.send(b"x")
            assert c.recv(1) == b"x"
            sock.close()
            assert c.recv(1) == b""
    finally:
        server.stop(timeout=1)


def test_a_session_is_found_by_its_in_flight_table_until_it_closes(rig):
    """The worker's stalled-send sweep looks only at in-flight tables (``events.tables``): a session
    is there from its set-up to its close."""
    from rmqfast.proxy.failover import with_requests

    rig.events.tables = {}
    with socket.create_connection(("127.0.0.1", rig.port), timeout=5) as s, gevent.Timeout(10):
        s.sendall(send(1))
        assert decode_frame(read_frame(s)).code == C.SUCCESS
        (session,) = rig.sessions
        assert rig.events.tables == {session.inflight: session}
        assert with_requests(rig.events.tables) == []  # answered: nothing in flight
        session.inflight.track(0, 99, codec.code_slot(C.SEND_MESSAGE_V2), 0)
        assert with_requests(rig.events.tables) == [session]
    rig.wait_ended()
    assert rig.events.tables == {}
